"""Upstream nano-vllm (GeeeekExplorer/nano-vllm) as a peer: imported where installed, or from a source
folder (`--nanovllm-src DIR`, e.g. `git archive` of the mirror); never copied into this repository.

It needs real safetensors weights (it has no dummy load format): a random Qwen3ForCausalLM of the workload's
shape is saved first, outside the timed start-up. It imports the flash-attn package; where that is absent,
the stand-in package nanovllm_bench/shim/flash_attn (put on this process's path only) maps its two calls onto
vLLM's FA3 or flash-attn-4. One engine for all timed runs; its prefix-cache map is cleared before each run.
"""
import importlib.util
import os
import sys
import tempfile

from nanovllm_bench.peer import Unavailable
from nanovllm_bench.workload import make_model_folder

SHIM = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "shim")


def _flash_attn() -> str:
    """Which FlashAttention nano-vllm will import: the flash-attn package, else the stand-in over another."""
    try:
        from flash_attn import flash_attn_varlen_func, flash_attn_with_kvcache  # noqa: F401
        import flash_attn
        return f"flash-attn {getattr(flash_attn, '__version__', '?')}"
    except Exception:
        pass
    for name in [m for m in sys.modules if m == "flash_attn" or m.startswith("flash_attn.")]:
        del sys.modules[name]                      # e.g. flash-attn-4's namespace package, found above
    sys.path.insert(0, SHIM)
    try:
        import flash_attn
    except ImportError as exc:
        raise Unavailable(str(exc)) from exc
    return f"stand-in over {flash_attn.IMPLEMENTATION}"


def _commit(src: str | None) -> str | None:
    if src and os.path.exists(os.path.join(src, "COMMIT")):
        with open(os.path.join(src, "COMMIT")) as f:
            return f.read().strip()
    from importlib.metadata import PackageNotFoundError, version
    try:
        return version("nano-vllm")
    except PackageNotFoundError:
        return None


class NanoVllmPeer:
    fresh_per_run = False
    device = "cuda"

    def __init__(self, nanovllm, model_dir: str, engine_args: dict, versions: dict):
        self.nanovllm, self.model_dir, self.engine_args, self.versions, self.llm = \
            nanovllm, model_dir, engine_args, versions, None

    def start(self):
        self.llm = self.nanovllm.LLM(self.model_dir, **self.engine_args)

    def generate(self, prompts, max_tokens, temperature) -> int:
        sp = self.nanovllm.SamplingParams
        outs = self.llm.generate([list(p) for p in prompts],
                                 [sp(temperature=temperature, ignore_eos=True, max_tokens=m) for m in max_tokens],
                                 use_tqdm=False)
        return sum(len(o["token_ids"]) for o in outs)

    def reset(self):
        self.llm.scheduler.block_manager.hash_to_block_id.clear()      # no prefix hit in the next run

    def info(self) -> dict:
        return dict(engine_args=self.engine_args, versions=self.versions,
                    cache_policy="one engine, prefix-cache map cleared before each run")

    def close(self):
        if self.llm is not None:
            self.llm.exit()
            self.llm = None


def make(options: dict, workload, model_dir: str) -> NanoVllmPeer:
    import torch
    if not torch.cuda.is_available():
        raise Unavailable("nano-vllm needs CUDA")
    src = options.get("src")
    if src:
        sys.path.insert(0, src)
    if importlib.util.find_spec("nanovllm") is None:
        raise Unavailable("not importable: no module 'nanovllm' (pip install it, or pass --nanovllm-src DIR)")
    flash = _flash_attn()
    import nanovllm
    weights = make_model_folder(workload.model, tempfile.mkdtemp(prefix="nanovllm_upstream_"), weights=True)
    args = dict(max_model_len=4096, enforce_eager=bool(options.get("eager")))
    return NanoVllmPeer(nanovllm, weights, args, dict(peer=_commit(src), flash_attn=flash))
