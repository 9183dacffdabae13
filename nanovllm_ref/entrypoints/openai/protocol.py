"""The OpenAI wire format: request and response bodies of /v1/completions, /v1/chat/completions, their
streamed chunks, /v1/models and the error body (serving chapter).

Shapes follow OpenAI's API reference and vLLM's `vllm/entrypoints/openai/protocol.py`, which adds a few
sampling fields of its own (top_k, min_p, repetition_penalty, min_tokens, ignore_eos, stop_token_ids,
include_stop_str_in_output, skip_special_tokens); clients send those in the JSON body (the `openai` client's
`extra_body=`).

Requests are strict (`extra="forbid"`): a field this server does not know is refused with a 400 that names
it, never ignored, so a typo such as `temprature` cannot silently sample at the default. Every field it knows
reaches the engine or the chat template with OpenAI's (or vLLM's) meaning, or is refused by name
(`sampling.py`); tests/test_serve_fields.py holds the table of where each one goes. Types are checked here;
value ranges are checked by `SamplingParams` itself, so the two never disagree.
"""
import time
import uuid
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, Strict, model_serializer

# Strict scalars: "0.5" is not a temperature and true is not a max_tokens (pydantic's lax mode would convert
# both). A JSON integer is still a valid float.
Int = Annotated[int, Strict()]
Float = Annotated[float, Strict()]
Bool = Annotated[bool, Strict()]
Str = Annotated[str, Strict()]


def random_id(prefix: str) -> str:
    """An id like OpenAI's: `cmpl-3f2a...` (32 hex digits after the prefix)."""
    return f"{prefix}-{uuid.uuid4().hex}"


class _Request(BaseModel):
    model_config = ConfigDict(extra="forbid")


class StreamOptions(_Request):
    """include_usage: send one more chunk before `[DONE]`, with `choices: []` and the request's usage."""
    include_usage: Bool = False


class _SamplingFields(_Request):
    """Fields both endpoints share. None means "not given"; sampling.py applies the defaults."""
    model: Str | None = None
    temperature: Float | None = None          # OpenAI's default is 1
    top_p: Float | None = None
    n: Int | None = None
    stream: Bool | None = False                # null: not streamed, as vLLM reads it
    stream_options: StreamOptions | None = None
    stop: Str | list[Str] | None = None
    seed: Int | None = None
    presence_penalty: Float | None = None
    frequency_penalty: Float | None = None
    logit_bias: dict[Str, Float] | None = None
    user: Str | None = None                   # the caller's end-user id (abuse monitoring): no effect on the answer
    # vLLM's extra sampling fields
    top_k: Int | None = None
    min_p: Float | None = None
    repetition_penalty: Float | None = None
    min_tokens: Int | None = None
    ignore_eos: Bool | None = None
    stop_token_ids: list[Int] | None = None
    include_stop_str_in_output: Bool | None = None
    skip_special_tokens: Bool | None = None


# A prompt is text, a list of texts, a list of token ids, or a list of token-id lists (a batch).
Prompt = Str | list[Str] | list[Int] | list[list[Int]]


class CompletionRequest(_SamplingFields):
    """POST /v1/completions. max_tokens defaults to 16 as in OpenAI's API; None asks for the rest of the
    context (max_model_len - prompt length). logprobs: k >= 0 returns each token's logprob and the k most
    likely tokens' (choices[].logprobs, CompletionLogprobs)."""
    prompt: Prompt
    max_tokens: Int | None = 16
    logprobs: Int | None = None
    echo: Bool | None = None
    best_of: Int | None = None
    suffix: Str | None = None


class TextPart(_Request):
    type: Literal["text"]
    text: Str


class ChatMessage(_Request):
    """One message. content: a str, or a list of text parts (joined by newlines, as vLLM does for text-only
    models). name: the participant's name (OpenAI: to tell apart participants of one role), passed to the chat
    template as the message's `name`, as vLLM does; templates that do not read it render the same.
    tool_calls, refusal, function_call, audio, annotations: only null, the values an OpenAI client's own
    assistant message carries when it is sent back as history (`model_dump()`; this server runs no tools, makes
    no audio and cites nothing)."""
    role: Literal["system", "user", "assistant", "developer"]
    content: Str | list[TextPart]
    name: Str | None = None
    tool_calls: None = None
    refusal: None = None
    function_call: None = None
    audio: None = None
    annotations: None = None


class ChatCompletionRequest(_SamplingFields):
    """POST /v1/chat/completions. max_tokens (or its newer name max_completion_tokens) None: the rest of the
    context. add_generation_prompt: end the rendered prompt with the assistant's turn marker (default).
    logprobs: true returns each token's logprob (choices[].logprobs.content, ChatLogprobs); top_logprobs:
    k >= 0 adds the k most likely tokens at each position (needs logprobs: true)."""
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: Int | None = None
    max_completion_tokens: Int | None = None
    logprobs: Bool | None = None
    top_logprobs: Int | None = None
    response_format: dict | None = None
    tools: list[dict] | None = None
    tool_choice: Str | dict | None = None
    parallel_tool_calls: Bool | None = None
    add_generation_prompt: Bool = True
    chat_template_kwargs: dict | None = None


# -- responses -------------------------------------------------------------------------------------------
class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class CompletionLogprobs(BaseModel):
    """OpenAI's legacy logprobs of a completion choice, one entry per token: `tokens` (each token's text,
    decoded alone), `token_logprobs`, `top_logprobs` ({token text: logprob} of the token itself and the k
    most likely ones, so k or k + 1 entries) and `text_offset` (where each token's text starts in the
    concatenated token texts). Logprobs are natural logs under the model's raw distribution, -inf as -9999."""
    tokens: list[str] = Field(default_factory=list)
    token_logprobs: list[float] = Field(default_factory=list)
    top_logprobs: list[dict[str, float]] = Field(default_factory=list)
    text_offset: list[int] = Field(default_factory=list)


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None          # "stop", "length", "abort"; None while streaming
    stop_reason: int | str | None = None      # vLLM's: the stop id or string that ended it


class _UsageWhenGiven(BaseModel):
    """A body whose `usage` is written only when it was given, even as None. OpenAI's streamed chunks carry
    `"usage": null` only when the client asked for usage (stream_options.include_usage), and then on every
    chunk but the last; without it they have no usage key (vLLM's chat chunks too: exclude_unset)."""

    @model_serializer(mode="wrap")
    def _usage_when_given(self, handler):
        data = handler(self)
        if "usage" not in self.model_fields_set:
            data.pop("usage", None)
        return data


def stream_chunk_head(head: dict, include_usage: bool) -> dict:
    """The fields every text or finish chunk of a stream shares (head: id, created, model). With include_usage
    they carry "usage": null (OpenAI: every chunk but the usage one); without it no usage key at all
    (_UsageWhenGiven)."""
    return dict(head, usage=None) if include_usage else head


class CompletionResponse(_UsageWhenGiven):
    """A completion, or one chunk of a streamed one (the same shape, as in OpenAI's API). usage: given on a
    full response and on a stream's usage chunk; None on the other chunks when usage was asked for; not
    written at all otherwise (`_UsageWhenGiven`)."""
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str


class ChatLogprob(BaseModel):
    """One token: its text (decoded alone), logprob (-inf as -9999) and `bytes`, the UTF-8 bytes of that text."""
    token: str
    logprob: float
    bytes: list[int] | None = None


class ChatLogprobsContent(ChatLogprob):
    """A token of the answer, and `top_logprobs`: the k most likely tokens at its position, most likely first."""
    top_logprobs: list[ChatLogprob] = Field(default_factory=list)


class ChatLogprobs(BaseModel):
    content: list[ChatLogprobsContent] | None = None


class ChatChoice(BaseModel):
    index: int
    message: AssistantMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatChoice]
    usage: Usage


class DeltaMessage(BaseModel):
    """What a streamed chat chunk adds to a choice's message. Only the fields it sets are written: the first
    chunk of a choice is {"role": "assistant", "content": ""}, text chunks {"content": ...}, and the chunk
    that ends the choice {} (OpenAI's shapes; vLLM writes chat chunks with exclude_unset)."""
    role: Literal["assistant"] | None = None
    content: str | None = None

    @model_serializer(mode="wrap")
    def _set_fields_only(self, handler):
        data = handler(self)
        return {k: v for k, v in data.items() if v is not None}


class ChatChunkChoice(BaseModel):
    index: int
    delta: DeltaMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatCompletionChunk(_UsageWhenGiven):
    """One chunk of a streamed chat completion. usage as in CompletionResponse: written only when given."""
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=lambda: int(time.time()))
    owned_by: str = "nanovllm_ref"
    max_model_len: int


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class ErrorInfo(BaseModel):
    """OpenAI's error object. param: the request field at fault (dotted path for nested ones), or None."""
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    error: ErrorInfo


class APIError(Exception):
    """A request the server answers with an error body instead of a completion. status: 400 for a bad
    request, 404 for an unknown model, 503 when the server is full or stopping. param: the field at fault."""

    def __init__(self, message: str, param: str | None = None, status: int = 400,
                 type: str = "invalid_request_error"):
        super().__init__(message)
        self.message, self.param, self.status, self.type = message, param, status, type

    def body(self) -> dict:
        return ErrorResponse(error=ErrorInfo(message=self.message, type=self.type, param=self.param)).model_dump()
