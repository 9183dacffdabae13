"""Per-request sampling settings (chapter 08). Mirrors the subset of vLLM's `SamplingParams` we need."""
import math
import numbers
from dataclasses import dataclass

# Like vLLM: a temperature this small is greedy (dividing logits by it would overflow fp32).
GREEDY_BELOW = 1e-5


@dataclass(frozen=True)
class SamplingParams:
    """How to pick each next token of one request. Frozen: checked once, then it cannot change.

    temperature: a finite number >= 0. Below 1e-5 (0 included) means greedy (argmax, deterministic; top_k
        and top_p are then ignored); otherwise sample from softmax(logits / T), the division done in fp32.
    top_k: int. 0 or -1 = off (vLLM's convention: 0 is the default, -1 is accepted and stored as 0);
        k >= 1 keeps the k largest logits after the temperature, and every token tied with the k-th
        largest (as HF's TopKLogitsWarper does). k larger than the vocabulary keeps everything.
    top_p: a number in (0, 1]; 1 = off. Nucleus sampling, applied after top_k: sort the remaining
        probabilities ascending, drop the tokens whose running sum is <= 1 - top_p, always keep the most
        likely token (HF's TopPLogitsWarper and vLLM do the same).
    max_tokens: int >= 1, the most new tokens to generate.
    ignore_eos: if True, keep generating past the end-of-sequence token (benchmarks use this).
    seed: None, or an int >= 0: this request's random numbers come from it alone, so its samples are the same
        whatever else is in the batch (layers/sampler.py, counter-based noise). None: the engine draws a seed
        for the request from its own `seed` argument, in the order requests arrive.
    Raises TypeError / ValueError, naming the argument, on construction for values outside those ranges.
    """
    temperature: float = 1.0
    max_tokens: int = 64
    ignore_eos: bool = False
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None

    def __post_init__(self):
        t = self.temperature
        if isinstance(t, bool) or not isinstance(t, numbers.Real):
            raise TypeError(f"temperature must be a number >= 0, got {type(t).__name__}")
        if not math.isfinite(t) or t < 0:
            raise ValueError(f"temperature must be a finite number >= 0 (0 = greedy), got {t}")
        if isinstance(self.max_tokens, bool) or not isinstance(self.max_tokens, numbers.Integral):
            raise TypeError(f"max_tokens must be an int >= 1, got {type(self.max_tokens).__name__}")
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens}")
        if not isinstance(self.ignore_eos, bool):
            raise TypeError(f"ignore_eos must be a bool, got {type(self.ignore_eos).__name__}")
        k = self.top_k
        if isinstance(k, bool) or not isinstance(k, numbers.Integral):
            raise TypeError(f"top_k must be an int (0 or -1 = off, k >= 1 keeps k tokens), got {type(k).__name__}")
        if k < -1:
            raise ValueError(f"top_k must be 0 or -1 (off) or >= 1, got {k}")
        p = self.top_p
        if isinstance(p, bool) or not isinstance(p, numbers.Real):
            raise TypeError(f"top_p must be a number in (0, 1] (1 = off), got {type(p).__name__}")
        if not (0 < p <= 1):                  # also refuses NaN
            raise ValueError(f"top_p must be in (0, 1] (1 = off), got {p}")
        if self.seed is not None:
            if isinstance(self.seed, bool) or not isinstance(self.seed, numbers.Integral):
                raise TypeError(f"seed must be None or an int >= 0, got {type(self.seed).__name__}")
            if self.seed < 0:
                raise ValueError(f"seed must be None or an int >= 0, got {self.seed}")
            object.__setattr__(self, "seed", int(self.seed))
        object.__setattr__(self, "temperature", 0.0 if t < GREEDY_BELOW else float(t))
        object.__setattr__(self, "max_tokens", int(self.max_tokens))
        object.__setattr__(self, "top_k", max(int(k), 0))
        object.__setattr__(self, "top_p", float(p))
