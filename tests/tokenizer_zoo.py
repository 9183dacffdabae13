"""Small tokenizers of the kinds real models use, built in memory with `tokenizers` (no hub), for the
detokenizer tests.

- `sentencepiece(decoder)`: a SentencePiece-style Unigram model with a Metaspace pre-tokenizer (prepend
  "▁" to the first word). decoder="llama": byte fallback and the decoder chain of Llama-2, Mistral and
  TinyLlama (Replace "▁" -> " ", ByteFallback, Fuse, Strip one leading space); decoder="metaspace": no byte
  fallback (unknown characters are <unk>) and the Metaspace decoder (T5-style). Both drop the leading
  space of the first token they decode, which is what loses the space at the prompt boundary.
- `byte_level()`: a byte-level BPE (GPT-2, SmolLM2, Qwen), trained on text with multi-byte characters so
  that some characters stay split over several byte tokens.
Special tokens: <unk>/<|endoftext|>=0, <s>/<|im_start|>=1, </s>/<|im_end|>=2 (eos).
"""
import functools
import random
import warnings

WORDS = ("hello world this is a quick test the brown fox jumps over lazy dog café naïve s and more token "
         "block cache paged prefix").split()
EXOTIC = ["日本語", "テキスト", "🙂", "🚀", "€", "ß", "ñ"]


def _fast(tok, **special):
    from transformers import PreTrainedTokenizerFast
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return PreTrainedTokenizerFast(tokenizer_object=tok, **special)


@functools.lru_cache(maxsize=None)
def sentencepiece(decoder: str = "llama"):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    chars = sorted(set("".join(WORDS)) | set("abcdefghijklmnopqrstuvwxyzHT.,!?'0123456789 "))
    byte_fallback = decoder == "llama"
    vocab = [("<unk>", 0.0), ("<s>", 0.0), ("</s>", 0.0)]
    vocab += [(f"<0x{i:02X}>", -20.0) for i in range(256)] if byte_fallback else []
    vocab += [("▁", -3.0)] + [(c, -5.0) for c in chars if c != " "] + [("▁" + w, -2.0) for w in WORDS]
    vocab += [(w[:2], -4.0) for w in WORDS] + [("▁" + w[:3], -3.5) for w in WORDS]
    seen = set()
    vocab = [v for v in vocab if not (v[0] in seen or seen.add(v[0]))]
    tok = Tokenizer(models.Unigram(vocab, unk_id=0, byte_fallback=byte_fallback))
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first")
    if decoder == "llama":
        tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                         decoders.Strip(" ", 1, 0)])
    elif decoder == "metaspace":
        tok.decoder = decoders.Metaspace(replacement="▁", prepend_scheme="first")
    else:
        raise ValueError(decoder)
    return _fast(tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>")


@functools.lru_cache(maxsize=None)
def byte_level():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    rng = random.Random(1)
    corpus = [" ".join(rng.choice(WORDS + EXOTIC[:2]) for _ in range(12)) for _ in range(300)]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=420, special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(corpus, trainer=trainer)
    return _fast(tok, unk_token="<|endoftext|>", bos_token="<|im_start|>", eos_token="<|im_end|>")


ALL = {"sentencepiece-llama": lambda: sentencepiece("llama"),
       "sentencepiece-metaspace": lambda: sentencepiece("metaspace"),
       "byte-level": byte_level}
