"""Stops as vLLM has them (engine/stop.py): stop strings across token boundaries, stop_token_ids, eos,
include_stop_str_in_output, min_tokens (HF's min_new_tokens is the oracle), and the streamed text that a stop
string may still claim. The tiny model's greedy free run tells where each stop must land."""
import pytest
import torch

from engine_helpers import LLM, hf_model, tiny_dir
from nanovllm_ref import SamplingParams
from nanovllm_ref.engine.detokenizer import IncrementalDetokenizer
from nanovllm_ref.engine.stop import find_stop_string

PROMPT = "Prefix caching reuses"
FREE = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)


LLM_ARGS = dict(kvcache_block_size=4, max_model_len=64)       # the llm fixture (tests/conftest.py)


@pytest.fixture(scope="module")
def free_run(llm):
    """(token ids, text after each token) of the prompt's greedy completion, as the engine decodes it. The
    last text includes what the final flush adds (a character cut short, as U+FFFD)."""
    out = llm.generate([PROMPT], FREE, use_tqdm=False)[0]
    d = IncrementalDetokenizer(llm.tokenizer, out.prompt_token_ids)
    texts = []
    for t in out.outputs[0].token_ids:
        d.update([t])
        texts.append(d.text)
    texts[-1] += d.flush()
    assert out.outputs[0].text == texts[-1]
    return out.outputs[0].token_ids, texts


def spanning_stop(texts) -> str:
    """A 3-character stop string made of the end of one token's text and the start of the next one's."""
    for a, b, c in zip(texts, texts[1:], texts[2:]):
        left, right = b[len(a):], c[len(b):]
        if len(left) >= 2 and right and "\ufffd" not in left[-2:] + right[:1]:
            return left[-2:] + right[:1]
    raise AssertionError("no two neighbouring tokens with text in the free run")


def tokens_until(texts, end: int) -> int:
    """How many tokens it takes until the text has `end` characters."""
    return next(k + 1 for k, t in enumerate(texts) if len(t) >= end)


def one(llm, sp, prompt=PROMPT):
    return llm.generate([prompt], sp, use_tqdm=False)[0].outputs[0]


# -- stop strings ----------------------------------------------------------------------------------------------
def test_find_stop_string_takes_the_leftmost_match_that_ends_in_the_new_text():
    assert find_stop_string("a cat sat", 3, ("at",), False) == ("at", 7)
    assert find_stop_string("a cat sat", 3, ("at",), True) == ("at", 9)
    assert find_stop_string("a cat sat", 2, ("t s", "at"), False) == ("at", 7)     # "t s" ended earlier
    assert find_stop_string("a cat sat", 5, ("sat", "t s"), False) == ("t s", 4)   # leftmost wins
    assert find_stop_string("a cat sat", 0, ("at",), False) is None
    assert find_stop_string("ab", 2, ("abc",), False) is None


@pytest.mark.parametrize("include", [False, True])
def test_stop_string_across_tokens_cuts_the_text_and_is_the_stop_reason(llm, free_run, include):
    ids, texts = free_run
    stop = spanning_stop(texts)
    start = texts[-1].find(stop)
    out = one(llm, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, stop=[stop],
                                  include_stop_str_in_output=include))
    assert out.finish_reason == "stop" and out.stop_reason == stop
    assert out.text == texts[-1][:start + (len(stop) if include else 0)]
    assert out.token_ids == ids[:tokens_until(texts, start + len(stop))]


def test_first_of_several_stop_strings_in_the_text_wins(llm, free_run):
    ids, texts = free_run
    late, early = texts[-1][-3:], spanning_stop(texts)
    assert texts[-1].find(early) < texts[-1].find(late)
    out = one(llm, SamplingParams(temperature=0, max_tokens=24, stop=[late, early]))
    assert out.stop_reason == early and out.text == texts[-1][:texts[-1].find(early)]


def test_streamed_text_never_shows_what_a_stop_string_may_still_claim(llm, free_run):
    ids, texts = free_run
    stop = spanning_stop(texts)
    sp = SamplingParams(temperature=0, max_tokens=24, stop=["\x00never", stop])
    rid = llm.add_request(PROMPT, sp)
    seen = []
    while not llm.is_finished():
        seen += [o.outputs[0].text for o in llm.step() if o.request_id == rid]
    final = texts[-1][:texts[-1].find(stop)]
    assert seen[-1] == final and all(final.startswith(s) for s in seen)
    # held back: the longest stop string's length - 1 characters
    assert all(len(s) <= max(len(t) - (len("\x00never") - 1), 0) for s, t in zip(seen[:-1], texts))


def test_stop_string_in_the_first_min_tokens_does_not_stop(llm, free_run):
    ids, texts = free_run
    stop = spanning_stop(texts)
    needed = tokens_until(texts, texts[-1].find(stop) + len(stop))
    out = one(llm, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, stop=[stop], min_tokens=needed))
    later = texts[-1].find(stop, texts[-1].find(stop) + 1)
    # the same greedy tokens (no stop id is masked), and the first match no longer counts
    if later == -1:
        assert out.finish_reason == "length" and out.token_ids == ids and out.text == texts[-1]
    else:
        assert out.stop_reason == stop and out.text == texts[-1][:later]


# -- stop token ids and eos ---------------------------------------------------------------------------------
@pytest.mark.parametrize("include", [False, True])
def test_ordinary_stop_token_id_leaves_its_text_out_unless_asked(llm, free_run, include):
    ids, texts = free_run
    k = next(k for k in range(3, len(ids)) if len(texts[k]) > len(texts[k - 1]) and ids[k] not in ids[:k])
    out = one(llm, SamplingParams(temperature=0, max_tokens=24, stop_token_ids=[ids[k]],
                                  include_stop_str_in_output=include))
    assert out.token_ids == ids[:k + 1], "token_ids end with the stop token"
    assert out.finish_reason == "stop" and out.stop_reason == ids[k]
    assert out.text == (texts[k] if include else texts[k - 1])


def hf_greedy_min(path, prompt, max_new, min_new, eos):
    """HF greedy ids with min_new_tokens, up to and including the first eos."""
    model = hf_model(path)
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=max_new, min_new_tokens=min_new, do_sample=False,
                             eos_token_id=eos, pad_token_id=0, attention_mask=torch.ones(1, len(prompt), dtype=torch.long))
    ids = out[0, len(prompt):].tolist()
    return next((ids[:i + 1] for i, t in enumerate(ids) if t in eos), ids)


@pytest.mark.parametrize("offset", [None, 0, 1, 4])
def test_min_tokens_masks_eos_like_hf_min_new_tokens(llm, free_run, offset):
    ids, texts = free_run
    k = next(k for k in range(3, len(ids)) if ids[k] not in ids[:k])
    eos = ids[k]                                       # pretend this greedy token is the EOS
    min_tokens = 0 if offset is None else k + offset   # k: the eos is the (min_tokens + 1)-th token, allowed
    path = tiny_dir("qwen3", eos_token_id=eos)
    prompt = llm.tokenizer.encode(PROMPT)
    got = LLM(path, kvcache_block_size=4, max_model_len=64).generate(
        [prompt], SamplingParams(temperature=0, max_tokens=16, min_tokens=min_tokens), use_tqdm=False)[0].outputs[0]
    want = hf_greedy_min(path, prompt, 16, min_tokens, [eos, 2])
    assert got.token_ids == want
    assert (got.token_ids == ids[:k + 1]) == (min_tokens <= k)
    assert (got.finish_reason, got.stop_reason) == (("stop", None) if want[-1] in (eos, 2) else ("length", None))
    if got.finish_reason == "stop":              # the eos (an ordinary token here) is left out of the text
        assert got.text == LLM(path, kvcache_block_size=4, max_model_len=64).generate(
            [prompt], SamplingParams(temperature=0, max_tokens=len(want) - 1, ignore_eos=True),
            use_tqdm=False)[0].outputs[0].text


@pytest.mark.parametrize("min_tokens", [2, 5])
def test_min_tokens_masks_stop_token_ids_like_hf(llm, free_run, min_tokens):
    ids, _ = free_run
    stop = ids[1]
    prompt = llm.tokenizer.encode(PROMPT)
    got = one(llm, SamplingParams(temperature=0, max_tokens=16, min_tokens=min_tokens, stop_token_ids=[stop]),
              prompt)
    want = hf_greedy_min(tiny_dir("qwen3"), prompt, 16, min_tokens, [stop, 2])
    assert got.token_ids == want
    assert stop not in got.token_ids[:min_tokens]


def test_min_tokens_on_the_graph_decode_path_masks_after_the_step(llm, free_run):
    # The decode graph samples inside the step; a row short of min_tokens needs its logits masked first, so
    # the batch goes to the sampler after the step. EagerReplayRunner runs the graph path without CUDA.
    from test_thin_step import EagerReplayRunner
    ids, _ = free_run
    k = next(k for k in range(3, len(ids)) if ids[k] not in ids[:k])
    path = tiny_dir("qwen3", eos_token_id=ids[k])
    graph_llm = LLM(path, enforce_eager=True, max_num_seqs=8, kvcache_block_size=16, max_model_len=64)
    runner = graph_llm.model_runner
    runner.capture_cudagraph(EagerReplayRunner)
    replays, step = [], runner.graph_runner._step
    runner.graph_runner._step = lambda bs: (replays.append(bs), step(bs))[1]
    prompt = llm.tokenizer.encode(PROMPT)
    masked, plain = graph_llm.generate([prompt, prompt], [SamplingParams(temperature=0, max_tokens=16, min_tokens=k + 2),
                                                          SamplingParams(temperature=0, max_tokens=16)], use_tqdm=False)
    assert replays, "decode did not take the graph path"
    assert masked.outputs[0].token_ids == hf_greedy_min(path, prompt, 16, k + 2, [ids[k], 2])
    assert plain.outputs[0].token_ids == ids[:k + 1]


def test_ignore_eos_still_stops_at_stop_token_ids(llm, free_run):
    ids, _ = free_run
    out = one(llm, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, stop_token_ids=[ids[5]]))
    assert out.token_ids == ids[:ids.index(ids[5]) + 1] and out.stop_reason == ids[5]


def test_stop_token_id_outside_the_vocabulary_is_refused_before_queuing(llm):
    with pytest.raises(ValueError, match="stop_token_ids"):
        llm.generate(["a", "b"], [FREE, SamplingParams(stop_token_ids=[10**6])], use_tqdm=False)
    assert llm.is_finished() and not llm.requests


# -- special tokens in the text (the real model: its chat answers end with <|im_end|>) ----------------------
@pytest.fixture(scope="module")
def smollm2():
    from nanovllm_models.download import ensure_model
    llm = LLM(str(ensure_model()), max_model_len=256, kvcache_block_size=16, max_num_seqs=4)
    yield llm
    llm.exit()                                        # its weights and cache are 600 MB: give them back


def test_special_eos_text_shows_only_when_kept_and_not_skipped(smollm2):
    conv = [{"role": "user", "content": "What is the capital of France?"}]
    plain = smollm2.chat(conv, SamplingParams(temperature=0, max_tokens=32), use_tqdm=False)[0].outputs[0]
    assert plain.finish_reason == "stop" and plain.token_ids[-1] == 2 and plain.stop_reason is None
    assert plain.text == "The capital of France is Paris."
    kept = smollm2.chat(conv, SamplingParams(temperature=0, max_tokens=32, include_stop_str_in_output=True),
                        use_tqdm=False)[0].outputs[0]
    assert kept.text == plain.text                              # kept, but a special token is skipped
    shown = smollm2.chat(conv, SamplingParams(temperature=0, max_tokens=32, include_stop_str_in_output=True,
                                              skip_special_tokens=False), use_tqdm=False)[0].outputs[0]
    assert shown.text == plain.text + "<|im_end|>"
    cut = smollm2.chat(conv, SamplingParams(temperature=0, max_tokens=32, stop=[" Paris"]), use_tqdm=False)[0]
    assert cut.outputs[0].text == "The capital of France is" and cut.outputs[0].stop_reason == " Paris"
