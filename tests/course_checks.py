"""What the course's mutation tests share: a check passes with its one ok line, or fails with a message.

Each check helper (nanovllm_course/chNN.py) prints exactly `E6.1 ok` on success and raises AssertionError
whose text starts with `E6.1: ` on failure; these helpers assert exactly that. A check takes the student's
function(s) as its arguments: `passes(ch03.check_gqa, gqa, tag="E3.1", capsys=capsys)`.
"""
import pytest


def stub(*args, **kwargs):
    """An exercise not done yet, as the released chapter's stub is: its check must say `not implemented yet`."""
    raise NotImplementedError("Exercise: fill in this code")


def passes(check, *fns, tag, capsys, times=1):
    """`check(*fns)` prints `<tag> ok` and nothing else, on each of `times` calls (each draws fresh cases)."""
    for _ in range(times):
        capsys.readouterr()
        check(*fns)
        assert capsys.readouterr().out == f"{tag} ok\n"


def fails(check, *fns, match=None, tag=None, contains=(), times=1) -> str:
    """`check(*fns)` raises AssertionError on each of `times` calls: its text matches the regex `match`
    (re.search), starts with `<tag>: ` when `tag` is given, and contains every string in `contains`.
    Returns the last text."""
    for _ in range(times):
        with pytest.raises(AssertionError, match=match) as info:
            check(*fns)
        text = str(info.value)
        if tag is not None:
            assert text.startswith(f"{tag}: "), text
        for part in contains:
            assert part in text, text
    return text


def passes_by_tag(checks: dict, tag, fn, capsys, times=1):
    """`passes` with the check looked up by exercise id in `checks`."""
    passes(checks[tag], fn, tag=tag, capsys=capsys, times=times)


def fails_by_tag(checks: dict, tag, fn, *matches, times=1) -> str:
    """The check of exercise `tag` (from `checks`) fails on `fn`: the message starts with `<tag>: ` and
    contains every string in `matches`. Returns the message."""
    return fails(checks[tag], fn, tag=tag, contains=matches, times=times)
