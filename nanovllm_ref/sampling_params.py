"""Per-request sampling settings (chapters 07, 08). The fields and their meaning are vLLM's `SamplingParams`.

Every field is checked when the object is made, so a bad value fails at once with an error that names it: a
RequestError (a ValueError; a RequestTypeError, also a TypeError, for a wrong type) whose `field` is the
field's name (nanovllm_ref/errors.py). A field accepted before its engine side exists (so code written for
vLLM constructs the same objects) goes into `PENDING`, and the engine refuses a request that sets it away from
its default, by name, instead of ignoring it. Every field is implemented now, so PENDING is empty.
"""
import math
import numbers
import struct
from dataclasses import KW_ONLY, dataclass

from nanovllm_ref.errors import RequestError, RequestTypeError
from nanovllm_ref.utils.checks import is_finite, shown

# Like vLLM: a temperature this small is greedy (dividing logits by it would overflow fp32).
GREEDY_BELOW = 1e-5
# top_k values above this are stored as it: it exceeds every vocabulary, so it keeps every token, and it
# fits the int64 tensor the sampler reads (10**30 would not).
TOP_K_MAX = 2**31 - 1
_FP32_MAX = 3.4028234663852886e38

# Fields whose sampler side is not implemented yet, with their defaults. The engine refuses a request whose
# value differs (nanovllm_ref.engine.request.check_request). Remove a name here when it is implemented.
PENDING: dict = {}


def _int(name: str, value, low: int, high: int | None = None, what: str = "", field: str | None = None) -> int:
    field = field or name                  # name may be a path into the field: stop_token_ids[2]
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise RequestTypeError(field, f"{name} must be an int{what}, got {type(value).__name__}")
    if value < low or (high is not None and value > high):
        rng = f">= {low}" if high is None else f"in [{low}, {high}]"
        raise RequestError(field, f"{name} must be {rng}{what}, got {value}")
    return int(value)


def _as_fp32(value: float) -> float:
    """value rounded to fp32, the precision the sampler computes in (inf where fp32 cannot hold it)."""
    try:
        return struct.unpack("f", struct.pack("f", value))[0]
    except OverflowError:
        return math.inf


def _real(name: str, value, ok, rng: str, fp32: bool = True) -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise RequestTypeError(name, f"{name} must be a number {rng}, got {type(value).__name__}")
    if not is_finite(value) or not ok(value):        # also refuses NaN (and 10**400, which no float holds)
        raise RequestError(name, f"{name} must be a finite number {rng}, got {shown(value)}")
    # The sampler reads the value as fp32 (top_p, fp32=False, it takes as the Python float): 1e300 would become
    # inf there (a temperature of inf turns masked logits into NaN) and 1e-300 would become 0 (a repetition
    # penalty of 0). The rule must hold after that rounding too.
    rounded = _as_fp32(float(value)) if fp32 else float(value)
    if not math.isfinite(rounded) or not ok(rounded):
        raise RequestError(name, f"{name} must be a finite number {rng} in fp32's range (the sampler's "
                                 f"precision; its largest is {_FP32_MAX:.4g}), got {value}")
    return float(value)


def _bool(name: str, value) -> bool:
    # numpy's bool (bool_ before numpy 2) is not a bool subclass (nor an Integral): take it by its type name, as numpy ints are
    # taken through numbers.Integral, without importing numpy here.
    if type(value).__module__ == "numpy" and type(value).__name__ in ("bool", "bool_"):   # numpy 2, numpy 1
        return bool(value)
    if not isinstance(value, bool):
        raise RequestTypeError(name, f"{name} must be a bool, got {type(value).__module__}.{type(value).__qualname__}"
                               if type(value).__module__ != "builtins" else
                               f"{name} must be a bool, got {type(value).__name__}")
    return value


def _optional_int(name: str, value, low: int, high: int | None = None):
    return None if value is None else _int(name, value, low, high, " or None")


@dataclass(frozen=True)
class SamplingParams:
    """How to pick each next token of one request, and when to stop. Frozen: checked once, then it cannot
    change. The first five fields may be given by position, the others by name only.

    Sampling (layers/sampler.py, chapter 08):
    temperature: a finite number >= 0. Below 1e-5 (0 included) means greedy (argmax, deterministic; top_k
        and top_p are then ignored); otherwise sample from softmax(logits / T), the division done in fp32.
    top_k: int. 0 or -1 = off (vLLM's convention: 0 is the default, -1 is accepted and stored as 0);
        k >= 1 keeps the k largest logits after the temperature, and every token tied with the k-th
        largest (as HF's TopKLogitsWarper does). k larger than the vocabulary keeps everything (values above
        2**31 - 1 are stored as 2**31 - 1, which keeps everything too).
    top_p: a number in (0, 1]; 1 = off. Nucleus sampling, applied after top_k: sort the remaining
        probabilities ascending, drop the tokens whose running sum is <= 1 - top_p, always keep the most
        likely token (HF's TopPLogitsWarper and vLLM do the same).
    min_p: a number in [0, 1]; 0 = off. Keep the tokens whose probability (after the temperature) is at
        least min_p times the most likely token's (HF's MinPLogitsWarper; layers/logits_processors.py).
        Order as in vLLM: temperature, min_p, top_k, top_p. Greedy rows ignore it (it never drops the
        most likely token).
    n: int >= 1, the number of completions of the prompt (RequestOutput.outputs[0..n-1]). They share the
        prompt's KV blocks: the prompt is prefilled once, then the samples fork (engine/scheduler.py).

    Length and stops (engine/stop.py, chapter 07):
    max_tokens: int >= 1, the most new tokens to generate.
    min_tokens: int in [0, max_tokens]: no stop of any kind (eos, stop_token_ids, stop strings) before this
        many new tokens; the eos and stop ids are masked out of the logits until then (HF's min_new_tokens).
    ignore_eos: if True, keep generating past the end-of-sequence ids (benchmarks use this). stop_token_ids
        and stop strings still stop.
    stop: a str or a list of non-empty str. Generation stops when one of them appears in the completion's
        text (across token boundaries); the text is cut before it, and stop_reason is the string.
    stop_token_ids: a list of token ids that end the completion as eos does; stop_reason is the id.
    include_stop_str_in_output: keep the stop string, or the text of the stop token (eos or a stop id) in
        the text. token_ids always end with the stop token.

    Text (engine/detokenizer.py):
    skip_special_tokens: leave special tokens (eos, chat markers) out of the text.

    Random numbers (layers/sampler.py, counter-based noise):
    seed: None, or an int: this request's random numbers come from it alone, so its samples are the same
        whatever else is in the batch and however it is batched. None: the engine draws a seed for the
        request from its own `seed` argument, in the order requests arrive. With n > 1 each sample gets a
        seed of its own derived from it. Any int in [-2**63, 2**64), taken mod 2**64 (as torch.manual_seed);
        it picks one of 2**32 random streams through a 64-bit mix (engine/sequence.py, request_seed), so two
        different seeds share a stream only by chance, 2**-32 a pair.

    Penalties (layers/logits_processors.py), on the logits before anything else, greedy rows included, in
    vLLM's order:
    repetition_penalty: a number > 0; 1 = off. Every token seen in the prompt or the output so far: its
        logit is divided by it when >= 0, multiplied when < 0 (HF's RepetitionPenaltyLogitsProcessor).
    frequency_penalty: in [-2, 2]; 0 = off. Subtract it times the token's count in the output so far.
    presence_penalty: in [-2, 2]; 0 = off. Subtract it from every token that occurs in the output so far.
        (OpenAI's and vLLM's definitions: over output tokens only.)

    Logprobs (layers/logprobs.py), of the model's raw distribution (log_softmax of the logits, before the
    temperature, penalties and filters; vLLM's default):
    logprobs: None, or an int >= 0 (the engine takes at most 20, vLLM's default max_logprobs):
        CompletionOutput.logprobs gets, for each generated token, a dict
        {token_id: Logprob(logprob, rank, decoded_token)} of that token and the `logprobs` most likely ones;
        cumulative_logprob their sum.
    prompt_logprobs: None, or an int >= 0 (at most 20 too): RequestOutput.prompt_logprobs, the same per prompt token
        (None for the first). Such a request takes no prefix-cache hit (its positions need logits).

    Normalised on construction: stop and stop_token_ids become tuples (empty when not given), numpy
    numbers become Python ints / floats. Raises RequestTypeError (a TypeError) / RequestError (a ValueError),
    `field` the argument's name, for values outside those ranges.
    """
    temperature: float = 1.0
    max_tokens: int = 64
    ignore_eos: bool = False
    top_k: int = 0
    top_p: float = 1.0
    _: KW_ONLY
    n: int = 1
    min_tokens: int = 0
    stop: str | list[str] | tuple[str, ...] | None = None
    stop_token_ids: list[int] | tuple[int, ...] | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    seed: int | None = None
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    min_p: float = 0.0

    def __post_init__(self):
        set_ = lambda name, value: object.__setattr__(self, name, value)      # noqa: E731 (frozen)
        t = _real("temperature", self.temperature, lambda v: v >= 0, ">= 0 (0 = greedy)")
        set_("temperature", 0.0 if t < GREEDY_BELOW else t)
        set_("max_tokens", _int("max_tokens", self.max_tokens, 1))
        set_("ignore_eos", _bool("ignore_eos", self.ignore_eos))
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, numbers.Integral):
            raise RequestTypeError("top_k", f"top_k must be an int (0 or -1 = off, k >= 1 keeps k tokens), "
                                            f"got {type(self.top_k).__name__}")
        if self.top_k < -1:
            raise RequestError("top_k", f"top_k must be 0 or -1 (off) or >= 1, got {self.top_k}")
        set_("top_k", min(max(int(self.top_k), 0), TOP_K_MAX))
        set_("top_p", _real("top_p", self.top_p, lambda v: 0 < v <= 1, "in (0, 1] (1 = off)", fp32=False))
        set_("n", _int("n", self.n, 1))
        set_("min_tokens", _int("min_tokens", self.min_tokens, 0, self.max_tokens, " (at most max_tokens)"))
        set_("stop", self._stop_strings(self.stop))
        set_("stop_token_ids", self._token_ids(self.stop_token_ids))
        set_("include_stop_str_in_output", _bool("include_stop_str_in_output", self.include_stop_str_in_output))
        set_("skip_special_tokens", _bool("skip_special_tokens", self.skip_special_tokens))
        # torch.Generator.manual_seed takes [-2**63, 2**64)
        set_("seed", _optional_int("seed", self.seed, -2**63, 2**64 - 1))
        set_("logprobs", _optional_int("logprobs", self.logprobs, 0))
        set_("prompt_logprobs", _optional_int("prompt_logprobs", self.prompt_logprobs, 0))
        for name in ("presence_penalty", "frequency_penalty"):
            set_(name, _real(name, getattr(self, name), lambda v: -2 <= v <= 2, "in [-2, 2] (0 = off)"))
        set_("repetition_penalty", _real("repetition_penalty", self.repetition_penalty, lambda v: v > 0,
                                         "> 0 (1 = off)"))
        set_("min_p", _real("min_p", self.min_p, lambda v: 0 <= v <= 1, "in [0, 1] (0 = off)"))

    @staticmethod
    def _stop_strings(stop) -> tuple[str, ...]:
        if stop is None:
            return ()
        values = (stop,) if isinstance(stop, str) else stop
        if not isinstance(values, (list, tuple)) or not all(isinstance(s, str) for s in values):
            raise RequestTypeError("stop", f"stop must be a str or a list of str, got {stop!r:.80}")
        if any(s == "" for s in values):
            raise RequestError("stop", "stop must not contain an empty string (it would match everywhere)")
        return tuple(values)

    @staticmethod
    def _token_ids(ids) -> tuple[int, ...]:
        if ids is None:
            return ()
        if not isinstance(ids, (list, tuple)):
            raise RequestTypeError("stop_token_ids", f"stop_token_ids must be a list of int token ids, got "
                                                     f"{type(ids).__name__}")
        return tuple(_int(f"stop_token_ids[{i}]", t, 0, field="stop_token_ids") for i, t in enumerate(ids))

    def pending_fields(self) -> list[str]:
        """Names of the fields set away from their default whose sampler side is not implemented (PENDING)."""
        return [name for name, default in PENDING.items() if getattr(self, name) != default]

    @property
    def stop_holdback(self) -> int:
        """Characters of a streamed text held back, so a stop string that is still being completed never has
        to be taken back: the longest stop string's length - 1 (0 without stop strings, or when the stop
        string stays in the text)."""
        if not self.stop or self.include_stop_str_in_output:
            return 0
        return max(map(len, self.stop)) - 1

