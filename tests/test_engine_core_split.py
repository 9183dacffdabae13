"""The engine split in two (issue 28): the core (engine/core.py) in token ids, the front end's OutputProcessor
(engine/output_processor.py) for text and stop strings, the core in this process or in its own
(engine/core_client.py). The same requests give the same ids, text, reasons and logprobs either way."""
import os
import signal
import time

import pytest

from engine_helpers import LLM, hf_greedy, live_parents, tiny_dir
from nanovllm_ref import SamplingParams
from nanovllm_ref.engine.core_client import EngineCoreDead, InprocClient, ProcessClient
from nanovllm_ref.engine.core_messages import (EngineCoreAbort, EngineCoreOutput, EngineCoreOutputs, EngineCoreRequest,
                                               core_sampling_params, input_decoder, input_encoder, output_decoder,
                                               output_encoder, sampling_fields)

PROMPTS = ["hello world", "The capital of", "one two three four"]


def _children(pid: int) -> set[int]:
    """Live (not zombie) child processes of `pid`."""
    return {p for p, parent in live_parents().items() if parent == pid}


@pytest.fixture(scope="module")
def engines():
    inproc, process = LLM(tiny_dir("qwen3")), LLM(tiny_dir("qwen3"), engine_core="process")
    yield inproc, process
    inproc.exit()
    process.exit()


def _same(a, b):
    assert len(a) == len(b)
    for x, y in zip(a, b):
        assert x.prompt_token_ids == y.prompt_token_ids and x.finished and y.finished
        _close(x.prompt_logprobs, y.prompt_logprobs)
        for o, p in zip(x.outputs, y.outputs, strict=True):
            assert (o.token_ids, o.text, o.finish_reason, o.stop_reason) == (p.token_ids, p.text, p.finish_reason,
                                                                             p.stop_reason)
            _close(o.logprobs, p.logprobs)
            assert (o.cumulative_logprob is None) == (p.cumulative_logprob is None)
            assert o.cumulative_logprob == pytest.approx(p.cumulative_logprob, abs=1e-4)


def _close(a, b):
    """Logprob dicts alike: the same tokens, ranks and texts; values to float noise (the core's process may run
    its matmuls with another thread count than the test's, which moves the last bits)."""
    assert (a is None) == (b is None)
    for d, e in zip(a or [], b or [], strict=True):
        assert (d is None) == (e is None)
        if d is not None:
            assert [(t, v.rank, v.decoded_token) for t, v in d.items()] == [(t, v.rank, v.decoded_token)
                                                                            for t, v in e.items()]
            assert [v.logprob for v in d.values()] == pytest.approx([v.logprob for v in e.values()], abs=1e-4)


def _spanning_stop(llm, prompt):
    """A stop string that spans a token boundary of the greedy completion of `prompt`, and the text before it."""
    out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=24), use_tqdm=False)[0].outputs[0]
    ids, tok = out.token_ids, llm.tokenizer
    pieces = [tok.decode(ids[:i]) for i in range(len(ids) + 1)]
    for i in range(2, len(ids) - 2):
        # the end of token i-1's text and the start of token i's, both printable
        left, right = pieces[i][len(pieces[i - 1]):], pieces[i + 1][len(pieces[i]):]
        if len(left) >= 1 and len(right) >= 1 and "\ufffd" not in left + right and pieces[i + 1].startswith(pieces[i]):
            stop = left[-1] + right[0]
            first = pieces[-1].find(stop)
            if first >= len(pieces[i - 1]) - 1:             # no earlier match
                return stop, pieces[-1][:first]
    pytest.fail("no token boundary to put a stop string across")


def test_process_core_gives_the_inproc_ids_text_and_logprobs(engines):
    inproc, process = engines
    stop, before = _spanning_stop(inproc, PROMPTS[0])
    sps = [SamplingParams(temperature=0, max_tokens=24, stop=[stop], logprobs=2),
           SamplingParams(temperature=0.9, seed=5, n=2, max_tokens=16, stop=["e", "zz"], prompt_logprobs=1),
           SamplingParams(temperature=0, max_tokens=10, include_stop_str_in_output=True, stop=[stop])]
    a = inproc.generate(PROMPTS, sps, use_tqdm=False)
    b = process.generate(PROMPTS, sps, use_tqdm=False)
    _same(a, b)
    first = a[0].outputs[0]
    assert (first.finish_reason, first.stop_reason, first.text) == ("stop", stop, before)
    assert len(first.logprobs) == len(first.token_ids)
    assert len(a[1].outputs) == 2 and a[1].prompt_logprobs[0] is None and len(a[1].prompt_logprobs) == len(
        a[1].prompt_token_ids)
    # streamed step by step, the process core's snapshots end where generate's do
    for i, (p, sp) in enumerate(zip(PROMPTS, sps)):
        process.add_request(p, sp, request_id=f"s{i}")
    last = {}
    while not process.is_finished():
        for out in process.step():
            prev = last.get(out.request_id)
            if prev is not None:
                assert all(o.text.startswith(q.text) for o, q in zip(out.outputs, prev.outputs))
            last[out.request_id] = out
    _same(a, [last[f"s{i}"] for i in range(3)])
    # the core's steps by what they launched after what add up to its totals; the first came after idle
    kinds = process.core_step_kinds
    assert sum(n for n, _, _ in kinds.values()) == process.core_steps
    assert abs(sum(t for _, t, _ in kinds.values()) - process.core_step_s) < 1e-6
    assert kinds["idle>prefill"][0] >= 1 and kinds["decode>decode"][0] >= 1
    assert set(kinds) <= {f"{a}>{b}" for a in ("idle", "prefill", "decode") for b in ("prefill", "decode")}


def test_a_stop_string_with_async_scheduling_drops_the_token_in_flight():
    sync, asyn = LLM(tiny_dir("qwen3")), LLM(tiny_dir("qwen3"), async_scheduling=True)
    try:
        stop, before = _spanning_stop(sync, PROMPTS[2])
        sp = SamplingParams(temperature=0, max_tokens=24, stop=[stop], logprobs=1)
        a, b = sync.generate([PROMPTS[2]], sp, use_tqdm=False), asyn.generate([PROMPTS[2]], sp, use_tqdm=False)
        _same(a, b)
        assert a[0].outputs[0].stop_reason == stop and a[0].outputs[0].text == before
        # the core let the sample go: nothing left in the scheduler, every KV block back
        assert asyn.is_finished() and not asyn.requests
        while asyn._in_flight is not None:
            asyn.step()
        assert asyn.scheduler.block_manager.num_free_blocks == asyn.config.num_kvcache_blocks
    finally:
        sync.exit()
        asyn.exit()


def test_abort_and_a_reused_request_id_on_the_process_core(engines):
    _, process = engines
    sp = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    process.add_request(PROMPTS[0], sp, request_id="mine")
    # a step may first take in a message from before (an idle core's stats after an earlier test's aborts)
    assert any(out.request_id == "mine" for _ in range(3) for out in process.step()) and "mine" in process.requests
    assert process.abort_request("mine") is True and process.abort_request("mine") is False
    assert process.is_finished() and process.step() == []
    # the id is free again; the core's late outputs of the aborted request are never taken for the new one
    process.add_request(PROMPTS[1], SamplingParams(temperature=0, max_tokens=5), request_id="mine")
    outs = []
    while not process.is_finished():
        outs += process.step()
    want = process.generate([PROMPTS[1]], SamplingParams(temperature=0, max_tokens=5), use_tqdm=False)[0]
    assert outs[-1].request_id == "mine" and outs[-1].outputs[0].token_ids == want.outputs[0].token_ids
    assert process.core_stats["running"] == 0 and process.core_stats["waiting"] == 0
    assert process.core_stats["kv_blocks_free"] == process.config.num_kvcache_blocks


def test_core_stats_drop_aborted_requests_while_idle(engines):
    """After aborting every request, an idle process core still reports its scheduler's stats once, and an
    idle step() takes that in: core_stats (the server's /health) no longer show the aborted sequences running
    or their blocks taken (a reported fault: they stayed until the next request ran)."""
    import time
    _, process = engines
    sp = SamplingParams(temperature=0, max_tokens=200, ignore_eos=True, n=3)
    process.add_request(PROMPTS[0], sp, request_id="gone")
    while not process.core_stats.get("running"):
        assert process.step() is not None
    assert process.core_stats["running"] == 3
    assert process.abort_request("gone") and process.is_finished()
    deadline = time.monotonic() + 60                         # a liveness bound, not a timing: stale stays stale
    while process.core_stats["running"] and time.monotonic() < deadline:
        assert process.step() == []
        time.sleep(0.01)
    assert process.core_stats["running"] == 0 and process.core_stats["waiting"] == 0
    assert process.core_stats["kv_blocks_free"] == process.config.num_kvcache_blocks


def test_wake_returns_a_waiting_step_at_once_and_the_next_step_still_runs(engines):
    """LLMEngine.wake from another thread (the server's engine loop on a new request): a get_outputs waiting with
    no timeout on an idle process core returns [] instead of waiting for a step that never comes; outputs still
    arrive after."""
    import threading
    _, process = engines
    got = []
    waiter = threading.Thread(target=lambda: got.append(process.core_client.get_outputs()), daemon=True)
    waiter.start()
    waiter.join(0.2)
    assert waiter.is_alive(), "get_outputs returned with nothing to return and no wake-up"
    process.wake()
    waiter.join(60)                                            # a liveness bound: a broken wake blocks for ever
    assert not waiter.is_alive() and got == [[]], "wake() did not end the wait"
    process.wake()                                             # a stale wake-up costs one early return at most
    out = process.generate([[5, 6, 7]], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True), use_tqdm=False)
    assert out[0]["token_ids"] == hf_greedy(tiny_dir("qwen3"), [5, 6, 7], 4)


def test_bad_engine_core_is_refused_by_name_before_anything_loads():
    with pytest.raises(ValueError, match="engine_core must be one of \\['inproc', 'process'\\], got 'thread'"):
        LLM(tiny_dir("qwen3"), engine_core="thread")
    with pytest.raises(ValueError, match="engine_core"):
        LLM(tiny_dir("qwen3"), engine_core=None)


def test_inproc_keeps_the_core_parts_and_process_names_where_they_went(engines):
    inproc, process = engines
    assert isinstance(inproc.core_client, InprocClient) and inproc.scheduler is inproc.core_client.core.scheduler
    assert inproc.model_runner is inproc.core_client.core.model_runner and inproc.workers == []
    assert isinstance(process.core_client, ProcessClient) and process.workers == []
    with pytest.raises(AttributeError, match="engine_core='process'"):
        process.scheduler


def test_messages_round_trip_and_sampling_defaults_stay_off_the_wire():
    sp = SamplingParams(temperature=0, max_tokens=5, stop=["ab"], stop_token_ids=[3], logprobs=2, seed=-5, n=2)
    req = EngineCoreRequest("7", [1, 2, 3], sampling_fields(sp), [11, 12])
    back = input_decoder().decode(input_encoder().encode(req))
    assert back == req and "stop" not in back.sampling_params and "top_p" not in back.sampling_params
    core_sp = core_sampling_params(back)
    assert (core_sp.stop, core_sp.stop_token_ids, core_sp.seed, core_sp.n, core_sp.logprobs) == ((), (3,), -5, 2, 2)
    assert input_decoder().decode(input_encoder().encode(EngineCoreAbort("7", 1))) == EngineCoreAbort("7", 1)
    outs = EngineCoreOutputs([EngineCoreOutput("7", 1, [5], "stop", 3, [([5, 2], [-0.5, -1.0], 1)])])
    assert output_decoder().decode(output_encoder().encode(outs)) == outs
    # a decode step's delta, on the wire: a few bytes per sample
    assert len(output_encoder().encode(EngineCoreOutput("123", 0, [15496]))) <= 16


def test_a_killed_process_core_fails_the_next_step_and_leaves_nothing_behind():
    llm = LLM(tiny_dir("qwen3"), engine_core="process")
    core_pid = llm.core_client.pid
    assert core_pid in _children(os.getpid())
    llm.add_request(PROMPTS[0], SamplingParams(temperature=0, max_tokens=200, ignore_eos=True))
    llm.step()
    os.kill(core_pid, signal.SIGKILL)
    with pytest.raises(EngineCoreDead, match="SIGKILL"):
        for _ in range(1000):
            llm.step()
    with pytest.raises(EngineCoreDead):
        llm.add_request(PROMPTS[0])
    llm.exit()
    deadline = time.monotonic() + 10
    while core_pid in _children(os.getpid()) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert core_pid not in _children(os.getpid())


def test_a_script_that_starts_a_process_core_without_a_main_guard_gets_engine_core_dead_naming_the_guard(tmp_path):
    # spawn imports the script again in the core's process, whose top level then starts another process before
    # it has finished starting: the core ends without a word, and the parent must say why, not EOFError.
    import subprocess
    import sys
    script = tmp_path / "no_guard.py"
    script.write_text("from nanovllm_ref import LLM\n"
                      "from nanovllm_ref.engine.core_client import EngineCoreDead\n"
                      "try:\n"
                      f"    LLM({tiny_dir('qwen3')!r}, engine_core='process')\n"
                      "except EngineCoreDead as exc:\n"
                      "    print('DEAD', exc)\n")
    run = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=240,
                         env={**os.environ, "OMP_NUM_THREADS": "1"})
    dead = [line for line in run.stdout.splitlines() if line.startswith("DEAD")]
    assert len(dead) == 1, run.stdout + run.stderr
    assert 'if __name__ == "__main__":' in dead[0] and "while starting" in dead[0]
