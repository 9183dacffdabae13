"""Per-request sampling settings (chapter 08). Mirrors the subset of vLLM's `SamplingParams` we need."""
import math
from dataclasses import dataclass


@dataclass
class SamplingParams:
    """How to pick each next token of one request.

    temperature: float >= 0. 0 means greedy (argmax, deterministic); > 0 samples from softmax(logits / T),
        with the division done in fp32.
    max_tokens: int >= 1, the most new tokens to generate.
    ignore_eos: if True, keep generating past the end-of-sequence token (benchmarks use this).
    Raises TypeError / ValueError on construction for values outside those ranges.
    """
    temperature: float = 1.0
    max_tokens: int = 64
    ignore_eos: bool = False

    def __post_init__(self):
        if isinstance(self.temperature, bool) or not isinstance(self.temperature, (int, float)):
            raise TypeError(f"temperature must be a number >= 0, got {type(self.temperature).__name__}")
        if math.isnan(self.temperature) or math.isinf(self.temperature) or self.temperature < 0:
            raise ValueError(f"temperature must be a finite number >= 0 (0 = greedy), got {self.temperature}")
        if isinstance(self.max_tokens, bool) or not isinstance(self.max_tokens, int):
            raise TypeError(f"max_tokens must be an int >= 1, got {type(self.max_tokens).__name__}")
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens}")
        if not isinstance(self.ignore_eos, bool):
            raise TypeError(f"ignore_eos must be a bool, got {type(self.ignore_eos).__name__}")
        self.temperature = float(self.temperature)
