"""vLLM as a peer (imported where installed; never copied here). One engine for all timed runs, with prefix
caching off, so a later run finds nothing cached. Random ('dummy') weights of the config-only model folder,
no tokenizer (prompts go in as token ids, `detokenize=False`), bf16, max_model_len 4096; every other setting
is vLLM's default (0.20: FlashAttention 3 on Hopper, async scheduling, CUDA graphs, torch.compile).
Keep any `flash_attn` stand-in off this process's path: vLLM then imports `flash_attn.ops` from it and fails
to start (seen with vLLM 0.20.2).
"""
from nanovllm_bench.peer import Unavailable


class VllmPeer:
    fresh_per_run = False
    device = "cuda"
    compiles_here = False              # vLLM 0.20 runs the model in its engine-core process

    def __init__(self, vllm, model_dir: str, engine_args: dict):
        self.vllm, self.model_dir, self.engine_args, self.llm = vllm, model_dir, engine_args, None

    def start(self):
        self.llm = self.vllm.LLM(self.model_dir, load_format="dummy", skip_tokenizer_init=True,
                                 enable_prefix_caching=False, **self.engine_args)

    def generate(self, prompts, max_tokens, temperature) -> int:
        sp = self.vllm.SamplingParams
        outs = self.llm.generate([dict(prompt_token_ids=list(p)) for p in prompts],
                                 [sp(temperature=temperature, ignore_eos=True, max_tokens=m, detokenize=False)
                                  for m in max_tokens], use_tqdm=False)
        return sum(len(o.outputs[0].token_ids) for o in outs)

    def reset(self):
        reset = getattr(self.llm, "reset_prefix_cache", None)
        if reset is not None:                       # prefix caching is off; this is belt and braces
            reset()

    def info(self) -> dict:
        return dict(engine_args=dict(self.engine_args, enable_prefix_caching=False, load_format="dummy"),
                    versions=dict(peer=self.vllm.__version__), cache_policy="prefix caching off, one engine")

    def close(self):
        self.llm = None


def make(options: dict, workload, model_dir: str) -> VllmPeer:
    import torch
    if not torch.cuda.is_available():
        raise Unavailable("vllm needs CUDA")
    # vLLM forks its engine core unless CUDA is already initialised here; on the H200 (2026-12-01) the fork
    # met an initialised CUDA anyway ("Cannot re-initialize CUDA in forked subprocess"), so spawn it always.
    import os
    os.environ.setdefault("VLLM_WORKER_MULTIPROC_METHOD", "spawn")
    try:
        import vllm
    except Exception as exc:
        raise Unavailable(f"not importable: {type(exc).__name__}: {exc}"[:300]) from exc
    args = dict(max_model_len=4096, dtype="bfloat16")
    args.update(options.get("engine_args", {}))
    return VllmPeer(vllm, model_dir, args)
