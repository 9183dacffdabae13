"""HF transformers continuous batching as a peer (`init_continuous_batching`, paged|sdpa, CUDA graphs on;
transformers 5.x). Per-request max_new_tokens with EOS off (`eos_token_id=-1`). Each generate makes a new
manager, so nothing is cached from an earlier run. One run of the bench workload takes about 180 s on an
H200, so the harness runs it fewer times (`--hf-repeats`)."""
from nanovllm_bench.peer import Unavailable


class HFPeer:
    fresh_per_run = False
    device = "cuda"

    def __init__(self, model_dir: str):
        self.model_dir, self.model = model_dir, None

    def start(self):
        import torch
        from transformers import AutoConfig, AutoModelForCausalLM
        cfg = AutoConfig.from_pretrained(self.model_dir)
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16, attn_implementation="paged|sdpa")
        self.model = model.cuda().eval()

    def generate(self, prompts, max_tokens, temperature) -> int:
        from transformers import ContinuousBatchingConfig, GenerationConfig
        gc = GenerationConfig(do_sample=True, temperature=temperature, max_new_tokens=max(max_tokens),
                              eos_token_id=-1, pad_token_id=0)
        manager = self.model.init_continuous_batching(generation_config=gc,
                                                      continuous_batching_config=ContinuousBatchingConfig(
                                                          use_cuda_graph=True))
        manager.start()
        try:
            for i, (p, m) in enumerate(zip(prompts, max_tokens)):
                manager.add_request(list(p), request_id=f"r{i}", max_new_tokens=m, eos_token_id=-1)
            done, tokens = 0, 0
            while done < len(prompts):
                r = manager.get_result(timeout=120)
                if r is None:
                    raise RuntimeError("HF continuous batching gave no result for 120 s")
                if r.is_finished():
                    done += 1
                    tokens += len(r.generated_tokens)
        finally:
            manager.stop(block=True)
        return tokens

    def reset(self):
        pass                                        # every generate builds a new manager and cache

    def info(self) -> dict:
        return dict(attn_implementation="paged|sdpa", use_cuda_graph=True,
                    cache_policy="a new continuous-batching manager per run")

    def close(self):
        self.model = None


def make(options: dict, workload, model_dir: str) -> HFPeer:
    import torch
    if not torch.cuda.is_available():
        raise Unavailable("HF continuous batching runs here on CUDA only")
    try:
        from transformers import ContinuousBatchingConfig  # noqa: F401
    except ImportError as exc:
        raise Unavailable(f"this transformers has no continuous batching: {exc}") from exc
    return HFPeer(model_dir)
