"""The messages between the front end and the engine core (issue 28; vLLM v1's `vllm/v1/engine/__init__.py`).

    front end (LLMEngine, the server)                 engine core (engine/core.py)
    EngineCoreRequest / EngineCoreAbort  ──input──▶   add_request / abort, then schedule + execute
    OutputProcessor  ◀──output── EngineCoreOutputs    one message per step: token-id deltas

Every message is a msgspec Struct, encoded with msgspec.msgpack as an array (array_like: fields by position,
no names on the wire), so a decode step's delta is about 14 bytes per sequence; the sampling settings travel
as a dict without the fields at their default. Nothing here is text: token ids, finish reasons and raw logprob rows only; the front end owns the
tokenizer, the stop strings and the RequestOutputs (engine/output_processor.py).

The input socket carries a tagged union (`InputMessage`): the first array element names the struct.
"""
import dataclasses
from typing import Any, Union

import msgspec

from nanovllm_ref.sampling_params import SamplingParams

# A logprob row as the model runner returns it (layers/logprobs.py): (token ids, logprobs, rank of the first
# id); column 0 is the chosen (or, for a prompt row, the actual next) token, then the top tokens.
LogprobRow = tuple[list[int], list[float], int]

# SamplingParams fields the core does not need: stop strings are matched in the front end, on the text.
FRONT_END_ONLY = ("stop",)


class EngineCoreRequest(msgspec.Struct, array_like=True, tag=True):
    """Queue one request in the core.

    request_id: str, the core's id for it (unique among every request this front end ever sent, so late
        outputs of a finished request can never be taken for a new one's). prompt_token_ids: list[int].
    sampling_params: dict[str, Any], the SamplingParams fields other than FRONT_END_ONLY, without those at
        their default (`sampling_fields`); the core rebuilds the SamplingParams (`core_sampling_params`).
    seeds: list[int], one per sample (n): the seed the front end drew for each, in arrival order (a
        SamplingParams.seed wins over it; engine/sequence.py)."""
    request_id: str
    prompt_token_ids: list[int]
    sampling_params: dict[str, Any] = {}
    seeds: list[int] = []


class EngineCoreAbort(msgspec.Struct, array_like=True, tag=True):
    """Stop a request in the core and free its KV blocks. request_id: str, the core id. index: int, one sample
    (a stop string ended it in the front end), or -1 for every sample of the request. Unknown or finished
    ids are ignored: the front end may abort what has just finished."""
    request_id: str
    index: int = -1


class EngineCoreShutdown(msgspec.Struct, array_like=True, tag=True):
    """Leave the busy loop, free the model and the workers, and exit (the process core)."""


InputMessage = Union[EngineCoreRequest, EngineCoreAbort, EngineCoreShutdown]


class EngineCoreOutput(msgspec.Struct, array_like=True):
    """What one sample of one request got in one step.

    request_id: str, the core id. index: int, the sample (0..n-1). new_token_ids: list[int], the tokens
    the step added (usually one; none for a prefill chunk whose logits only gave prompt logprobs).
    finish_reason: None while it runs, else "stop" (eos or a stop id: the core stops on token ids only) or
    "length"; sent once, with the last token. stop_reason: int, the stop id, or None (eos, length).
    new_logprobs: None unless SamplingParams.logprobs is set; then one LogprobRow per new token.
    new_prompt_logprobs: None, or the prompt's LogprobRows this step computed (sample 0 only), for prompt
    tokens 1, 2, ... in order."""
    request_id: str
    index: int = 0
    new_token_ids: list[int] = []
    finish_reason: str | None = None
    stop_reason: int | None = None
    new_logprobs: list[LogprobRow] | None = None
    new_prompt_logprobs: list[LogprobRow] | None = None


class CoreStepStats(msgspec.Struct, array_like=True):
    """The step the core launched (nanovllm_ref.outputs.StepStats): kind "prefill" | "decode", num_tokens it
    computes, num_seqs in its batch."""
    kind: str
    num_tokens: int
    num_seqs: int


class EngineCoreOutputs(msgspec.Struct, array_like=True):
    """One core step.

    outputs: list[EngineCoreOutput], one per sample that progressed. step: the CoreStepStats of the step
    launched, None if none was (an idle step, or async scheduling finishing the last one in flight).
    scheduler_stats: dict[str, int], "running", "waiting", "kv_blocks_free", "kv_blocks_total" after the
    step (GET /health). step_s: float, seconds the core spent on the step (schedule, launch, wait for the
    ids, bookkeeping, building this message). error: None, or "<ExceptionType>: <message>" when the core
    failed: the last message of a core process, which then exits."""
    outputs: list[EngineCoreOutput] = []
    step: CoreStepStats | None = None
    scheduler_stats: dict[str, int] = {}
    step_s: float = 0.0
    error: str | None = None


_DEFAULTS = SamplingParams()


def sampling_fields(sp: SamplingParams) -> dict[str, Any]:
    """The EngineCoreRequest.sampling_params of `sp`: its fields but FRONT_END_ONLY, those at their default
    left out (stop_token_ids as a list)."""
    out = {}
    for f in dataclasses.fields(SamplingParams):
        if f.name in FRONT_END_ONLY or not f.init:
            continue
        value = getattr(sp, f.name)
        if value != getattr(_DEFAULTS, f.name):
            out[f.name] = list(value) if isinstance(value, tuple) else value
    return out


def core_sampling_params(request: EngineCoreRequest) -> SamplingParams:
    """The SamplingParams the core's sequences run with (checked again on construction: a few microseconds)."""
    return SamplingParams(**request.sampling_params)


# One encoder / decoder pair per socket direction (msgspec reuses their buffers).
def input_encoder() -> msgspec.msgpack.Encoder:
    return msgspec.msgpack.Encoder()


def input_decoder() -> msgspec.msgpack.Decoder:
    return msgspec.msgpack.Decoder(InputMessage)


def output_encoder() -> msgspec.msgpack.Encoder:
    return msgspec.msgpack.Encoder()


def output_decoder() -> msgspec.msgpack.Decoder:
    return msgspec.msgpack.Decoder(EngineCoreOutputs)
