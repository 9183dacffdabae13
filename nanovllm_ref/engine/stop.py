"""When a sequence stops, and what its text is then (chapter 07; vLLM's stop checks).

`Scheduler.postprocess` appends each sampled token and calls `check_stop(seq, token_id, eos, max_model_len)` once:
the only place that decides whether a sequence finishes. In vLLM's order:
1. min_tokens: no stop of any kind until the completion has more than `min_tokens` tokens (the model
   runner also masks the eos and stop ids out of the logits until then: `min_tokens_bans`, as HF's
   MinNewTokensLengthLogitsProcessor does, so the (min_tokens + 1)-th token is the first that can stop);
2. a stop token: an eos id (unless ignore_eos; stop_reason None) or one of `stop_token_ids` (stop_reason =
   the id). Its text stays out of the completion's text unless include_stop_str_in_output;
3. a stop string: the first (leftmost) of `stop` found in the text, across token boundaries. Only a match
   that ends in this token's new text counts (earlier ones were seen before). The text is cut before it
   (or after it, with include_stop_str_in_output); stop_reason = the string;
4. length: max_tokens new tokens, or prompt + completion = max_model_len (finish_reason "length").

Text is decoded lazily (engine/detokenizer.py): every token at once only for requests with stop strings,
else when an output is made (`completion_text`). A streamed text holds back its last len(longest stop) - 1
characters, which a stop string may still claim, so it only ever grows.

The decisions are pure functions of the sequence's settings and its new token / new text
(`stop_token_reason`, `find_stop_string`), so an asynchronous step can call them the same way.
"""
from typing import NamedTuple

from nanovllm_ref.engine.sequence import Sequence


class Stop(NamedTuple):
    finish_reason: str                       # "stop" | "length"
    stop_reason: int | str | None = None     # the stop id or string; None for eos and length


def stop_token_reason(seq: Sequence, token_id: int, eos: frozenset) -> Stop | None:
    """Stop("stop", ...) if `token_id` (just appended to `seq`) is a stop token that may stop it now."""
    if seq.num_known_completion_tokens <= seq.min_tokens:
        return None
    if not seq.ignore_eos and token_id in eos:
        return Stop("stop", None)
    if token_id in seq.stop_token_ids:
        return Stop("stop", token_id)
    return None


def find_stop_string(text: str, num_new_chars: int, stops: tuple[str, ...], include: bool) -> tuple[str, int] | None:
    """The leftmost stop string that ends within the last `num_new_chars` characters of `text`, and the
    length the text is cut to: before it, or after it when `include`. None if there is none.
    Example: find_stop_string("a cat sat", 3, ("at",), False) -> ("at", 7)."""
    best = None
    for stop in stops:
        i = text.find(stop, max(0, len(text) - num_new_chars - len(stop) + 1))
        if i != -1 and (best is None or i < best[1]):
            best = (stop, i)
    if best is None:
        return None
    stop, i = best
    return stop, i + len(stop) if include else i


def check_stop(seq: Sequence, token_id: int, eos: frozenset, max_model_len: int) -> bool:
    """Decide, once per token, whether `seq` finishes with `token_id`, its last known token (async scheduling:
    later tokens may be pending, and are not counted); if so set seq.finish_reason and seq.stop_reason (and
    cut its text at a stop string). Returns True if it finished. Does not touch status, blocks or queues (the
    scheduler does)."""
    sp = seq.sampling_params
    stop = stop_token_reason(seq, token_id, eos)
    if stop is not None:
        seq.hide_last_token_text = not sp.include_stop_str_in_output
    elif sp.stop and seq.detokenizer is not None:
        # Stop strings need the text of every token as it comes (they may span tokens).
        d = seq.detokenizer
        new = d.update(seq.completion_token_ids[d.num_tokens:])
        if seq.num_known_completion_tokens > seq.min_tokens:
            hit = find_stop_string(d.text, len(new), sp.stop, sp.include_stop_str_in_output)
            if hit is not None:
                d.truncate(hit[1])
                stop = Stop("stop", hit[0])
    if stop is None and (seq.num_known_completion_tokens >= seq.max_tokens
                         or len(seq) - seq.num_pending >= max_model_len):
        stop = Stop("length")
    if stop is None:
        return False
    seq.finish_reason, seq.stop_reason = stop
    return True


def shown_text(d, token_ids, known: int, hide_last: bool, finished: bool, holdback: int) -> str:
    """The text a completion may show now, from its IncrementalDetokenizer `d` (engine/detokenizer.py): the
    first `known` of `token_ids` decoded (but for the last one when `hide_last`: a stop token whose text stays
    out), all of it once `finished`, else without its last `holdback` characters (a stop string may still
    claim them). The core's sequences (completion_text) and the front end's samples
    (output_processor.SampleState.text) both show their text this way."""
    if not d.flushed:
        end = known - (1 if hide_last else 0)
        if end > d.num_tokens:
            d.update(token_ids[d.num_tokens:end])
        if finished:
            d.flush()
    if finished:
        return d.text
    return d.text[:max(len(d.text) - holdback, 0)] if holdback else d.text


def completion_text(seq: Sequence) -> str:
    """The text of `seq`'s completion as far as it may be shown now (shown_text). "" for a sequence without a
    detokenizer."""
    if seq.detokenizer is None:
        return ""
    return shown_text(seq.detokenizer, seq.completion_token_ids, seq.num_known_completion_tokens,
                      seq.hide_last_token_text, seq.is_finished, seq.sampling_params.stop_holdback)


def min_tokens_bans(seqs: list[Sequence], eos: frozenset, vocab_size: int) -> tuple[list[int], list[int]] | None:
    """(rows, token ids) of the logits to mask this step: for each sequence still short of min_tokens
    new tokens, its stop ids and (unless ignore_eos) the eos ids. None when no row needs it (the usual
    case: decided on the host, from the sequences' counts)."""
    rows, cols = [], []
    for row, seq in enumerate(seqs):
        if seq.num_completion_tokens < seq.min_tokens:
            ids = seq.stop_token_ids if seq.ignore_eos else seq.stop_token_ids | eos
            ids = sorted(t for t in ids if t < vocab_size)
            rows += [row] * len(ids)
            cols += ids
    return (rows, cols) if rows else None
