"""The server on the real engine (`serve` with its default engine factory, on the CPU), for two models: a tiny
random Qwen3 (its byte-level tokenizer and random weights produce byte-split UTF-8 characters, which the
incremental detokenizer must hold back and join) and SmolLM2-135M-Instruct (`make model`; real text, its
chat template). For each: greedy answers, streamed and not, through the `openai` client and curl, equal
`LLM.generate` / `LLM.chat`; 16 concurrent streams equal the offline batch; a client killed mid-stream gives
its KV blocks back; bad requests get 400s naming the field, the engine's own refusals included; SIGTERM
ends an open stream with finish_reason "abort" and the process exits 0."""
import asyncio
import json
import signal
import subprocess
import sys
import time

import httpx
import openai
import pytest
from serve_helpers import ROOT, child_env, free_port, need_curl

from nanovllm_ref import sampling_params as sampling_params_module

ENGINE = dict(device="cpu", max_model_len=256, kvcache_block_size=16, max_num_seqs=16)
FLAGS = ["--device", "cpu", "--max-model-len", "256", "--kvcache-block-size", "16", "--max-num-seqs", "16"]
PROMPTS = ["The capital of France is", "Hello, world!", "def f(x):"]
MAX_TOKENS = 24


@pytest.fixture(scope="module", params=["tiny", "smollm2"])
def model_dir(request, tmp_path_factory):
    if request.param == "tiny":
        from nanovllm_models.tiny import make_tiny_model
        return make_tiny_model(str(tmp_path_factory.mktemp("serve_tiny")), "qwen3")
    from nanovllm_models.download import ensure_model
    return str(ensure_model())


@pytest.fixture(scope="module")
def llm(model_dir):
    from nanovllm_ref import LLM
    engine = LLM(model_dir, **ENGINE)
    yield engine
    engine.exit()


class RealServer:
    def __init__(self, model_dir, log_path):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = open(log_path, "w+")
        cmd = [sys.executable, "-m", "nanovllm_ref", "serve", "--model", model_dir, "--port", str(self.port),
               "--served-model-name", "m", *FLAGS]
        self.proc = subprocess.Popen(cmd, cwd=ROOT, env=child_env(), stdout=self.log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 180
        while True:
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.proc.kill()
                raise AssertionError(f"the server did not start:\n{self.text()}")
            time.sleep(0.3)

    def text(self) -> str:
        self.log.flush()
        self.log.seek(0)
        return self.log.read()

    def health(self) -> dict:
        return httpx.get(self.url + "/health", timeout=10).json()


@pytest.fixture(scope="module")
def server(model_dir, tmp_path_factory):
    srv = RealServer(model_dir, tmp_path_factory.mktemp("serve_real") / "server.log")
    yield srv
    if srv.proc.poll() is None:                       # the SIGTERM test did not run (-k): stop it here
        srv.proc.send_signal(signal.SIGTERM)
        assert srv.proc.wait(timeout=60) == 0, srv.text()
    srv.log.close()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="none", timeout=120, max_retries=0)


@pytest.fixture
def tokens(request):
    """`tokens(n)`: the max_tokens a test asks for, as written for the tiny model (cheap; its byte-split characters
    need the length), halved for SmolLM2: each of its decode steps costs ~70 ms of CPU in the server and again
    offline, and half the tokens of its real text still tell a wrong detokenizer, chat template or logprob."""
    div = 2 if request.node.callspec.params["model_dir"] == "smollm2" else 1
    return lambda n: n // div


def _greedy(max_tokens=MAX_TOKENS):
    from nanovllm_ref import SamplingParams
    return SamplingParams(temperature=0, max_tokens=max_tokens)


def test_completions_streamed_and_not_equal_llm_generate(llm, client, server, tokens):
    max_tokens = tokens(MAX_TOKENS)
    offline = llm.generate(PROMPTS, _greedy(max_tokens), use_tqdm=False)
    for prompt, want in zip(PROMPTS, offline):
        full = client.completions.create(model="m", prompt=prompt, max_tokens=max_tokens, temperature=0)
        assert full.choices[0].text == want["text"]
        assert full.choices[0].finish_reason == want["finish_reason"]
        assert full.usage.completion_tokens == len(want["token_ids"])
        assert full.usage.prompt_tokens == len(want["prompt_token_ids"])
        stream = client.completions.create(model="m", prompt=prompt, max_tokens=max_tokens, temperature=0,
                                           stream=True)
        chunks = [c for c in stream if c.choices]
        assert "".join(c.choices[0].text for c in chunks) == want["text"]
        assert chunks[-1].choices[0].finish_reason == want["finish_reason"]
    # curl, a client that shares no code with the server's Python stack, on the token-id prompt
    body = json.dumps({"model": "m", "prompt": offline[0]["prompt_token_ids"], "max_tokens": max_tokens,
                       "temperature": 0, "stream": True})
    out = subprocess.run([need_curl(), "-sS", "-N", "-H", "Content-Type: application/json", "-d", body,
                          server.url + "/v1/completions"], capture_output=True, text=True, timeout=120, check=True)
    events = [line[len("data: "):] for line in out.stdout.splitlines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    assert "".join(json.loads(e)["choices"][0]["text"] for e in events[:-1]) == offline[0]["text"]


def test_chat_streamed_and_not_equal_llm_chat(llm, client, tokens):
    messages, n = [{"role": "user", "content": "Name a colour."}], tokens(20)
    want = llm.chat(messages, _greedy(n), use_tqdm=False)[0]
    full = client.chat.completions.create(model="m", messages=messages, max_tokens=n, temperature=0)
    assert full.choices[0].message.content == want["text"]
    assert full.usage.prompt_tokens == len(want["prompt_token_ids"])
    chunks = client.chat.completions.create(model="m", messages=messages, max_tokens=n, temperature=0, stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == want["text"]


def test_logprobs_streamed_and_not_equal_llm_generate(llm, client, tokens):
    """logprobs through both endpoints, in OpenAI's shapes, equal LLM.generate's (the same greedy tokens, each
    token's logprob and the top 3 by rank). Tolerance 1e-4: the server's process and this one may run the
    CPU kernels on different thread counts, which changes the summation order (the ids stay the same)."""
    from nanovllm_ref import SamplingParams
    prompt, k, n, m = PROMPTS[0], 3, tokens(12), tokens(8)
    want = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=n, logprobs=k), use_tqdm=False)[0].outputs[0]
    chosen = [d[t] for t, d in zip(want.token_ids, want.logprobs)]
    close = lambda a, b: all(abs(x - y) <= 1e-4 for x, y in zip(a, b)) and len(a) == len(b)   # noqa: E731

    full = client.completions.create(model="m", prompt=prompt, max_tokens=n, temperature=0, logprobs=k)
    chunks = [c for c in client.completions.create(model="m", prompt=prompt, max_tokens=n, temperature=0,
                                                   logprobs=k, stream=True) if c.choices and c.choices[0].logprobs]
    for lp in (full.choices[0].logprobs, *[c.choices[0].logprobs for c in chunks]):
        assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset)
    streamed = [x for c in chunks for x in c.choices[0].logprobs.tokens]
    assert full.choices[0].logprobs.tokens == streamed == [lp.decoded_token for lp in chosen]
    for got in (full.choices[0].logprobs.token_logprobs, [x for c in chunks for x in c.choices[0].logprobs.token_logprobs]):
        assert close(got, [lp.logprob for lp in chosen])
    for top, d in zip(full.choices[0].logprobs.top_logprobs, want.logprobs):
        assert set(top) == {lp.decoded_token for lp in d.values()}       # keys: token texts (equal texts merge)

    messages = [{"role": "user", "content": "Name a colour."}]
    want = llm.chat(messages, SamplingParams(temperature=0, max_tokens=m, logprobs=k), use_tqdm=False)[0].outputs[0]
    for content in (client.chat.completions.create(model="m", messages=messages, max_tokens=m, temperature=0,
                                                   logprobs=True, top_logprobs=k).choices[0].logprobs.content,
                    [x for c in client.chat.completions.create(model="m", messages=messages, max_tokens=m,
                                                               temperature=0, logprobs=True, top_logprobs=k,
                                                               stream=True)
                     if c.choices and c.choices[0].logprobs for x in c.choices[0].logprobs.content]):
        assert [c.token for c in content] == [d[t].decoded_token for t, d in zip(want.token_ids, want.logprobs)]
        assert close([c.logprob for c in content], [d[t].logprob for t, d in zip(want.token_ids, want.logprobs)])
        for c, d in zip(content, want.logprobs):
            top = sorted(d.values(), key=lambda lp: lp.rank)[:k]
            assert [t.token for t in c.top_logprobs] == [lp.decoded_token for lp in top]
            assert close([t.logprob for t in c.top_logprobs], [lp.logprob for lp in top])


def test_sixteen_concurrent_streams_equal_the_offline_batch(llm, server, tokens):
    prompts, n = [f"Question {i}: what is {i} plus {i}?" for i in range(16)], tokens(20)
    offline = [o["text"] for o in llm.generate(prompts, _greedy(n), use_tqdm=False)]

    async def one(client, prompt):
        stream = await client.completions.create(model="m", prompt=prompt, max_tokens=n, temperature=0,
                                                 stream=True)
        return "".join([c.choices[0].text async for c in stream if c.choices])

    async def main():
        client = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="none", timeout=240, max_retries=0)
        return await asyncio.wait_for(asyncio.gather(*(one(client, p) for p in prompts)), 300)

    assert asyncio.run(main()) == offline
    assert server.health()["open_requests"] == 0


def _wait_idle(server, timeout=30) -> dict:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        health = server.health()
        stats = health["engine"]
        if health["open_requests"] == 0 and stats.get("running") == 0 and stats.get("waiting") == 0 and \
                stats.get("kv_blocks_free") == stats.get("kv_blocks_total"):
            return health
        time.sleep(0.1)
    raise AssertionError(f"the engine still holds requests or KV blocks: {health}")


def test_client_killed_mid_stream_frees_its_kv_blocks(server, client):
    body = json.dumps({"model": "m", "prompt": [5, 6, 7, 8], "max_tokens": 200, "ignore_eos": True, "stream": True})
    proc = subprocess.Popen([need_curl(), "-sS", "-N", "-H", "Content-Type: application/json", "-d", body,
                             server.url + "/v1/completions"], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().startswith("data: ")
        busy = server.health()
        assert busy["open_requests"] == 1
        assert busy["engine"]["kv_blocks_free"] < busy["engine"]["kv_blocks_total"]
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=10)
    _wait_idle(server)
    # the others go on: a request after the abort still runs to its length
    assert client.completions.create(model="m", prompt=[5, 6, 7], max_tokens=5, temperature=0,
                                     extra_body={"ignore_eos": True}).usage.completion_tokens == 5


def _bad_requests(vocab_size: int) -> list[tuple[dict, str]]:
    """(body, the param its 400 must name). The PENDING fields are read now: another change may shrink it."""
    cases = [({"prompt": "x", "temprature": 0.5}, "temprature"),
             ({"prompt": "x", "temperature": -1}, "temperature"),
             ({"prompt": "x", "top_p": 0}, "top_p"),
             ({"prompt": "x", "max_tokens": 0}, "max_tokens"),
             ({"prompt": "x", "max_tokens": 10**6}, "max_tokens"),
             ({"prompt": [vocab_size + 3]}, "prompt"),
             ({"prompt": []}, "prompt"),
             ({"prompt": [5] * 300}, "prompt"),
             ({"prompt": "x", "n": 17}, "n"),
             ({"prompt": "x", "stop_token_ids": [vocab_size]}, "stop_token_ids"),
             ({"prompt": "x", "logprobs": 21}, "logprobs"),           # above the engine's MAX_LOGPROBS
             ({"prompt": "x", "stream": "yes"}, "stream")]
    asks = {"presence_penalty": 0.5, "frequency_penalty": 0.5, "repetition_penalty": 1.2, "min_p": 0.1,
            "logprobs": 1, "prompt_logprobs": 1}
    cases += [({"prompt": "x", name: asks[name]}, name) for name in sampling_params_module.PENDING
              if name in asks and name not in ("logprobs", "prompt_logprobs")]
    return cases


def test_bad_requests_get_400_naming_the_field_and_change_nothing(server, llm):
    vocab = llm.config.hf_config.vocab_size
    for body, param in _bad_requests(vocab):
        res = httpx.post(server.url + "/v1/completions", json={"model": "m", **body}, timeout=30)
        assert res.status_code == 400, (body, res.text)
        assert res.json()["error"]["param"] == param, (body, res.json())
    res = httpx.post(server.url + "/v1/completions", content=b"{not json", timeout=30,
                     headers={"Content-Type": "application/json"})
    assert res.status_code == 400 and "malformed JSON" in res.json()["error"]["message"]
    _wait_idle(server)


def test_sigterm_ends_open_streams_with_abort_and_exits_zero(server):
    """Last in the module: it stops the server."""
    body = {"model": "m", "prompt": [5, 6, 7, 8], "max_tokens": 200, "ignore_eos": True, "stream": True}
    finish = []
    with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=60) as res:
        lines = res.iter_lines()
        assert next(lines).startswith("data: ")
        server.proc.send_signal(signal.SIGTERM)
        for line in lines:
            if line.startswith("data: {"):
                finish += [c["finish_reason"] for c in json.loads(line[6:])["choices"] if c["finish_reason"]]
    assert finish == ["abort"]
    assert server.proc.wait(timeout=60) == 0, server.text()
