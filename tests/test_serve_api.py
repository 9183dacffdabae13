"""The OpenAI-compatible server against real clients (the `openai` package, curl, httpx), on a server started in a
subprocess with the fake engine (serve_fake_engine.py): answers, streaming, batching, aborts, bad requests."""
import asyncio
import json
import signal
import subprocess

import httpx
import openai
import pytest
from serve_fake_engine import fake_answer
from serve_helpers import ServerProcess, need_curl

from nanovllm_ref import sampling_params
from nanovllm_ref.entrypoints.openai.sampling import MAPPED
from nanovllm_ref.llm import chat_token_ids

MAX_MODEL_LEN, KV_CACHE_TOKENS, EOS_AFTER = 256, 200, 24
PROMPT = "The capital of France is"


@pytest.fixture(scope="module")
def tokenizer(model_dir):
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(model_dir)


@pytest.fixture(scope="module")
def server(tmp_path_factory, model_dir):
    kwargs = {"step_delay": 0.01, "max_num_seqs": 16, "kv_cache_tokens": KV_CACHE_TOKENS, "eos_after": EOS_AFTER}
    with ServerProcess(tmp_path_factory.mktemp("serve_api"), model_dir, kwargs,
                       args=["--served-model-name", "fake", "--max-model-len", str(MAX_MODEL_LEN)]) as srv:
        yield srv


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="none", timeout=30, max_retries=0)


def _streamed_text(stream):
    text, finish, usage = {}, {}, None
    for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        for c in chunk.choices:
            piece = c.delta.content if hasattr(c, "delta") else c.text
            text[c.index] = text.get(c.index, "") + (piece or "")
            if c.finish_reason is not None:
                finish[c.index] = c.finish_reason
    return text, finish, usage


@pytest.mark.parametrize("max_tokens,finish", [(20, "length"), (40, "stop")])
def test_completion_streamed_equals_non_streamed_and_the_engine_answer(client, tokenizer, max_tokens, finish):
    ids = tokenizer.encode(PROMPT)
    want, want_finish, want_ids = fake_answer(tokenizer, ids, max_tokens, EOS_AFTER)
    assert want_finish == finish
    full = client.completions.create(model="fake", prompt=PROMPT, max_tokens=max_tokens, temperature=0)
    assert full.choices[0].text == want
    assert full.choices[0].finish_reason == finish
    assert (full.usage.prompt_tokens, full.usage.completion_tokens) == (len(ids), len(want_ids))
    assert full.usage.total_tokens == len(ids) + len(want_ids)
    stream = client.completions.create(model="fake", prompt=PROMPT, max_tokens=max_tokens, temperature=0,
                                       stream=True, stream_options={"include_usage": True})
    text, finishes, usage = _streamed_text(stream)
    assert text == {0: want} and finishes == {0: finish}
    assert usage.model_dump() == full.usage.model_dump()


def test_chat_streamed_equals_non_streamed_and_renders_the_chat_template(client, server, tokenizer):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name a colour."}]
    ids = chat_token_ids(tokenizer, messages)
    want, _, want_ids = fake_answer(tokenizer, ids, 16, EOS_AFTER)
    full = client.chat.completions.create(model="fake", messages=messages, max_tokens=16, temperature=0)
    assert full.choices[0].message.role == "assistant"
    assert full.choices[0].message.content == want
    assert full.usage.prompt_tokens == len(ids) and full.usage.completion_tokens == 16
    added = [e for e in server.events("add") if e["prompt_token_ids"] == ids]
    assert added, "the chat's token ids never reached the engine"
    chunks = list(client.chat.completions.create(model="fake", messages=messages, max_tokens=16, temperature=0,
                                                 stream=True))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == want
    assert chunks[-1].choices[0].finish_reason == "length"


def test_chat_max_tokens_left_out_asks_for_what_the_context_and_cache_have_left(client, server, tokenizer):
    messages = [{"role": "user", "content": "Go on."}]
    ids = chat_token_ids(tokenizer, messages)
    out = client.chat.completions.create(model="fake", messages=messages, temperature=0,
                                         extra_body={"ignore_eos": True})
    # The cache (200 tokens) is smaller than max_model_len (256): the last sampled token needs no K/V.
    assert out.usage.completion_tokens == min(MAX_MODEL_LEN, KV_CACHE_TOKENS + 1) - len(ids)
    assert out.choices[0].finish_reason == "length"


def test_token_id_prompts_and_a_batch_of_prompts(client, tokenizer):
    one = [5, 17, 42, 99]
    out = client.completions.create(model="fake", prompt=one, max_tokens=8, temperature=0)
    assert out.choices[0].text == fake_answer(tokenizer, one, 8, EOS_AFTER)[0]
    assert out.usage.prompt_tokens == 4
    two = [[5, 6, 7], [8, 9, 10, 11, 12]]
    out = client.completions.create(model="fake", prompt=two, max_tokens=6, temperature=0)
    assert [c.index for c in out.choices] == [0, 1]
    assert [c.text for c in out.choices] == [fake_answer(tokenizer, p, 6, EOS_AFTER)[0] for p in two]
    assert out.usage.prompt_tokens == 8 and out.usage.completion_tokens == 12
    text, finishes, _ = _streamed_text(client.completions.create(model="fake", prompt=two, max_tokens=6,
                                                                 temperature=0, stream=True))
    assert text == {0: out.choices[0].text, 1: out.choices[1].text}
    assert finishes == {0: "length", 1: "length"}


def _curl(server, path, body, *extra):
    cmd = [need_curl(), "-sS", "-N", "--max-time", "30", "-H", "Content-Type: application/json",
           "-d", body if isinstance(body, str) else json.dumps(body), *extra, server.url + path]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=60)


def test_curl_gets_server_sent_events_ending_in_done(server, tokenizer):
    body = {"model": "fake", "prompt": PROMPT, "max_tokens": 12, "temperature": 0}
    full = json.loads(_curl(server, "/v1/completions", body).stdout)
    res = _curl(server, "/v1/completions", {**body, "stream": True})
    assert res.returncode == 0, res.stderr
    events = res.stdout.split("\n\n")
    assert events[-1] == "" and events[-2] == "data: [DONE]"
    chunks = [json.loads(e[len("data: "):]) for e in events[:-2]]
    assert all(e.startswith("data: ") for e in events[:-1])
    pieces = [c["choices"][0]["text"] for c in chunks]
    assert all(pieces[:-1]), "an empty text chunk was sent before the finish chunk"
    assert "".join(pieces) == full["choices"][0]["text"] == fake_answer(tokenizer, tokenizer.encode(PROMPT), 12)[0]
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    assert full["usage"] == {"prompt_tokens": len(tokenizer.encode(PROMPT)), "completion_tokens": 12,
                             "total_tokens": len(tokenizer.encode(PROMPT)) + 12}


def test_curl_malformed_json_gets_an_openai_error_body(server):
    res = _curl(server, "/v1/completions", '{"prompt": "hi", "max_tokens": ', "-w", "\n%{http_code}")
    body, status = res.stdout.rsplit("\n", 1)
    assert status == "400"
    error = json.loads(body)["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert "malformed JSON" in error["message"] and error["type"] == "invalid_request_error"


def _long(n):
    return list(range(5, 5 + n))


BAD = [
    ("/v1/completions", {"prompt": PROMPT, "temperature": -1}, "temperature"),
    ("/v1/completions", {"prompt": PROMPT, "temperature": "0.5"}, "temperature"),
    ("/v1/completions", {"prompt": PROMPT, "top_p": 2}, "top_p"),
    ("/v1/completions", {"prompt": PROMPT, "top_k": -5}, "top_k"),
    ("/v1/completions", {"prompt": PROMPT, "max_tokens": 0}, "max_tokens"),
    ("/v1/completions", {"prompt": PROMPT, "max_tokens": "ten"}, "max_tokens"),
    ("/v1/completions", {"prompt": PROMPT, "max_tokens": True}, "max_tokens"),
    ("/v1/completions", {"prompt": PROMPT, "max_tokens": MAX_MODEL_LEN}, "max_tokens"),        # beyond max_model_len
    ("/v1/completions", {"prompt": _long(10), "max_tokens": 195}, "max_tokens"),               # beyond the KV cache
    ("/v1/completions", {"prompt": _long(MAX_MODEL_LEN + 1)}, "prompt"),
    ("/v1/completions", {"prompt": _long(MAX_MODEL_LEN), "max_tokens": None}, "prompt"),       # no room left
    ("/v1/completions", {"prompt": []}, "prompt"),
    ("/v1/completions", {"prompt": ""}, "prompt"),
    ("/v1/completions", {"prompt": [[5, 6], []]}, "prompt"),
    ("/v1/completions", {"prompt": [5, 10**6]}, "prompt"),
    ("/v1/completions", {"prompt": [5, "x"]}, "prompt"),
    ("/v1/completions", {"max_tokens": 5}, "prompt"),
    ("/v1/completions", {"prompt": PROMPT, "temprature": 0.5}, "temprature"),
    ("/v1/completions", {"prompt": PROMPT, "logprobs": 21}, "logprobs"),         # the engine's MAX_LOGPROBS is 20
    ("/v1/completions", {"prompt": PROMPT, "logprobs": -1}, "logprobs"),
    ("/v1/completions", {"prompt": PROMPT, "echo": True}, "echo"),
    ("/v1/completions", {"prompt": PROMPT, "best_of": 3}, "best_of"),
    ("/v1/completions", {"prompt": PROMPT, "suffix": "!"}, "suffix"),
    ("/v1/completions", {"prompt": PROMPT, "logit_bias": {"5": 10}}, "logit_bias"),
    ("/v1/completions", {"prompt": PROMPT, "stream_options": {"include_usage": True, "x": 1}}, "stream_options"),
    ("/v1/chat/completions", {"messages": []}, "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "user"}]}, "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "robot", "content": "hi"}]}, "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]},
     "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": 0},
     "max_completion_tokens"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 10**6}, "max_tokens"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "top_logprobs": 2}, "top_logprobs"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "logprobs": True, "top_logprobs": 21},
     "top_logprobs"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "tools": [{"type": "function"}]},
     "tools"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}],
                              "response_format": {"type": "json_object"}}, "response_format"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "chat_template_kwargs": {"tokenize": False}},
     "chat_template_kwargs"),
    ("/v1/completions", {"prompt": PROMPT, "stream_options": {"include_usage": True}}, "stream_options"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "stream": False,
                              "stream_options": {"include_usage": False}}, "stream_options"),
]


@pytest.mark.parametrize("path,body,param", BAD, ids=[f"{p.split('/')[-1]}-{param}-{i}" for i, (p, _, param)
                                                      in enumerate(BAD)])
def test_bad_request_gets_400_naming_the_field(server, path, body, param):
    res = httpx.post(server.url + path, json=body, timeout=10)
    assert res.status_code == 400, res.text
    error = res.json()["error"]
    assert error["param"] == param, error
    assert error["type"] == "invalid_request_error" and error["message"]
    assert httpx.get(server.url + "/health", timeout=5).status_code == 200


# A value that fits none of a field's shapes: the 400 lists the shapes and where the closest one failed (it once
# said only "prompt.str: Input should be a valid string", or named a text part as "content.str").
SHAPE_ERRORS = [
    ("/v1/completions", {"prompt": [[5, 6], "abc"]}, "prompt",
     ["prompt must be a str, a list of str, a list of int token ids, or a list of token-id lists",
      "at prompt[1]: Input should be a valid list (got 'abc')"]),
    ("/v1/completions", {"prompt": [[5, 6], [7, -0.5]]}, "prompt", ["at prompt[1][1]: Input should be a valid integer"]),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": [
        {"type": "text", "text": "a"}, {"type": "image_url", "image_url": {"url": "x"}}]}]}, "messages",
     ["messages[0].content must be a str or a list of text parts", "this server serves text only",
      "at messages[0].content[1].type: Input should be 'text' (got 'image_url')"]),
    ("/v1/completions", {"prompt": PROMPT, "stop": ["a", 3]}, "stop", ["stop must be a str or a list of str",
                                                                       "at stop[1]"]),
    # the first bad element, not the last
    ("/v1/completions", {"prompt": [1, 2, "a", 3, "b"]}, "prompt", ["at prompt[2]"]),
    # not unions: two fields of one message, a dict's keys; the old wording, with the real path
    ("/v1/chat/completions", {"messages": [{"role": "bad", "content": "x", "name": 5}]}, "messages",
     ["messages.0.role: Input should be"]),
    ("/v1/completions", {"prompt": PROMPT, "stream_options": {"include_usage": True, "a": 1, "b": 2}},
     "stream_options", ["unknown field `stream_options.a`"]),
    # finite in JSON, not in the sampler's fp32 (SamplingParams' own check)
    ("/v1/completions", {"prompt": PROMPT, "temperature": 1e300}, "temperature", ["in fp32's range"]),
]


@pytest.mark.parametrize("path,body,param,parts", SHAPE_ERRORS, ids=[f"{param}-{i}" for i, (_, _, param, _)
                                                                      in enumerate(SHAPE_ERRORS)])
def test_a_value_of_no_accepted_shape_gets_a_400_that_lists_the_shapes(server, path, body, param, parts):
    res = httpx.post(server.url + path, json={"max_tokens": 2, **body}, timeout=10)
    assert res.status_code == 400, res.text
    error = res.json()["error"]
    assert error["param"] == param and all(part in error["message"] for part in parts), error


def test_stream_null_is_not_streamed(server):
    res = httpx.post(server.url + "/v1/completions", json={"prompt": PROMPT, "max_tokens": 3, "stream": None},
                     timeout=10)
    assert res.status_code == 200 and res.headers["content-type"] == "application/json", res.text
    assert res.json()["usage"]["completion_tokens"] == 3


def test_more_prompts_than_the_queue_holds_is_a_400_naming_the_limit(server):
    res = httpx.post(server.url + "/v1/completions", json={"prompt": [[5, 6]] * 1025, "max_tokens": 2}, timeout=10)
    error = res.json()["error"]
    assert res.status_code == 400 and error["param"] == "prompt", res.text
    assert "1025 prompts" in error["message"] and "at most 1024" in error["message"] and "retry" not in error["message"]


# Text no tokenizer can encode: JSON's \ud800 escapes give a lone surrogate (json.dumps writes them as escapes).
BAD_TEXT = [
    ("/v1/completions", {"prompt": "\ud800", "max_tokens": 2}, "prompt", "prompt is not valid text: character 0"),
    ("/v1/completions", {"prompt": ["fine", "a\ud800b"], "max_tokens": 2}, "prompt", "prompt[1] is not valid text"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "a\udfffb"}], "max_tokens": 2}, "messages",
     "messages[0].content is not valid text: character 1"),
    ("/v1/chat/completions", {"messages": [{"role": "system", "content": "ok"}, {"role": "user", "content": [
        {"type": "text", "text": "x"}, {"type": "text", "text": "\udc80"}]}]}, "messages",
     "messages[1].content is not valid text: character 2"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}],
                              "chat_template_kwargs": {"persona": "\udfff"}}, "chat_template_kwargs",
     "chat_template_kwargs.persona is not valid text"),
    ("/v1/completions", {"model": "\ud800", "prompt": PROMPT}, "model", "does not exist"),   # quoted in a 404
]


@pytest.mark.parametrize("path,body,param,message", BAD_TEXT, ids=[f"{p.split('/')[-1]}-{param}-{i}" for i, (
    p, _, param, _) in enumerate(BAD_TEXT)])
def test_text_the_tokenizer_cannot_encode_gets_a_4xx_naming_the_field(server, path, body, param, message):
    with httpx.Client(base_url=server.url, timeout=10) as client:
        res = client.post(path, content=json.dumps(body), headers={"Content-Type": "application/json"})
        assert res.status_code == (404 if param == "model" else 400), res.text
        error = res.json()["error"]
        assert error["param"] == param and message in error["message"], error
        assert "lone surrogate" in error["message"] or param == "model"
        assert res.headers.get("connection") != "close"           # a 500 would close the keep-alive connection
        assert client.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 2}).status_code == 200


def test_a_reserved_chat_template_kwarg_is_refused_with_advice_for_http_clients(server):
    res = httpx.post(server.url + "/v1/chat/completions", timeout=10, json={
        "messages": [{"role": "user", "content": "hi"}], "chat_template_kwargs": {"add_generation_prompt": False}})
    error = res.json()["error"]
    assert res.status_code == 400 and error["param"] == "chat_template_kwargs", error
    assert "add_generation_prompt is a field of the request body" in error["message"]
    assert "chat()" not in error["message"]


ROUTE_ERRORS = [
    ("GET", "/v1/completions", None, 405, "GET is not allowed on /v1/completions; use POST"),
    ("GET", "/nope", None, 404, "no route GET /nope"),
    ("POST", "/v1/completions", b'{"prompt": "\xff\xfe", "max_tokens": 2}', 400, "could not be parsed as JSON"),
    ("POST", "/v1/completions", b"[" * 100_000 + b"]" * 100_000, 400, "could not be parsed as JSON"),
]


@pytest.mark.parametrize("method,path,content,status,message", ROUTE_ERRORS,
                         ids=["405", "404", "invalid-utf8", "deep-json"])
def test_routing_and_parsing_errors_have_the_openai_error_shape(server, method, path, content, status, message):
    res = httpx.request(method, server.url + path, content=content, timeout=10,
                        headers={"Content-Type": "application/json"} if content else None)
    assert res.status_code == status, res.text
    body = res.json()
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}, body
    assert message in body["error"]["message"], body
    assert body["error"]["type"] == ("not_found_error" if status == 404 else "invalid_request_error")


def test_a_body_over_the_limit_gets_413_declared_or_chunked(server):
    from nanovllm_ref.entrypoints.cli_args import DEFAULT_MAX_REQUEST_BYTES
    over = b" " * (DEFAULT_MAX_REQUEST_BYTES + 1)
    for content in (over, iter([over[:2**20]] * 9)):          # Content-Length, then chunked (no length)
        res = httpx.post(server.url + "/v1/completions", content=content, timeout=30,
                         headers={"Content-Type": "application/json"})
        assert res.status_code == 413, res.text[:200]
        error = res.json()["error"]
        assert f"at most {DEFAULT_MAX_REQUEST_BYTES} bytes (--max-request-bytes)" in error["message"], error
    chunked = iter([json.dumps({"prompt": [5, 6], "max_tokens": 3}).encode()])   # a chunked body within the limit
    res = httpx.post(server.url + "/v1/completions", content=chunked, timeout=10,
                     headers={"Content-Type": "application/json"})
    assert res.status_code == 200 and res.json()["usage"]["completion_tokens"] == 3, res.text


def test_a_long_prompt_is_tokenized_off_the_event_loop(server):
    """While a 2.4 MB prompt is tokenized (seconds on a CPU), /health keeps answering: the longest wait between
    two health answers is a small part of the long request's time (on the event loop it was nearly all of it)."""
    import threading
    import time
    done = {}

    def long_request():
        start = time.monotonic()
        res = httpx.post(server.url + "/v1/completions", json={"prompt": "hello world " * 200_000}, timeout=120)
        done.update(status=res.status_code, param=res.json()["error"]["param"], seconds=time.monotonic() - start)

    thread = threading.Thread(target=long_request)
    thread.start()
    answers = [time.monotonic()]
    while thread.is_alive():
        assert httpx.get(server.url + "/health", timeout=60).status_code == 200
        answers.append(time.monotonic())
    thread.join()
    assert (done["status"], done["param"]) == (400, "prompt")        # far longer than max_model_len
    longest_wait = max(b - a for a, b in zip(answers, answers[1:]))
    assert longest_wait < done["seconds"] / 3, (longest_wait, done)


ASKS = {"n": 2, "stop": ["xyz"], "stop_token_ids": [5], "presence_penalty": 0.5, "frequency_penalty": 0.5,
        "repetition_penalty": 1.2, "min_p": 0.1, "min_tokens": 2, "include_stop_str_in_output": True,
        "skip_special_tokens": False, "seed": 3, "top_k": 5, "top_p": 0.9, "temperature": 0.7, "ignore_eos": True}
NEUTRAL = {"n": 1, "stop": [], "stop_token_ids": [], "presence_penalty": 0, "frequency_penalty": 0.0,
           "repetition_penalty": 1, "min_p": 0, "min_tokens": 0, "include_stop_str_in_output": False,
           "skip_special_tokens": True, "seed": None, "logprobs": None, "echo": False, "best_of": 1, "user": "me"}


def test_every_mapped_field_is_honoured_or_refused_by_name(server):
    """A field the engine lists as PENDING (read now: another change may shrink it) is refused by the engine's
    own check, naming the field; every other one runs."""
    assert set(ASKS) == set(MAPPED)
    pending = set(sampling_params.PENDING)
    for name, value in ASKS.items():
        res = httpx.post(server.url + "/v1/completions", json={"prompt": PROMPT, "max_tokens": 4, name: value},
                         timeout=10)
        if MAPPED[name][0] in pending:
            assert res.status_code == 400 and res.json()["error"]["param"] == name, (name, res.text)
            assert "not implemented yet" in res.json()["error"]["message"]
        else:
            assert res.status_code == 200, (name, res.text)


def test_neutral_values_of_unsupported_fields_are_accepted(server):
    res = httpx.post(server.url + "/v1/completions", json={"prompt": PROMPT, "max_tokens": 4, **NEUTRAL}, timeout=10)
    assert res.status_code == 200, res.text
    assert res.json()["usage"]["completion_tokens"] == 4


def test_openai_client_sees_bad_request_with_the_param(client):
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model="fake", prompt=PROMPT, max_tokens=4, temperature=-0.5)
    assert info.value.param == "temperature" and info.value.status_code == 400


def test_another_models_name_gets_404(client):
    with pytest.raises(openai.NotFoundError) as info:
        client.completions.create(model="gpt-4", prompt=PROMPT, max_tokens=4)
    assert info.value.param == "model"


def test_a_request_the_engine_refuses_gets_400_and_the_server_goes_on(server, client):
    res = httpx.post(server.url + "/v1/completions", json={"prompt": [0, 0, 5, 6], "max_tokens": 4}, timeout=10)
    assert res.status_code == 400
    assert "fake engine refuses" in res.json()["error"]["message"]
    assert client.completions.create(model="fake", prompt=[5, 6], max_tokens=3).usage.completion_tokens == 3


def test_models_and_health(server, client):
    assert [(m.id, m.object) for m in client.models.list().data] == [("fake", "model")]
    assert httpx.get(server.url + "/v1/models", timeout=5).json()["data"][0]["max_model_len"] == MAX_MODEL_LEN
    health = httpx.get(server.url + "/health", timeout=5).json()
    assert health["status"] == "ok"
    loop = health["loop"]                     # the loop's own host time (the overhead benchmark reads it)
    assert loop["steps"] > 0 and 0 < loop["step_s"] <= loop["tick_s"] and loop["engine_cpu_s"] > 0
    assert loop["busy_s"] > 0 and loop["deliver_s"] > 0 and loop["process_cpu_s"] > loop["engine_cpu_s"]


def test_sixteen_concurrent_streaming_clients_all_finish_in_shared_batches(server, tokenizer):
    prompts = [f"Question {i}: what is {i} plus {i}?" for i in range(16)]
    steps_before = len(server.events("step"))

    async def one(client, prompt):
        stream = await client.completions.create(model="fake", prompt=prompt, max_tokens=20, temperature=0,
                                                 stream=True)
        text, finish = "", None
        async for chunk in stream:
            text += chunk.choices[0].text
            finish = chunk.choices[0].finish_reason or finish
        return text, finish

    async def main():
        client = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="none", timeout=60, max_retries=0)
        return await asyncio.wait_for(asyncio.gather(*(one(client, p) for p in prompts)), 120)

    results = asyncio.run(main())
    for prompt, (text, finish) in zip(prompts, results):
        assert (text, finish) == (fake_answer(tokenizer, tokenizer.encode(prompt), 20, EOS_AFTER)[0], "length")
    batches = [len(e["batch"]) for e in server.events("step")[steps_before:]]
    assert max(batches) >= 8, f"the 16 requests never shared a step (batch sizes {sorted(set(batches))})"


def test_curl_killed_mid_stream_has_its_request_aborted(server, client):
    body = json.dumps({"model": "fake", "prompt": [7, 8, 9, 123], "max_tokens": 190, "ignore_eos": True,
                       "stream": True})
    proc = subprocess.Popen([need_curl(), "-sS", "-N", "-H", "Content-Type: application/json", "-d", body,
                             server.url + "/v1/completions"], stdout=subprocess.PIPE, text=True)
    try:
        first = proc.stdout.readline()
        assert first.startswith("data: "), first
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=10)
    add = server.wait_for(lambda ev: [e for e in ev if e["event"] == "add" and e["prompt_token_ids"] == [7, 8, 9, 123]],
                          what="the request's add")[-1]
    rid = add["request_id"]
    server.wait_for(lambda ev: [e for e in ev if e["event"] == "abort" and e["request_id"] == rid and e["known"]],
                    what=f"abort_request({rid!r})")
    steps = [e for e in server.events("step") if rid in e["batch"]]
    assert len(steps) < 190, "the request ran to the end although its client was gone"
    assert client.completions.create(model="fake", prompt=[5, 6], max_tokens=3).usage.completion_tokens == 3


def test_non_streaming_client_that_gives_up_has_its_request_aborted(server):
    prompt = [11, 12, 13, 14, 15]
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(server.url + "/v1/completions", json={"prompt": prompt, "max_tokens": 190, "ignore_eos": True},
                   timeout=httpx.Timeout(10, read=0.3))
    rid = server.wait_for(lambda ev: [e for e in ev if e["event"] == "add" and e["prompt_token_ids"] == prompt],
                          what="the request's add")[-1]["request_id"]
    server.wait_for(lambda ev: [e for e in ev if e["event"] == "abort" and e["request_id"] == rid and e["known"]],
                    what=f"abort_request({rid!r})")


# -- logprobs, through the openai client ---------------------------------------------------------------------------
def _engine_dicts(tokenizer, ids, k):
    """The logprob dicts the fake engine gives the completion `ids` (serve_fake_engine.fake_logprobs)."""
    from serve_fake_engine import fake_logprobs, word_ids
    words = word_ids(tokenizer)
    return [fake_logprobs(t, pos, k, words, lambda i: tokenizer.decode([i])) for pos, t in enumerate(ids)]


def _joined_completion_logprobs(chunks):
    out = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    for c in chunks:
        for choice in c.choices:
            if choice.logprobs is not None:
                for key in out:
                    out[key] += getattr(choice.logprobs, key)
    return out


def test_completion_logprobs_streamed_and_not_are_the_engines(client, tokenizer):
    prompt, k = "Logprobs, please", 2
    ids = tokenizer.encode(prompt)
    _, _, want_ids = fake_answer(tokenizer, ids, 30, EOS_AFTER)           # eos at 24: the stop token has logprobs too
    dicts = _engine_dicts(tokenizer, want_ids, k)
    tokens = [tokenizer.decode([t]) for t in want_ids]
    want = {"tokens": tokens, "token_logprobs": [d[t].logprob for t, d in zip(want_ids, dicts)],
            "top_logprobs": [{lp.decoded_token: lp.logprob for lp in d.values()} for d in dicts],
            "text_offset": [sum(map(len, tokens[:i])) for i in range(len(tokens))]}
    full = client.completions.create(model="fake", prompt=prompt, max_tokens=30, temperature=0, logprobs=k)
    assert full.choices[0].logprobs.model_dump() == want
    assert [len(top) for top in want["top_logprobs"]] == [2, 3] * 12 + [2]  # the token among the top 2, or not
    stream = client.completions.create(model="fake", prompt=prompt, max_tokens=30, temperature=0, logprobs=k,
                                       stream=True)
    assert _joined_completion_logprobs(list(stream)) == want


def test_chat_logprobs_streamed_and_not_are_the_engines(client, tokenizer):
    messages = [{"role": "user", "content": "Logprobs in a chat"}]
    ids = chat_token_ids(tokenizer, messages)
    _, _, want_ids = fake_answer(tokenizer, ids, 6, EOS_AFTER)
    dicts = _engine_dicts(tokenizer, want_ids, 3)
    want = [(tokenizer.decode([t]), d[t].logprob, [(lp.decoded_token, lp.logprob) for lp in
                                                    sorted(d.values(), key=lambda lp: lp.rank) if lp.rank <= 3])
            for t, d in zip(want_ids, dicts)]

    def seen(content):
        return [(c.token, c.logprob, [(t.token, t.logprob) for t in c.top_logprobs]) for c in content]
    full = client.chat.completions.create(model="fake", messages=messages, max_tokens=6, logprobs=True, top_logprobs=3)
    assert seen(full.choices[0].logprobs.content) == want
    assert all(c.bytes == list(c.token.encode()) for c in full.choices[0].logprobs.content)
    chunks = client.chat.completions.create(model="fake", messages=messages, max_tokens=6, logprobs=True,
                                            top_logprobs=3, stream=True)
    assert [x for c in chunks for ch in c.choices if ch.logprobs for x in seen(ch.logprobs.content)] == want
    plain = client.chat.completions.create(model="fake", messages=messages, max_tokens=6)
    assert plain.choices[0].logprobs is None


def test_logprobs_of_n_samples_are_each_samples_own(client, tokenizer):
    out = client.completions.create(model="fake", prompt=[5, 6, 7], max_tokens=4, n=2, logprobs=0)
    assert [len(c.logprobs.tokens) for c in out.choices] == [4, 4]
    assert all(len(top) == 1 for c in out.choices for top in c.logprobs.top_logprobs)
    assert ["".join(c.logprobs.tokens) for c in out.choices] == [c.text for c in out.choices]
    assert out.choices[0].text != out.choices[1].text
