"""`python -m nanovllm_ref chat` in a subprocess with the fake engine: answers stream, the history is kept,
Ctrl-C (SIGINT) stops an answer between steps and aborts its request, /reset starts over, Ctrl-D quits with 0."""
import json
import signal
import subprocess
import sys
import threading
import time

from serve_fake_engine import fake_answer
from serve_helpers import FAKE, ROOT, child_env

from nanovllm_ref.llm import chat_token_ids

MAX_TOKENS = 60


class _Reader:
    """Collects a pipe's output on a thread, so the test can wait for text without blocking."""

    def __init__(self, pipe):
        self.text = ""
        self._lock = threading.Lock()
        threading.Thread(target=self._pump, args=(pipe,), daemon=True).start()

    def _pump(self, pipe):
        for chunk in iter(lambda: pipe.read(1), ""):
            with self._lock:
                self.text += chunk

    def wait_for(self, predicate, timeout=30, what="output"):
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            with self._lock:
                if predicate(self.text):
                    return self.text
            time.sleep(0.02)
        raise AssertionError(f"timed out waiting for {what}; output so far: {self.text!r}")


def test_chat_shell_streams_keeps_history_stops_on_ctrl_c_and_quits_on_ctrl_d(tmp_path, model_dir):
    from transformers import AutoTokenizer
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    record = tmp_path / "events.jsonl"
    kwargs = {"step_delay": 0.03, "eos_after": 1000, "record": str(record)}
    cmd = [sys.executable, "-u", "-m", "nanovllm_ref", "chat", "--model", model_dir, "--max-tokens", str(MAX_TOKENS),
           "--engine-factory", FAKE, "--engine-factory-kwargs", json.dumps(kwargs)]
    proc = subprocess.Popen(cmd, cwd=ROOT, env=child_env(), stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    out = _Reader(proc.stdout)
    try:
        out.wait_for(lambda t: t.endswith(">>> "), timeout=120, what="the first prompt")
        proc.stdin.write("hello\n")
        proc.stdin.flush()
        out.wait_for(lambda t: len(t.split(">>> ", 1)[1]) >= 6, what="the answer to start streaming")
        proc.send_signal(signal.SIGINT)
        text = out.wait_for(lambda t: "[stopped]" in t and t.endswith(">>> "), what="the stopped answer")
        partial = text.split(">>> ", 1)[1].split("\n[stopped]\n", 1)[0]
        first = chat_token_ids(tokenizer, [{"role": "user", "content": "hello"}])
        full = fake_answer(tokenizer, first, MAX_TOKENS, eos_after=1000)[0]
        assert partial and full.startswith(partial) and partial != full

        proc.stdin.write("again\n")
        proc.stdin.flush()
        text = out.wait_for(lambda t: t.count(">>> ") == 3, what="the second answer")
        second = chat_token_ids(tokenizer, [{"role": "user", "content": "hello"},
                                            {"role": "assistant", "content": partial},
                                            {"role": "user", "content": "again"}])
        answer = text.split(">>> ")[2]
        assert answer == fake_answer(tokenizer, second, MAX_TOKENS, eos_after=1000)[0] + "\n"

        proc.stdin.flush()
        proc.stdin.buffer.write(b"a\xffb\n")            # not UTF-8: refused by name, the history unchanged
        proc.stdin.buffer.flush()
        text = out.wait_for(lambda t: t.count(">>> ") == 4, what="the refusal of the line that is not UTF-8")
        assert text.split(">>> ")[3] == ("error: your message is not valid text: character 1 is a lone surrogate "
                                         "('\\udcff', half of a UTF-16 pair, which UTF-8 cannot encode); send "
                                         "whole characters\n")

        proc.stdin.write("/reset\n")
        proc.stdin.close()                               # Ctrl-D
        assert proc.wait(timeout=30) == 0, out.text
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=10)
    assert "(new conversation)" in out.text
    events = [json.loads(line) for line in record.read_text().splitlines()]
    adds = [e for e in events if e["event"] == "add"]
    assert [a["prompt_token_ids"] for a in adds] == [first, second]
    assert {"event": "abort", "request_id": adds[0]["request_id"], "known": True} in events
    assert events[-1] == {"event": "exit", "unfinished": []}
