"""Browser clients: CORS (FastAPI's CORSMiddleware with vLLM's flags --allowed-origins, --allowed-methods,
--allowed-headers, --allow-credentials). A page on another origin first sends a preflight (OPTIONS with Origin
and Access-Control-Request-Method); the browser reads an answer only when it carries
Access-Control-Allow-Origin. Driven here by real preflight and cross-origin requests to a real server (the fake
engine); tests/browser_lab.py does it from Chromium."""
import json

import httpx
import openai
import pytest
from serve_helpers import ServerProcess

PAGE = "http://page.example:5173"
CHAT = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}


@pytest.fixture(scope="module")
def open_server(tmp_path_factory, model_dir):
    """vLLM's defaults: any origin, method and header; no credentials."""
    with ServerProcess(tmp_path_factory.mktemp("cors_open"), model_dir, args=["--max-request-bytes", "1000"]) as srv:
        yield srv


@pytest.fixture(scope="module")
def strict_server(tmp_path_factory, model_dir):
    args = ["--allowed-origins", json.dumps([PAGE]), "--allowed-methods", '["POST"]',
            "--allowed-headers", '["content-type"]', "--allow-credentials"]
    with ServerProcess(tmp_path_factory.mktemp("cors_strict"), model_dir, args=args) as srv:
        yield srv


def preflight(server, path="/v1/chat/completions", origin=PAGE, method="POST", headers="authorization, content-type"):
    return httpx.options(server.url + path, timeout=10, headers={
        "Origin": origin, "Access-Control-Request-Method": method, "Access-Control-Request-Headers": headers})


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions", "/v1/models"])
def test_a_preflight_from_any_origin_is_allowed_by_default(open_server, path):
    res = preflight(open_server, path)
    assert res.status_code == 200, res.text
    assert res.headers["access-control-allow-origin"] == "*"
    assert "POST" in res.headers["access-control-allow-methods"]
    assert set(res.headers["access-control-allow-headers"].lower().replace(" ", "").split(",")) >= {
        "authorization", "content-type"}
    assert "access-control-allow-credentials" not in res.headers


def test_every_answer_to_another_origin_carries_the_allow_origin_header(open_server):
    """Answers, streams and errors alike: a page can only read what carries Access-Control-Allow-Origin."""
    origin = {"Origin": PAGE}
    url = open_server.url
    ok = httpx.post(url + "/v1/chat/completions", json=CHAT, headers=origin, timeout=30)
    assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 3
    with httpx.stream("POST", url + "/v1/completions", json={"prompt": "hi", "max_tokens": 3, "stream": True},
                      headers=origin, timeout=30) as stream:
        assert stream.headers["access-control-allow-origin"] == "*"
        assert "data: [DONE]" in list(stream.iter_lines())
    errors = [httpx.post(url + "/v1/completions", json={"prompt": "hi", "temperature": -1}, headers=origin, timeout=10),
              httpx.get(url + "/nope", headers=origin, timeout=10),
              httpx.post(url + "/v1/completions", content=b" " * 2000, headers=origin, timeout=10)]
    assert [e.status_code for e in errors] == [400, 404, 413]
    for res in (ok, *errors):
        assert res.headers["access-control-allow-origin"] == "*", (res.status_code, dict(res.headers))


def test_clients_that_send_no_origin_are_unchanged(open_server):
    client = openai.OpenAI(base_url=open_server.url + "/v1", api_key="none", timeout=30, max_retries=0)
    out = client.chat.completions.create(model=client.models.list().data[0].id, **CHAT)
    assert out.usage.completion_tokens == 3
    res = httpx.post(open_server.url + "/v1/chat/completions", json=CHAT, timeout=30)
    assert "access-control-allow-origin" not in res.headers


def test_the_flags_restrict_origins_methods_and_headers_and_allow_credentials(strict_server):
    res = preflight(strict_server, headers="content-type")
    assert res.status_code == 200, res.text
    assert res.headers["access-control-allow-origin"] == PAGE          # named, never "*" with credentials
    assert res.headers["access-control-allow-credentials"] == "true"
    assert "origin" in res.headers.get("vary", "").lower()
    other_origin = preflight(strict_server, origin="http://other.example", headers="content-type")
    assert other_origin.status_code == 400 and "access-control-allow-origin" not in other_origin.headers
    for refused, what in ((other_origin, "origin"), (preflight(strict_server, method="DELETE", headers="content-type"),
                                                     "method"),
                          (preflight(strict_server, headers="content-type, x-secret"), "headers")):
        assert refused.status_code == 400 and f"Disallowed CORS {what}" in refused.text, refused.text
    allowed = httpx.post(strict_server.url + "/v1/chat/completions", json=CHAT, headers={"Origin": PAGE}, timeout=30)
    assert allowed.headers["access-control-allow-origin"] == PAGE
    assert allowed.headers["access-control-allow-credentials"] == "true"
    other = httpx.post(strict_server.url + "/v1/chat/completions", json=CHAT, headers={"Origin": "http://other.example"},
                       timeout=30)
    assert other.status_code == 200 and "access-control-allow-origin" not in other.headers   # the browser hides it


@pytest.mark.parametrize("flag,value", [("--allowed-origins", "*"), ("--allowed-methods", '"POST"'),
                                        ("--allowed-headers", "[1]"), ("--allowed-origins", "[not json")])
def test_a_flag_that_is_not_a_json_list_of_str_is_refused_by_name(flag, value, capsys):
    """Through the command line's main() in this process (what `python -m nanovllm_ref` exits with; argparse
    exits 2 from inside it): no process start per flag."""
    from nanovllm_ref.__main__ import main
    with pytest.raises(SystemExit) as exit_:
        main(["serve", "--model", "unused", flag, value])
    stderr = capsys.readouterr().err
    assert exit_.value.code == 2
    assert f"argument {flag}: {flag} must be a JSON list of str" in stderr, stderr


def test_a_server_fault_is_a_500_a_page_can_read(model_dir):
    """Starlette answers an unhandled exception from outside every middleware, without CORS headers; the
    server answers it inside them."""
    from fastapi.testclient import TestClient
    from serve_fake_engine import FakeEngine

    from nanovllm_ref.entrypoints.openai.api_server import build_app
    from nanovllm_ref.entrypoints.openai.engine_loop import EngineLoop

    class Broken(FakeEngine):
        def check_request(self, prompt_token_ids, sampling_params, where="prompt"):
            raise RuntimeError("a bug, not the client's fault")

    with TestClient(build_app(EngineLoop(Broken(model_dir)), "m"), raise_server_exceptions=False) as client:
        res = client.post("/v1/completions", json={"prompt": [5], "max_tokens": 2}, headers={"Origin": PAGE})
    assert res.status_code == 500 and res.json()["error"]["type"] == "internal_server_error"
    assert res.headers["access-control-allow-origin"] == "*"
