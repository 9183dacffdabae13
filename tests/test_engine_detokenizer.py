"""Incremental detokenization (engine/detokenizer.py): the completion's text with the prompt's end as context.

The contract (vLLM, TGI): decode(prompt) + text == decode(prompt + completion) wherever decode(prompt) is the
start of decode(prompt + completion); streamed pieces only append, and streaming gives the text decoding
everything at once gives. Checked on SentencePiece-style tokenizers (Metaspace, byte fallback), a byte-level
BPE, and SmolLM2's real tokenizer, with hypothesis drawing prompts and continuations.
"""
import tempfile

import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

import tokenizer_zoo
from engine_helpers import LLM
from nanovllm_ref import SamplingParams
from nanovllm_ref.engine.detokenizer import IncrementalDetokenizer
from nanovllm_models.tiny import make_tiny_model


@pytest.fixture(scope="module")
def smollm2_tokenizer():
    from transformers import AutoTokenizer
    from nanovllm_models.download import ensure_model
    return AutoTokenizer.from_pretrained(str(ensure_model()))


def stream(tokenizer, prompt, completion, chunks=None, skip=True):
    """(final text, texts after each update) decoding `completion` in pieces of the given sizes."""
    d = IncrementalDetokenizer(tokenizer, prompt, skip)
    seen, i = [], 0
    for k in chunks or [1] * len(completion):
        d.update(completion[i:i + k])
        seen.append(d.text)
        i += k
    d.update(completion[i:])
    d.flush()
    return d.text, seen


# -- the two faults at the prompt boundary ---------------------------------------------------------------
@pytest.mark.parametrize("decoder", ["llama", "metaspace"])
def test_sentencepiece_completion_keeps_the_space_of_its_first_token(decoder):
    tok = tokenizer_zoo.sentencepiece(decoder)
    ids = tok.encode("Hello world s quick", add_special_tokens=False)
    cut = tok.convert_ids_to_tokens(ids).index("▁world") + 1
    prompt, completion = ids[:cut], ids[cut:]
    assert tok.convert_ids_to_tokens(completion)[0] == "▁s"
    assert tok.decode(completion) == "s quick"                  # the old way: the space is lost
    text, _ = stream(tok, prompt, completion)
    assert text == " s quick"
    assert tok.decode(prompt) + text == tok.decode(ids) == "Hello world s quick"


def test_byte_level_character_split_between_prompt_and_completion_is_whole():
    tok = tokenizer_zoo.byte_level()
    ids = tok.encode("hello 🙂 world")
    pieces = tok.convert_ids_to_tokens(ids)
    # 🙂 is not in the tiny BPE's merges: its four bytes are separate tokens; cut after the first two.
    first = next(i for i, p in enumerate(pieces) if not p.isascii())
    prompt, completion = ids[:first + 2], ids[first + 2:]
    assert "\ufffd" in tok.decode(completion)                   # the old way: U+FFFD
    text, seen = stream(tok, prompt, completion)
    assert text == "🙂 world"                                    # the character belongs to the completion
    assert tok.decode(prompt).rstrip("\ufffd") + text == tok.decode(ids)
    assert all("\ufffd" not in s for s in seen)                 # nothing half-decoded was streamed


def test_skipped_special_tokens_at_the_prompt_end_do_not_anchor_the_window():
    # A prompt ending in special tokens that decode to nothing: the context must reach back to a token that
    # shows, or the Metaspace decoder would strip the completion's first space.
    tok = tokenizer_zoo.sentencepiece("llama")
    prompt = tok.encode("Hello world", add_special_tokens=False) + [tok.eos_token_id] * 6
    completion = tok.encode("quick test", add_special_tokens=False)
    text, _ = stream(tok, prompt, completion)
    assert text == " quick test"
    assert tok.decode(prompt, skip_special_tokens=True) + text == tok.decode(prompt + completion, skip_special_tokens=True)


def test_byte_fallback_run_that_turns_invalid_is_not_streamed_early():
    # ByteFallback decodes a run of byte tokens as a whole: if it ends invalid, all its bytes are U+FFFD,
    # even a valid "\n" at its start. So nothing is streamed while the run may go on.
    tok = tokenizer_zoo.sentencepiece("llama")
    prompt = tok.encode("hello", add_special_tokens=False)
    completion = tok.convert_tokens_to_ids(["<0x0A>", "<0xE8>", "▁dog"])
    text, seen = stream(tok, prompt, completion)
    assert text == tok.decode(prompt + completion)[len(tok.decode(prompt)):] == "\ufffd\ufffd dog"
    assert seen[:2] == ["", ""]


# -- properties ----------------------------------------------------------------------------------------------
TOKENIZERS = sorted(tokenizer_zoo.ALL) + ["smollm2"]


def _prompt_and_completion(draw, tok):
    vocab = len(tok)
    if draw(st.booleans()):
        words = draw(st.lists(st.sampled_from(tokenizer_zoo.WORDS + tokenizer_zoo.EXOTIC), min_size=1, max_size=6))
        prompt = tok.encode(draw(st.sampled_from(["", " "])) + " ".join(words), add_special_tokens=False)
    else:
        prompt = draw(st.lists(st.integers(0, vocab + 2), min_size=1, max_size=8))   # + ids it does not know
    if draw(st.booleans()):
        words = draw(st.lists(st.sampled_from(tokenizer_zoo.WORDS + tokenizer_zoo.EXOTIC), min_size=1, max_size=6))
        completion = tok.encode(" " + " ".join(words), add_special_tokens=False)
    else:
        completion = draw(st.lists(st.integers(0, vocab + 2), min_size=1, max_size=12))
    chunks = draw(st.lists(st.integers(1, 4), max_size=len(completion)))
    return prompt or [0], completion, chunks


@pytest.mark.parametrize("name", TOKENIZERS)
@settings(max_examples=250, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data(), skip=st.booleans())
def test_streamed_text_only_grows_equals_one_shot_and_keeps_the_contract(name, data, skip, request):
    tok = request.getfixturevalue("smollm2_tokenizer") if name == "smollm2" else tokenizer_zoo.ALL[name]()
    prompt, completion, chunks = _prompt_and_completion(data.draw, tok)
    text, seen = stream(tok, prompt, completion, chunks, skip)
    one_shot, _ = stream(tok, prompt, completion, [len(completion)], skip)
    assert text == one_shot
    assert all(text.startswith(s) for s in seen), "streamed text must only grow by appending"
    decode = lambda ids: tok.decode(ids, skip_special_tokens=skip)        # noqa: E731
    before, whole = decode(prompt), decode(prompt + completion)
    if whole.startswith(before):                                 # the prompt decodes to its own text
        assert before + text == whole


# -- the engine -----------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def sentencepiece_model():
    path = make_tiny_model(tempfile.mkdtemp(prefix="tiny_sp_"), "llama", tokenizer=False)
    tokenizer_zoo.sentencepiece("llama").save_pretrained(path)
    return path


PROMPTS = ["Hello world", "The quick brown fox", "hello this is a", "a lazy dog", "the paged block",
           "Hello", "token cache", "more", "jumps over the", "a quick test"]


def test_engine_text_keeps_the_prompt_boundary_and_equals_the_streamed_text(sentencepiece_model):
    llm = LLM(sentencepiece_model, kvcache_block_size=4, max_model_len=64)
    tok = llm.tokenizer
    sp = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    offline = llm.generate(PROMPTS, sp, use_tqdm=False)
    for out in offline:
        ids = out.prompt_token_ids + out.outputs[0].token_ids
        assert tok.decode(out.prompt_token_ids, skip_special_tokens=True) + out.outputs[0].text == \
            tok.decode(ids, skip_special_tokens=True)
    ids = [llm.add_request(p, sp) for p in PROMPTS]
    streamed = {i: "" for i in ids}
    while not llm.is_finished():
        for out in llm.step():
            assert out.outputs[0].text.startswith(streamed[out.request_id])
            streamed[out.request_id] = out.outputs[0].text
    assert [streamed[i] for i in ids] == [o.outputs[0].text for o in offline]


def test_smollm2_text_keeps_the_contract_and_streams_the_same(smollm2_tokenizer, request):
    from nanovllm_models.download import ensure_model
    llm = LLM(str(ensure_model()), max_model_len=256, kvcache_block_size=16, max_num_seqs=4)
    request.addfinalizer(llm.exit)                    # its weights and cache are 600 MB: give them back
    prompts = ["The capital of France is", "Café au lait and naïve", "日本語の", "Emoji: 🙂"]
    sp = SamplingParams(temperature=0, max_tokens=16)
    offline = llm.generate(prompts, sp, use_tqdm=False)
    tok = llm.tokenizer
    assert offline[0].outputs[0].text == " Paris.\n\nThe answer is: 2018-01"
    for out in offline:
        whole = tok.decode(out.prompt_token_ids + out.outputs[0].token_ids, skip_special_tokens=True)
        assert tok.decode(out.prompt_token_ids, skip_special_tokens=True) + out.outputs[0].text == whole
    ids = [llm.add_request(p, sp) for p in prompts]
    streamed = {}
    while not llm.is_finished():
        streamed.update((o.request_id, o.outputs[0].text) for o in llm.step())
    assert [streamed[i] for i in ids] == [o.outputs[0].text for o in offline]
