"""Per-request sampling settings (chapter 08). Mirrors the subset of vLLM's `SamplingParams` we need."""
import math
import numbers
from dataclasses import dataclass

# Like vLLM: a temperature this small is greedy (dividing logits by it would overflow fp32).
GREEDY_BELOW = 1e-5


@dataclass(frozen=True)
class SamplingParams:
    """How to pick each next token of one request. Frozen: checked once, then it cannot change.

    temperature: a finite number >= 0. Below 1e-5 (0 included) means greedy (argmax, deterministic);
        otherwise sample from softmax(logits / T), the division done in fp32.
    max_tokens: int >= 1, the most new tokens to generate.
    ignore_eos: if True, keep generating past the end-of-sequence token (benchmarks use this).
    Raises TypeError / ValueError on construction for values outside those ranges.
    """
    temperature: float = 1.0
    max_tokens: int = 64
    ignore_eos: bool = False

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
        object.__setattr__(self, "temperature", 0.0 if t < GREEDY_BELOW else float(t))
        object.__setattr__(self, "max_tokens", int(self.max_tokens))
