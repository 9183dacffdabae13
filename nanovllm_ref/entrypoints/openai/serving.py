"""From a request body to engine requests, and from engine outputs back to choices (serving chapter).

`completion_inputs` / `chat_inputs` turn a validated body into `EngineInput`s, one per prompt: token ids
(a text prompt is encoded with the engine's tokenizer; a chat is rendered by its chat template straight to
ids) and a SamplingParams (sampling.py). Every check runs here, before the request is queued: the server's
own (the body's shape, max_model_len) and the engine's (SamplingParams' ranges, its request check, asked
through check_with_engine), so a bad request is a 400 naming its field and changes no engine state.
`completion_logprobs` / `chat_logprobs` put the engine's logprob dicts in OpenAI's shapes.

`Choices` follows the outputs of one HTTP request (several prompts, n samples each) as they stream in: it
keeps the text already sent per choice and gives the new piece (`delta`). Engine text only grows by
appending (serving_engine.py), so a delta is the cumulative text minus what was sent; a text that does not
extend what was sent is a broken engine contract and raises RuntimeError rather than sending garbled text.
Choice index = prompt index * n + sample index, as in OpenAI's and vLLM's batched completions.
"""
import codecs
from dataclasses import dataclass, field

from nanovllm_ref.engine.request import encode_text
from nanovllm_ref.engine.token_bytes import token_bytes_for
from nanovllm_ref.entrypoints.openai.protocol import (APIError, ChatLogprob, ChatLogprobs, ChatLogprobsContent,
                                                      CompletionLogprobs, Usage)
from nanovllm_ref.entrypoints.openai.sampling import (check_with_engine, make_sampling_params, max_tokens_field,
                                                      request_param, resolve_max_tokens, sampling_kwargs)
from nanovllm_ref.sampling_params import SamplingParams


@dataclass
class EngineInput:
    prompt_token_ids: list[int]
    sampling_params: SamplingParams


def completion_prompts(prompt, tokenizer) -> list[tuple[list[int], str]]:
    """(token ids, how the engine's messages call it) of each prompt of a /v1/completions body. prompt: a str,
    a list of str, a list of token ids (one prompt, as vLLM accepts) or a list of token-id lists; the names
    are `prompt`, or `prompt[i]` in a batch. Raises APIError (param "prompt") for an empty list and for text
    the tokenizer cannot encode. The ids themselves are the engine's to check (check_with_engine)."""
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
        out.append((ids, where))
    return out


def needs_tokenizer(prompt) -> bool:
    """A /v1/completions prompt (as completion_prompts takes it) holds text: a str, or a list with a str in it.
    Token ids alone need no tokenizer, so the server checks them on the event loop."""
    return isinstance(prompt, str) or (isinstance(prompt, list) and any(isinstance(p, str) for p in prompt))


def chat_conversation(messages) -> list[dict]:
    """The messages as the chat template reads them: role, content (text parts joined by newlines) and, when
    given, name (vLLM passes it through too)."""
    conversation = []
    for m in messages:
        message = {"role": m.role, "content": m.content if isinstance(m.content, str)
                   else "\n".join(part.text for part in m.content)}
        if m.name is not None:
            message["name"] = m.name
        conversation.append(message)
    return conversation


def chat_prompt(messages, tokenizer, add_generation_prompt: bool = True,
                chat_template_kwargs: dict | None = None) -> list[int]:
    """The token ids of a conversation rendered by the tokenizer's chat template (nanovllm_ref.llm's
    chat_token_ids, the same function `LLM.chat` uses; chat_template_kwargs: more template variables, e.g.
    {"enable_thinking": false} for Qwen3). Raises APIError with param "chat_template_kwargs" for a bad one
    (checked first, on its own), else "messages" (text that is not valid, no template, or the template
    refusing the conversation): the param is the input that was being checked when the error came, never
    guessed from the error's text."""
    from jinja2 import TemplateError

    from nanovllm_ref.llm import chat_token_ids, check_chat_template_kwargs
    try:
        kwargs = check_chat_template_kwargs(chat_template_kwargs, own_parameters=_OWN_PARAMETERS)
    except (TypeError, ValueError) as exc:
        raise APIError(str(exc), param="chat_template_kwargs") from exc
    if not getattr(tokenizer, "chat_template", None):
        raise APIError("this model's tokenizer has no chat template, so it cannot answer chat requests; send the "
                       "text to /v1/completions instead", param="messages")
    try:
        return chat_token_ids(tokenizer, chat_conversation(messages), add_generation_prompt=add_generation_prompt,
                              chat_template_kwargs=kwargs or None)
    except (TypeError, ValueError, TemplateError) as exc:   # its messages name the part of `messages` at fault
        raise APIError(str(exc), param="messages") from exc


# Where an HTTP client sets what chat_template_kwargs may not (the offline message points to LLM.chat's arguments).
_OWN_PARAMETERS = "add_generation_prompt is a field of the request body itself; the others are fixed by this server"


def check_stream_options(request) -> None:
    """stream_options only means something for a streamed answer: refused without `stream: true`, as vLLM does."""
    if request.stream_options is not None and not request.stream:
        raise APIError("stream_options can only be given when stream is true", param="stream_options")


def engine_inputs(request, prompts: list[tuple[list[int], str]], engine) -> list[EngineInput]:
    """One EngineInput per (token ids, name) prompt: max_tokens resolved (sampling.py), SamplingParams made,
    and the engine asked whether it can run it (check_with_engine). Raises APIError."""
    defaults = getattr(engine, "sampling_defaults", None) or {}      # the model's generation config
    kwargs = sampling_kwargs(request, defaults)
    requested = getattr(request, max_tokens_field(request))
    if max_tokens_field(request) not in request.model_fields_set and requested is not None:
        # left out of a completions request: OpenAI's 16, and no more than the model's max_new_tokens (vLLM)
        requested = min(requested, defaults.get("max_tokens", requested))
    defaulted = {name: value for name, value in kwargs.items() if name in defaults and getattr(request, name) is None}
    inputs = []
    for ids, where in prompts:
        max_tokens = resolve_max_tokens(requested, len(ids), engine.max_model_len, engine.kv_cache_tokens,
                                        max_tokens_field(request), request_param(request, "prompt"), where,
                                        default=defaults.get("max_tokens"))
        left_out = max_tokens_field(request) not in request.model_fields_set
        named = {**defaulted, "max_tokens": max_tokens} if left_out and max_tokens == defaults.get("max_tokens") \
            else defaulted
        sp = make_sampling_params(request, kwargs, max_tokens, named)
        check_with_engine(engine, request, ids, sp, where)
        inputs.append(EngineInput(ids, sp))
    return inputs


def completion_inputs(request, engine) -> list[EngineInput]:
    check_stream_options(request)
    return engine_inputs(request, completion_prompts(request.prompt, engine.tokenizer), engine)


def chat_inputs(request, engine) -> list[EngineInput]:
    check_stream_options(request)
    ids = chat_prompt(request.messages, engine.tokenizer, request.add_generation_prompt, request.chat_template_kwargs)
    return engine_inputs(request, [(ids, "messages (rendered)")], engine)


# -- logprobs in OpenAI's shapes --------------------------------------------------------------------------
LOGPROB_FLOOR = -9999.0          # OpenAI's and vLLM's stand-in for -inf (JSON has no infinity)


def _token_text(tokenizer, token_id: int, logprob) -> str:
    return logprob.decoded_token if logprob.decoded_token is not None else token_bytes_for(tokenizer).text(token_id)


class TextOffsets:
    """Where each token's text starts in a completion's text, in characters, from the tokens' own bytes
    (engine/token_bytes.py): a character spread over several tokens starts where its first piece does. One per
    choice, kept across a stream's chunks."""

    def __init__(self):
        self.chars = 0
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")   # holds an unfinished character

    def take(self, raw: bytes) -> int:
        start = self.chars
        self.chars += len(self._utf8.decode(raw))
        return start


def completion_logprobs(token_ids, dicts, tokenizer, offsets: TextOffsets | None = None) -> CompletionLogprobs:
    """/v1/completions' logprobs of `token_ids` from the engine's dicts ({token_id: Logprob}, one per token:
    the token itself, then the k most likely; nanovllm_ref/outputs.py). top_logprobs holds every entry of a
    dict (the token and the k most likely, as OpenAI's "up to logprobs + 1"), text_offset counts on from
    `offsets` (a stream continues where its last chunk ended; None: from 0)."""
    out, offsets, token_bytes = CompletionLogprobs(), offsets or TextOffsets(), token_bytes_for(tokenizer)
    for token_id, entries in zip(token_ids, dicts):
        out.tokens.append(_token_text(tokenizer, token_id, entries[token_id]))
        out.token_logprobs.append(max(entries[token_id].logprob, LOGPROB_FLOOR))
        out.top_logprobs.append({_token_text(tokenizer, t, lp): max(lp.logprob, LOGPROB_FLOOR)
                                 for t, lp in entries.items()})
        out.text_offset.append(offsets.take(token_bytes.bytes(token_id)))
    return out


def _chat_logprob(tokenizer, token_id, logprob, cls=ChatLogprob, **more):
    # bytes: the token's own (OpenAI: joined over the tokens of a character, they spell it), not its text's
    return cls(token=_token_text(tokenizer, token_id, logprob), logprob=max(logprob.logprob, LOGPROB_FLOOR),
               bytes=list(token_bytes_for(tokenizer).bytes(token_id)), **more)


def chat_logprobs(token_ids, dicts, top_logprobs: int, tokenizer) -> ChatLogprobs:
    """/v1/chat/completions' logprobs.content of `token_ids`: each token, and the `top_logprobs` most likely
    tokens at its position by rank (OpenAI's meaning; vLLM takes the first k entries of its dict, which start
    with the sampled token: the same list when the sampled token is the most likely). A dict holds k + 1
    entries when the token is not among the k most likely (it comes first), else k."""
    content = []
    for token_id, entries in zip(token_ids, dicts):
        items = list(entries.items())
        top = sorted(items if len(items) <= top_logprobs else items[1:], key=lambda item: item[1].rank)[:top_logprobs]
        content.append(_chat_logprob(tokenizer, token_id, entries[token_id], ChatLogprobsContent,
                                     top_logprobs=[_chat_logprob(tokenizer, t, lp) for t, lp in top]))
    return ChatLogprobs(content=content)


@dataclass
class ChoiceDelta:
    """What changed in one choice: `text` appended since the last delta ("" if none), and `finish_reason`
    / `stop_reason` once it has finished (None before). With logprobs asked for: `token_ids` and `logprobs`
    (their dicts) of the tokens no earlier delta carried, so a stream's deltas hold each token once and
    together equal the whole completion's (a token whose text is still held back waits for the next delta
    with text, or the finishing one); else None."""
    index: int
    text: str
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    token_ids: list[int] | None = None
    logprobs: list | None = None


@dataclass
class _Choice:
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list | None = None           # the engine's dicts, one per token (None: not asked for)
    num_sent: int = 0                      # tokens whose logprobs a delta carried
    finish_reason: str | None = None
    stop_reason: int | str | None = None

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)


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
            choice.text, choice.token_ids = sample.text, sample.token_ids      # cumulative: kept, not copied
            choice.logprobs = getattr(sample, "logprobs", None)
            if sample.finish_reason is not None:
                choice.finish_reason, choice.stop_reason = sample.finish_reason, sample.stop_reason
            if new or sample.finish_reason is not None:
                ids = lps = None
                if choice.logprobs is not None:
                    ids, lps = choice.token_ids[choice.num_sent:], choice.logprobs[choice.num_sent:]
                    choice.num_sent = len(choice.token_ids)
                deltas.append(ChoiceDelta(index, new, sample.finish_reason, sample.stop_reason, ids, lps))
        return deltas

    @property
    def finished(self) -> bool:
        return all(c.finish_reason is not None for c in self.choices.values())

    def usage(self) -> Usage:
        prompt, completion = sum(self.prompt_lens), sum(c.num_tokens for c in self.choices.values())
        return Usage(prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion)

    def final(self) -> list[tuple[int, _Choice]]:
        return sorted(self.choices.items())
