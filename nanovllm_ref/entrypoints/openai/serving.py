"""From a request body to engine requests, and from engine outputs back to choices (serving chapter).

`completion_inputs` / `chat_inputs` turn a validated body into `EngineInput`s, one per prompt: token ids
(a text prompt is encoded with the engine's tokenizer; a chat is rendered by its chat template straight to
ids) and a SamplingParams (sampling.py). Every check that can fail runs here, before the engine sees
anything, so a bad request is a 400 and changes no engine state.

`Choices` follows the outputs of one HTTP request (several prompts, n samples each) as they stream in: it
keeps the text already sent per choice and gives the new piece (`delta`). Engine text only grows by
appending (serving_engine.py), so a delta is the cumulative text minus what was sent; a text that does not
extend what was sent is a broken engine contract and raises RuntimeError rather than sending garbled text.
Choice index = prompt index * n + sample index, as in OpenAI's and vLLM's batched completions.
"""
from dataclasses import dataclass, field

from nanovllm_ref.engine.request import encode_text
from nanovllm_ref.entrypoints.openai.protocol import APIError, Usage
from nanovllm_ref.entrypoints.openai.sampling import (check_fits_cache, check_with_engine, make_sampling_params,
                                                      resolve_max_tokens, sampling_kwargs)
from nanovllm_ref.sampling_params import SamplingParams


@dataclass
class EngineInput:
    prompt_token_ids: list[int]
    sampling_params: SamplingParams


def _check_ids(ids: list[int], vocab_size: int, where: str) -> list[int]:
    if not ids:
        raise APIError(f"{where} is empty; a prompt needs at least one token", param="prompt")
    bad = [t for t in ids if not 0 <= t < vocab_size]
    if bad:
        raise APIError(f"{where} has token ids outside [0, {vocab_size}): {bad[:5]}", param="prompt")
    return ids


def completion_prompts(prompt, tokenizer, vocab_size: int) -> list[list[int]]:
    """The token ids of each prompt of a /v1/completions body. prompt: a str, a list of str, a list of token
    ids (one prompt, as vLLM accepts) or a list of token-id lists. Raises APIError (param "prompt", the
    message naming `prompt` or `prompt[i]`), also for text the tokenizer cannot encode."""
    if isinstance(prompt, str):
        prompts = [prompt]
    elif prompt and all(isinstance(p, int) for p in prompt):
        prompts = [prompt]
    else:
        prompts = list(prompt)
    if not prompts:
        raise APIError("prompt is an empty list; give a str, a list of str or token ids", param="prompt")
    out = []
    for i, p in enumerate(prompts):
        where = "prompt" if len(prompts) == 1 else f"prompt[{i}]"
        if isinstance(p, str):
            try:
                ids = encode_text(tokenizer, p, where)
            except ValueError as exc:               # text the tokenizer cannot encode (a lone surrogate)
                raise APIError(str(exc), param="prompt") from exc
        else:
            ids = list(p)
        out.append(_check_ids(ids, vocab_size, where))
    return out


def chat_prompt(messages, tokenizer, vocab_size: int, add_generation_prompt: bool = True,
                chat_template_kwargs: dict | None = None) -> list[int]:
    """The token ids of a conversation rendered by the tokenizer's chat template (nanovllm_ref.llm's
    chat_token_ids, the same function `LLM.chat` uses; chat_template_kwargs: more template variables, e.g.
    {"enable_thinking": false} for Qwen3). Text parts of a message are joined by newlines. Raises APIError
    with param "chat_template_kwargs" for a bad one (checked first, on its own), else "messages" (text that
    is not valid, no template, or the template refusing the conversation): the param is the input that was
    being checked when the error came, never guessed from the error's text."""
    from jinja2 import TemplateError

    from nanovllm_ref.llm import chat_token_ids, check_chat_template_kwargs
    try:
        kwargs = check_chat_template_kwargs(chat_template_kwargs, own_parameters=_OWN_PARAMETERS)
    except (TypeError, ValueError) as exc:
        raise APIError(str(exc), param="chat_template_kwargs") from exc
    if not getattr(tokenizer, "chat_template", None):
        raise APIError("this model's tokenizer has no chat template, so it cannot answer chat requests; send the "
                       "text to /v1/completions instead", param="messages")
    conversation = [{"role": m.role, "content": m.content if isinstance(m.content, str)
                     else "\n".join(part.text for part in m.content)} for m in messages]
    try:
        ids = chat_token_ids(tokenizer, conversation, add_generation_prompt=add_generation_prompt,
                             chat_template_kwargs=kwargs or None)
    except (TypeError, ValueError, TemplateError) as exc:   # its messages name the part of `messages` at fault
        raise APIError(str(exc), param="messages") from exc
    return _check_ids(ids, vocab_size, "messages (rendered)")


# Where an HTTP client sets what chat_template_kwargs may not (the offline message points to LLM.chat's arguments).
_OWN_PARAMETERS = "add_generation_prompt is a field of the request body itself; the others are fixed by this server"


def check_stream_options(request) -> None:
    """stream_options only means something for a streamed answer: refused without `stream: true`, as vLLM does."""
    if request.stream_options is not None and not request.stream:
        raise APIError("stream_options can only be given when stream is true", param="stream_options")


def engine_inputs(request, prompts: list[list[int]], engine, requested_max_tokens: int | None,
                  max_tokens_field: str = "max_tokens", prompt_field: str = "prompt") -> list[EngineInput]:
    """One EngineInput per prompt, every length rule checked (sampling.py) and the engine asked whether it can
    run it (check_with_engine). Raises APIError."""
    kwargs = sampling_kwargs(request)
    inputs = []
    for ids in prompts:
        max_tokens = resolve_max_tokens(requested_max_tokens, len(ids), engine.max_model_len, max_tokens_field,
                                        prompt_field, engine.kv_cache_tokens)
        sp = make_sampling_params(kwargs, max_tokens, max_tokens_field)
        check_fits_cache(len(ids), sp.max_tokens, engine.max_model_len, engine.kv_cache_tokens, max_tokens_field,
                         prompt_field)
        check_with_engine(engine, ids, sp, max_tokens_field, prompt_field)
        inputs.append(EngineInput(ids, sp))
    return inputs


def completion_inputs(request, engine) -> list[EngineInput]:
    check_stream_options(request)
    prompts = completion_prompts(request.prompt, engine.tokenizer, engine.vocab_size)
    return engine_inputs(request, prompts, engine, request.max_tokens)


def chat_inputs(request, engine) -> list[EngineInput]:
    check_stream_options(request)
    ids = chat_prompt(request.messages, engine.tokenizer, engine.vocab_size, request.add_generation_prompt,
                      request.chat_template_kwargs)
    if request.max_completion_tokens is not None:
        requested, name = request.max_completion_tokens, "max_completion_tokens"
    else:
        requested, name = request.max_tokens, "max_tokens"
    return engine_inputs(request, [ids], engine, requested, name, "messages")


@dataclass
class ChoiceDelta:
    """What changed in one choice: `text` appended since the last delta ("" if none), and `finish_reason`
    / `stop_reason` once it has finished (None before)."""
    index: int
    text: str
    finish_reason: str | None = None
    stop_reason: int | str | None = None


@dataclass
class _Choice:
    text: str = ""
    num_tokens: int = 0
    finish_reason: str | None = None
    stop_reason: int | str | None = None


@dataclass
class Choices:
    """The choices of one HTTP request: `num_prompts` prompts, `n` samples each."""
    prompt_lens: list[int]
    n: int
    choices: dict[int, _Choice] = field(default_factory=dict)

    def __post_init__(self):
        self.choices = {i: _Choice() for i in range(len(self.prompt_lens) * self.n)}

    def update(self, prompt_index: int, output) -> list[ChoiceDelta]:
        """Fold in one RequestOutput of prompt `prompt_index`; returns a delta for each choice whose text grew
        or that finished in it."""
        deltas = []
        for sample in output.outputs:
            index = prompt_index * self.n + sample.index
            choice = self.choices[index]
            if choice.finish_reason is not None:
                continue
            if not sample.text.startswith(choice.text):
                raise RuntimeError(f"engine text of choice {index} did not extend what was already sent "
                                   f"({choice.text[-20:]!r} -> {sample.text[-20:]!r}); outputs must only append")
            new = sample.text[len(choice.text):]
            choice.text, choice.num_tokens = sample.text, len(sample.token_ids)
            if sample.finish_reason is not None:
                choice.finish_reason, choice.stop_reason = sample.finish_reason, sample.stop_reason
            if new or sample.finish_reason is not None:
                deltas.append(ChoiceDelta(index, new, sample.finish_reason, sample.stop_reason))
        return deltas

    @property
    def finished(self) -> bool:
        return all(c.finish_reason is not None for c in self.choices.values())

    def usage(self) -> Usage:
        prompt, completion = sum(self.prompt_lens), sum(c.num_tokens for c in self.choices.values())
        return Usage(prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion)

    def final(self) -> list[tuple[int, _Choice]]:
        return sorted(self.choices.items())
