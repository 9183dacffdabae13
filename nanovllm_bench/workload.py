"""The benchmark workload (chapter 11): upstream nano-vllm's bench.py, and the model folder it runs on.

Default: a Qwen3-0.6B-shaped model with random weights, 256 requests. `random.seed(0)`, then every prompt
(`randint(100, 1024)` tokens, each `randint(0, 10000)`), then every request's max_tokens (`randint(100,
1024)`), in that order; ignore_eos, temperature 0.6, one warm-up generate first. That draw totals 142,827
prompt and 133,966 output tokens (`EXPECTED_TOTALS`, checked before a GPU run). Throughput = output tokens /
wall seconds of the timed generate. Source: GeeeekExplorer/nano-vllm bench.py.
"""
import os
import random
import warnings
from dataclasses import asdict, dataclass

QWEN3_06B = dict(vocab_size=151936, hidden_size=1024, intermediate_size=3072, num_hidden_layers=28,
                 num_attention_heads=16, num_key_value_heads=8, head_dim=128, max_position_embeddings=40960,
                 rope_theta=1e6, rms_norm_eps=1e-6, tie_word_embeddings=True, bos_token_id=151643,
                 eos_token_id=151645)
EXPECTED_TOTALS = {256: (142_827, 133_966)}
WARMUP_PROMPT, WARMUP_TOKENS = [1, 2, 3], 16        # every peer's one warm-up generate


def make_workload(num_requests=256, seed=0, min_len=100, max_len=1024, min_out=100, max_out=1024, max_id=10000):
    """(prompts as token-id lists, max_tokens per request), drawn in upstream bench.py's order. max_id: the
    largest prompt token id (upstream's 10000; smaller for a model with a small vocabulary)."""
    random.seed(seed)
    prompts = [[random.randint(0, max_id) for _ in range(random.randint(min_len, max_len))]
               for _ in range(num_requests)]
    max_tokens = [random.randint(min_out, max_out) for _ in range(num_requests)]
    return prompts, max_tokens


@dataclass(frozen=True)
class Workload:
    """What every peer runs: the draw of `make_workload`, the model shape, and the batch-1 probe (one prompt
    of `batch1_prompt` tokens, `batch1_tokens` new tokens, ignore_eos)."""
    model: str = "qwen3-0.6b"          # "qwen3-0.6b" or "tiny" (make_model_folder)
    num_requests: int = 256
    min_len: int = 100
    max_len: int = 1024
    min_out: int = 100
    max_out: int = 1024
    temperature: float = 0.6
    batch1_prompt: int = 100
    batch1_tokens: int = 1024

    def draw(self):
        return make_workload(self.num_requests, 0, self.min_len, self.max_len, self.min_out, self.max_out)

    def to_dict(self) -> dict:
        return asdict(self)


def gpu_workload(num_requests: int = 256) -> Workload:
    return Workload(num_requests=num_requests)


def cpu_tiny_workload(num_requests: int = 16) -> Workload:
    """A tiny random Qwen3 and short requests: the whole harness in seconds on a CPU."""
    return Workload(model="tiny", num_requests=num_requests, min_len=16, max_len=64, min_out=16, max_out=48,
                    batch1_prompt=16, batch1_tokens=32)


def make_model_folder(kind: str, path: str, weights: bool = False, device: str = "cuda") -> str:
    """A folder the engines can open: config.json and a small tokenizer (prompts are token ids, so any
    tokenizer will do). kind: "qwen3-0.6b" (bf16) or "tiny". Without `weights` the engines use random
    ('dummy') weights; with it a random Qwen3ForCausalLM is saved as safetensors on `device` (upstream
    nano-vllm has no dummy load format)."""
    import torch
    from nanovllm_models.tiny import make_tokenizer, tiny_config
    os.makedirs(path, exist_ok=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if kind == "qwen3-0.6b":
            cfg = tiny_config("qwen3", **QWEN3_06B)
            cfg.dtype = torch.bfloat16
        elif kind == "tiny":
            cfg = tiny_config("qwen3", vocab_size=10240, max_position_embeddings=4096)
        else:
            raise ValueError(f"kind must be 'qwen3-0.6b' or 'tiny', got {kind!r}")
        if weights:
            from transformers import AutoModelForCausalLM
            with torch.device(device):
                model = AutoModelForCausalLM.from_config(cfg, dtype=getattr(cfg, "dtype", None) or torch.float32)
            model.save_pretrained(path)
            del model
            if device == "cuda":
                torch.cuda.empty_cache()
        cfg.save_pretrained(path)
        make_tokenizer(path)
    return path
