"""The server on the real engine (a tiny random Qwen3 on the CPU, `serve` with its default engine factory):
greedy answers, streamed and not, equal `LLM.generate` / `LLM.chat`; 16 concurrent streams equal the offline
batch; a client killed mid-stream gives its KV blocks back. It runs once LLMEngine has the request API the
server drives (add_request(..., request_id), abort_request, step() -> RequestOutputs; issue 23), and is
skipped, saying so, before."""
import asyncio
import json
import signal
import subprocess
import time

import httpx
import openai
import pytest
from serve_helpers import ROOT, child_env, free_port, need_curl

from nanovllm_ref.engine.llm_engine import LLMEngine
from nanovllm_ref.entrypoints.openai.serving_engine import engine_request_api_missing

MISSING = engine_request_api_missing(LLMEngine)
pytestmark = pytest.mark.skipif(bool(MISSING), reason=f"LLMEngine lacks the request API the server drives: {MISSING}")
ENGINE = dict(device="cpu", max_model_len=256, kvcache_block_size=16, max_num_seqs=16)
PROMPTS = ["The capital of France is", "Hello, world!", "def f(x):"]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from nanovllm_models.tiny import make_tiny_model
    return make_tiny_model(str(tmp_path_factory.mktemp("serve_tiny")), "qwen3")


@pytest.fixture(scope="module")
def llm(model_dir):
    from nanovllm_ref import LLM
    engine = LLM(model_dir, **ENGINE)
    yield engine
    engine.exit()


@pytest.fixture(scope="module")
def server(model_dir, tmp_path_factory):
    port = free_port()
    log = open(tmp_path_factory.mktemp("serve_real") / "server.log", "w+")
    cmd = ["python", "-m", "nanovllm_ref", "serve", "--model", model_dir, "--port", str(port), "--served-model-name",
           "tiny", "--device", "cpu", "--max-model-len", "256", "--kvcache-block-size", "16", "--max-num-seqs", "16"]
    import sys
    cmd[0] = sys.executable
    proc = subprocess.Popen(cmd, cwd=ROOT, env=child_env(), stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 180
    while True:
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                break
        except httpx.HTTPError:
            pass
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            log.seek(0)
            raise AssertionError(f"the server did not start:\n{log.read()}")
        time.sleep(0.3)
    yield url
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=60) == 0
    log.close()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server + "/v1", api_key="none", timeout=60, max_retries=0)


def test_completions_streamed_and_not_equal_llm_generate(llm, client):
    from nanovllm_ref import SamplingParams
    offline = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=24), use_tqdm=False)
    for prompt, want in zip(PROMPTS, offline):
        full = client.completions.create(model="tiny", prompt=prompt, max_tokens=24, temperature=0)
        assert full.choices[0].text == want["text"]
        assert full.choices[0].finish_reason == want["finish_reason"]
        assert full.usage.completion_tokens == len(want["token_ids"])
        assert full.usage.prompt_tokens == len(want["prompt_token_ids"])
        stream = client.completions.create(model="tiny", prompt=prompt, max_tokens=24, temperature=0, stream=True)
        assert "".join(c.choices[0].text for c in stream if c.choices) == want["text"]


def test_chat_equals_llm_chat(llm, client):
    from nanovllm_ref import SamplingParams
    messages = [{"role": "user", "content": "Name a colour."}]
    want = llm.chat(messages, SamplingParams(temperature=0, max_tokens=20), use_tqdm=False)[0]
    full = client.chat.completions.create(model="tiny", messages=messages, max_tokens=20, temperature=0)
    assert full.choices[0].message.content == want["text"]
    chunks = client.chat.completions.create(model="tiny", messages=messages, max_tokens=20, temperature=0, stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == want["text"]


def test_sixteen_concurrent_streams_equal_the_offline_batch(llm, server):
    from nanovllm_ref import SamplingParams
    prompts = [f"Question {i}: what is {i} plus {i}?" for i in range(16)]
    offline = [o["text"] for o in llm.generate(prompts, SamplingParams(temperature=0, max_tokens=20), use_tqdm=False)]

    async def one(client, prompt):
        stream = await client.completions.create(model="tiny", prompt=prompt, max_tokens=20, temperature=0,
                                                 stream=True)
        return "".join([c.choices[0].text async for c in stream if c.choices])

    async def main():
        client = openai.AsyncOpenAI(base_url=server + "/v1", api_key="none", timeout=120, max_retries=0)
        return await asyncio.wait_for(asyncio.gather(*(one(client, p) for p in prompts)), 240)

    assert asyncio.run(main()) == offline


def test_client_killed_mid_stream_frees_its_kv_blocks(server):
    body = json.dumps({"model": "tiny", "prompt": [5, 6, 7, 8], "max_tokens": 200, "ignore_eos": True, "stream": True})
    proc = subprocess.Popen([need_curl(), "-sS", "-N", "-H", "Content-Type: application/json", "-d", body,
                             server + "/v1/completions"], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().startswith("data: ")
        busy = httpx.get(server + "/health", timeout=5).json()
        assert busy["open_requests"] == 1
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=10)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        health = httpx.get(server + "/health", timeout=5).json()
        stats = health["engine"]
        if health["open_requests"] == 0 and stats.get("running") == 0 and \
                stats.get("kv_blocks_free") == stats.get("kv_blocks_total"):
            break
        time.sleep(0.1)
    else:
        raise AssertionError(f"the killed client's request still holds engine state: {health}")
