"""The server with its engine core in its own process (`serve --engine-core process`, issue 28), when the core
fails: a real server process on the tiny model and real HTTP clients. A core that raises mid-step, or is
killed with SIGKILL while idle or mid-step: every open stream ends (finish_reason "abort" and an error
event), /health answers 503, a new request gets 503, nothing hangs, the core process is gone; SIGTERM then
stops the server with exit status 0 and no process of it left. SIGTERM with a live core stops both cleanly."""
import json
import os
import signal
import subprocess
import sys
import threading
import time

import httpx
import pytest
from engine_helpers import live_parents
from serve_helpers import ROOT, child_env, free_port

FLAGS = ["--device", "cpu", "--max-model-len", "256", "--kvcache-block-size", "16", "--max-num-seqs", "16",
         "--engine-core", "process"]
DEADLINE_S = 30              # a guard against a hang, not a timing claim


def descendants(pid: int) -> set[int]:
    ppids, found, frontier = live_parents(), set(), {pid}
    while frontier:
        frontier = {p for p, pp in ppids.items() if pp in frontier} - found
        found |= frontier
    return found


def alive(pid: int) -> bool:
    return pid in live_parents()


def wait_until(predicate, what: str):
    deadline = time.monotonic() + DEADLINE_S
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"not within {DEADLINE_S} s: {what}")
        time.sleep(0.02)


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    from nanovllm_models.tiny import make_tiny_model
    return make_tiny_model(str(tmp_path_factory.mktemp("faults_tiny")), "qwen3")


class CoreServer:
    """`serve --engine-core process` on the tiny model; `core_pid` from /health."""

    def __init__(self, model_dir, log_path, factory_kwargs: dict | None = None):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = open(log_path, "w+")
        cmd = [sys.executable, "-m", "nanovllm_ref", "serve", "--model", model_dir, "--port", str(self.port),
               "--served-model-name", "m", *FLAGS]
        if factory_kwargs is not None:
            cmd += ["--engine-factory", "serve_core_faults:engine", "--engine-factory-kwargs", json.dumps(factory_kwargs)]
        self.proc = subprocess.Popen(cmd, cwd=ROOT, env=child_env(), stdout=self.log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 180
        while True:
            assert self.proc.poll() is None, f"the server exited early:\n{self.text()}"
            try:
                res = httpx.get(self.url + "/health", timeout=2)
                if res.status_code == 200:
                    self.core_pid = res.json()["engine"]["core_pid"]
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise AssertionError(f"the server was not ready:\n{self.text()}")
            time.sleep(0.2)
        assert self.core_pid in descendants(self.proc.pid)

    def text(self) -> str:
        self.log.flush()
        self.log.seek(0)
        return self.log.read()

    def health(self) -> int:
        return httpx.get(self.url + "/health", timeout=5).status_code

    def complete(self, max_tokens=4) -> httpx.Response:
        body = {"model": "m", "prompt": [5, 6, 7], "max_tokens": max_tokens, "ignore_eos": True}
        return httpx.post(self.url + "/v1/completions", json=body, timeout=DEADLINE_S)

    def sigterm_exits_cleanly(self):
        """SIGTERM: exit status 0 and, shortly after, no process the server started still alive."""
        family = descendants(self.proc.pid)
        self.proc.send_signal(signal.SIGTERM)
        assert self.proc.wait(timeout=DEADLINE_S) == 0, self.text()
        wait_until(lambda: not any(alive(p) for p in family), f"the server's processes {family} exit")

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def close(self):
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=10)
        self.log.close()


class Stream(threading.Thread):
    """One streamed completion read on its own thread: `chunks` (data lines before [DONE]), `finish` reasons,
    `errors` (error events), `first` set at the first chunk."""

    def __init__(self, url, max_tokens=200):
        super().__init__(daemon=True)
        self.url, self.max_tokens = url, max_tokens
        self.chunks, self.finish, self.errors, self.done = [], [], [], False
        self.first = threading.Event()
        self.start()

    def run(self):
        body = {"model": "m", "prompt": [5, 6, 7, 8], "max_tokens": self.max_tokens, "ignore_eos": True,
                "stream": True}
        with httpx.stream("POST", self.url + "/v1/completions", json=body, timeout=DEADLINE_S) as res:
            self.status = res.status_code
            for line in res.iter_lines():
                if line == "data: [DONE]":
                    self.done = True
                elif line.startswith("data: "):
                    event = json.loads(line[6:])
                    if "error" in event:
                        self.errors.append(event["error"]["message"])
                    else:
                        self.chunks.append(event)
                        self.finish += [c["finish_reason"] for c in event["choices"] if c["finish_reason"]]
                    self.first.set()
        self.first.set()


def _check_dead_server(server: CoreServer, streams, reason: str):
    for s in streams:
        s.join(DEADLINE_S)
        assert not s.is_alive(), "a stream still hangs after the core died"
        assert s.status == 200 and s.done, (s.status, s.chunks, server.text()[-3000:])
        assert s.finish == ["abort"] and len(s.errors) == 1 and reason in s.errors[0], (s.errors, s.finish)
    wait_until(lambda: server.health() == 503, "/health answers 503")
    res = server.complete()
    assert res.status_code == 503 and reason in res.json()["error"]["message"], res.text
    wait_until(lambda: not alive(server.core_pid), "the core process is gone")
    assert server.proc.poll() is None                # the server itself stays up, answering 503


def test_a_core_that_raises_mid_step_ends_every_open_stream_with_the_error(tiny_dir, tmp_path):
    with CoreServer(tiny_dir, tmp_path / "raise.log", {"fail_with_seqs": 2}) as server:
        first = Stream(server.url, max_tokens=250)           # the fault waits for both to run together
        assert first.first.wait(DEADLINE_S)
        streams = [first, Stream(server.url, max_tokens=250)]
        _check_dead_server(server, streams, "planted fault: the scheduler failed mid-step")
        assert all(s.chunks for s in streams)                 # both ran before the fault
        assert "RuntimeError: planted fault" in server.text()   # the core's traceback is in the log
        server.sigterm_exits_cleanly()


def test_a_core_killed_idle_turns_health_to_503_without_a_request(tiny_dir, tmp_path):
    with CoreServer(tiny_dir, tmp_path / "idle.log") as server:
        assert server.complete().status_code == 200
        os.kill(server.core_pid, signal.SIGKILL)
        _check_dead_server(server, [], "SIGKILL")
        server.sigterm_exits_cleanly()


def test_a_core_killed_mid_step_ends_every_open_stream(tiny_dir, tmp_path):
    with CoreServer(tiny_dir, tmp_path / "busy.log") as server:
        streams = [Stream(server.url, max_tokens=240), Stream(server.url, max_tokens=240)]
        for s in streams:
            assert s.first.wait(DEADLINE_S) and not s.finish
        os.kill(server.core_pid, signal.SIGKILL)
        _check_dead_server(server, streams, "SIGKILL")
        server.sigterm_exits_cleanly()


def test_sigterm_stops_the_server_and_its_live_core_cleanly(tiny_dir, tmp_path):
    with CoreServer(tiny_dir, tmp_path / "term.log") as server:
        assert server.complete(max_tokens=6).json()["choices"][0]["text"] is not None
        stream = Stream(server.url, max_tokens=240)
        assert stream.first.wait(DEADLINE_S)
        core = server.core_pid
        server.sigterm_exits_cleanly()
        stream.join(DEADLINE_S)
        assert stream.done and stream.finish == ["abort"] and not stream.errors
        assert not alive(core)
