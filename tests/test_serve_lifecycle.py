"""The server's back-pressure and lifecycle, on real server processes with the fake engine: a full admission
queue answers 503 at once, SIGTERM aborts what is open and exits 0 (its own server), start-up errors exit by name
(argument and factory errors through the command's main() in this process, a taken port in a real process)."""
import json
import socket
import subprocess
import sys

import httpx
import pytest
from serve_helpers import FAKE, ROOT, ServerProcess, child_env


def _open_stream(client: httpx.Client, prompt, max_tokens=190):
    body = {"prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True, "stream": True}
    response = client.send(client.build_request("POST", "/v1/completions", json=body), stream=True)
    assert response.status_code == 200, response.read()
    lines = response.iter_lines()
    first = next(lines)
    assert first.startswith("data: "), first
    return response, lines


ODD_NAME = 'm 987654321 "@@text@@" @@text@@'      # the marks the stream's chunk template was once cut at


@pytest.fixture(scope="module")
def queue_server(tmp_path_factory, model_dir):
    """One server for the two tests that only send requests: two places in the admission queue, and a served
    model name holding the chunk marks (the admission test leaves out `model`, which any name accepts)."""
    with ServerProcess(tmp_path_factory.mktemp("lifecycle"), model_dir, {"step_delay": 0.02},
                       args=["--max-queued-requests", "2", "--served-model-name", ODD_NAME]) as srv:
        yield srv


def test_full_admission_queue_answers_503_at_once_and_recovers(queue_server):
    srv = queue_server
    with httpx.Client(base_url=srv.url, timeout=httpx.Timeout(20)) as client:
        held = [_open_stream(client, [5, 6, 7 + i]) for i in range(2)]
        res = httpx.post(srv.url + "/v1/completions", json={"prompt": [5, 6], "max_tokens": 2}, timeout=10)
        # answered at once: both held requests were still in the engine's running batch when the 503 came back
        # (a server that queued the client until a place freed would have answered after one of them finished)
        held_ids = {e["request_id"] for e in srv.events("add") if e["prompt_token_ids"] in ([5, 6, 7], [5, 6, 8])}
        assert len(held_ids) == 2 and held_ids <= set(srv.events("step")[-1]["batch"]), \
            "the overloaded server made the client wait"
        assert res.status_code == 503, res.text
        assert res.headers.get("retry-after") == "1"
        error = res.json()["error"]
        assert error["type"] == "service_unavailable" and "max-queued-requests" in error["message"]
        # A batch of two prompts needs two places: refused whole, and nothing of it reached the engine.
        res = httpx.post(srv.url + "/v1/completions", json={"prompt": [[5, 9], [5, 10]], "max_tokens": 2}, timeout=10)
        assert res.status_code == 503
        # Three prompts can never fit two places: a 400 naming the prompt and the limit, not "retry later".
        res = httpx.post(srv.url + "/v1/completions", json={"prompt": [[5, 9], [5, 10], [5, 11]], "max_tokens": 2},
                         timeout=10)
        assert res.status_code == 400 and res.json()["error"]["param"] == "prompt", res.text
        assert "at most 2 prompts per request" in res.json()["error"]["message"]
        assert not [e for e in srv.events("add") if e["prompt_token_ids"] in ([5, 6], [5, 9], [5, 10])]
        assert httpx.get(srv.url + "/health", timeout=5).json()["open_requests"] == 2
        for response, _ in held:
            response.close()
        srv.wait_for(lambda ev: len([e for e in ev if e["event"] == "abort"]) == 2, what="the two aborts")
        res = httpx.post(srv.url + "/v1/completions", json={"prompt": [5, 6], "max_tokens": 2}, timeout=10)
        assert res.status_code == 200 and res.json()["usage"]["completion_tokens"] == 2


def test_sigterm_aborts_open_requests_calls_exit_and_exits_0(fake_server):
    srv = fake_server({"step_delay": 0.02})
    with httpx.Client(base_url=srv.url, timeout=httpx.Timeout(20)) as client:
        response, lines = _open_stream(client, [21, 22, 23])
        status = srv.terminate(timeout=30)
        rest = [line for line in lines if line]
        response.close()
    assert status == 0, srv.log()
    assert rest[-1] == "data: [DONE]"
    finishes = [json.loads(line[6:])["choices"][0]["finish_reason"] for line in rest if line.startswith("data: {")]
    # aborted, not waited for: a stream left to finish would end with 'length' (190 tokens, ignore_eos)
    assert finishes[-1] == "abort", "shutdown waited for the open stream instead of aborting it"
    events = srv.record()
    rid = [e for e in events if e["event"] == "add"][-1]["request_id"]
    kinds = [e["event"] for e in events]
    assert {"event": "abort", "request_id": rid, "known": True} in events
    assert kinds[-1] == "exit" and events[-1]["unfinished"] == []
    assert "Application shutdown complete" in srv.log()


def test_sigterm_answers_a_request_still_being_tokenized_503_and_exits_promptly(fake_server):
    """A request on the tokenizing thread at SIGTERM is not yet the engine loop's: it once went on being
    encoded, uvicorn's graceful timeout (10 s) cancelled it with a plain-text 500, and the exit then waited for
    the encoding to end (reported for a 7.5 MB prompt). Now: OpenAI's 503 body at once, and the process exits
    without waiting for the encoding (here 120 s; the 30 s bound is a liveness bound, not a timing)."""
    import threading
    srv = fake_server({"slow_encode_s": 120})
    got = []
    sender = threading.Thread(target=lambda: got.append(httpx.post(
        srv.url + "/v1/completions", json={"prompt": "SLOW text", "max_tokens": 2}, timeout=60)), daemon=True)
    sender.start()
    srv.wait_for(lambda ev: any(e["event"] == "encode_start" for e in ev), what="the prompt's encoding")
    status = srv.terminate(timeout=30)
    sender.join(30)
    assert status == 0, srv.log()
    assert got and got[0].status_code == 503, got and got[0].text
    error = got[0].json()["error"]
    assert error["type"] == "service_unavailable" and "shutting down" in error["message"]
    assert srv.events("add") == [], "the request reached the engine after shutdown began"


def _serve(args, timeout=120):
    cmd = [sys.executable, "-m", "nanovllm_ref", "serve", *args]
    return subprocess.run(cmd, cwd=ROOT, env=child_env(), capture_output=True, text=True, timeout=timeout)


class _Exit:
    def __init__(self, returncode, stderr):
        self.returncode, self.stderr = returncode, stderr


@pytest.fixture
def serve_main(capsys):
    """`python -m nanovllm_ref serve ARGS` run in this process: the command line's own main(), whose return value
    `python -m` exits with (an argparse error exits 2 from inside it). For refusals that happen before anything
    serves: each saves a process start (~2.5 s of CPU importing torch); test_port_in_use_exits_1_before_the_engine_loads
    keeps a real process. The tests that use it carry a 60 s timeout: a regression that let the command serve
    would block in this process, and fails there instead."""
    from nanovllm_ref.__main__ import main

    def run(args):
        capsys.readouterr()
        try:
            code = main(["serve", *args])
        except SystemExit as exc:
            code = exc.code
        return _Exit(code, capsys.readouterr().err)
    return run


@pytest.mark.timeout(60)
def test_bad_engine_factory_fails_by_name_before_serving(model_dir, serve_main):
    res = serve_main(["--model", model_dir, "--engine-factory", "no_such_module:make"])
    assert res.returncode == 2
    assert "--engine-factory" in res.stderr and "no_such_module" in res.stderr
    res = serve_main(["--model", model_dir, "--engine-factory", FAKE, "--engine-factory-kwargs", "[1]"])
    assert res.returncode == 2 and "must be a JSON object" in res.stderr
    res = serve_main(["--model", model_dir, "--engine-factory", FAKE, "--max-queued-requests", "0"])
    assert res.returncode == 2 and "max_queued_requests must be an int >= 1" in res.stderr


def test_port_in_use_exits_1_before_the_engine_loads(tmp_path, model_dir):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        res = _serve(["--model", model_dir, "--engine-factory", FAKE, "--port", str(port),
                      "--engine-factory-kwargs", json.dumps({"record": str(tmp_path / "ev.jsonl")})])
    assert res.returncode == 1, res.stderr
    assert f"error: cannot listen on 127.0.0.1:{port}" in res.stderr and "address already in use" in res.stderr.lower()
    assert "Traceback" not in res.stderr
    assert not (tmp_path / "ev.jsonl").exists(), "the engine was built although the port was taken"


@pytest.mark.timeout(60)
@pytest.mark.parametrize("port", ["99999", "0", "-1", "http"])
def test_a_port_outside_the_tcp_range_is_an_argument_error_before_loading(tmp_path, model_dir, serve_main, port):
    res = serve_main(["--model", model_dir, "--engine-factory", FAKE, "--port", port,
                      "--engine-factory-kwargs", json.dumps({"record": str(tmp_path / "ev.jsonl")})])
    assert res.returncode == 2 and "Traceback" not in res.stderr, res.stderr
    assert "argument --port: a TCP port must be" in res.stderr
    assert not (tmp_path / "ev.jsonl").exists()


def test_a_served_model_name_holding_the_chunk_marks_streams_intact(queue_server):
    srv = queue_server       # its prompt is one that the admission test's filters do not match, in any order
    for path, body, text_of in (
            ("/v1/completions", {"prompt": [7, 8, 9]}, lambda c: c["text"]),
            ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]},
             lambda c: c["message"]["content"] if "message" in c else c["delta"].get("content") or "")):
        body = {**body, "model": ODD_NAME, "max_tokens": 6}
        full = httpx.post(srv.url + path, json=body, timeout=10).json()
        with httpx.stream("POST", srv.url + path, json={**body, "stream": True}, timeout=10) as res:
            lines = [line for line in res.iter_lines() if line]
        assert lines[-1] == "data: [DONE]"
        chunks = [json.loads(line[6:]) for line in lines[:-1]]
        assert {c["model"] for c in chunks} == {ODD_NAME} == {full["model"]}
        assert len({c["id"] for c in chunks}) == 1 and all(c["choices"][0]["index"] == 0 for c in chunks)
        streamed = "".join(text_of(c["choices"][0]) for c in chunks)
        assert streamed == text_of(full["choices"][0]) and len(streamed.split()) == 6
