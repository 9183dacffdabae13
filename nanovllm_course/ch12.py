"""Checks and tools for chapter 12: serving (an OpenAI-compatible server over the engine).

- `check_apply_pending(fn)` (E12.1): the student's `apply_pending(engine, adds, aborts)` against the server's
  `nanovllm_ref.entrypoints.openai.engine_loop.apply_pending` on a recording fake engine, on fresh random
  scripts (aborts of live and unknown ids, groups of 1-4 requests, refusals by ValueError and TypeError at
  the first, a middle and the last member, an engine that breaks): the same engine calls (the order of the
  aborts that undo one refused group aside), the same requests left in the engine, the same refused groups
  with the very exceptions the engine raised, and a broken engine's error passed through. Repeated calls leave
  nothing behind: after every call no container the function keeps (a default argument, a closure's variable, a
  module-level list: `common.held_state`) may have grown, and after 200 more ticks nothing may still hold one of
  the groups or pending inputs it was given (weak references).
- `check_detokenize_step(fn)` (E12.2): the student's `detokenize_step(decode, ids, prefix, read, final)`, run
  token chunk by token chunk over streams of every tokenizer family the course's models use, with special
  tokens shown and skipped: a byte-level BPE (Qwen3, SmolLM2, the tiny models: characters split over several
  byte tokens, a prompt that ends inside a character, random byte soup, a chat-template prompt), a
  SentencePiece-style Metaspace tokenizer (leading spaces, lone "▁" tokens, <s> / </s>) and one with Llama-2's
  decoder chain (in-vocabulary text: runs of byte-fallback tokens need the engine's extra rule), against the
  engine's own
  `nanovllm_ref.engine.detokenizer.IncrementalDetokenizer` fed the same chunks: every emitted piece
  **exactly** equal, and no decode window more than twice as long as the reference's (+ 8 tokens): the cost
  per token must not grow with the completion.
- `check_completion_events(fn)` (E12.3): the student's `completion_events(head, n, outputs, include_usage)`,
  the server-sent events of a streamed /v1/completions answer built from the engine's cumulative
  RequestOutputs, against `reference_completion_events` (the server's `Choices` and its pydantic wire
  models) on fresh random streams (1-3 prompts, n = 1-3, samples that finish at different steps, steps that
  add no text, text that ends in multi-byte characters): the same events in the same order, each
  `data: {json}\\n\\n` with the same fields, then `data: [DONE]\\n\\n`.
- `check_process_outputs(fn)` (E12.4): the student's `process_outputs(requests, outputs)`, the front end's half of a
  step (the core's token-id deltas in: ids and text per sample, stop strings that end in the new text, the
  samples to abort in the core out, late tokens and forgotten requests dropped), replayed on streams recorded
  from the engine's own `nanovllm_ref.engine.output_processor.OutputProcessor` fed by a simulated core that runs
  ahead (a sample it is asked to abort gets 0-2 more outputs) and a client that leaves: after every step the same
  ids, text, finish and stop reasons per sample, the same aborts, the same requests left. The draws are redrawn
  until each planted mistake (FRONT_MUTANTS) gives answers of its own, so a failure names the one it matches.

Each check prints `E12.n ok` and nothing else on success and draws new inputs on every call. On a wrong answer
it runs the usual wrong answers on the failing case and names the one that matches.

Tools: `byte_level_tokenizer()`, `metaspace_tokenizer()` and `llama_tokenizer()` (the tokenizer kinds, built in
memory), `Server`
(`python -m nanovllm_ref serve` in a subprocess on a free port), `online_run` (the engine driven by Poisson
arrivals in-process, with every request's TTFT and TPOT), `serve_record()` and `overhead_record()` (the
committed records the chapter reads), `gil_steps` (section 12.6: an engine's time per step with and without a
thread of pure Python beside it).
"""
from __future__ import annotations

import functools
import json
import os
import random
import signal
import socket
import subprocess
import sys
import tempfile
from collections import Counter
import time
import warnings
from functools import lru_cache
from os.path import commonprefix
from pathlib import Path
from types import SimpleNamespace

from nanovllm_course.common import call_student, check_no_state_kept, fail, fresh_generator, held_state, ok, randint

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "results"
REPLACEMENT = "\ufffd"


def _rng(g) -> random.Random:
    """A Python RNG seeded from the check's torch generator (fresh every call)."""
    return random.Random(randint(g, 0, 2**31 - 1))


# -- the two kinds of tokenizer (built in memory: no model hub) ------------------------------------------------
WORDS = ("hello world this is a quick test the brown fox jumps over lazy dog cache block paged prefix token "
         "stream server request engine").split()
EXOTIC = ["日本語", "テキスト", "🙂", "🚀", "€", "ß", "ñ", "é", "Ω"]


@lru_cache(maxsize=None)
def byte_level_tokenizer():
    """The tiny models' tokenizer (nanovllm_models.tiny): a byte-level BPE, as GPT-2, SmolLM2 and Qwen use.
    Trained on ASCII text, so every other character is spelt with 2-4 byte tokens, each of which decodes
    to U+FFFD on its own. Special tokens <|endoftext|>=0, <|im_start|>=1, <|im_end|>=2."""
    from nanovllm_models.tiny import make_tokenizer
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return make_tokenizer(tempfile.mkdtemp(prefix="nanovllm_ch12_bpe_"))


@lru_cache(maxsize=None)
def metaspace_tokenizer():
    """A SentencePiece-style Unigram model with a Metaspace pre-tokenizer and decoder (T5-style, no byte
    fallback): a word's first piece carries "▁", which decodes to a space, except at the start of a decode,
    where the decoder drops it. Special tokens <unk>=0, <s>=1, </s>=2."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    chars = sorted(set("".join(WORDS)) | set("abcdefghijklmnopqrstuvwxyz.,!?'0123456789"))
    vocab = [("<unk>", 0.0), ("<s>", 0.0), ("</s>", 0.0), ("▁", -3.0)] + [(c, -5.0) for c in chars]
    vocab += [("▁" + w, -2.0) for w in WORDS] + [(w[:2], -4.0) for w in WORDS] + [("▁" + w[:3], -3.5) for w in WORDS]
    seen = set()
    vocab = [v for v in vocab if not (v[0] in seen or seen.add(v[0]))]
    tok = Tokenizer(models.Unigram(vocab, unk_id=0, byte_fallback=False))
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first")
    tok.decoder = decoders.Metaspace(replacement="▁", prepend_scheme="first")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>")


@lru_cache(maxsize=None)
def llama_tokenizer():
    """A SentencePiece-style Unigram model with byte fallback and Llama-2's decoder chain (as Llama-2, Mistral and
    TinyLlama use: Replace "▁" -> " ", ByteFallback, Fuse, Strip one leading space), with the vocabulary of
    `metaspace_tokenizer`. E12.2 streams only text it has pieces for: runs of byte-fallback tokens need the
    engine's extra rule (engine/detokenizer.py), which the exercise leaves out. Special tokens <unk>=0, <s>=1,
    </s>=2."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    chars = sorted(set("".join(WORDS)) | set("abcdefghijklmnopqrstuvwxyz.,!?'0123456789"))
    vocab = [("<unk>", 0.0), ("<s>", 0.0), ("</s>", 0.0)] + [(f"<0x{i:02X}>", -20.0) for i in range(256)]
    vocab += [("▁", -3.0)] + [(c, -5.0) for c in chars]
    vocab += [("▁" + w, -2.0) for w in WORDS] + [(w[:2], -4.0) for w in WORDS] + [("▁" + w[:3], -3.5) for w in WORDS]
    seen = set()
    vocab = [v for v in vocab if not (v[0] in seen or seen.add(v[0]))]
    tok = Tokenizer(models.Unigram(vocab, unk_id=0, byte_fallback=True))
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first")
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                     decoders.Strip(" ", 1, 0)])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>")


def decoder_of(tokenizer, skip_special_tokens: bool = True):
    """decode(ids: list[int]) -> str as the engine decodes: the fast tokenizer's backend, no clean-up."""
    backend = tokenizer.backend_tokenizer
    return lambda ids: backend.decode(list(ids), skip_special_tokens=skip_special_tokens)


# -- E12.2 incremental detokenization ---------------------------------------------------------------------------
def reference_detokenize_step(decode, ids, prefix, read, final=False):
    """One step of the engine's IncrementalDetokenizer (engine/detokenizer.py, `_emit`), for tokenizers without
    byte-fallback tokens (the engine has two more rules, for runs of `<0xNN>` byte tokens and for a window that
    would start at a token that decodes to nothing; with these tokenizers they give the same text). ids: every token id so far (the prompt's,
    then the completion's); ids[:read] have been turned into text already, and ids[prefix:read] are the
    context the next decode starts with. Returns (new text, new prefix, new read)."""
    if read == len(ids):
        return "", prefix, read
    context = decode(ids[prefix:read])
    full = decode(ids[prefix:])
    # context is the start of full, except when the prompt's last token ends inside a character: context then
    # ends in U+FFFD where full has the whole character, which belongs to the new text
    start = len(context) if full.startswith(context) else len(commonprefix([context, full]))
    new = full[start:]
    if not new or (not final and full.endswith(REPLACEMENT)):
        return "", prefix, read                       # a character is still incomplete: wait for its last bytes
    return new, read, len(ids)                         # the window moves on: the new tokens are the context


def context_start(tokenizer, prompt_ids, skip_special_tokens: bool = True) -> int:
    """Where the engine's first decode window starts in the prompt (the prefix offset of E12.2's first call):
    CONTEXT_TOKENS back from the end, further while the window would show nothing (engine/detokenizer.py)."""
    from nanovllm_ref.engine.detokenizer import IncrementalDetokenizer
    det = IncrementalDetokenizer(tokenizer, prompt_ids, skip_special_tokens)
    return len(prompt_ids) - len(det._ids)            # it keeps ids[prefix:] only


def _detok_no_context(decode, ids, prefix, read, final=False):
    if read == len(ids):
        return "", prefix, read
    new = decode(ids[read:])
    if not new or (not final and new.endswith(REPLACEMENT)):
        return "", prefix, read
    return new, read, len(ids)


def _detok_no_holdback(decode, ids, prefix, read, final=False):
    return reference_detokenize_step(decode, ids, prefix, read, final=True)


def _detok_final_ignored(decode, ids, prefix, read, final=False):
    return reference_detokenize_step(decode, ids, prefix, read, final=False)


def _detok_fixed_prefix(decode, ids, prefix, read, final=False):
    new, _, read = reference_detokenize_step(decode, ids, prefix, read, final)
    return new, prefix, read


def _detok_prefix_to_end(decode, ids, prefix, read, final=False):
    new, moved, read2 = reference_detokenize_step(decode, ids, prefix, read, final)
    return new, (read2 if moved != prefix else prefix), read2


def _detok_len_context(decode, ids, prefix, read, final=False):
    if read == len(ids):
        return "", prefix, read
    context, full = decode(ids[prefix:read]), decode(ids[prefix:])
    new = full[len(context):]
    if not new or (not final and full.endswith(REPLACEMENT)):
        return "", prefix, read
    return new, read, len(ids)


def _detok_planted(decode, ids, prefix, read, final, mistake):
    """The step with one planted mistake of DETOK_MUTANTS' later rows."""
    if read == len(ids):
        return "", prefix, read
    context, full = decode(ids[prefix:read]), decode(ids[prefix:])
    start = len(context) if full.startswith(context) else len(commonprefix([context, full]))
    new = full[start:]
    if mistake == "stripped" and new.strip():
        new = new.strip(" ")
    hold = {"fffd_inside": REPLACEMENT in new, "context_fffd": context.endswith(REPLACEMENT)}.get(
        mistake, full.endswith(REPLACEMENT))
    if not new or (not final and hold) or (mistake == "blank_held" and new.isspace() and not final):
        return ("", prefix, len(ids)) if mistake == "read_on_hold" else ("", prefix, read)
    return new, read, len(ids)


def _detok_stripped(decode, ids, prefix, read, final=False):
    return _detok_planted(decode, ids, prefix, read, final, "stripped")


def _detok_fffd_inside(decode, ids, prefix, read, final=False):
    return _detok_planted(decode, ids, prefix, read, final, "fffd_inside")


def _detok_context_fffd(decode, ids, prefix, read, final=False):
    return _detok_planted(decode, ids, prefix, read, final, "context_fffd")


def _detok_read_on_hold(decode, ids, prefix, read, final=False):
    return _detok_planted(decode, ids, prefix, read, final, "read_on_hold")


def _detok_blank_held(decode, ids, prefix, read, final=False):
    return _detok_planted(decode, ids, prefix, read, final, "blank_held")


DETOK_MUTANTS = [
    ("no_context", "your text differs where a decode needs the tokens before the new ones: decoding only the new "
     "tokens loses the leading space of a Metaspace word piece (the decoder drops it at the start of a decode) "
     "and cannot finish a character whose first bytes came earlier",
     "decode ids[prefix:read] and ids[prefix:] and emit the difference: both decodes start at the same token, "
     "so whatever the decoder does at the start happens in both and cancels"),
    ("len_context", "a character cut by the end of the prompt was lost: when the context decode ends in U+FFFD, "
     "full[len(context):] skips the character the new token completes",
     "if full does not start with context, start the new text where the two first differ "
     "(os.path.commonprefix([context, full]))"),
    ("no_holdback", "you emitted U+FFFD in the middle of a stream: the last token stopped inside a multi-byte "
     "character, so the decode ends in U+FFFD until the next token completes it",
     "while final is False and the longer decode ends in U+FFFD, return ('', prefix, read) and emit the "
     "character once it is whole"),
    ("final_ignored", "the final call held text back: at the end of the completion everything must come out, "
     "even a character cut short (as U+FFFD, what decoding all the ids gives)",
     "with final=True, emit whatever is new even if it ends in U+FFFD"),
    ("prefix_to_end", "a word lost its leading space after a step: you moved prefix to the end of the ids, so "
     "the next decode has no context before the new tokens",
     "after emitting, the window becomes the tokens just emitted: prefix = the old read, read = len(ids)"),
    ("read_on_hold", "text was lost after a held-back step: while holding back you moved read on, so the bytes held "
     "back are never decoded as new again", "when you hold back, return ('', prefix, read) unchanged: the held "
     "tokens are still new at the next step"),
    ("stripped", "you stripped spaces from the new text: a piece's leading or trailing space is part of the text "
     "(' over ' is a word between two spaces)", "emit full[start:] as it is; the window's decodes already "
     "cancel what the decoder does at their start"),
    ("fffd_inside", "you held text back because it contains U+FFFD somewhere: only a U+FFFD at the END of the decode "
     "is a character still incomplete; one inside is an invalid byte that stays U+FFFD for good",
     "hold back only while full.endswith('\\ufffd') (and final is False)"),
    ("context_fffd", "you held back on the context's end instead of the new decode's: the context ends in U+FFFD "
     "when the prompt's last token stops inside a character, which the new tokens complete",
     "hold back while the longer decode, full = decode(ids[prefix:]), ends in U+FFFD"),
    ("blank_held", "a piece that is only whitespace (a space token, a newline) was held back: it is text like any "
     "other", "emit whatever full[start:] is, spaces included; hold back only for an empty piece or a U+FFFD at "
     "the end"),
]


def _detok_cases(g):
    """(tokenizer name, tokenizer, prompt ids, completion ids, chunk sizes, skip_special_tokens) for one check call.
    Every call draws each tokenizer family the course's models use, with and without special tokens: byte-level BPE
    (Qwen3, SmolLM2, the tiny models: split characters, a prompt that ends inside a character, a completion that
    stops inside one, random bytes, a chat-template prompt with special tokens, shown and skipped), SentencePiece
    with the Metaspace decoder (T5: leading spaces, lone '▁' tokens) and with Llama-2's decoder chain (<s> and </s>
    in prompt and completion, shown and skipped), and one completion long enough to show a window that never
    moves."""
    rng = _rng(g)
    bpe, sp, llama = byte_level_tokenizer(), metaspace_tokenizer(), llama_tokenizer()

    def text(k, exotic=0.3):
        return " ".join(rng.choice(EXOTIC) if rng.random() < exotic else rng.choice(WORDS) for _ in range(k))

    def chunks(n):
        out = []
        while sum(out) < n:
            out.append(min(rng.choice((1, 1, 1, 2, 3)), n - sum(out)))
        return out

    def with_specials(tok, ids, specials, k):
        ids = list(ids)
        for _ in range(k):
            ids.insert(rng.randint(0, len(ids)), rng.choice(specials))
        return ids

    cases = []
    for _ in range(2):                                          # byte-level: text with split characters
        prompt = bpe.encode(text(rng.randint(1, 6)))
        completion = bpe.encode(" " + text(rng.randint(3, 10), 0.5))
        cases.append(("byte-level", bpe, prompt, completion, True))
    # the prompt ends inside a character: its first bytes in the prompt, the rest in the completion
    ids = bpe.encode(rng.choice(WORDS) + " " + rng.choice(EXOTIC[:4]) + " " + text(3, 0.4))
    split = [i for i in range(1, len(ids)) if bpe.decode(ids[:i]).endswith(REPLACEMENT)]
    cut = rng.choice(split)
    cases.append(("byte-level", bpe, ids[:cut], ids[cut:], True))
    # the completion stops inside a character (max_tokens reached mid-character): the final call must emit it
    ids = bpe.encode(" " + text(rng.randint(1, 4), 0.2) + " " + rng.choice(EXOTIC[:5]))
    ends = [i for i in range(1, len(ids)) if bpe.decode(ids[:i]).endswith(REPLACEMENT)]
    cases.append(("byte-level", bpe, bpe.encode(text(2, 0.0)), ids[:ends[-1]], True))
    # random bytes (invalid UTF-8: the final text ends in U+FFFD) and special tokens mixed in
    soup = [rng.choice(range(3, len(bpe))) for _ in range(rng.randint(6, 14))]
    soup = [2 if rng.random() < 0.1 else t for t in soup]
    cases.append(("byte-level", bpe, bpe.encode(text(2, 0.0)), soup, True))
    # an invalid byte in the middle (a lone continuation byte: U+FFFD for good), then more text
    cases.append(("byte-level", bpe, bpe.encode(text(2, 0.0)), bpe.encode(" " + text(rng.randint(1, 3), 0.0)) +
                  [rng.choice(_lone_bytes())] + bpe.encode(" " + text(rng.randint(2, 4), 0.0)), True))
    # a chat prompt (<|im_start|>user ... <|im_end|> <|im_start|>assistant), an answer with <|im_end|> inside
    # (ignore_eos) and after: once with the special tokens skipped, once shown (skip_special_tokens=False)
    for skip in (True, False):
        chat = [1] + bpe.encode("user\n" + text(rng.randint(1, 4), 0.2)) + [2] + bpe.encode("\n") + [1] + \
            bpe.encode("assistant\n")
        answer = with_specials(bpe, bpe.encode(text(rng.randint(3, 7), 0.3)), [0, 2], rng.randint(1, 2)) + [2]
        cases.append(("byte-level" + ("" if skip else " (special tokens shown)"), bpe, chat, answer, skip))
    # Metaspace: leading spaces at the prompt boundary and after every word; lone "▁" tokens and skipped specials
    space = sp.convert_tokens_to_ids("▁")
    for k, lone in enumerate((False, True, True)):
        prompt = sp.encode(text(rng.randint(1, 5), 0.0))
        completion = sp.encode(text(rng.randint(3, 8), 0.0))[:]
        if lone:
            for _ in range(rng.randint(1, 3)):
                completion.insert(rng.randint(0, len(completion)), space)
            if k == 1 or rng.random() < 0.5:
                completion.insert(rng.randint(0, len(completion)), 2)       # </s>: skipped, shows nothing
        cases.append(("metaspace", sp, prompt, completion, True))
    cases.append(("metaspace (special tokens shown)", sp, [1] + sp.encode(text(rng.randint(1, 4), 0.0)),
                  with_specials(sp, sp.encode(text(rng.randint(3, 7), 0.0)), [1, 2], 2), False))
    # Llama-2's decoder chain, text it has pieces for: <s> at the prompt's start, </s> inside and at the end
    lspace = llama.convert_tokens_to_ids("▁")
    for skip in (True, False):
        prompt = [1] + llama.encode(text(rng.randint(1, 5), 0.0), add_special_tokens=False)
        completion = with_specials(llama, llama.encode(text(rng.randint(3, 8), 0.0), add_special_tokens=False),
                                   [2, lspace], rng.randint(1, 3)) + [2]
        cases.append(("llama" + ("" if skip else " (special tokens shown)"), llama, prompt, completion, skip))
    long = sp.encode(text(40, 0.0))                                          # > 30 tokens
    cases.append(("metaspace", sp, sp.encode(text(2, 0.0)), long, True))
    return [(name, tok, list(p), list(c), chunks(len(c)), skip) for name, tok, p, c, skip in cases]


@lru_cache(maxsize=None)
def _lone_bytes() -> tuple:
    """Byte-level token ids that stay U+FFFD whatever follows them (lone UTF-8 continuation bytes 0x80-0xBF)."""
    bpe = byte_level_tokenizer()
    space = bpe.encode(" the")
    return tuple(t for t in range(3, len(bpe)) if bpe.decode([t]) == REPLACEMENT
                 and bpe.decode([t] + space) == REPLACEMENT + " the")


class _Window:
    """decode(), recording the longest window it was asked for."""

    def __init__(self, decode):
        self.decode, self.longest = decode, 0

    def __call__(self, ids):
        ids = list(ids)
        self.longest = max(self.longest, len(ids))
        return self.decode(ids)


def _run_detok(step, tokenizer, prompt, completion, sizes, tag=None, skip=True):
    """Feed `completion` in chunks of `sizes` through `step`; returns (pieces, longest window)."""
    window = _Window(decoder_of(tokenizer, skip))
    ids, prefix, read, pieces, at = list(prompt), context_start(tokenizer, prompt, skip), len(prompt), [], 0
    for i, size in enumerate(sizes + [0]):
        ids += completion[at:at + size]
        at += size
        final = i == len(sizes)
        args = (window, list(ids), prefix, read, final)
        out = call_student(tag, step, *args) if tag else step(*args)
        if tag:
            if not (isinstance(out, tuple) and len(out) == 3 and isinstance(out[0], str)
                    and all(isinstance(v, int) and not isinstance(v, bool) for v in out[1:])):
                fail(tag, f"detokenize_step should return a tuple (new_text: str, prefix: int, read: int), got "
                          f"{type(out).__name__}{'' if not isinstance(out, tuple) else f' of {len(out)}'}",
                     "return new, prefix, read")
            if not 0 <= out[1] <= out[2] <= len(ids):
                fail(tag, f"detokenize_step returned prefix={out[1]}, read={out[2]} for {len(ids)} ids: they must "
                          "satisfy 0 <= prefix <= read <= len(ids)",
                     "read is how many ids have been turned into text; prefix <= read starts the next window")
        piece, prefix, read = out
        pieces.append(piece)
    return pieces, window.longest


def _engine_pieces(tokenizer, prompt, completion, sizes, skip=True):
    from nanovllm_ref.engine.detokenizer import IncrementalDetokenizer
    det = IncrementalDetokenizer(tokenizer, prompt, skip_special_tokens=skip)
    pieces, at = [], 0
    for size in sizes:
        pieces.append(det.update(completion[at:at + size]))
        at += size
    pieces.append(det.flush())
    return pieces


def _show(pieces, k=None) -> str:
    return repr(pieces if k is None else pieces[max(0, k - 1):k + 2])


def check_detokenize_step(fn) -> None:
    tag = "E12.2"
    g = fresh_generator()
    state = held_state(fn)
    cases = list(_detok_cases(g))
    for name, tok, prompt, completion, sizes, skip in cases:
        want = _engine_pieces(tok, prompt, completion, sizes, skip)
        ref, ref_longest = _run_detok(reference_detokenize_step, tok, prompt, completion, sizes, skip=skip)
        if ref != want:                                    # the course's reference must be the engine's rule
            raise RuntimeError(f"reference_detokenize_step disagrees with the engine on a {name} stream")
        got, longest = _run_detok(fn, tok, prompt, completion, sizes, tag, skip=skip)
        check_no_state_kept(tag, fn, state, len(sizes) + 1, "the server calls detokenize_step for every sequence "
                                                            "at every step")
        case = (f"a {name} stream (prompt {prompt[-6:]} at its end, completion {completion[:8]}"
                f"{'...' if len(completion) > 8 else ''} in chunks {sizes[:8]}{'...' if len(sizes) > 8 else ''})")
        if got != want:
            k = next(i for i, (a, b) in enumerate(zip(got, want)) if a != b)
            what = "the final call" if k == len(sizes) else f"update {k + 1}"
            matches = [m for m in DETOK_MUTANTS
                       if _run_detok(globals()[f"_detok_{m[0]}"], tok, prompt, completion, sizes, skip=skip)[0] == got]
            if len(matches) > 1:
                # Two planted mistakes can emit the same pieces on one stream; the one that is the student's also
                # emits what the student does on every other stream of this run.
                yours = [_run_detok(fn, c[1], c[2], c[3], c[4], tag, skip=c[5])[0] for c in cases]
                matches = [m for m in matches
                           if all(_run_detok(globals()[f"_detok_{m[0]}"], c[1], c[2], c[3], c[4], skip=c[5])[0] == y
                                  for c, y in zip(cases, yours))] or matches
            if matches:
                _, message, hint = matches[0]
                fail(tag, f"{message}; on {case}, at {what} you emitted {got[k]!r}, the engine {want[k]!r}", hint)
            fail(tag, f"on {case}, at {what} you emitted {got[k]!r} where the engine's detokenizer emits {want[k]!r} "
                      f"(yours {_show(got, k)}, the engine's {_show(want, k)})",
                 "emit decode(ids[prefix:]) minus decode(ids[prefix:read]); hold back while it ends in U+FFFD "
                 "(unless final); then prefix = read, read = len(ids)")
        if longest > max(2 * ref_longest, ref_longest + 8):
            fail(tag, f"your decodes grew to {longest} tokens on {case} (the engine's never exceed {ref_longest}): "
                      "the window never moves on, so every step decodes more of the completion",
                 "after emitting, set prefix = read (the tokens just emitted become the context) and read = len(ids)")
    ok(tag)


# -- E12.3 the OpenAI wire format: server-sent events from cumulative outputs ------------------------------------
def reference_completion_events(head: dict, n: int, outputs, include_usage: bool = False) -> list[str]:
    """The SSE events of a streamed /v1/completions answer (the server's rules, nanovllm_ref/entrypoints/openai:
    `Choices` keeps what was sent per choice, the protocol's pydantic models give the shapes). head: {"id",
    "created", "model"}; outputs: (prompt index, RequestOutput) pairs in arrival order."""
    from nanovllm_ref.entrypoints.openai.protocol import CompletionChoice, CompletionResponse, stream_chunk_head
    from nanovllm_ref.entrypoints.openai.serving import Choices
    lens = {}
    for prompt_index, out in outputs:
        lens[prompt_index] = len(out.prompt_token_ids)
    choices = Choices([lens[i] for i in sorted(lens)], n)

    def sse(chunk):
        return f"data: {chunk.model_dump_json()}\n\n"

    events = []
    chunk_head = stream_chunk_head(head, include_usage)              # OpenAI: "usage": null only when asked
    for prompt_index, out in outputs:
        for d in choices.update(prompt_index, out):
            if d.text:
                events.append(sse(CompletionResponse(**chunk_head, choices=[CompletionChoice(index=d.index,
                                                                                             text=d.text)])))
            if d.finish_reason is not None:
                events.append(sse(CompletionResponse(**chunk_head, choices=[CompletionChoice(
                    index=d.index, text="", finish_reason=d.finish_reason, stop_reason=d.stop_reason)])))
    if include_usage:
        events.append(sse(CompletionResponse(**head, choices=[], usage=choices.usage())))
    return events + ["data: [DONE]\n\n"]


def _stream_outputs(rng, num_prompts: int, n: int):
    """(prompt index, RequestOutput) snapshots as the engine returns them: each step a random subset of the
    unfinished requests makes progress; each sample's text grows by zero or more pieces (a step may add none:
    text held back), and samples finish at different steps."""
    from nanovllm_ref.outputs import CompletionOutput, RequestOutput
    plans = {}
    for p in range(num_prompts):
        prompt = [rng.randrange(3, 500) for _ in range(rng.randint(1, 12))]
        samples = []
        for i in range(n):
            pieces = [rng.choice(WORDS + EXOTIC) + rng.choice(("", " ", "\n", ", ", '"')) for _ in range(rng.randint(1, 7))]
            reason = rng.choice(("stop", "length", "stop"))
            stop = rng.choice((None, "\n\n", 7)) if reason == "stop" else None
            samples.append(dict(pieces=pieces, sent=0, tokens=0, reason=reason, stop=stop, done=False))
        plans[p] = (prompt, samples)
    events, live = [], set(plans)
    while live:
        for p in sorted(live):
            if rng.random() < 0.35:
                continue
            prompt, samples = plans[p]
            for s in samples:
                if s["done"]:
                    continue
                s["sent"] += rng.choice((0, 1, 1, 2))
                s["tokens"] += rng.randint(1, 3)
                if s["sent"] >= len(s["pieces"]):
                    s["sent"] = len(s["pieces"])
                    s["done"] = rng.random() < 0.7 or s["tokens"] > 30
            outs = [CompletionOutput(index=i, text="".join(s["pieces"][:s["sent"]]),
                                     token_ids=list(range(s["tokens"])),
                                     finish_reason=s["reason"] if s["done"] else None,
                                     stop_reason=s["stop"] if s["done"] else None) for i, s in enumerate(samples)]
            finished = all(s["done"] for s in samples)
            events.append((p, RequestOutput(request_id=f"req-{p}", prompt=None, prompt_token_ids=prompt,
                                            outputs=outs, finished=finished)))
            if finished:
                live.discard(p)
    return events


def _events_ok(tag, events, case) -> list:
    if not isinstance(events, list) or not all(isinstance(e, str) for e in events):
        fail(tag, f"completion_events should return a list of str (one per event), got {type(events).__name__}",
             "build each event as the string f'data: {json.dumps(chunk)}\\n\\n'")
    parsed = []
    for i, e in enumerate(events):
        if not (e.startswith("data: ") and e.endswith("\n\n")) or e.count("\n\n") != 1 or "\n" in e[:-2]:
            fail(tag, f"event {i} of {case} is {e[:60]!r}: a server-sent event is one line 'data: <payload>' "
                      "followed by an empty line", "f'data: {json.dumps(chunk)}\\n\\n' (json.dumps writes no newline)")
        body = e[len("data: "):-2]
        if body == "[DONE]":
            parsed.append("[DONE]")
            continue
        try:
            parsed.append(json.loads(body))
        except json.JSONDecodeError as exc:
            fail(tag, f"event {i} of {case} is not JSON after 'data: ': {exc}", "json.dumps(the chunk's dict)")
    return parsed


def _normal(event):
    """What a client reads from an event: the fields every chunk has, per choice index / text / finish_reason
    (and stop_reason when present), and usage."""
    if event == "[DONE]":
        return event
    if not isinstance(event, dict):
        return ("not an object", event)
    out = {k: event.get(k, "<missing>") for k in ("id", "object", "created", "model")}
    choices = event.get("choices", "<missing>")
    if isinstance(choices, list):
        out["choices"] = [{k: c.get(k, "<missing>") for k in ("index", "text", "finish_reason")}
                          | ({"stop_reason": c["stop_reason"]} if isinstance(c, dict) and "stop_reason" in c else {})
                          if isinstance(c, dict) else c for c in choices]
    else:
        out["choices"] = choices
    out["usage"] = event.get("usage")
    return out


def _strip_stop_reason(events):
    out = []
    for e in events:
        if isinstance(e, dict) and isinstance(e.get("choices"), list):
            e = dict(e, choices=[{k: v for k, v in c.items() if k != "stop_reason"} if isinstance(c, dict) else c
                                 for c in e["choices"]])
        out.append(e)
    return out


def completion_events_variant(head: dict, n: int, outputs, include_usage: bool = False, kind: str | None = None):
    """E12.3 written out by hand, with one of the usual mistakes (`kind`, see SSE_MUTANTS) or none (kind=None:
    the same events as reference_completion_events; a test holds them to it)."""
    def chunk(index, text, finish_reason=None, stop_reason=None):
        return {**head, "object": "text_completion", "choices": [{"index": index, "text": text, "logprobs": None,
                "finish_reason": finish_reason, "stop_reason": stop_reason}]} | ({"usage": None} if include_usage else {})

    events, sent, finished, tokens, prompt_lens = [], {}, set(), {}, {}
    prompt_seen = 0
    for p, out in outputs:
        prompt_lens[p] = len(out.prompt_token_ids)
        prompt_seen += len(out.prompt_token_ids)
        for s in out.outputs:
            key = (p, s.index) if kind != "sent_by_sample" else s.index
            index = s.index if kind == "sample_index" else p * n + s.index
            if key in finished and kind != "refinish":
                continue
            new = s.text if kind == "cumulative" else s.text[len(sent.get(key, "")):]
            if kind == "finish_with_text" and s.finish_reason is not None:
                events.append(chunk(index, new, s.finish_reason, s.stop_reason))
                finished.add(key)
                sent[key], tokens[key] = s.text, len(s.token_ids)
                continue
            if new or kind == "empty_chunks":
                events.append(chunk(index, new))
            if s.finish_reason is not None:
                events.append(chunk(index, "", s.finish_reason, s.stop_reason))
                finished.add(key)
            sent[key] = s.text
            tokens[key] = len(s.text) if kind == "usage_characters" else len(s.token_ids)
    if include_usage:
        prompt = sum(prompt_lens.values()) * (n if kind == "usage_per_sample" else 1)
        if kind == "usage_per_output":
            prompt = prompt_seen
        completion = sum(tokens.values())
        events.append({**head, "object": "text_completion", "choices": [],
                       "usage": {"prompt_tokens": prompt, "completion_tokens": completion,
                                 "total_tokens": prompt + completion}})
    lines = [f"data: {json.dumps(e, ensure_ascii=False)}\n\n" for e in events]
    return lines if kind == "no_done" else lines + ["data: [DONE]\n\n"]


SSE_MUTANTS = [
    ("cumulative", "a chunk carried the whole text so far: each chunk must carry only the text added since the "
     "previous one (the client appends them)", "keep what you sent per choice; send s.text[len(sent):]"),
    ("empty_chunks", "you sent a chunk with empty text for a choice whose text did not grow (a step may add no "
     "text: a character or a stop string is still held back)", "send a text chunk only when the new text is not ''"),
    ("refinish", "a finished choice got another chunk: later snapshots of a request still list its finished "
     "samples, with the same text and finish_reason", "remember which choices finished and skip them"),
    ("sample_index", "the choice index is the sample's index alone: with several prompts, choice index = "
     "prompt index * n + sample index (OpenAI's and vLLM's batched completions)",
     "index = prompt_index * n + sample.index"),
    ("usage_per_sample", "usage counted the prompt once per sample: prompt_tokens counts each prompt once, "
     "however many samples share it", "prompt_tokens = sum of the prompts' lengths; completion_tokens = sum over "
     "choices of len(token_ids); total = their sum"),
    ("no_done", "the stream did not end with 'data: [DONE]': OpenAI's clients read until it",
     "append 'data: [DONE]\\n\\n' last"),
    ("finish_with_text", "the last text of a choice came in its finish chunk: the server sends the new text in a "
     "text chunk, then a chunk with text '' and the finish_reason", "two chunks when a choice ends in an output "
     "that also adds text: first the text, then {'text': '', 'finish_reason': ...}"),
    ("sent_by_sample", "what was sent is kept per sample index, so two prompts' samples with the same index mix "
     "their texts: keep it per choice", "key what you sent (and what finished) by (prompt_index, sample.index), or "
     "by the choice index prompt_index * n + sample.index"),
    ("usage_per_output", "usage counted a prompt once per engine output: the engine sends a prompt's request many "
     "times (one cumulative snapshot per step), and each prompt counts once", "keep each prompt's length by its "
     "prompt index and sum those at the end"),
    ("usage_characters", "completion_tokens counted characters of the text, not tokens", "completion_tokens = sum "
     "over choices of len(sample.token_ids) (the last snapshot's)"),
]


def _first_difference(got, want, path="") -> str:
    """Where two decoded events first differ, as `choices[0].text: yours '...', the server's '...'`."""
    if isinstance(got, dict) and isinstance(want, dict):
        for key in list(want) + [k for k in got if k not in want]:
            if key not in got:
                return f"{path}{key} is missing (the server's {json.dumps(want[key], ensure_ascii=False)[:120]})"
            if key not in want:
                return f"{path}{key} is not in the server's event (yours {json.dumps(got[key], ensure_ascii=False)[:120]})"
            if got[key] != want[key]:
                return _first_difference(got[key], want[key], f"{path}{key}.")
    if isinstance(got, list) and isinstance(want, list) and len(got) == len(want):
        for i, (a, b) in enumerate(zip(got, want)):
            if a != b:
                return _first_difference(a, b, f"{path.rstrip('.')}[{i}].")
    return (f"{path.rstrip('.') or 'the event'}: yours {json.dumps(got, ensure_ascii=False)[:120]}, the server's "
            f"{json.dumps(want, ensure_ascii=False)[:120]}")


def check_completion_events(fn) -> None:
    tag = "E12.3"
    g = fresh_generator()
    rng = _rng(g)
    shapes = [(1, 1, False), (1, rng.randint(2, 3), True), (rng.randint(2, 3), 1, False),
              (rng.randint(2, 3), rng.randint(2, 3), True), (rng.randint(1, 3), rng.randint(1, 3), rng.random() < 0.5)]
    state = held_state(fn)
    cases = []
    for num_prompts, n, include_usage in shapes:
        outputs = _stream_outputs(rng, num_prompts, n)
        head = {"id": f"cmpl-{rng.getrandbits(64):016x}", "created": rng.randint(1_700_000_000, 1_900_000_000),
                "model": rng.choice(("tiny", "SmolLM2-135M-Instruct", "m"))}
        case = f"{num_prompts} prompt(s), n={n}, include_usage={include_usage}, {len(outputs)} engine outputs"
        cases.append((head, n, outputs, include_usage, case))
    results = {}                                            # case index -> the student's events, stop_reason stripped

    def student_events(i):
        if i not in results:
            head, n, outputs, include_usage, case = cases[i]
            got_raw = call_student(tag, fn, dict(head), n, list(outputs), include_usage)
            check_no_state_kept(tag, fn, state, len(results) + 1,
                                "the server calls completion_events for every streamed request")
            results[i] = [_normal(e) for e in _events_ok(tag, got_raw, case)]
        return results[i]

    def mutant_events(i, kind):
        head, n, outputs, include_usage, case = cases[i]
        return _strip_stop_reason([_normal(e) for e in _events_ok(
            tag, completion_events_variant(dict(head), n, outputs, include_usage, kind), case)])

    for call, (head, n, outputs, include_usage, case) in enumerate(cases):
        want = [_normal(e) for e in _events_ok(tag, reference_completion_events(head, n, outputs, include_usage), case)]
        got = student_events(call)
        if not any("stop_reason" in c for e in got if isinstance(e, dict) and isinstance(e.get("choices"), list)
                   for c in e["choices"]):
            want = _strip_stop_reason(want)                  # stop_reason is vLLM's extra: optional
        if got == want:
            continue
        k = next((i for i, (a, b) in enumerate(zip(got, want)) if a != b), min(len(got), len(want)))
        if _strip_stop_reason(got) == _strip_stop_reason(want):     # right but for the optional field itself
            fail(tag, f"event {k} of {case}: {_first_difference(got[k], want[k])}",
                 "stop_reason is what ended the choice: the stop string or stop id that matched, None for eos or "
                 "the length limit (the engine's CompletionOutput.stop_reason); or leave the field out")
        # The planted mistakes that give the student's events on this case. A mistake that changes nothing on
        # this case (the index mistake with one prompt) names nothing. Two mistakes can give the same events
        # on one case (one prompt, n=2 and two engine outputs: counting the prompt per sample or per output
        # both double it), so the student's is the one that also gives their events on every other case.
        candidates = [(kind, message, hint) for kind, message, hint in SSE_MUTANTS
                      if mutant_events(call, kind) != _strip_stop_reason(want)
                      and mutant_events(call, kind) == _strip_stop_reason(got)]
        for other in range(len(cases)):
            if len(candidates) <= 1:
                break
            if other != call:
                theirs = _strip_stop_reason(student_events(other))
                narrowed = [m for m in candidates if mutant_events(other, m[0]) == theirs]
                candidates = narrowed or candidates
        if candidates:
            kind, message, hint = candidates[0]
            fail(tag, f"{message} ({case})", hint)
        if k == min(len(got), len(want)):
            fail(tag, f"{len(got)} events for {case}, the server sends {len(want)} (the first {k} agree; next: "
                      f"{json.dumps(want[k] if k < len(want) else got[k], ensure_ascii=False)[:160]})",
                 "one chunk per choice whose text grew, one with its finish_reason when it ends, the usage chunk "
                 "if asked for, then [DONE]")
        fail(tag, f"event {k} of {case} differs: {_first_difference(got[k], want[k])}",
             'a text chunk: {"id", "object": "text_completion", "created", "model", "choices": [{"index", "text", '
             '"finish_reason": null}]} with the text new since the last chunk (not all of it so far) and the index '
             'prompt * n + sample; a finish chunk has text "" and the finish_reason')
    ok(tag)


# -- E12.1 the engine loop's admission and abort rules -------------------------------------------------------------
class RecordingEngine:
    """A fake engine for E12.1: add_request / abort_request only, each call logged. Refuses a prompt whose first
    id is REFUSE_VALUE (ValueError) or REFUSE_TYPE (TypeError), breaks (RuntimeError) on BROKEN. `live`: the
    requests it holds."""
    REFUSE_VALUE, REFUSE_TYPE, BROKEN = -1, -2, -3

    def __init__(self, live=()):
        self.live = list(live)
        self.log = []
        self.raised = {}                                    # request id -> the exception raised for it

    def add_request(self, prompt_token_ids, sampling_params, request_id):
        self.log.append(("add", request_id))
        first = prompt_token_ids[0]
        if first in (self.REFUSE_VALUE, self.REFUSE_TYPE, self.BROKEN):
            exc = {self.REFUSE_VALUE: ValueError, self.REFUSE_TYPE: TypeError, self.BROKEN: RuntimeError}[first](
                f"the engine refuses request {request_id}" if first != self.BROKEN else "the engine broke")
            self.raised[request_id] = exc
            raise exc
        if request_id in self.live:
            raise AssertionError(f"request id {request_id} added twice")
        self.live.append(request_id)
        return request_id

    def abort_request(self, request_id):
        self.log.append(("abort", request_id))
        if request_id in self.live:
            self.live.remove(request_id)


class Group:
    """A stand-in for the server's RequestGroup (one HTTP request): hashable, named."""

    def __init__(self, name):
        self.name = name

    def __repr__(self):
        return f"group {self.name}"


class PendingInput:
    """What the handler queues with a request: its prompt ids and sampling params (a stand-in for the server's
    pending item, weak-referenceable so the check can see whether anything still holds it)."""

    def __init__(self, prompt_token_ids, sampling_params=None):
        self.prompt_token_ids, self.sampling_params = prompt_token_ids, sampling_params

    def __repr__(self):
        return f"PendingInput({self.prompt_token_ids})"


def reference_apply_pending(engine, adds, aborts):
    from nanovllm_ref.entrypoints.openai.engine_loop import apply_pending
    return apply_pending(engine, adds, aborts)


def _pending_script(rng, broken=False):
    """(live ids, adds, aborts): aborts of live and unknown ids; groups of 1-4 requests, some refused (at the
    first, a middle or the last member, by ValueError or TypeError)."""
    live = [f"old-{i}" for i in range(rng.randint(1, 5))]
    aborts = rng.sample(live, rng.randint(0, len(live))) + [f"gone-{i}" for i in range(rng.randint(0, 2))]
    rng.shuffle(aborts)
    adds, k = [], 0
    kinds = ["ok", "ok", "refuse_mid", "refuse_first", "refuse_last", "ok"] + (["broken"] if broken else [])
    rng.shuffle(kinds)
    for gi, kind in enumerate(kinds):
        group, size = Group(f"G{gi}"), rng.randint(1, 4) if kind != "refuse_mid" else rng.randint(3, 4)
        bad = {"ok": None, "refuse_first": 0, "refuse_last": size - 1, "refuse_mid": 1, "broken": rng.randrange(size)}[kind]
        marker = RecordingEngine.BROKEN if kind == "broken" else rng.choice((RecordingEngine.REFUSE_VALUE,
                                                                             RecordingEngine.REFUSE_TYPE))
        for j in range(size):
            ids = [marker if j == bad else rng.randrange(3, 500)] + [rng.randrange(3, 500) for _ in range(rng.randint(0, 5))]
            adds.append((group, f"req-{k}", PendingInput(ids)))
            k += 1
    return live, adds, set(aborts) if rng.random() < 0.5 else aborts


def _normal_log(log):
    """The call log with each run of aborts after the first add sorted (the order of undo aborts is free)."""
    out, run, seen_add = [], [], False
    for call in log:
        if call[0] == "abort" and seen_add:
            run.append(call)
            continue
        out += sorted(run)
        run = []
        seen_add = seen_add or call[0] == "add"
        out.append(call)
    return out + sorted(run)


_TICKS = "the server calls apply_pending on every tick of its engine loop, for as long as it runs"
TICKS = 200


def _check_ticks_leave_nothing(tag, fn, rng, state) -> None:
    """TICKS calls on fresh scripts; then neither a container the function keeps (held_state) may have grown, nor
    may anything still hold one of the groups or pending inputs it was given (weak references, after a gc)."""
    import gc
    import weakref
    held = []
    for _ in range(TICKS):
        live, adds, aborts = _pending_script(rng)
        held += [weakref.ref(x) for gg, _, item in adds for x in (gg, item)]
        call_student(tag, fn, RecordingEngine(live), list(adds), aborts)
        del live, adds, aborts
    check_no_state_kept(tag, fn, state, TICKS + 4, _TICKS)
    gc.collect()
    alive = [r() for r in held if r() is not None]
    if alive:
        kinds = sorted({type(x).__name__ for x in alive})
        fail(tag, f"your function keeps state between calls: after {TICKS} ticks {len(alive)} of the groups and pending "
                  f"inputs it was given ({', '.join(kinds)}) are still referenced from somewhere; {_TICKS}, so every "
                  "request ever added stays in memory",
             "keep nothing between calls: build `added` and `refused` inside the function (a default argument such as "
             "added=[] is made once and shared by every call, and so is a module-level list)")


def check_apply_pending(fn) -> None:
    tag = "E12.1"
    g = fresh_generator()
    rng = _rng(g)
    state = held_state(fn)
    for call in range(4):
        live, adds, aborts = _pending_script(rng)
        ref, mine = RecordingEngine(live), RecordingEngine(live)
        want = reference_apply_pending(ref, list(adds), aborts)
        got = call_student(tag, fn, mine, list(adds), aborts)
        check_no_state_kept(tag, fn, state, call + 1, _TICKS)
        groups = {a[0].name: [r for gg, r, _ in adds if gg is a[0]] for a in adds}
        case = (f"aborts {sorted(aborts)} with {live} in the engine, then groups "
                + ", ".join(f"{n}: {ids}" for n, ids in groups.items()))
        first_add = next((i for i, c in enumerate(mine.log) if c[0] == "add"), len(mine.log))
        late = [c[1] for c in mine.log[first_add:] if c[0] == "abort" and c[1] in set(aborts)]
        if late:
            fail(tag, f"the pending abort of {late[0]} ran after an add ({case}): the aborts go first, so the KV "
                      "blocks and batch seats they free are there for the requests added in the same tick",
                 "first `for rid in aborts: engine.abort_request(rid)`, then the adds")
        missing = [rid for rid in aborts if ("abort", rid) not in mine.log]
        if missing:
            fail(tag, f"the pending abort of {missing[0]} never reached the engine ({case})",
                 "call engine.abort_request for every id in aborts (the engine ignores ids it does not know)")
        if not isinstance(got, dict):
            fail(tag, f"apply_pending should return a dict {{group: exception}}, got {type(got).__name__}",
                 "refused[group] = exc in the except branch; return refused")
        for gname, rids in groups.items():
            refused_here = [r for r in rids if r in ref.raised]
            if not refused_here:
                continue
            bad = refused_here[0]
            after = [r for r in rids[rids.index(bad) + 1:] if ("add", r) in mine.log]
            if after:
                fail(tag, f"{gname}'s request {after[0]} was added after the engine refused its sibling {bad} "
                          f"({case}): a group is admitted whole or not at all",
                     "once a group is refused, skip its later requests (if group in refused: continue)")
            still = [r for r in rids if r in mine.live]
            if still:
                fail(tag, f"{gname}'s request {still[0]} is still in the engine after the engine refused its sibling "
                          f"{bad} ({case}): the siblings added before the refusal must be aborted again",
                     "on a refusal, engine.abort_request every request of that group added so far")
        # an undo that reaches past the refused group
        owner = {r: gg for gg, r, _ in adds}
        # Counted, not looked up: undoing every request added so far also aborts again one that an earlier
        # refusal already undid, an abort the reference makes once.
        ref_aborts, mine_aborts, extra = Counter(r for k, r in ref.log if k == "abort"), Counter(), []
        for kind_, r in mine.log:
            if kind_ == "abort" and r in owner:
                mine_aborts[r] += 1
                if mine_aborts[r] > ref_aborts[r]:
                    extra.append(r)
        if extra:
            fail(tag, f"you aborted {owner[extra[0]].name}'s request {extra[0]}, which no refusal concerns ({case}): only "
                      "the refused group's own earlier requests are undone", "when undoing, abort only the requests "
                      "added so far whose group is the refused one (other is group)")
        # every request the reference offered the engine (the refused ones included) must be offered by yours too
        not_added = [(gg, r) for gg, r, _ in adds if ("add", r) in ref.log and ("add", r) not in mine.log]
        if not_added:
            gg, r = not_added[0]
            fail(tag, f"{gg.name}'s request {r} never reached engine.add_request ({case}): a refused group is skipped, "
                      "but it must not stop the groups after it", "after a refusal, go on with the next group")
        wrong_keys = {repr(k) for k in got} ^ {repr(k) for k in want}
        if wrong_keys:
            fail(tag, f"you returned refused = {sorted(map(repr, got))}, expected {sorted(map(repr, want))} ({case})",
                 "the keys are the groups (the first item of each add), the values the exception the engine raised")
        for grp in want:
            exc = next(mine.raised[r] for gg, r, _ in adds if gg is grp and r in mine.raised)
            if got.get(grp) is not exc:
                fail(tag, f"refused[{grp!r}] is {got.get(grp)!r}, not the exception the engine raised ({exc!r})",
                     "store the caught exception itself: the server answers the HTTP request with its message")
        if _normal_log(mine.log) != _normal_log(ref.log) or sorted(mine.live) != sorted(ref.live):
            fail(tag, f"the engine saw {mine.log}, the reference's {ref.log} ({case})",
                 "aborts first, then each add in order; a refused group: undo its earlier adds, skip its later ones")
    # a long run of ticks: nothing may pile up from one to the next, wherever the function keeps it
    _check_ticks_leave_nothing(tag, fn, rng, state)
    live, adds, aborts = _pending_script(rng, broken=True)
    try:
        call_student(tag, fn, RecordingEngine(live), list(adds), aborts)
    except RuntimeError as exc:
        if str(exc) != "the engine broke":
            raise
    else:
        fail(tag, "an engine that raised RuntimeError from add_request was treated as a refusal: only ValueError "
                  "and TypeError mean 'this request can never run'; anything else means the engine is broken, and the "
                  "loop must see it (it then fails every open request)",
             "catch (ValueError, TypeError) only")
    ok(tag)


# -- E12.4 the front end's half of a step: token-id deltas in, text, stop strings and aborts out ----------------
class FrontSample:
    """One sample of a request in the front end (E12.4): `index`, `token_ids` (the completion's ids so far),
    `text` (its text so far), `finish_reason` / `stop_reason` (None while it runs), and `detokenize(ids) -> str`,
    the new text of ids that follow every id passed before (the engine's IncrementalDetokenizer, E12.2)."""

    def __init__(self, index: int, detokenize):
        self.index = index
        self.token_ids: list[int] = []
        self.text = ""
        self.finish_reason = None
        self.stop_reason = None
        self.detokenize = detokenize

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def __repr__(self):
        return (f"FrontSample(index={self.index}, token_ids={self.token_ids}, text={self.text!r}, "
                f"finish_reason={self.finish_reason!r}, stop_reason={self.stop_reason!r})")


class FrontRequest:
    """One request in the front end (E12.4): `core_id` (the id the core knows it by), `sampling_params` (a
    SamplingParams: stop, include_stop_str_in_output, min_tokens are read), `samples` (a FrontSample per
    sample, n of them)."""

    def __init__(self, core_id: str, sampling_params, samples):
        self.core_id, self.sampling_params, self.samples = core_id, sampling_params, samples

    @property
    def finished(self) -> bool:
        return all(s.finished for s in self.samples)

    def __repr__(self):
        return f"FrontRequest({self.core_id!r}, n={len(self.samples)})"


def reference_process_outputs(requests, outputs):
    """E12.4 by the spec, line by line as engine/output_processor.py's OutputProcessor.process_outputs and
    _take_tokens do it (the check holds both to the same answers)."""
    from nanovllm_ref.engine.stop import find_stop_string
    aborts, progressed = [], []
    for out in outputs:
        req = requests.get(out.request_id)
        if req is None:                                   # aborted by its client, or finished here: dropped
            continue
        sp, sample = req.sampling_params, req.samples[out.index]
        if sample.finished or not out.new_token_ids:       # the core ran past a stop string: dropped
            continue
        progressed.append(req)
        ids, last = out.new_token_ids, len(out.new_token_ids) - 1
        token_stop = out.finish_reason == "stop"          # the core stopped on this delta's last token id
        hit = None
        for j, token_id in enumerate(ids):
            sample.token_ids.append(token_id)
            if token_stop and j == last:                  # eos or a stop id: its text is no stop-string text
                if sp.include_stop_str_in_output:
                    sample.text += sample.detokenize([token_id])
                break
            new = sample.detokenize([token_id])
            sample.text += new
            if sp.stop and len(sample.token_ids) > sp.min_tokens:
                hit = find_stop_string(sample.text, len(new), sp.stop, sp.include_stop_str_in_output)
                if hit is not None:
                    sample.text = sample.text[:hit[1]]
                    sample.finish_reason, sample.stop_reason = "stop", hit[0]
                    if out.finish_reason is None:         # the core still runs it: ask it to stop
                        aborts.append((out.request_id, out.index))
                    break
        if hit is None and out.finish_reason is not None:
            sample.finish_reason, sample.stop_reason = out.finish_reason, out.stop_reason
    for req in progressed:
        if req.finished:
            requests.pop(req.core_id, None)
    return aborts


def process_outputs_variant(requests, outputs, kind=None):
    """E12.4 written out by hand, with one of the usual mistakes (`kind`, see FRONT_MUTANTS) or none (kind=None:
    the reference's answers; a test holds them to it)."""
    aborts, progressed = [], []
    for out in outputs:
        if kind == "key_error":
            req = requests[out.request_id]
        else:
            req = requests.get(out.request_id)
            if req is None:
                continue
        sp, sample = req.sampling_params, req.samples[out.index]
        if (sample.finished and kind != "after_finish") or not out.new_token_ids:
            continue
        progressed.append(req)
        ids, last = out.new_token_ids, len(out.new_token_ids) - 1
        token_stop = out.finish_reason == "stop"
        hit = False
        for j, token_id in enumerate(ids):
            sample.token_ids.append(token_id)
            if token_stop and j == last:
                if sp.include_stop_str_in_output or kind == "stop_token_text":
                    sample.text += sample.detokenize([token_id])
                break
            new = sample.detokenize([token_id])
            sample.text += new
            if hit or not sp.stop or (len(sample.token_ids) <= sp.min_tokens and kind != "no_min_tokens"):
                continue
            found = None
            for s in sp.stop:
                if kind == "new_text_only":
                    i = new.find(s)
                    i = -1 if i == -1 else len(sample.text) - len(new) + i
                else:
                    start = 0 if kind == "whole_text" else max(0, len(sample.text) - len(new) - len(s) + 1)
                    i = sample.text.find(s, start)
                if i != -1 and (found is None or i < found[1]):
                    found = (s, i)
            if found is None:
                continue
            s, i = found
            cut = i + len(s) if sp.include_stop_str_in_output and kind != "include_ignored" else i
            sample.text = sample.text[:cut]
            sample.finish_reason, sample.stop_reason = "stop", s
            hit = True
            if (out.finish_reason is None or kind == "abort_finished") and kind != "no_abort":
                aborts.append((out.request_id, out.index))
            if kind != "rest_of_delta":
                break
        if not hit and out.finish_reason is not None and kind != "finish_not_copied":
            sample.finish_reason, sample.stop_reason = out.finish_reason, out.stop_reason
    if kind != "keep_finished":
        for req in progressed:
            if req.finished:
                requests.pop(req.core_id, None)
    return aborts


_CORE_RUNS_ON = ("the core runs ahead of the front end: by the time your abort reaches it, it has made more "
                 "tokens of that sample, and they are already on their way")
FRONT_MUTANTS = [
    ("after_finish", "tokens that arrived after a sample had finished were appended to it: " + _CORE_RUNS_ON,
     "skip an output whose sample has already finished (if sample.finish_reason is not None: continue)"),
    ("new_text_only", "a stop string that is split over several tokens was missed: you searched only the new "
     "token's text", "search sample.text, from max(0, len(text) - len(new) - len(stop) + 1): the stop string may "
     "begin in earlier tokens and end in this one"),
    ("whole_text", "a stop string that appeared before min_tokens was matched later: search only where a match "
     "ends in the new token's text (an earlier match was seen, and refused, when it was new)",
     "text.find(stop, max(0, len(text) - len(new) - len(stop) + 1)), not text.find(stop)"),
    ("no_min_tokens", "a stop string ended a sample before it had more than min_tokens tokens",
     "search for stop strings only once len(sample.token_ids) > sampling_params.min_tokens"),
    ("no_abort", "a stop string ended a sample but the core was not asked to stop it, so it runs on to "
     "max_tokens, holding its KV blocks and its batch seat", "append (out.request_id, out.index) to the list "
     "you return when a stop string ends a sample the core still runs (out.finish_reason is None)"),
    ("abort_finished", "you asked the core to abort a sample it had finished itself in the same output (its "
     "finish_reason was set): it holds nothing of it any more", "abort only when out.finish_reason is None"),
    ("stop_token_text", "the text of the token the core stopped on (eos or a stop id) is in the sample's text: "
     "it stays out unless include_stop_str_in_output", "for the last token of an output with finish_reason "
     "'stop', append its id, and its text only if include_stop_str_in_output"),
    ("include_ignored", "with include_stop_str_in_output the stop string stays in the text: you cut before it",
     "cut the text at the match's start + len(stop) when include_stop_str_in_output, else at its start"),
    ("rest_of_delta", "after a stop string ended a sample, the output's later tokens were appended to it",
     "stop taking an output's tokens at the one that completed the stop string (break)"),
    ("finish_not_copied", "the core finished a sample (finish_reason 'length' or 'stop' in its output) and it "
     "is still running in the front end", "when the output has a finish_reason (and no stop string ended the "
     "sample first), copy its finish_reason and stop_reason to the sample"),
    ("keep_finished", "a request all of whose samples finished is still in `requests`: the front end must forget "
     "it, so late outputs of it are dropped and it does not stay in memory",
     "after the loop, requests.pop(core id) for every request that progressed and has all its samples finished"),
]
FRONT_KINDS = [k for k, _, _ in FRONT_MUTANTS]
_FRONT_STOPS = ("the lazy", "ox ju", "ck b", ". ", "er t", "he ", "fix t", "st s")


def _front_stream(rng, tok, stops, feature=None, min_tokens=0):
    """One sample's planned core stream: ASCII text (every token's text is whole; stop strings spread over
    several tokens) and how the core ends it. feature "min_block": the text starts with a stop string that ends
    within the first `min_tokens` tokens (returned: the min_tokens that covers it); "final_hit": the stream
    ends ("length") on the very token that completes a stop string."""
    text = " ".join(rng.choice(WORDS) for _ in range(rng.randint(4, 12)))
    for _ in range(rng.choice((0, 1, 1, 2)) if stops else 0):         # plant stop strings (maybe twice)
        k = rng.randint(0, len(text))
        text = text[:k] + rng.choice(stops) + text[k:]
    if feature == "min_block":
        text = stops[0] + text
    ids = tok.encode(text, add_special_tokens=False)
    if feature == "min_block":
        upto = next(j for j in range(len(ids)) if stops[0] in tok.decode(ids[:j + 1]))
        min_tokens = upto + 1 + rng.randint(0, 2)
        return dict(ids=ids[:max(min_tokens + 4, rng.randint(6, 30))], reason="length", stop_reason=None), min_tokens
    if feature == "final_hit":
        start = rng.randint(2, 5)
        ids = ids[:start] + tok.encode(stops[0] + " " + text, add_special_tokens=False)
        upto = next(j for j in range(len(ids)) if stops[0] in tok.decode(ids[:j + 1]))
        return dict(ids=ids[:upto + 1], reason="length", stop_reason=None), min_tokens
    ids = ids[:rng.randint(6, 30)]
    end = rng.choice(("length", "length", "eos", "stop_id"))
    if end == "eos":
        return dict(ids=ids + [tok.eos_token_id], reason="stop", stop_reason=None), min_tokens
    if end == "stop_id":
        return dict(ids=ids, reason="stop", stop_reason=ids[-1]), min_tokens
    return dict(ids=ids, reason="length", stop_reason=None), min_tokens


def _front_case(rng, tok):
    """One E12.4 case: 3-4 requests (n = 1-2) with their settings and the core's planned token streams, plus a
    script of client aborts; request 0 has a stop string hidden by min_tokens, request 1 a stop string on the
    token the core finished with, the others are random. Returns a dict the check replays."""
    from nanovllm_ref import SamplingParams
    reqs = []
    for r in range(rng.randint(3, 4)):
        feature = {0: "min_block", 1: "final_hit"}.get(r)
        n = rng.choice((1, 2, 2))
        stops = rng.sample(_FRONT_STOPS, 1 if feature == "final_hit" else rng.choice((0, 1, 2, 2, 3) if feature is None
                                                                                     else (1, 2)))
        include = rng.random() < 0.35
        streams, min_tokens = [], 0 if feature is not None or rng.random() < 0.6 else rng.randint(1, 4)
        for i in range(n):
            stream, m = _front_stream(rng, tok, stops, feature if i == 0 else None, min_tokens)
            if i == 0:
                min_tokens = m
            streams.append(stream)
        min_tokens = min(min_tokens, min(len(s["ids"]) for s in streams) - 1)
        stop_ids = sorted({s["stop_reason"] for s in streams if s["stop_reason"] is not None})
        sp = SamplingParams(n=n, stop=stops or None, include_stop_str_in_output=include, min_tokens=max(min_tokens, 0),
                            max_tokens=64, stop_token_ids=stop_ids or None)
        prompt = tok.encode(" ".join(rng.choice(WORDS) for _ in range(rng.randint(1, 5))), add_special_tokens=False)
        reqs.append(dict(core_id=f"{r}-{rng.getrandbits(24):06x}", sp=sp, prompt=prompt, streams=streams))
    rng.shuffle(reqs)
    # a client leaves at this step (None: none does); its request's outputs already on their way still come
    return dict(requests=reqs, seed=rng.getrandbits(32), client_abort=rng.choice((None, 1, 2, 3)))


def _front_objects(case, tok):
    """Fresh FrontRequests for a case (each sample with its own IncrementalDetokenizer)."""
    from nanovllm_ref.engine.detokenizer import IncrementalDetokenizer
    out = {}
    for r in case["requests"]:
        samples = [FrontSample(i, IncrementalDetokenizer(tok, r["prompt"], True).update) for i in range(r["sp"].n)]
        out[r["core_id"]] = FrontRequest(r["core_id"], r["sp"], samples)
    return out


def _front_record(case, tok):
    """Run the case through the engine's own OutputProcessor with a simulated core that runs ahead (a sample
    the front end aborts gets 0-2 more outputs: the abort is in flight) and clients that leave. Returns
    (steps, trace): steps = [(client aborts, [EngineCoreOutput])], trace = the OutputProcessor's state after each
    step (see _front_snapshot)."""
    from types import SimpleNamespace as NS

    from nanovllm_ref.engine.core_messages import EngineCoreOutput
    from nanovllm_ref.engine.output_processor import OutputProcessor
    rng = random.Random(case["seed"])
    proc = OutputProcessor(tok)
    states = {r["core_id"]: proc.add_request(r["core_id"], r["core_id"], None, r["prompt"], r["sp"])
              for r in case["requests"]}
    pos = {(r["core_id"], i): 0 for r in case["requests"] for i in range(r["sp"].n)}
    stop_at = {}                                          # (core id, index) -> step from which the core sends none
    steps, trace, step = [], [], 0
    no_hold = NS(stop_holdback=0)
    while any(p is not None for p in pos.values()) and step < 200:
        client = []
        live = [r["core_id"] for r in case["requests"] if r["core_id"] in proc.requests]
        if step == case["client_abort"] and live:
            rid = rng.choice(live)
            proc.abort_request(rid)
            client.append(rid)
            delay = rng.randint(0, 2)
            for key in pos:
                if key[0] == rid:
                    stop_at.setdefault(key, step + delay)
        outs = []
        for r in case["requests"]:
            for i, s in enumerate(r["streams"]):
                key = (r["core_id"], i)
                p = pos[key]
                if p is None or stop_at.get(key, 1 << 30) <= step:
                    pos[key] = None
                    continue
                k = 2 if rng.random() < 0.25 else 1
                if rng.random() < 0.05 and step == 0:
                    k = 0                                  # a prefill chunk: no token yet
                new = s["ids"][p:p + k]
                pos[key] = p + len(new)
                done = pos[key] >= len(s["ids"])
                outs.append(EngineCoreOutput(r["core_id"], i, list(new), s["reason"] if done else None,
                                             s["stop_reason"] if done else None))
                if done:
                    pos[key] = None
        rng.shuffle(outs) if rng.random() < 0.3 else None
        _, aborts = proc.process_outputs(outs)
        for key in aborts:
            stop_at.setdefault(tuple(key), step + 1 + rng.randint(0, 2))
        steps.append((client, outs))
        trace.append(_front_snapshot(aborts, proc.requests.keys(), {
            cid: [(list(s.token_ids), s.text(no_hold), s.finish_reason, s.stop_reason) for s in st.samples]
            for cid, st in states.items()}))
        step += 1
    return steps, trace


def _front_snapshot(aborts, live_ids, samples):
    return {"aborts": sorted(tuple(a) for a in aborts), "requests": sorted(live_ids), "samples": samples}


def _front_replay(fn, case, steps, tok, tag=None):
    """The trace of `fn` on a recorded case (the same outputs, the same client aborts): (trace, None), or
    (trace so far, (step, KeyError)) if fn raised KeyError."""
    reqs = _front_objects(case, tok)
    objs = dict(reqs)
    trace = []
    for k, (client, outs) in enumerate(steps):
        for rid in client:                                # the client left: the front end forgets it
            gone = reqs.pop(rid, None) or objs[rid]
            for s in gone.samples:
                if s.finish_reason is None:
                    s.finish_reason, s.stop_reason = "abort", None
        try:
            got = fn(reqs, list(outs)) if tag is None else call_student(tag, fn, reqs, list(outs))
        except KeyError as exc:
            return trace, (k, exc)
        if not isinstance(got, list) or not all(isinstance(a, tuple) and len(a) == 2 for a in got):
            return trace, (k, TypeError(f"process_outputs should return a list of (core request id, sample index) "
                                        f"tuples, got {got!r}"[:300]))
        trace.append(_front_snapshot(got, reqs.keys(), {
            cid: [(list(s.token_ids), s.text, s.finish_reason, s.stop_reason) for s in r.samples]
            for cid, r in objs.items()}))
    return trace, None


def _front_cases(g, tok, tries: int = 30):
    """Fresh E12.4 cases on which every planted mistake gives answers of its own: each differs from the
    engine's somewhere, and no two give the same answers everywhere (redrawn until so)."""
    rng = _rng(g)
    for _ in range(tries):
        cases = [_front_case(rng, tok) for _ in range(5)]
        if not any(c["client_abort"] for c in cases):
            cases[0]["client_abort"] = 1
        records = [_front_record(c, tok) for c in cases]
        traces = {kind: tuple(repr(_front_replay(functools.partial(process_outputs_variant, kind=kind), c, st, tok))
                              for c, (st, _) in zip(cases, records)) for kind in FRONT_KINDS}
        want = tuple(repr((tr, None)) for _, tr in records)
        if (all(t != want for t in traces.values()) and len(set(traces.values())) == len(traces)
                and any(_output_after_client_left(st) for st, _ in records)):
            return cases, records
    return cases, records


def _output_after_client_left(steps) -> bool:
    """Some output arrives for a request whose client has left (so `requests[out.request_id]` would raise): a
    draw without one could not catch that mistake (a client abort with no delay, or none live to abort)."""
    gone = set()
    for client, outs in steps:
        gone.update(client)
        if any(o.request_id in gone for o in outs):
            return True
    return False


def _front_describe(case, k, got=None, want=None) -> str:
    """The step and the request (its settings) where the student's answers first differ from the engine's."""
    rid = None
    if got is not None and want is not None:
        # in _front_difference's order: the samples, then the aborts, then the requests left
        diff = [cid for cid in want["samples"] if got["samples"].get(cid) != want["samples"][cid]]
        diff += [a[0] for a in sorted(set(got["aborts"]) ^ set(want["aborts"]))]
        diff += sorted(set(got["requests"]) ^ set(want["requests"]))
        rid = diff[0] if diff else None
    r = next((r for r in case["requests"] if r["core_id"] == rid), None)
    if r is None:
        return f"at step {k}"
    sp = r["sp"]
    return (f"at step {k}, request {rid}: n={sp.n}, stop={list(sp.stop)}, include_stop_str_in_output="
            f"{sp.include_stop_str_in_output}, min_tokens={sp.min_tokens}")


def check_process_outputs(fn) -> None:
    tag = "E12.4"
    g = fresh_generator()
    tok = byte_level_tokenizer()
    state = held_state(fn)
    cases, records = _front_cases(g, tok)
    got_traces = {}

    def student(i):
        if i not in got_traces:
            got_traces[i] = _front_replay(fn, cases[i], records[i][0], tok, tag)
            check_no_state_kept(tag, fn, state, len(got_traces),
                                "the front end calls process_outputs for every step of the core")
        return got_traces[i]

    def mutant(i, kind):
        return _front_replay(functools.partial(process_outputs_variant, kind=kind), cases[i], records[i][0], tok)

    for i, (case, (steps, want)) in enumerate(zip(cases, records)):
        got, err = student(i)
        if err is not None and isinstance(err[1], TypeError):
            fail(tag, str(err[1]), "return the list of (out.request_id, out.index) pairs a stop string ended")
        if err is None and got == want:
            continue
        # the planted mistakes that give the student's answers here, narrowed by the other cases
        mine = repr((got, None if err is None else type(err[1]).__name__))
        candidates = [m for m in FRONT_MUTANTS if repr(_normal_err(mutant(i, m[0]))) == mine]
        for other in range(len(cases)):
            if len(candidates) <= 1:
                break
            if other != i:
                theirs = repr(_normal_err(student(other)))
                candidates = [m for m in candidates if repr(_normal_err(mutant(other, m[0]))) == theirs] or candidates
        k = len(got) if err is not None else next(j for j, (a, b) in enumerate(zip(got, want)) if a != b)
        where = f"({_front_describe(case, k, *((got[k], want[k]) if err is None else ()))})"
        if candidates:
            kind, message, hint = candidates[0]
            fail(tag, f"{message} {where}", hint)
        if err is not None:
            fail(tag, f"KeyError {err[1]}: an output came for a request that is no longer in `requests` (its client "
                      f"left, or it finished here while the core ran on; the core's outputs are already on their "
                      f"way) {where}", "look each output's request up with requests.get(out.request_id) and skip it "
                      "when it is None")
        fail(tag, f"after step {k} {_front_difference(got[k], want[k])} {where}",
             "per output: skip an unknown request or a finished sample; per token: append the id, add its text, "
             "search for a stop string that ends in the new text; then copy the core's finish; return the aborts")
    ok(tag)


def _normal_err(result):
    trace, err = result
    return trace, None if err is None else type(err[1]).__name__


def _front_difference(got: dict, want: dict) -> str:
    """What first differs between two snapshots, in words."""
    names = ("token_ids", "text", "finish_reason", "stop_reason")
    for cid, samples in want["samples"].items():
        for idx, (a, b) in enumerate(zip(got["samples"][cid], samples)):
            for name, x, y in zip(names, a, b):
                if x != y:
                    return f"sample {idx} of {cid} has {name} {x!r}, the engine's front end {y!r}"
    if got["aborts"] != want["aborts"]:
        return f"you asked the core to abort {got['aborts']}, the front end must ask for {want['aborts']}"
    if got["requests"] != want["requests"]:
        return f"`requests` holds {got['requests']}, it should hold {want['requests']}"
    return "the states differ"


# -- the server in a subprocess (the chapter's demos) -------------------------------------------------------------
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """`python -m nanovllm_ref serve --model MODEL ARGS...` on 127.0.0.1 and a free port, served as "m", its log in
    a temporary file; `url`, `health()`, `stop()` (SIGTERM, then the exit status). Raises RuntimeError with the
    log's tail if it does not answer /health within `startup_s`."""

    def __init__(self, model: str, *args, startup_s: float = 120):
        import httpx
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = Path(tempfile.mkdtemp(prefix="nanovllm_ch12_serve_")) / "server.log"
        self._log = open(self.log_path, "w")
        env = dict(os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"))
        self.proc = subprocess.Popen([sys.executable, "-m", "nanovllm_ref", "serve", "--model", model, "--port",
                                      str(self.port), "--served-model-name", "m", "--log-level", "warning", *args],
                                     stdout=self._log, stderr=subprocess.STDOUT, env=env, cwd=str(ROOT))
        deadline = time.monotonic() + startup_s
        while True:
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.proc.kill()
                raise RuntimeError(f"the server did not start: {self.log_path.read_text()[-1500:]}")
            time.sleep(0.2)

    def health(self) -> dict:
        import httpx
        return httpx.get(self.url + "/health", timeout=10).json()

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        status = self.proc.wait(timeout=60)
        self._log.close()
        return status


# -- 12.6 the GIL, measured: an engine's steps with and without Python work beside them --------------------------
def http_side_load(stop) -> int:
    """What the HTTP side does per chunk, as pure Python, until the threading.Event `stop` is set: build an SSE
    chunk's dict and json.dumps it (both hold the GIL all the way). Returns the chunks made."""
    made = 0
    while not stop.is_set():
        chunk = {"id": "cmpl-1", "object": "text_completion", "created": 1796000000, "model": "m",
                 "choices": [{"index": 0, "text": " token", "logprobs": None, "finish_reason": None}]}
        f"data: {json.dumps(chunk)}\n\n"
        made += 1
    return made


def gil_steps(llm, load: bool, num_requests: int = 8, max_tokens: int = 16) -> dict:
    """Run num_requests greedy requests of max_tokens tokens to the end on `llm` (an LLM with any engine core),
    with `load` a thread of this process running `http_side_load` meanwhile (the server's event loop, which
    shares this process's GIL). Returns {"steps", "core_ms" (the core's own time per step: EngineCoreOutputs.step_s,
    measured where the core runs), "wall_ms" (wall time per step seen by the caller), "chunks" (what the load
    thread made)}."""
    import threading

    from nanovllm_ref import SamplingParams
    sp = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    stop, made = threading.Event(), []
    thread = threading.Thread(target=lambda: made.append(http_side_load(stop)), daemon=True)
    for i in range(num_requests):
        llm.add_request([5 + i, 6, 7, 8], sp)
    if load:
        thread.start()
    core_s, steps, start = llm.core_step_s, 0, time.perf_counter()
    while not llm.is_finished():
        llm.step()
        steps += len(llm.last_steps)
    wall = time.perf_counter() - start
    stop.set()
    if load:
        thread.join()
    steps = max(steps, 1)
    return {"steps": steps, "core_ms": (llm.core_step_s - core_s) / steps * 1e3, "wall_ms": wall / steps * 1e3,
            "chunks": made[0] if made else 0}


# -- TTFT and TPOT, live: the engine driven by arrivals in-process ---------------------------------------------------
def online_run(llm, prompts, max_tokens: int, rate: float, seed: int = 0) -> dict:
    """Drive `llm` (an LLM / LLMEngine) as the server's loop does, without HTTP: request i arrives at the i-th
    arrival of a Poisson process of `rate` requests/s (from the run's start, wall clock); before every step the
    requests that have arrived are added; every output's time stamps its request. Greedy, ignore_eos, max_tokens
    each. Returns {"requests": [{"sent", "ttft", "e2e", "tpot", "output_tokens"}], "steps": {"prefill", "decode"},
    "summary": nanovllm_bench.serve.latency_summary of them} (times in s)."""
    from nanovllm_bench.serve import arrival_times, latency_summary
    from nanovllm_ref import SamplingParams
    sp = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    times = arrival_times(len(prompts), rate, seed)
    first, last, tokens, ids = {}, {}, {}, {}
    steps = {"prefill": 0, "decode": 0}
    start, i = time.perf_counter(), 0
    while i < len(prompts) or not llm.is_finished():
        now = time.perf_counter() - start
        while i < len(prompts) and times[i] <= now:
            ids[llm.add_request(prompts[i], sp)] = i
            i += 1
        if llm.is_finished():
            time.sleep(max(0.0, min(times[i] - now, 0.05)))
            continue
        outs = llm.step()
        now = time.perf_counter() - start
        if llm.last_step is not None:
            steps[llm.last_step.kind] += 1
        for out in outs:
            k = ids[out.request_id]
            first.setdefault(k, now)
            last[k] = now
            tokens[k] = len(out.outputs[0].token_ids)
    results = []
    for k in range(len(prompts)):
        ttft, e2e = first[k] - times[k], last[k] - times[k]
        results.append({"sent": times[k], "ttft": ttft, "e2e": e2e, "output_tokens": tokens[k], "error": None,
                        "tpot": (e2e - ttft) / (tokens[k] - 1) if tokens[k] > 1 else None})
    return {"requests": results, "steps": steps, "summary": latency_summary(results, time.perf_counter() - start)}


def chat_prompts(tokenizer, n: int, seed: int = 0) -> list[list[int]]:
    """n chat prompts for SmolLM2 (its chat template), of different lengths, as token ids."""
    rng = random.Random(seed)
    topics = ["the KV cache", "continuous batching", "a paged attention kernel", "prefix caching", "tokenizers",
              "server-sent events", "CUDA graphs", "tensor parallelism", "the Poisson process", "a scheduler"]
    out = []
    for i in range(n):
        q = f"Explain {rng.choice(topics)} " + " ".join(["in simple words, with an example,"] * rng.randint(0, 6))
        out.append(tokenizer.apply_chat_template([{"role": "user", "content": q.strip(", ") + "."}],
                                                 add_generation_prompt=True, tokenize=True, return_dict=False))
    return out


# -- the committed records -------------------------------------------------------------------------------------------
# The hook for the H200 record: `bash bench/gpu_serve.sh` on the H200 writes serve_h200.json (our server and
# `vllm serve` on the Qwen3-0.6B-shaped workload, the same client and rates); once it is committed under
# bench/results/, serve_record() returns it and `python -m nanovllm_course figures 12` redraws
# figures/ch12_serving_latency.png from it. Until then both read the CPU record.
H200_SERVE_RECORD = "serve_h200.json"
CPU_SERVE_RECORD = "serve_cpu.json"


def serve_record() -> tuple[str, dict]:
    """(file name, record) of the online serving benchmark the chapter shows: the H200 record
    (bench/results/serve_h200.json, H200_SERVE_RECORD) once it is committed, else the CPU record
    (bench/results/serve_cpu.json: our server on SmolLM2 under three engine settings)."""
    for name in (H200_SERVE_RECORD, CPU_SERVE_RECORD):
        path = RESULTS / name
        if path.is_file():
            return name, json.loads(path.read_text())
    raise FileNotFoundError("no serving record in bench/results (serve_h200.json or serve_cpu.json)")


def cpu_serve_record() -> tuple[str, dict]:
    """(file name, record) of the CPU serving record (bench/results/serve_cpu.json: our server on SmolLM2 under
    three engine settings), the one section 12.5's trade-off reads whatever else is committed."""
    return CPU_SERVE_RECORD, json.loads((RESULTS / CPU_SERVE_RECORD).read_text())


H200_CORE_PROFILE_RECORD = "serve_h200_core_profile_2026-12-02.json"


def core_step_costs(run: dict) -> dict:
    """{"decode>prefill": (steps, ms a step, tokens a step), ...} for one rate of a serving record whose
    runs keep our server's /health before and after (bench/results/serve_h200_core_profile_2026-12-02.json):
    the engine core's steps by what each launched after what (LLMEngine.core_step_kinds), this rate's share
    (after minus before). {} when the run has no such snapshots (vLLM's, or an older record)."""
    health = run.get("health") or {}
    before, after = health.get("before") or {}, health.get("after") or {}
    kinds_before = (before.get("engine") or {}).get("core_step_kinds", {})
    kinds_after = (after.get("engine") or {}).get("core_step_kinds", {})
    out = {}
    for kind, (n, seconds, tokens) in sorted(kinds_after.items()):
        n0, s0, t0 = kinds_before.get(kind, (0, 0.0, 0))
        if n > n0:
            out[kind] = (n - n0, (seconds - s0) / (n - n0) * 1e3, (tokens - t0) / (n - n0))
    return out


def overhead_record() -> dict:
    """bench/results/serve_overhead_cpu.json: the host time the server adds per step (nanovllm_bench serve overhead)."""
    return json.loads((RESULTS / "serve_overhead_cpu.json").read_text())


# -- the demos' HTTP helpers ----------------------------------------------------------------------------------------
def sse_lines(url: str, body: dict, timeout: float = 60) -> list[str]:
    """The raw lines of one streamed POST to `url` (httpx), the empty lines between events left out."""
    import httpx
    with httpx.stream("POST", url, json=body, timeout=timeout) as res:
        return [line for line in res.iter_lines() if line]


def hold_streams(url: str, n: int, body: dict, timeout: float = 60) -> list[tuple[int, str]]:
    """Open n streamed POSTs to `url` one after the other on one client, each kept open once its answer's
    status and first line have come, so that all n are open at once; then every client leaves (closes its
    connection mid-stream). Opening one costs a round trip, a few ms, so the first requests are still running
    when the last arrive (as long as they ask for a few hundred tokens). Returns (status, first line of the
    body) per client, in order."""
    from contextlib import ExitStack

    import httpx
    out, readers = [], []
    with httpx.Client(timeout=timeout, limits=httpx.Limits(max_connections=n + 1)) as client, ExitStack() as streams:
        for _ in range(n):
            res = streams.enter_context(client.stream("POST", url, json=body))
            # keep each line reader referenced: a dropped reader is closed by the garbage collector, and with it the
            # connection, which the server takes for a client that left
            readers.append(line for line in res.iter_lines() if line)
            out.append((res.status_code, next(readers[-1], "")))
    return out


def wait_idle(server: Server, timeout: float = 30) -> dict:
    """Poll GET /health until the server holds no request and every KV block is free; returns the last
    health answer (raises TimeoutError if that does not happen within `timeout` s)."""
    deadline = time.monotonic() + timeout
    while True:
        health = server.health()
        engine = health.get("engine", {})
        if health["open_requests"] == 0 and engine.get("running") == 0 and engine.get("waiting") == 0 \
                and engine.get("kv_blocks_free") == engine.get("kv_blocks_total"):
            return health
        if time.monotonic() > deadline:
            raise TimeoutError(f"the server still holds requests or blocks: {health}")
        time.sleep(0.05)


def smollm2_dir() -> str:
    """SmolLM2-135M-Instruct's folder (nanovllm_models.download: converted once, from a PyPI wheel)."""
    from nanovllm_models.download import ensure_model
    return str(ensure_model())


# --- the chapter's exercises (read by grade, export, engine_check, the capstone and the tests) -----------------
from nanovllm_course.common import Exercise, exercises  # noqa: E402

EXERCISES = exercises(
    Exercise("E12.1", check_apply_pending, ("apply_pending",), (reference_apply_pending,)),
    Exercise("E12.2", check_detokenize_step, ("detokenize_step",), (reference_detokenize_step,)),
    Exercise("E12.3", check_completion_events, ("completion_events",), (reference_completion_events,)),
    Exercise("E12.4", check_process_outputs, ("process_outputs",), (reference_process_outputs,)),
)
# No engine parts: the exercises are the serving layer's own rules (apply_pending, the detokenizer step, the SSE
# events, the front end's step). None is a `nanovllm_ref.Parts` field: Parts holds what runs inside a step
# (layers, inputs, attention, block manager, scheduler, sampler, graph sizes), and the serving layer sits outside
# LLMEngine, calling its request API; the detokenizer and the OutputProcessor are the engine's own, not
# swappable. So export and the capstone take nothing here.
PARTS: list = []
