"""Tensor parallelism on CPU (gloo) and the engine's handling of bad input."""
import json
import math
import os
import shutil
import signal
import tempfile

import pytest

from nanovllm_ref import SamplingParams
from engine_helpers import LLM, hf_greedy, tiny_dir

GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
PROMPTS = [[5, 6, 7, 8, 9, 10, 11], [20, 21], list(range(30, 47))]


@pytest.mark.parametrize("arch", ["qwen3", "llama"])
def test_tensor_parallel_2_on_cpu_equals_tp_1_and_hf(arch):
    path = tiny_dir(arch)
    with LLM(path, tensor_parallel_size=2, kvcache_block_size=4, max_model_len=64) as llm:
        tp2 = [o["token_ids"] for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]
        # A second generate on the same engine, with a prefix hit and preemption-free reuse.
        again = [o["token_ids"] for o in llm.generate(PROMPTS[:1], GREEDY, use_tqdm=False)]
    tp1 = [o["token_ids"] for o in LLM(path, kvcache_block_size=4, max_model_len=64).generate(PROMPTS, GREEDY, use_tqdm=False)]
    assert tp2 == tp1 == [hf_greedy(path, p, 8) for p in PROMPTS]
    assert again == tp1[:1]


def test_two_tp_engines_one_after_another_do_not_clash():
    path = tiny_dir("qwen3")
    outs = []
    for _ in range(2):
        llm = LLM(path, tensor_parallel_size=2, kvcache_block_size=4, max_model_len=64)
        outs.append(llm.generate(PROMPTS[:2], GREEDY, use_tqdm=False))
        workers = list(llm.workers)
        llm.exit()
        assert all(not w.is_alive() for w in workers)
    assert outs[0] == outs[1]


LLM_ARGS = dict(kvcache_block_size=4, max_model_len=32, num_kvcache_blocks=6)   # the llm fixture (tests/conftest.py)


BAD_REQUESTS = [
    ([[]], GREEDY, ValueError, "empty"),
    ([""], GREEDY, ValueError, "empty"),
    ([list(range(3, 40))], GREEDY, ValueError, "max_model_len"),
    ([list(range(3, 20))], SamplingParams(temperature=0, max_tokens=10), ValueError, "never fit"),
    ([[1, 2, 99999]], GREEDY, ValueError, "outside"),
    ([[1.5, 2]], GREEDY, TypeError, "must be an int token id"),
    ([b"hi"], GREEDY, TypeError, "list of int token ids"),
    ([None], GREEDY, TypeError, "prompts\\[1\\]"),
    ([[1, 2], [3]], [GREEDY], ValueError, "one per prompt"),
    ([[1, 2]], "greedy", ValueError, "SamplingParams"),
    ([[1, 2]], [None], TypeError, "sampling_params\\[0\\]"),
]


@pytest.mark.parametrize("prompts,sp,exc,match", BAD_REQUESTS)
def test_bad_request_raises_before_any_state_change_and_engine_stays_usable(llm, prompts, sp, exc, match):
    good = [7, 8, 9]
    with pytest.raises(exc, match=match):
        llm.generate([good] + prompts if isinstance(sp, SamplingParams) else prompts, sp, use_tqdm=False)
    assert llm.is_finished(), "a rejected batch must not leave requests queued"
    assert llm.scheduler.block_manager.num_free_blocks == 6
    out = llm.generate([good], GREEDY, use_tqdm=False)
    assert out[0]["token_ids"] == hf_greedy(tiny_dir("qwen3"), good, 8)


@pytest.mark.parametrize("kwargs,exc,match", [
    (dict(temperature=-0.1), ValueError, "temperature"),
    (dict(temperature=math.nan), ValueError, "temperature"),
    (dict(temperature="hot"), TypeError, "temperature"),
    (dict(max_tokens=0), ValueError, "max_tokens"),
    (dict(max_tokens=2.5), TypeError, "max_tokens"),
])
def test_bad_sampling_params_raise_clear_errors(kwargs, exc, match):
    with pytest.raises(exc, match=match):
        SamplingParams(**kwargs)


def test_missing_model_folder_raises_value_error():
    with pytest.raises(ValueError, match="model folder not found"):
        LLM("/nonexistent/model/folder")


def test_unsupported_architecture_raises_value_error():
    src = tiny_dir("qwen3")
    dst = tempfile.mkdtemp()
    shutil.copytree(src, dst, dirs_exist_ok=True)
    with open(os.path.join(dst, "config.json")) as f:
        cfg = json.load(f)
    cfg["architectures"] = ["GPT2LMHeadModel"]
    with open(os.path.join(dst, "config.json"), "w") as f:
        json.dump(cfg, f)
    with pytest.raises(ValueError, match="unsupported architecture"):
        LLM(dst)


def test_too_little_memory_for_one_block_raises_value_error():
    with pytest.raises(ValueError, match="too little memory for one KV-cache block"):
        LLM(tiny_dir("qwen3"), kvcache_block_size=4096, cpu_kvcache_space_gib=1e-6, device="cpu")


@pytest.mark.parametrize("kwargs,exc,match", [
    (dict(kvcache_block_size=0), ValueError, "kvcache_block_size"),
    (dict(tensor_parallel_size=3), ValueError, "tensor_parallel_size"),
    (dict(attention_backend="cudnn"), ValueError, "attention_backend"),
    (dict(dtype="int8"), ValueError, "dtype"),
    (dict(max_num_seqs="8"), TypeError, "max_num_seqs"),
    (dict(num_kvcache_blocks=0), ValueError, "num_kvcache_blocks"),
    (dict(not_an_arg=1), TypeError, "unknown engine argument"),
    # read from the model folder, never passed (they used to be accepted and then overwritten)
    (dict(eos=frozenset({5})), TypeError, r"unknown engine argument\(s\) \['eos'\]"),
    (dict(hf_config=object()), TypeError, r"unknown engine argument\(s\) \['hf_config'\]"),
    (dict(max_model_len=10**6), ValueError, "max_model_len=1000000 is more than the model's max_position_embeddings"),
])
def test_bad_engine_arguments_raise_clear_errors(kwargs, exc, match):
    with pytest.raises(exc, match=match):
        LLM(tiny_dir("qwen3"), **kwargs)


CRASHING_RUN = r"""
import sys, time
sys.path.insert(0, {tests!r})
from engine_helpers import LLM
from nanovllm_ref import SamplingParams
llm = LLM({path!r}, tensor_parallel_size=2, kvcache_block_size=4, max_model_len=64)
print("worker pids", *[w.pid for w in llm.workers], flush=True)
while True:
    llm.generate([[5, 6, 7]], SamplingParams(temperature=0, max_tokens=8), use_tqdm=False)
"""


def test_tp_engine_killed_mid_run_leaves_no_workers_and_next_engine_starts():
    import signal
    import subprocess
    import sys
    import time
    path = tiny_dir("qwen3")
    tests_dir = os.path.dirname(os.path.abspath(__file__))
    proc = subprocess.Popen([sys.executable, "-c", CRASHING_RUN.format(tests=tests_dir, path=path)],
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    import select
    ready, _, _ = select.select([proc.stdout], [], [], 200)   # a start-up that hangs fails here, not forever
    if not ready:
        proc.kill()
        pytest.fail("the TP engine in the child process did not start within 200 s")
    line = proc.stdout.readline()
    assert line.startswith("worker pids"), line
    worker_pids = [int(x) for x in line.split()[2:]]
    time.sleep(1.0)                                   # let it run a few generate calls
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=30)
    deadline = time.time() + 30                       # orphaned workers see their pipe close and exit
    while time.time() < deadline and any(os.path.exists(f"/proc/{p}") and
                                         open(f"/proc/{p}/stat").read().split()[2] != "Z" for p in worker_pids):
        time.sleep(0.2)
    assert not any(os.path.exists(f"/proc/{p}") and open(f"/proc/{p}/stat").read().split()[2] != "Z"
                   for p in worker_pids), "a TP worker outlived its killed engine"
    with LLM(path, tensor_parallel_size=2, kvcache_block_size=4, max_model_len=64) as llm:
        out = llm.generate([[5, 6, 7]], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True), use_tqdm=False)
    assert out[0]["token_ids"] == hf_greedy(path, [5, 6, 7], 8)


ARM_FILE_ENV = "NANOVLLM_TEST_REFUSE_LONG_STEPS_FILE"


def rms_norm_refusing_long_steps(x, weight, eps):
    """A part that fails on every rank for steps of more than 40 tokens once armed (picklable: a module-level
    function). Armed = the file named by $NANOVLLM_TEST_REFUSE_LONG_STEPS_FILE exists: the workers inherit the
    variable and see the file, and the engine's start-up warm-up (on CUDA it runs long prefill steps) comes
    before the test creates it."""
    flag = os.environ.get(ARM_FILE_ENV)
    if x.shape[0] > 40 and flag and os.path.exists(flag):
        raise ValueError("rms_norm_refusing_long_steps: more than 40 tokens")
    from nanovllm_ref.layers.layernorm import rms_norm
    return rms_norm(x, weight, eps)


def test_tp_step_that_raises_on_every_rank_reaches_the_caller_and_exit_still_finishes(tmp_path, monkeypatch):
    """The error of a failed step reaches the caller, and the workers stay alive, so exit() does not hang
    at its barrier (a worker that died on the error used to leave rank 0 waiting there)."""
    from nanovllm_ref import Parts
    path = tiny_dir("qwen3")
    arm = tmp_path / "armed"
    monkeypatch.setenv(ARM_FILE_ENV, str(arm))
    llm = LLM(path, tensor_parallel_size=2, kvcache_block_size=4, max_model_len=64,
              parts=Parts(rms_norm=rms_norm_refusing_long_steps))
    arm.touch()
    ok = llm.generate([[5, 6, 7]], GREEDY, use_tqdm=False)
    assert ok[0]["token_ids"] == hf_greedy(path, [5, 6, 7], 8)
    with pytest.raises(ValueError, match="more than 40 tokens"):
        llm.generate([list(range(1, 51))], GREEDY, use_tqdm=False)
    workers = list(llm.workers)
    assert all(w.is_alive() for w in workers), "a worker died on the step's error"
    llm.exit()
    # exit code 0: each worker took the Exit message and met rank 0 at the exit barrier; one left waiting there
    # would have been terminated after exit's join timeout (-SIGTERM), and a lost one would hang exit().
    assert [w.exitcode for w in workers] == [0] * len(workers)


_INTERRUPT = {"armed": False}


def rms_norm_interrupted_on_rank0(x, weight, eps):
    """Raises KeyboardInterrupt on rank 0 alone, once, in the first decode step of 3 rows after arming: what a
    notebook's interrupt does (it reaches only the kernel's process, rank 0)."""
    import torch.distributed as dist
    if _INTERRUPT["armed"] and dist.get_rank() == 0 and x.shape[0] == 3:
        _INTERRUPT["armed"] = False
        raise KeyboardInterrupt
    from nanovllm_ref.layers.layernorm import rms_norm
    return rms_norm(x, weight, eps)


def test_tp_step_interrupted_on_rank0_closes_the_engine_with_a_clear_error():
    """The workers are left inside the interrupted step's collectives: the next step would pair rank 0's
    collectives with those stale ones. So the engine refuses further steps by name, and exit() stops the
    workers without waiting for them at a barrier; a new engine then works."""
    from nanovllm_ref import Parts
    path = tiny_dir("qwen3")
    # Eager: with CUDA graphs a decode step replays the captured kernels and never calls the part in Python,
    # so the interrupt must land in an eager step (as it does in a notebook between replays, in host code).
    llm = LLM(path, tensor_parallel_size=2, kvcache_block_size=4, max_model_len=64, enforce_eager=True,
              parts=Parts(rms_norm=rms_norm_interrupted_on_rank0))
    _INTERRUPT["armed"] = True
    with pytest.raises(KeyboardInterrupt):
        llm.generate([[1, 2], [3, 4], [5, 6]], GREEDY, use_tqdm=False)
    with pytest.raises(RuntimeError, match="interrupted on rank 0"):
        llm.generate([[5, 6, 7]], GREEDY, use_tqdm=False)
    workers = list(llm.workers)
    assert llm.model_runner.out_of_step       # so exit() stops the workers at once instead of meeting them
    llm.exit()
    assert [w.exitcode for w in workers] == [-signal.SIGTERM] * len(workers)   # stopped, not waited for
    assert not any(w.is_alive() for w in workers)
    with LLM(path, tensor_parallel_size=2, kvcache_block_size=4, max_model_len=64) as again:
        out = again.generate([[5, 6, 7]], GREEDY, use_tqdm=False)
    assert out[0]["token_ids"] == hf_greedy(path, [5, 6, 7], 8)


def test_config_is_plain_data_the_engine_keeps_a_derived_copy():
    """The Config a caller builds never changes: the engine's own (llm.config) is a copy with the cache size
    and the tokenizer's eos added."""
    import dataclasses
    from nanovllm_ref.config import Config
    cfg = Config(tiny_dir("qwen3"), kvcache_block_size=4)
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.num_kvcache_blocks = 3
    llm = LLM(tiny_dir("qwen3"), kvcache_block_size=4, max_model_len=64)
    assert cfg.num_kvcache_blocks == -1 and llm.config.num_kvcache_blocks == llm.model_runner.num_kvcache_blocks > 0
    assert llm.tokenizer.eos_token_id in llm.config.eos
    assert llm.config.max_model_len == 64 and cfg.max_model_len == 512    # default: the model's limit (tiny: 512)
    llm.exit()
