"""A request's sampling fields mapped to `SamplingParams`, and the length checks a request must pass before it
reaches the engine (serving chapter).

Every field is either honoured or refused. Each sampling field maps to the SamplingParams field of the same
meaning and is passed on whenever it asks for something (a value other than its neutral one); whether the
engine can do it is the engine's own decision, made by its request check (`ServingEngine.check_request`,
for LLMEngine engine/request.py's `check_request`, which refuses the fields `sampling_params.PENDING` lists
at that moment). So a client that asks for `presence_penalty=1.5` from an engine without penalties gets a
400 naming the field, not a silently unpenalised answer, and the server needs no change when the engine
learns a field. Value ranges are SamplingParams' own checks (its errors name the field, passed on as 400s).

| request field (OpenAI / vLLM extra) | SamplingParams field | neutral value (always accepted) |
|---|---|---|
| temperature, top_p, top_k, seed | same name | None (not given) |
| max_tokens (chat: max_completion_tokens first) | max_tokens | — (resolved per prompt) |
| n | n | 1 |
| stop, stop_token_ids | same name | None, [] |
| presence_penalty, frequency_penalty | same name | 0 |
| repetition_penalty | same name | 1 |
| min_p, min_tokens | same name | 0 |
| ignore_eos, include_stop_str_in_output | same name | false |
| skip_special_tokens | same name | true |
| logprobs, top_logprobs, echo, suffix, best_of > 1, logit_bias, response_format other than text, tools, tool_choice | (none: this server does not return or apply them yet) | None, false, {}, [] |

Length rules (vLLM's): a prompt needs at least one token and room for one more under max_model_len;
prompt + max_tokens must fit max_model_len; max_tokens None asks for the rest of the context; and the most
tokens the request ever holds K/V for must fit the whole KV cache (else it could never run).
"""
import re

from nanovllm_ref.entrypoints.openai.protocol import APIError
from nanovllm_ref.sampling_params import SamplingParams

# request field -> (SamplingParams field, neutral values)
MAPPED = {
    "temperature": ("temperature", (None,)),
    "top_p": ("top_p", (None,)),
    "top_k": ("top_k", (None,)),
    "seed": ("seed", (None,)),
    "n": ("n", (None, 1)),
    "stop": ("stop", (None, [])),
    "stop_token_ids": ("stop_token_ids", (None, [])),
    "presence_penalty": ("presence_penalty", (None, 0, 0.0)),
    "frequency_penalty": ("frequency_penalty", (None, 0, 0.0)),
    "repetition_penalty": ("repetition_penalty", (None, 1, 1.0)),
    "min_p": ("min_p", (None, 0, 0.0)),
    "min_tokens": ("min_tokens", (None, 0)),
    "ignore_eos": ("ignore_eos", (None, False)),
    "include_stop_str_in_output": ("include_stop_str_in_output", (None, False)),
    "skip_special_tokens": ("skip_special_tokens", (None, True)),
}
# Fields the server knows but cannot serve (it would have to return or apply something it does not build yet:
# log-probabilities, an echoed prompt, tool calls): refused unless neutral, whatever the engine can do.
NOT_SERVED = {
    "logprobs": (None, False),          # completions' logprobs=0 asks for the chosen tokens' logprobs: refused too
    "top_logprobs": (None, 0),
    "echo": (None, False),
    "suffix": (None, ""),
    "best_of": (None, 1),
    "logit_bias": (None, {}),
    "response_format": (None, {"type": "text"}),
    "tools": (None, []),
    "tool_choice": (None, "none"),
    "parallel_tool_calls": (None,),
}


def _is_neutral(value, neutral) -> bool:
    return any(value is n if n is None or isinstance(n, bool) else (value == n and not isinstance(value, bool))
               for n in neutral)


def sampling_kwargs(request) -> dict:
    """The SamplingParams keyword arguments `request` asks for, max_tokens left out: every mapped field whose
    value is not neutral. Raises APIError (400) naming the first field this server cannot serve (NOT_SERVED);
    what the engine cannot do is refused later, by the engine's own check (check_with_engine)."""
    for name, neutral in NOT_SERVED.items():
        if name in type(request).model_fields and not _is_neutral(getattr(request, name), neutral):
            raise APIError(f"`{name}` is not supported by this server yet; leave it out", param=name)
    return {sp_name: getattr(request, name) for name, (sp_name, neutral) in MAPPED.items()
            if not _is_neutral(getattr(request, name), neutral)}


_WORD = re.compile(r"\w+")


def request_field(sp_name: str | None, max_tokens_field: str = "max_tokens") -> str | None:
    """The request field that sets SamplingParams field `sp_name` (None if none does)."""
    if sp_name == "max_tokens":
        return max_tokens_field
    return {v[0]: k for k, v in MAPPED.items()}.get(sp_name)


def check_with_engine(engine, prompt_token_ids: list[int], sp: SamplingParams, max_tokens_field: str = "max_tokens",
                      prompt_field: str = "prompt") -> None:
    """Ask the engine whether it can run this request, before it is queued: its optional `check_request`
    (serving_engine.py) raises ValueError / TypeError for what it cannot do, a field it does not implement
    yet among them. Raises APIError (400) with the engine's message; param is the request field of the first
    SamplingParams field the message names (`SamplingParams.min_p=0.2 is not implemented yet`, `n=17 samples
    cannot run ...`), else the prompt's (the prompt itself is what the engine refused)."""
    check = getattr(engine, "check_request", None)
    if check is None:
        return
    try:
        check(prompt_token_ids, sp)
    except (ValueError, TypeError) as exc:
        text = str(exc)
        sp_fields = {v[0] for v in MAPPED.values()} | {"max_tokens"}
        named = next((w for w in _WORD.findall(text) if w in sp_fields), None)
        param = request_field(named, max_tokens_field)
        raise APIError(f"the engine cannot run this request: {text}", param=param or prompt_field) from exc


def make_sampling_params(kwargs: dict, max_tokens: int, max_tokens_field: str = "max_tokens") -> SamplingParams:
    """SamplingParams(**kwargs, max_tokens=...). Its ValueError / TypeError becomes an APIError naming the
    request field (SamplingParams' messages start with the field's name)."""
    try:
        return SamplingParams(**kwargs, max_tokens=max_tokens)
    except (TypeError, ValueError) as exc:
        text = str(exc)
        sp_name = next((n for n in sorted({*kwargs, "max_tokens"}, key=len, reverse=True) if text.startswith(n)), None)
        raise APIError(text, param=request_field(sp_name, max_tokens_field)) from exc


def resolve_max_tokens(requested: int | None, prompt_len: int, max_model_len: int, field: str = "max_tokens",
                       prompt_field: str = "prompt", kv_cache_tokens: int | None = None) -> int:
    """The max_tokens to run: `requested`, or for None the rest of the context (and no more than the KV cache
    can hold: prompt + max_tokens - 1 tokens, see check_fits_cache). Raises APIError when the prompt leaves no
    room under max_model_len or prompt + max_tokens does not fit it."""
    room = max_model_len - prompt_len
    if room < 1:
        raise APIError(f"this model's maximum context length is {max_model_len} tokens and the prompt has "
                       f"{prompt_len}: no room for a completion; shorten the prompt", param=prompt_field)
    if requested is None:
        if kv_cache_tokens is not None:
            room = min(room, kv_cache_tokens + 1 - prompt_len)
        return max(room, 1)                   # < 1: check_fits_cache refuses the prompt itself
    if requested >= 1 and requested > room:
        raise APIError(f"this model's maximum context length is {max_model_len} tokens; the prompt has "
                       f"{prompt_len} and {field}={requested} asks for {prompt_len + requested}; lower {field} "
                       f"to at most {room}", param=field)
    return requested


def check_fits_cache(prompt_len: int, max_tokens: int, max_model_len: int, kv_cache_tokens: int | None,
                     field: str = "max_tokens", prompt_field: str = "prompt") -> None:
    """Raise APIError if the request can never fit the KV cache. The most tokens it holds K/V for: the prompt,
    then every sampled token but the last (it is never fed back), capped by max_model_len; blocks round up,
    and ceil(L / block_size) <= num_blocks exactly when L <= num_blocks * block_size, so tokens suffice."""
    if kv_cache_tokens is None:
        return
    longest = max(prompt_len, min(prompt_len + max_tokens, max_model_len) - 1)
    if prompt_len > kv_cache_tokens:
        raise APIError(f"the prompt can never fit in the KV cache: {prompt_len} tokens, the cache holds "
                       f"{kv_cache_tokens}; shorten it", param=prompt_field)
    if longest > kv_cache_tokens:
        raise APIError(f"the request can never fit in the KV cache: up to {longest} tokens, the cache holds "
                       f"{kv_cache_tokens}; lower {field} or shorten the prompt", param=field)
