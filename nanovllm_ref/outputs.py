"""What the engine returns, in vLLM's shape (`vllm/outputs.py`): one RequestOutput per request, holding one
CompletionOutput per sample (SamplingParams.n).

    out = llm.generate(["The capital of France is"], SamplingParams(temperature=0, max_tokens=8))[0]
    out.outputs[0].text, out.outputs[0].token_ids, out.outputs[0].finish_reason

Dict access, the shape `generate` returned before: for a request with one sample, `out["text"]`,
`out["token_ids"]`, `out["prompt_token_ids"]` and `out["finish_reason"]` still work (a RequestOutput of one
sample is a read-only Mapping over those four keys, so `dict(out)` gives the old dict). With n > 1, use
`out.outputs[i]`.
"""
from collections.abc import Mapping
from dataclasses import dataclass, field

DICT_KEYS = ("text", "token_ids", "prompt_token_ids", "finish_reason")


@dataclass
class Logprob:
    """One token's entry in a logprobs dict (vLLM's `vllm.logprobs.Logprob`). logprob: float, the natural
    log of its probability under the model's raw distribution (layers/logprobs.py); rank: int >= 1, the
    number of tokens at least as likely (1 = the most likely); decoded_token: the token decoded alone
    (`tokenizer.decode([token_id])`), or None without a tokenizer."""
    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


@dataclass
class CompletionOutput:
    """One sample of a request.

    index: which sample (0..n-1). text: the completion's text (engine/detokenizer.py: decoded with the
    prompt's end as context; without the stop string or the stop token's text unless
    include_stop_str_in_output). token_ids: the completion's token ids, the stop token included.
    finish_reason: None while running, then "stop" (eos, a stop id or a stop string), "length"
    (max_tokens, or prompt + completion reached max_model_len) or "abort". stop_reason: the stop id or
    string that ended it (None for eos, for "length" and while running). logprobs: None unless
    SamplingParams.logprobs is set; then one dict per token of token_ids, {token_id: Logprob}, holding the
    token itself and the `logprobs` most likely tokens at that step (so logprobs or logprobs + 1 entries),
    as in vLLM. cumulative_logprob: the sum of the tokens' own logprobs (None without logprobs).
    """
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    cumulative_logprob: float | None = None
    logprobs: list | None = None

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass(eq=True)
class RequestOutput(Mapping):
    """The state of one request: a snapshot, made when `step()` or `generate()` returns it.

    request_id: str, the id `add_request` returned. prompt: the prompt when it was given as a str, else
    None (token ids, chat). prompt_token_ids: list[int], one list shared by all snapshots of the request
    (do not modify it). outputs: one CompletionOutput per sample, in index
    order. finished: True once every sample has finished. prompt_logprobs: None unless
    SamplingParams.prompt_logprobs is set; then one entry per prompt token: None for the first (nothing
    predicts it), then {token_id: Logprob} with the prompt token itself and the `prompt_logprobs` most likely
    tokens at that position (vLLM's shape).
    Successive snapshots of one request only grow: text and token_ids of each sample extend the previous
    ones (text a stop string may still complete is held back), so a server can stream the differences.
    """
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    prompt_logprobs: list | None = field(default=None)

    # -- the n = 1 dict view (see the module docstring) --------------------------------------------------
    def _one(self) -> CompletionOutput:
        if len(self.outputs) != 1:
            raise TypeError(f"request {self.request_id!r} has {len(self.outputs)} samples (n > 1); dict access "
                            "works for one sample only: use .outputs[i].text / .token_ids / .finish_reason")
        return self.outputs[0]

    def __getitem__(self, key: str):
        if key == "prompt_token_ids":
            return self.prompt_token_ids
        if key in DICT_KEYS:
            return getattr(self._one(), key)
        raise KeyError(f"{key!r} (a RequestOutput's dict view has the keys {list(DICT_KEYS)}; see its attributes "
                       "request_id, prompt, prompt_token_ids, outputs, finished)")

    def __iter__(self):
        self._one()
        return iter(DICT_KEYS)

    def __len__(self) -> int:
        self._one()
        return len(DICT_KEYS)

    __hash__ = None                                     # mutable, like the dict it stands in for


@dataclass(frozen=True)
class StepStats:
    """What the last `LLMEngine.step()` computed, for throughput: `kind` "prefill" or "decode";
    `num_tokens` the tokens it computed (prefill: the prompt tokens of this step's chunks; decode: one per
    sequence, the batch size); `num_seqs` the sequences in the batch."""
    kind: str
    num_tokens: int
    num_seqs: int

    @property
    def is_prefill(self) -> bool:
        return self.kind == "prefill"
