"""Start `python -m nanovllm_ref serve` in a subprocess on a free local port, with the fake engine
(serve_fake_engine.py) loaded through the server's --engine-factory test hook, and read what it recorded."""
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

TESTS = Path(__file__).resolve().parent
ROOT = TESTS.parent
FAKE = "serve_fake_engine:FakeEngine"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def make_tokenizer_dir(path) -> str:
    from nanovllm_models.tiny import make_tokenizer
    make_tokenizer(str(path))
    return str(path)


def child_env() -> dict:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(TESTS), str(ROOT), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    env.setdefault("OMP_NUM_THREADS", "1")
    return env


def need_curl() -> str:
    path = shutil.which("curl")
    if path is None:
        pytest.fail("curl is not installed; the server's tests drive it as a real client "
                    "(Debian: apt-get install curl; .ci/run installs it)")
    return path


class ServerProcess:
    """A running server. url: http://127.0.0.1:PORT. record(): the fake engine's events so far."""

    def __init__(self, tmp_path, model_dir: str, fake_kwargs: dict | None = None, args=(), startup_s: float = 120):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.record_path = Path(tmp_path) / f"events_{self.port}.jsonl"
        self.log_path = Path(tmp_path) / f"server_{self.port}.log"
        kwargs = {"record": str(self.record_path), **(fake_kwargs or {})}
        cmd = [sys.executable, "-m", "nanovllm_ref", "serve", "--model", model_dir, "--port", str(self.port),
               "--engine-factory", FAKE, "--engine-factory-kwargs", json.dumps(kwargs), "--log-level", "info",
               *args]
        self._log = open(self.log_path, "w")
        self.proc = subprocess.Popen(cmd, cwd=ROOT, env=child_env(), stdout=self._log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + startup_s
        while True:
            if self.proc.poll() is not None:
                raise AssertionError(f"the server exited with {self.proc.returncode} before it was ready:\n{self.log()}")
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                self.kill()
                raise AssertionError(f"the server was not ready after {startup_s} s:\n{self.log()}")
            time.sleep(0.2)

    def log(self) -> str:
        self._log.flush()
        return self.log_path.read_text()

    def record(self) -> list[dict]:
        if not self.record_path.exists():
            return []
        return [json.loads(line) for line in self.record_path.read_text().splitlines() if line.strip()]

    def events(self, kind: str) -> list[dict]:
        return [e for e in self.record() if e["event"] == kind]

    def wait_for(self, predicate, timeout: float = 20, what: str = "an event"):
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            found = predicate(self.record())
            if found:
                return found
            time.sleep(0.05)
        raise AssertionError(f"timed out after {timeout} s waiting for {what}; events: {self.record()[-10:]}")

    def terminate(self, timeout: float = 30) -> int:
        """SIGTERM, then the exit status."""
        self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            raise AssertionError(f"the server did not exit within {timeout} s of SIGTERM:\n{self.log()}")

    def kill(self):
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=10)
        self._log.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.kill()
