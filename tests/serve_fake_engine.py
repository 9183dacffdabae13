"""A fake engine with the ServingEngine contract (nanovllm_ref/entrypoints/openai/serving_engine.py), for the
server's tests: no model, one deterministic token per running request per step.

The server loads it through its test hook, in a subprocess started by a test:
    python -m nanovllm_ref serve --model TOKENIZER_DIR --engine-factory serve_fake_engine:FakeEngine \
        --engine-factory-kwargs '{"step_delay": 0.01, "record": "/tmp/events.jsonl"}'
(with tests/ on PYTHONPATH). What it does:
- continuous batching like the real scheduler: at most `max_num_seqs` requests run; a waiting request joins
  the batch at the first step with a free slot (FCFS);
- token k of sample i of a request is drawn from WORD_IDS (tokens that decode to ASCII words, so the text of
  the ids is the concatenation of the tokens' texts) by a formula of the prompt, k and i: the same request
  always gets the same answer, whatever else runs;
- token `eos_after` (0-based) is the tokenizer's eos unless ignore_eos; a sequence also ends at max_tokens
  or when prompt + completion reaches max_model_len ("length");
- text is tokenizer.decode(completion ids, skip_special_tokens=True) (fake_answer computes it so), built
  by appending each word token's text;
- add_request refuses (ValueError) a prompt that starts with token ids 0, 0, to test the engine-refusal path;
- check_request refuses what the real engine's check refuses by field: a SamplingParams field that
  `sampling_params.PENDING` lists at the time of the call, set away from its default;
- `record`: a JSON-lines file of events, one per add / abort / step / exit, which the tests read: the server
  runs in another process.
"""
import json
import re
import time
from collections import deque
from dataclasses import dataclass, field


@dataclass
class FakeCompletion:
    index: int
    text: str = ""
    token_ids: list = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: int | str | None = None


@dataclass
class FakeRequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list
    outputs: list
    finished: bool


class _Request:
    def __init__(self, request_id, prompt_token_ids, sp):
        self.request_id = request_id
        self.prompt_token_ids = list(prompt_token_ids)
        self.sp = sp
        self.samples = [FakeCompletion(index=i) for i in range(getattr(sp, "n", 1))]

    @property
    def finished(self):
        return all(s.finish_reason is not None for s in self.samples)

    def output(self):
        return FakeRequestOutput(self.request_id, None, list(self.prompt_token_ids),
                                 [FakeCompletion(s.index, s.text, list(s.token_ids), s.finish_reason, s.stop_reason)
                                  for s in self.samples], self.finished)


def word_ids(tokenizer) -> list[int]:
    """Ids whose text is a space and an ASCII word (the tiny tokenizer has a few dozen)."""
    out = [i for i in range(len(tokenizer))
           if re.fullmatch(r" [a-z]{2,}", tokenizer.decode([i], clean_up_tokenization_spaces=False) or "")]
    if len(out) < 8:
        raise ValueError(f"the tokenizer has only {len(out)} word tokens; the fake engine needs 8")
    return out


def fake_token(prompt_token_ids, position: int, sample: int, words: list[int]) -> int:
    return words[(sum(prompt_token_ids) * 31 + len(prompt_token_ids) * 17 + position * 7 + sample * 13) % len(words)]


class FakeEngine:
    """model: a folder with a tokenizer. Engine arguments the real engine takes are accepted (max_model_len,
    max_num_seqs); the others are recorded and ignored. step_delay: seconds each step sleeps (a slow GPU)."""

    def __init__(self, model, max_model_len=None, max_num_seqs=8, step_delay=0.0, record=None,
                 kv_cache_tokens=4096, eos_after=24, fail_at_step=None, **engine_args):
        import warnings
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            from transformers import AutoTokenizer
            self.tokenizer = AutoTokenizer.from_pretrained(model)
        self.max_model_len = max_model_len or 256
        self.vocab_size = len(self.tokenizer)
        self.kv_cache_tokens = kv_cache_tokens
        self.max_num_seqs = max_num_seqs
        self.step_delay = step_delay
        self.eos_after = eos_after
        self.fail_at_step = fail_at_step
        self.words = word_ids(self.tokenizer)
        self._texts = {i: self.tokenizer.decode([i]) for i in self.words}
        self.waiting: deque[_Request] = deque()
        self.running: list[_Request] = []
        self.requests: dict[str, _Request] = {}
        self.calls: list[dict] = []
        self.num_steps = 0
        self.closed = False
        self._record = open(record, "a", buffering=1) if record else None
        self._log({"event": "start", "engine_args": {k: v for k, v in engine_args.items()
                                                     if isinstance(v, (int, float, str, bool, type(None)))}})

    def _log(self, event: dict) -> None:
        self.calls.append(event)
        if self._record is not None:
            self._record.write(json.dumps(event) + "\n")

    # -- ServingEngine -------------------------------------------------------------------------------------
    def add_request(self, prompt_token_ids, sampling_params, request_id):
        if not isinstance(request_id, str) or request_id in self.requests:
            raise ValueError(f"request_id {request_id!r} is not a new str")
        if prompt_token_ids[:2] == [0, 0]:
            raise ValueError("prompt starts with token ids 0, 0, which the fake engine refuses")
        request = _Request(request_id, prompt_token_ids, sampling_params)
        self.requests[request_id] = request
        self.waiting.append(request)
        self._log({"event": "add", "request_id": request_id, "prompt_token_ids": list(prompt_token_ids),
                   "max_tokens": sampling_params.max_tokens, "temperature": sampling_params.temperature,
                   "ignore_eos": sampling_params.ignore_eos})
        return request_id

    def check_request(self, prompt_token_ids, sampling_params):
        pending = sampling_params.pending_fields()            # reads sampling_params.PENDING now
        if pending:
            raise ValueError(f"the fake engine: SamplingParams.{pending[0]} is not implemented yet")

    def abort_request(self, request_id):
        request = self.requests.pop(request_id, None)
        self._log({"event": "abort", "request_id": request_id, "known": request is not None})
        if request is None:
            return
        if request in self.running:
            self.running.remove(request)
        if request in self.waiting:
            self.waiting.remove(request)

    def has_unfinished_requests(self):
        return bool(self.waiting or self.running)

    def step(self):
        if self.fail_at_step is not None and self.num_steps >= self.fail_at_step:
            raise RuntimeError("the fake engine failed on purpose (fail_at_step)")
        while self.waiting and len(self.running) < self.max_num_seqs:
            self.running.append(self.waiting.popleft())
        if not self.running:
            return []
        if self.step_delay:
            time.sleep(self.step_delay)
        self.num_steps += 1
        self._log({"event": "step", "batch": [r.request_id for r in self.running]})
        eos = self.tokenizer.eos_token_id
        for request in self.running:
            sp, prompt = request.sp, request.prompt_token_ids
            for s in request.samples:
                if s.finish_reason is not None:
                    continue
                k = len(s.token_ids)
                token = eos if (k == self.eos_after and not sp.ignore_eos) else fake_token(prompt, k, s.index,
                                                                                          self.words)
                s.token_ids.append(token)
                # Word tokens are ASCII, so the text of the ids is the concatenation of the tokens' texts (and
                # eos adds none): appending one token's text equals decoding them all, at O(1) a token.
                s.text += self._texts.get(token, "")
                if token == eos and not sp.ignore_eos:
                    s.finish_reason, s.stop_reason = "stop", None
                elif len(s.token_ids) >= sp.max_tokens or len(prompt) + len(s.token_ids) >= self.max_model_len:
                    s.finish_reason = "length"
        outputs = [r.output() for r in self.running]
        for request in [r for r in self.running if r.finished]:
            self.running.remove(request)
            del self.requests[request.request_id]
        return outputs

    def stats(self):
        return {"running": len(self.running), "waiting": len(self.waiting)}

    def exit(self):
        if self.closed:
            return
        self.closed = True
        self._log({"event": "exit", "unfinished": sorted(self.requests)})
        if self._record is not None:
            self._record.close()


def fake_answer(tokenizer, prompt_token_ids, max_tokens, eos_after=24, ignore_eos=False, max_model_len=256):
    """The text and finish_reason FakeEngine gives one request (sample 0), computed without the engine."""
    words, ids = word_ids(tokenizer), []
    for k in range(max_tokens):
        if k == eos_after and not ignore_eos:
            ids.append(tokenizer.eos_token_id)
            return tokenizer.decode(ids, skip_special_tokens=True, clean_up_tokenization_spaces=False), "stop", ids
        ids.append(fake_token(prompt_token_ids, k, 0, words))
        if len(prompt_token_ids) + len(ids) >= max_model_len:
            break
    return tokenizer.decode(ids, skip_special_tokens=True, clean_up_tokenization_spaces=False), "length", ids
