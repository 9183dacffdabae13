"""The front end's half of a request: text, stop strings, logprob dicts, RequestOutputs (issue 28; vLLM v1's
`vllm/v1/engine/output_processor.py`).

The engine core (engine/core.py) sends token-id deltas (engine/core_messages.py EngineCoreOutput). For each
request the OutputProcessor keeps a RequestState: per sample an IncrementalDetokenizer
(engine/detokenizer.py), the token ids so far, the raw logprob rows and the finish reason. `process_outputs`
takes one step's deltas and returns the requests that progressed, plus the samples to abort in the core:

- stop strings (engine/stop.py find_stop_string) are matched here, on each new token's text, in the rules
  the scheduler applied when it held the text (a match must end in the new token's text; none before
  min_tokens; none on a token that is itself a stop id or eos). On a match the sample finishes here: the
  text is cut (before the string, or after it with include_stop_str_in_output), and the core is asked to
  abort the sample. Tokens the core made past the match (a process core runs ahead) are dropped, so ids,
  text and logprobs are exactly the offline ones.
- a sample the core finished on a stop token keeps that token's text out unless include_stop_str_in_output.

`RequestState.output()` builds the RequestOutput snapshot (nanovllm_ref.outputs) as a step or generate returns
it: text held back by SamplingParams.stop_holdback while a stop string may still claim it, logprob dicts built
once per row and reused by later snapshots.
"""
from nanovllm_ref.engine.core_messages import EngineCoreOutput
from nanovllm_ref.engine.detokenizer import IncrementalDetokenizer
from nanovllm_ref.engine.stop import find_stop_string, shown_text
from nanovllm_ref.outputs import CompletionOutput, Logprob, RequestOutput
from nanovllm_ref.sampling_params import SamplingParams


class SampleState:
    """One sample (0..n-1) of a request in the front end: `token_ids` (the completion so far), `detokenizer`,
    `finish_reason` / `stop_reason` (None while it runs), `hide_last_token_text` (a stop token whose text
    stays out), `logprobs` (raw rows, one per token) and `cumulative_logprob`."""

    def __init__(self, index: int, detokenizer: IncrementalDetokenizer):
        self.index = index
        self.token_ids: list[int] = []
        self.detokenizer = detokenizer
        self.finish_reason: str | None = None
        self.stop_reason: int | str | None = None
        self.hide_last_token_text = False
        self.logprobs: list = []
        self.cumulative_logprob = 0.0
        self._dicts: list = []            # logprob dicts made for earlier snapshots

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def text(self, sp: SamplingParams) -> str:
        """The completion's text as far as it may be shown now: all of it once finished, else without the
        last stop_holdback characters (a stop string may still claim them)."""
        return shown_text(self.detokenizer, self.token_ids, len(self.token_ids), self.hide_last_token_text,
                          self.finished, sp.stop_holdback)


class RequestState:
    """One request in the front end: `request_id` (the caller's), `core_id` (the id the core knows it by),
    `prompt` (the str given, else None), `prompt_token_ids`, `sampling_params`, `samples` (SampleState per
    sample) and `prompt_logprobs` (raw rows for prompt tokens 1, 2, ...)."""

    def __init__(self, request_id: str, core_id: str, prompt, prompt_token_ids: list[int], sp: SamplingParams,
                 tokenizer, decode_token):
        self.request_id, self.core_id = request_id, core_id
        self.prompt = prompt if isinstance(prompt, str) else None
        self.prompt_token_ids = list(prompt_token_ids)
        self.sampling_params = sp
        self.samples = [SampleState(i, IncrementalDetokenizer(tokenizer, self.prompt_token_ids, sp.skip_special_tokens))
                        for i in range(sp.n)]
        self.prompt_logprobs: list = []
        self._prompt_dicts: list = []
        self._decode_token = decode_token

    @property
    def finished(self) -> bool:
        return all(s.finished for s in self.samples)

    def output(self) -> RequestOutput:
        """A snapshot of the request now (nanovllm_ref.outputs.RequestOutput)."""
        sp, decode_token = self.sampling_params, self._decode_token
        outputs = []
        for s in self.samples:
            logprobs = cumulative = None
            if sp.logprobs is not None:
                logprobs = _logprob_dicts(s.logprobs, s._dicts, len(s.token_ids), decode_token)
                cumulative = s.cumulative_logprob
            outputs.append(CompletionOutput(index=s.index, text=s.text(sp), token_ids=list(s.token_ids),
                                            finish_reason=s.finish_reason, stop_reason=s.stop_reason,
                                            cumulative_logprob=cumulative, logprobs=logprobs))
        prompt_logprobs = None
        if sp.prompt_logprobs is not None:
            prompt_logprobs = [None] + _logprob_dicts(self.prompt_logprobs, self._prompt_dicts,
                                                      len(self.prompt_token_ids) - 1, decode_token)
        # prompt_token_ids: one list shared by the request's snapshots (copying it every step would cost
        # more than the rest of a snapshot for long prompts)
        return RequestOutput(request_id=self.request_id, prompt=self.prompt, prompt_token_ids=self.prompt_token_ids,
                             outputs=outputs, finished=self.finished, prompt_logprobs=prompt_logprobs)


def _logprob_dicts(raw: list, built: list, count: int, decode_token) -> list[dict]:
    """The first `count` raw rows (token ids, logprobs, rank of the first) as vLLM's dicts {token_id: Logprob}:
    the chosen token with its rank, then the top tokens with ranks 1, 2, ... (a chosen token that is also
    among the top keeps its top rank, as in vLLM). Rows already turned into dicts are reused (`built` grows)."""
    for ids, lps, rank in raw[len(built):count]:
        ranks = [rank, *range(1, len(ids))]
        built.append({t: Logprob(lp, r, decode_token(t) if decode_token else None)
                      for t, lp, r in zip(ids, lps, ranks)})
    return built[:count]


class OutputProcessor:
    """The front end's requests. tokenizer: an HF tokenizer (each sample's IncrementalDetokenizer);
    decode_token: token id -> its text alone (Logprob.decoded_token), or None.

    `requests`: unfinished RequestStates by the caller's request id. Not thread-safe: the thread that steps
    the engine makes every call."""

    def __init__(self, tokenizer, decode_token=None):
        self.tokenizer = tokenizer
        self.decode_token = decode_token
        self.requests: dict[str, RequestState] = {}
        self._by_core_id: dict[str, RequestState] = {}

    def add_request(self, request_id: str, core_id: str, prompt, prompt_token_ids: list[int],
                    sp: SamplingParams) -> RequestState:
        state = RequestState(request_id, core_id, prompt, prompt_token_ids, sp, self.tokenizer, self.decode_token)
        self.requests[request_id] = self._by_core_id[core_id] = state
        return state

    def abort_request(self, request_id: str) -> RequestState | None:
        """Forget an unfinished request (its unfinished samples get finish_reason "abort"); returns its state,
        None if unknown. The caller aborts it in the core."""
        state = self.requests.pop(request_id, None)
        if state is not None:
            del self._by_core_id[state.core_id]
            for s in state.samples:
                if s.finish_reason is None:
                    s.finish_reason, s.stop_reason = "abort", None
        return state

    def abort_all(self) -> list[str]:
        """Forget every request; returns their core ids."""
        ids = list(self._by_core_id)
        for request_id in list(self.requests):
            self.abort_request(request_id)
        return ids

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    def process_outputs(self, outputs: list[EngineCoreOutput]) -> tuple[list[RequestState], list[tuple[str, int]]]:
        """Take one core step's deltas in. Returns (the requests that got a new token, in the order their first
        delta came, finished ones included and dropped from `requests`; the (core id, sample index) pairs the
        core must abort: samples a stop string ended here)."""
        progressed, aborts, ended = {}, [], []
        by_core_id = self._by_core_id
        for out in outputs:
            state = by_core_id.get(out.request_id)
            if state is None:                  # aborted here, or finished here while the core ran on
                continue
            if out.new_prompt_logprobs:
                state.prompt_logprobs.extend(out.new_prompt_logprobs)
            sample = state.samples[out.index]
            if sample.finish_reason is not None or not out.new_token_ids:
                continue
            if self._take_tokens(state.sampling_params, sample, out):
                aborts.append((out.request_id, out.index))
            progressed[state.request_id] = state
            if sample.finish_reason is not None:
                ended.append(state)            # only a request with a sample that just ended can be done
        for state in ended:
            if state.finished and state.request_id in self.requests:
                del self.requests[state.request_id]
                del by_core_id[state.core_id]
        return list(progressed.values()), aborts

    @staticmethod
    def _take_tokens(sp: SamplingParams, sample: SampleState, out: EngineCoreOutput) -> bool:
        """Append the delta's tokens (and their logprob rows) to `sample`, matching stop strings token by token;
        returns True if a stop string ended a sample the core is still running."""
        ids, rows = out.new_token_ids, out.new_logprobs
        # The core's own stop on a token id (eos, stop_token_ids): that token's text is not searched.
        token_stop = out.finish_reason == "stop"
        if not sp.stop and rows is None:
            # The usual delta (no stop strings, no logprobs): nothing to look at token by token. This runs for
            # every sample of every step, so it is kept to one extend.
            sample.token_ids.extend(ids)
            if out.finish_reason is not None:
                sample.finish_reason, sample.stop_reason = out.finish_reason, out.stop_reason
                sample.hide_last_token_text = token_stop and not sp.include_stop_str_in_output
            return False
        last = len(ids) - 1
        for j, token_id in enumerate(ids):
            sample.token_ids.append(token_id)
            if rows is not None:
                row = rows[j]
                sample.logprobs.append(row)
                sample.cumulative_logprob += row[1][0]
            if sp.stop and not (token_stop and j == last):
                d = sample.detokenizer
                new = d.update(sample.token_ids[d.num_tokens:])
                if len(sample.token_ids) > sp.min_tokens:
                    hit = find_stop_string(d.text, len(new), sp.stop, sp.include_stop_str_in_output)
                    if hit is not None:
                        d.truncate(hit[1])
                        sample.finish_reason, sample.stop_reason = "stop", hit[0]
                        return out.finish_reason is None      # else the core has already finished it
        if out.finish_reason is not None:
            sample.finish_reason, sample.stop_reason = out.finish_reason, out.stop_reason
            sample.hide_last_token_text = token_stop and not sp.include_stop_str_in_output
        return False
