"""What the course's mutation tests share: a check passes with its one ok line, or fails with a message.

Each check helper (nanovllm_course/chNN.py) prints exactly `E6.1 ok` on success and raises AssertionError
whose text starts with `E6.1: ` on failure; these helpers assert exactly that.
"""
import pytest


def passes(check, fn, tag, capsys):
    """`check(fn)` prints `<tag> ok` and nothing else."""
    capsys.readouterr()
    check(fn)
    assert capsys.readouterr().out == f"{tag} ok\n"


def fails(check, fn, match):
    """`check(fn)` raises AssertionError whose text matches the regex `match`; returns the text."""
    with pytest.raises(AssertionError, match=match) as info:
        check(fn)
    return str(info.value)


def passes_by_tag(checks: dict, tag, fn, capsys):
    """`passes` with the check looked up by exercise id in `checks`."""
    passes(checks[tag], fn, tag, capsys)


def fails_by_tag(checks: dict, tag, fn, *matches):
    """The check of exercise `tag` (from `checks`) fails on `fn`: the message starts with `<tag>: ` and
    contains every string in `matches`. Returns the message."""
    with pytest.raises(AssertionError) as info:
        checks[tag](fn)
    text = str(info.value)
    assert text.startswith(f"{tag}: "), text
    for m in matches:
        assert m in text, text
    return text
