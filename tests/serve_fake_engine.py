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
- check_request is the real engine's (engine/request.py's check_request, with a config of this engine's
  facts: a KV cache of `kv_cache_tokens` one-token blocks), so the server's 400s for token ids outside the
  vocabulary, an empty prompt, a request that can never fit the cache, n above max_num_seqs... are the
  engine's own RequestErrors here too; add_request runs it as well;
- with SamplingParams.logprobs = k, each token gets a logprob dict like the real engine's (fake_logprobs);
- `sampling_defaults`: the SamplingParams fields a request leaving them out gets (the real engine's come
  from generation_config.json);
- `slow_encode_s`: encoding a text that holds "SLOW" sleeps that long first (a prompt of many MB);
- `record`: a JSON-lines file of events, one per add / abort / step / exit, which the tests read: the server
  runs in another process. An add records the whole SamplingParams (`sampling_params`).
"""
import dataclasses
import json
import re
import time
from collections import deque
from dataclasses import dataclass, field
from types import SimpleNamespace

from nanovllm_ref.engine.request import check_request
from nanovllm_ref.engine.scheduler import Scheduler
from nanovllm_ref.outputs import Logprob


@dataclass
class FakeCompletion:
    index: int
    text: str = ""
    token_ids: list = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    logprobs: list | None = None


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
        self.samples = [FakeCompletion(index=i, logprobs=[] if getattr(sp, "logprobs", None) is not None else None)
                        for i in range(getattr(sp, "n", 1))]

    @property
    def finished(self):
        return all(s.finish_reason is not None for s in self.samples)

    def output(self):
        return FakeRequestOutput(self.request_id, None, list(self.prompt_token_ids),
                                 [FakeCompletion(s.index, s.text, list(s.token_ids), s.finish_reason, s.stop_reason,
                                                 None if s.logprobs is None else list(s.logprobs))
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


def fake_logprobs(token: int, position: int, k: int, words: list[int], decode) -> dict:
    """The logprob dict FakeEngine gives the token at `position`, shaped like the real engine's: the token
    first, then the k most likely (ranks 1..k). At even positions the token is the most likely (k entries, or
    1 for k = 0); at odd ones it is less likely than all k (k + 1 entries, its rank k + 1)."""
    shift = -0.01 * position
    others = [w for w in words if w != token][position % 3:][:k]
    if position % 2 == 0:
        ranked = [token, *others[:k - 1]] if k else []
        entries = {token: Logprob(-0.5 + shift, 1, decode(token))}
    else:
        ranked = others
        entries = {token: Logprob(-0.5 * (k + 2) + shift, k + 1, decode(token))}
    for rank, t in enumerate(ranked, start=1):
        entries[t] = Logprob(-0.5 * rank + shift, rank, decode(t))
    return entries


class FakeEngine:
    """model: a folder with a tokenizer. Engine arguments the real engine takes are accepted (max_model_len,
    max_num_seqs); the others are recorded and ignored. step_delay: seconds each step sleeps (a slow GPU)."""

    def __init__(self, model, max_model_len=None, max_num_seqs=8, step_delay=0.0, record=None,
                 kv_cache_tokens=4096, eos_after=24, fail_at_step=None, slow_encode_s=0.0, sampling_defaults=None,
                 **engine_args):
        import warnings
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            from transformers import AutoTokenizer
            self.tokenizer = AutoTokenizer.from_pretrained(model)
        self.max_model_len = max_model_len or 256
        self.vocab_size = len(self.tokenizer)
        self.kv_cache_tokens = kv_cache_tokens
        self.sampling_defaults = dict(sampling_defaults or {})     # as a model's generation_config.json would set them
        self.max_num_seqs = max_num_seqs
        self.step_delay = step_delay
        self.eos_after = eos_after
        self.fail_at_step = fail_at_step
        self.words = word_ids(self.tokenizer)
        # the real engine's request check reads these facts (one-token blocks: the cache holds kv_cache_tokens)
        self.config = SimpleNamespace(hf_config=SimpleNamespace(vocab_size=self.vocab_size), max_num_seqs=max_num_seqs,
                                      max_model_len=self.max_model_len, kvcache_block_size=1,
                                      num_kvcache_blocks=kv_cache_tokens or 0)
        self._texts = {i: self.tokenizer.decode([i]) for i in self.words}
        self.waiting: deque[_Request] = deque()
        self.running: list[_Request] = []
        self.requests: dict[str, _Request] = {}
        self.calls: list[dict] = []
        self.num_steps = 0
        self.closed = False
        self._record = open(record, "a", buffering=1) if record else None
        if slow_encode_s:
            self._slow_encode(slow_encode_s)
        self._log({"event": "start", "engine_args": {k: v for k, v in engine_args.items()
                                                     if isinstance(v, (int, float, str, bool, type(None)))}})

    def _slow_encode(self, seconds: float) -> None:
        """Encoding a text that holds "SLOW" takes `seconds` (a prompt of many MB), logged as "encode_start"."""
        encode = self.tokenizer.encode

        def slow(text, *args, **kwargs):
            if isinstance(text, str) and "SLOW" in text:
                self._log({"event": "encode_start"})
                time.sleep(seconds)
            return encode(text, *args, **kwargs)
        self.tokenizer.encode = slow

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
        self.check_request(prompt_token_ids, sampling_params)
        request = _Request(request_id, prompt_token_ids, sampling_params)
        self.requests[request_id] = request
        self.waiting.append(request)
        sp = {k: list(v) if isinstance(v, tuple) else v for k, v in dataclasses.asdict(sampling_params).items()}
        self._log({"event": "add", "request_id": request_id, "prompt_token_ids": list(prompt_token_ids),
                   "max_tokens": sampling_params.max_tokens, "temperature": sampling_params.temperature,
                   "ignore_eos": sampling_params.ignore_eos, "sampling_params": sp})
        return request_id

    def check_request(self, prompt_token_ids, sampling_params, where="prompt"):
        check_request(list(prompt_token_ids), sampling_params, tokenizer=self.tokenizer, config=self.config,
                      scheduler_cls=Scheduler, where=where, sp_where="the request")

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
                if s.logprobs is not None:
                    s.logprobs.append(fake_logprobs(token, k, sp.logprobs, self.words, self._decode))
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

    def _decode(self, token):
        return self._texts.get(token) or self.tokenizer.decode([token])

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
