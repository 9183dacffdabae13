"""Tiny random checkpoints for tests, notebooks and the CPU benchmark (no model hub needed).

`make_tiny_model(path, arch)` writes a folder that HF transformers and nanovllm_ref both load:
config.json + model.safetensors (random weights, HF names) + a small byte-level BPE tokenizer trained here
in ~0.1 s. Weights use a large init range (0.2) so greedy decoding does not collapse to one repeated
token, which would make equivalence tests weak.
"""
import json
import os
import warnings

import torch

_CORPUS = [
    "The capital of France is Paris.", "A paged KV cache stores keys and values in fixed-size blocks.",
    "Continuous batching adds new requests as soon as old ones finish.", "Hello, world! 0123456789",
    "Prefix caching reuses blocks whose tokens are the same.", "def f(x):\n    return x * 2\n",
    "The quick brown fox jumps over the lazy dog.", "Tensor parallelism splits each layer across GPUs.",
]
CHAT_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
                 "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def make_tokenizer(path: str, vocab_size: int = 384):
    """Train a byte-level BPE tokenizer and save it to `path`. Special tokens: <|endoftext|>=0,
    <|im_start|>=1, <|im_end|>=2 (eos), as in SmolLM2."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(_CORPUS * 4, trainer=trainer)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<|im_start|>", eos_token="<|im_end|>",
                                       pad_token="<|im_end|>", unk_token="<|endoftext|>")
        fast.chat_template = CHAT_TEMPLATE
        fast.save_pretrained(path)
    return fast


def tiny_config(arch: str = "qwen3", **overrides):
    """A small HF config for `arch` ("qwen3" or "llama"): 2 layers, hidden 64, 4 heads / 2 KV heads."""
    from transformers import LlamaConfig, Qwen3Config
    common = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=512,
                  rms_norm_eps=1e-6, rope_theta=10000.0, initializer_range=0.2, tie_word_embeddings=False,
                  bos_token_id=1, eos_token_id=2, pad_token_id=2)
    common.update(overrides)
    if arch == "qwen3":
        cfg = Qwen3Config(**common)
        cfg.architectures = ["Qwen3ForCausalLM"]
    elif arch == "llama":
        cfg = LlamaConfig(**common)
        cfg.architectures = ["LlamaForCausalLM"]
    else:
        raise ValueError(f"arch must be 'qwen3' or 'llama', got {arch!r}")
    return cfg


def make_tiny_model(path: str, arch: str = "qwen3", seed: int = 0, tokenizer: bool = True, **overrides) -> str:
    """Write a tiny random `arch` checkpoint (+ tokenizer) to `path`; returns `path`."""
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging
    hf_logging.disable_progress_bar()             # no "Writing model shards" bars in notebooks and tests
    os.makedirs(path, exist_ok=True)
    cfg = tiny_config(arch, **overrides)
    torch.manual_seed(seed)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
        model.save_pretrained(path, safe_serialization=True)
    # Keep config.json minimal and explicit about the architecture (save_pretrained already writes it).
    with open(os.path.join(path, "config.json")) as f:
        saved = json.load(f)
    saved["architectures"] = cfg.architectures
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(saved, f, indent=2)
    if tokenizer:
        make_tokenizer(path)
    return path
