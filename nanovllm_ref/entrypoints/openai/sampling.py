"""A request's sampling fields mapped to `SamplingParams`, the engine's refusals mapped back to the request's
own fields, and how max_tokens is resolved (serving chapter).

Every field is either honoured or refused. Each sampling field maps to the SamplingParams field of the same
meaning and is passed on whenever it asks for something (a value other than its neutral one). Validation
happens once, in the engine: SamplingParams checks the value ranges, and the engine's request check
(`ServingEngine.check_request`; for LLMEngine engine/request.py's `check_request`) checks the prompt
against the vocabulary, max_model_len and the KV cache, and what the engine can do. Both raise a
RequestError (nanovllm_ref/errors.py) whose `field` names the engine's argument; `request_param` maps it to
the request's field for the 400 (`max_tokens` is `max_completion_tokens` when a chat request set that,
`prompt` is `messages` for a chat, chat's `logprobs` is its `top_logprobs`). No rule is restated here and
no error text is read.

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
| completions: logprobs (int) | logprobs | None |
| chat: logprobs (bool) + top_logprobs (int) | logprobs = top_logprobs or 0 when logprobs is true | None, false |
| echo, suffix, best_of > 1 (best_of < n is refused as OpenAI does), logit_bias, response_format other than text, tools, tool_choice | (none: refused by name; this server does not build or apply them) | None, false, "", {}, [] |
| parallel_tool_calls | (none: no tools run, so it always holds) | None, true, false |

Omitted fields and the model's defaults (vLLM's `--generation-config auto`): a field the request leaves out
(None) of temperature, top_p, top_k, min_p, repetition_penalty and max_tokens takes the engine's
`sampling_defaults` (generation_config.json's, nanovllm_ref/sampling_defaults.py) where it has one; a value
the request gives, even the neutral one, wins. max_tokens left out is the rest of the context (chat) or
OpenAI's 16 (completions), either at most the file's max_new_tokens. (vLLM also caps a given max_tokens at
max_new_tokens; here a given max_tokens is kept, as every other given field.)

Length rules (vLLM's): prompt + max_tokens must fit max_model_len (so the prompt needs room for one more
token); max_tokens None asks for the rest of the context, and no more than the KV cache can ever hold
(engine/request.py's kv_cache_room, the rule the engine's check refuses by).
"""
from nanovllm_ref.engine.request import kv_cache_room
from nanovllm_ref.entrypoints.openai.protocol import APIError, ChatCompletionRequest
from nanovllm_ref.errors import RequestError
from nanovllm_ref.sampling_params import SamplingParams

# request field -> (SamplingParams field, neutral values); the fields both endpoints share
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
# Fields the server knows but does not serve (it would have to build or apply something it has not: an
# echoed prompt, a suffix, tool calls, a grammar): refused unless neutral, whatever the engine can do.
NOT_SERVED = {
    "echo": (None, False),
    "suffix": (None, ""),
    "best_of": (None, 1),
    "logit_bias": (None, {}),
    "response_format": (None, {"type": "text"}),
    "tools": (None, []),
    "tool_choice": (None, "none"),
    # no tools run here, so no call is ever made in parallel: either value holds (clients send false as
    # history or by default), as vLLM accepts it
    "parallel_tool_calls": (None, True, False),
}


def _is_neutral(value, neutral) -> bool:
    return any(value is n if n is None or isinstance(n, bool) else (value == n and not isinstance(value, bool))
               for n in neutral)


def _is_chat(request) -> bool:
    return isinstance(request, ChatCompletionRequest)


def max_tokens_field(request) -> str:
    """The request field that sets max_tokens: a chat's max_completion_tokens when given (it wins, as in vLLM)."""
    if _is_chat(request) and request.max_completion_tokens is not None:
        return "max_completion_tokens"
    return "max_tokens"


def request_param(request, field: str | None) -> str | None:
    """The field of `request` that a RequestError's `field` (an engine argument: "prompt" or a SamplingParams
    field) stands for; None when no request field sets it."""
    if field == "prompt":
        return "messages" if _is_chat(request) else "prompt"
    if field == "max_tokens":
        return max_tokens_field(request)
    if field == "logprobs":
        return "top_logprobs" if _is_chat(request) and request.top_logprobs is not None else "logprobs"
    return {sp_name: name for name, (sp_name, _) in MAPPED.items()}.get(field)


def _logprobs(request) -> int | None:
    """SamplingParams.logprobs for the request. Completions: `logprobs` itself (top tokens per position).
    Chat: `logprobs: true` turns them on, `top_logprobs` (default 0) says how many top tokens; top_logprobs
    without logprobs is refused, as in vLLM."""
    if not _is_chat(request):
        return request.logprobs
    if request.top_logprobs is not None and request.logprobs is not True:
        raise APIError("top_logprobs needs logprobs: true (it says how many of the most likely tokens to return "
                       "with each token's logprob)", param="top_logprobs")
    return (request.top_logprobs or 0) if request.logprobs else None


def sampling_kwargs(request, defaults: dict | None = None) -> dict:
    """The SamplingParams keyword arguments `request` asks for, max_tokens left out: every mapped field whose
    value is not neutral, the model's default for each mapped field the request leaves out (None) where
    `defaults` (the engine's sampling_defaults: SamplingParams field -> value) has one, and logprobs. Raises
    APIError (400) naming the first field this server does not serve (NOT_SERVED); what the engine cannot do
    is refused later, by the engine's own check."""
    best_of, n = getattr(request, "best_of", None), 1 if getattr(request, "n", None) is None else request.n
    if best_of is not None and best_of < n:   # OpenAI and vLLM refuse it so, first
        raise APIError(f"best_of must be at least n (the samples returned come from the best_of made), got "
                       f"best_of={best_of} and n={n}", param="best_of")
    for name, neutral in NOT_SERVED.items():
        if name in type(request).model_fields and not _is_neutral(getattr(request, name), neutral):
            raise APIError(f"`{name}` is not supported by this server; leave it out", param=name)
    kwargs = {sp_name: getattr(request, name) for name, (sp_name, neutral) in MAPPED.items()
              if not _is_neutral(getattr(request, name), neutral)}
    for name, (sp_name, _) in MAPPED.items():
        if getattr(request, name) is None and sp_name in (defaults or {}):
            kwargs[sp_name] = defaults[sp_name]
    logprobs = _logprobs(request)
    if logprobs is not None:
        kwargs["logprobs"] = logprobs
    return kwargs


def make_sampling_params(request, kwargs: dict, max_tokens: int, defaulted: dict | None = None) -> SamplingParams:
    """SamplingParams(**kwargs, max_tokens=...); its RequestError becomes an APIError (400) naming the
    request's field. defaulted: the fields (SamplingParams names -> values) that came from the model's
    generation config because the request left them out; a message about one says so (min_tokens is refused
    against max_tokens, so a defaulted max_tokens is named for it too)."""
    try:
        return SamplingParams(**kwargs, max_tokens=max_tokens)
    except RequestError as exc:
        message, defaulted = exc.message, defaulted or {}
        cause = exc.field if exc.field in defaulted else "max_tokens" if exc.field == "min_tokens" else None
        if cause in defaulted:
            message += (f" ({cause}={defaulted[cause]!r} is the model's default, from its generation config, as "
                        f"the request left {request_param(request, cause)} out)")
        raise APIError(message, param=request_param(request, exc.field)) from exc


def check_with_engine(engine, request, prompt_token_ids: list[int], sp: SamplingParams, where: str) -> None:
    """Ask the engine whether it can run this prompt with these settings, before it is queued: its optional
    `check_request(prompt_token_ids, sampling_params, where=...)` (serving_engine.py; `where` is how its
    messages call the prompt). Raises APIError (400) with the engine's message: param is the request field
    of the RequestError's field, or None when the engine refused without naming one."""
    check = getattr(engine, "check_request", None)
    if check is None:
        return
    try:
        check(prompt_token_ids, sp, where=where)
    except RequestError as exc:
        raise APIError(f"the engine cannot run this request: {exc.message}",
                       param=request_param(request, exc.field)) from exc
    except (ValueError, TypeError) as exc:
        raise APIError(f"the engine cannot run this request: {exc}", param=None) from exc


def resolve_max_tokens(requested: int | None, prompt_len: int, max_model_len: int,
                       kv_cache_tokens: int | None = None, field: str = "max_tokens",
                       prompt_field: str = "prompt", where: str | None = None, default: int | None = None) -> int:
    """The max_tokens to run: `requested`, or for None the rest of the context, at most `default` (the model's
    max_new_tokens, where its generation config sets one) and no more than the KV cache can ever hold
    (kv_cache_room; a prompt that alone does not fit gets 1, and the engine's check refuses it). Raises APIError naming `prompt_field` when the prompt leaves no room under max_model_len, or `field`
    when prompt + max_tokens does not fit it (the server's rule, vLLM's: the engine itself stops a completion
    at max_model_len). where: the prompt's name in the messages (`prompt[1]` in a batch; default prompt_field)."""
    where = where or prompt_field
    room = max_model_len - prompt_len
    if room < 1:
        raise APIError(f"this model's maximum context length is {max_model_len} tokens and {where} has "
                       f"{prompt_len}: no room for a completion; shorten it", param=prompt_field)
    if requested is None:
        fits = kv_cache_room(prompt_len, max_model_len, kv_cache_tokens) if kv_cache_tokens is not None else None
        rest = max(min(room, fits), 1) if fits is not None else room
        return min(rest, default) if default is not None else rest
    if requested >= 1 and requested > room:
        raise APIError(f"this model's maximum context length is {max_model_len} tokens; {where} has "
                       f"{prompt_len} and {field}={requested} asks for {prompt_len + requested}; lower {field} "
                       f"to at most {room}", param=field)
    return requested
