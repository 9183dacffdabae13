"""Each token's own bytes and text (nanovllm_ref/engine/token_bytes.py), for logprobs: a token that holds part of
a character (an emoji's bytes in byte-level BPE, `<0xF0>` in SentencePiece) is named by its bytes, not "�"
(a reported fault, from vllm-project/vllm#27300: every piece of 🎉 came back as "�" with the bytes of "�",
and the pieces among the top logprobs shared one key). OpenAI's `bytes` joined over a completion spell its
text, and completions' text_offset indexes the text."""
import random

import pytest
import tokenizer_zoo as zoo

from nanovllm_ref.engine.token_bytes import TokenBytes
from nanovllm_ref.entrypoints.openai.serving import chat_logprobs, completion_logprobs
from nanovllm_ref.outputs import Logprob

TOKENIZERS = {"byte_level": zoo.byte_level, "sentencepiece_byte_fallback": lambda: zoo.sentencepiece("llama"),
              "metaspace": lambda: zoo.sentencepiece("metaspace")}


@pytest.mark.parametrize("name", TOKENIZERS)
def test_the_bytes_of_any_token_run_spell_what_the_tokenizer_decodes(name):
    """Property over random runs of ordinary tokens: wherever the joined bytes are valid UTF-8, they are the
    tokenizer's own decode (SentencePiece's decoder drops the run's first space; a run that is not valid
    UTF-8 is replaced differently by each decoder, so it is left out)."""
    tok = TOKENIZERS[name]()
    tb = TokenBytes(tok)
    ids = [i for i in range(len(tok)) if i not in set(tok.all_special_ids)]
    rng, checked = random.Random(0), 0
    for _ in range(400):
        run = [rng.choice(ids) for _ in range(rng.randint(1, 8))]
        try:
            got = b"".join(tb.bytes(i) for i in run).decode("utf-8")
        except UnicodeDecodeError:
            continue
        want = tok.decode(run, clean_up_tokenization_spaces=False)
        first_space_dropped = tb.kind == "sentencepiece" and got[:1] == " " and got[1:] == want
        assert got == want or first_space_dropped, (run, got, want)
        checked += 1
    assert checked > 50


@pytest.mark.parametrize("name", ["byte_level", "sentencepiece_byte_fallback"])
def test_the_pieces_of_a_character_have_their_own_bytes_and_names(name):
    tok = TOKENIZERS[name]()
    tb = TokenBytes(tok)
    ids = tok.encode("🚀🙂", add_special_tokens=False)
    pieces = [i for i in ids if "\ufffd" in tok.decode([i])]
    assert len(pieces) >= 2, "the test needs a character split over tokens"
    assert b"".join(tb.bytes(i) for i in ids).decode("utf-8").strip() == "🚀🙂"
    texts = [tb.text(i) for i in pieces]
    assert all(t.startswith("bytes:\\x") for t in texts) and "\ufffd" not in "".join(texts)
    assert texts[0] == "bytes:" + "".join(f"\\x{b:02x}" for b in tb.bytes(pieces[0]))
    assert len({tb.text(i) for i in set(pieces)}) == len(set(pieces))            # no two pieces share a name


def test_server_logprobs_join_to_the_text_and_keep_every_alternative():
    tok = zoo.byte_level()
    tb = TokenBytes(tok)
    ids = tok.encode("🚀 hello 🙂", add_special_tokens=False)
    text = tok.decode(ids)
    others = [i for i in range(3, len(tok)) if i not in ids][:2]
    dicts = [{t: Logprob(-0.1, 1, tb.text(t)), **{o: Logprob(-2.0 - k, 2 + k, tb.text(o)) for k, o in enumerate(others)}}
             for t in ids]
    chat = chat_logprobs(ids, dicts, 2, tok).model_dump()["content"]
    assert bytes(b for c in chat for b in c["bytes"]).decode("utf-8") == text
    assert "\ufffd" not in "".join(c["token"] for c in chat)
    legacy = completion_logprobs(ids, dicts, tok).model_dump()
    assert [len(d) for d in legacy["top_logprobs"]] == [3] * len(ids)            # no two entries share a key
    offsets = legacy["text_offset"]
    assert offsets == sorted(offsets) and offsets[-1] < len(text) and offsets[0] == 0
    # each token that finishes a character points at that character's start in the text
    assert text[offsets[ids.index(tok.encode(" hello", add_special_tokens=False)[0])]:].startswith(" hello")
