"""How the front end reaches the engine core: in this process, or in a process of its own (issue 28; vLLM
v1's `vllm/v1/engine/core_client.py`).

Both clients have one interface, so LLMEngine (the front end) runs the same code over either:
`add_request(EngineCoreRequest)`, `abort(items)` (core ids, or (core id, sample index) pairs),
`get_outputs() -> list[EngineCoreOutputs]` (the steps the core finished since the last call, at least one;
raises EngineCoreDead if the core died), `shutdown()`, `check_health()`, and the facts the front end checks
requests against: `config` (the derived Config, with the KV cache's real size), `async_scheduling`,
`scheduler_cls`, `block_manager_cls`.

InprocClient (engine_core="inproc", the default of `LLM`): calls an EngineCore directly; `get_outputs` runs
one `core.step()`. A notebook reaches the core's scheduler and model runner through it.

ProcessClient (engine_core="process", the server's default on CUDA): spawns `run_engine_core` (multiprocessing
"spawn", so CUDA starts fresh in the child) and talks to it over two ZMQ PUSH/PULL sockets on ipc paths in a
private temporary folder, with msgspec messages (engine/core_messages.py):

    front end ── PUSH input  (EngineCoreRequest | EngineCoreAbort | EngineCoreShutdown) ──▶ PULL  core
    front end ◀─ PULL output (EngineCoreOutputs, one per step) ◀────────────────────────── PUSH  core

The core's busy loop: take every add and abort that arrived, run one step, send its outputs, again; block on
the input socket while it has no work (aborts that leave it without work still send one message: the
scheduler's stats after them, so the front end's `core_stats` do not keep the aborted requests). It never
waits for the front end, so the front end's text work (detokenizing, stop strings, HTTP) overlaps the next
step instead of delaying it. It stops on EngineCoreShutdown, on an exception in a step (sending
`EngineCoreOutputs(error=...)` first), or when its parent dies (Linux: PR_SET_PDEATHSIG; elsewhere it notices
within a second), so a killed server leaves no core behind. The front end notices a dead core at once: it waits on the output socket and the process's
sentinel together.
"""
import gc
import multiprocessing as mp
import os
import shutil
import signal
import sys
import tempfile
import traceback

from nanovllm_ref.engine.core_messages import (EngineCoreAbort, EngineCoreOutputs, EngineCoreRequest,
                                               EngineCoreShutdown, input_decoder, input_encoder, output_decoder,
                                               output_encoder)

ENGINE_CORE_KINDS = ("inproc", "process")
STARTUP_POLL_S = 0.1
IDLE_POLL_MS = 1000            # an idle core wakes this often to check that its parent is alive


class EngineCoreDead(RuntimeError):
    """The engine core failed (an exception in a step) or its process died (killed, out of memory): no request
    can run any more. The message says which."""


def check_engine_core(value) -> str:
    """`value` if it names a client kind (ENGINE_CORE_KINDS), else ValueError naming the argument."""
    if not isinstance(value, str) or value not in ENGINE_CORE_KINDS:
        raise ValueError(f"engine_core must be one of {list(ENGINE_CORE_KINDS)}, got {value!r}")
    return value


class InprocClient:
    """The core in this process (module docstring). config, parts: as EngineCore takes them."""

    def __init__(self, config, parts):
        from nanovllm_ref.engine.core import EngineCore
        self.core = EngineCore(config, parts)
        self.config = self.core.config
        self.async_scheduling = self.core.async_scheduling
        self.scheduler_cls = type(self.core.scheduler)
        self.block_manager_cls = type(self.core.scheduler.block_manager)

    def add_request(self, request: EngineCoreRequest) -> None:
        self.core.add_request(request)

    def abort(self, items) -> None:
        self.core.abort(items)

    def abort_all(self, core_ids) -> None:
        self.core.abort_all()

    def get_outputs(self) -> list[EngineCoreOutputs]:
        return [self.core.step()]

    def has_work(self) -> bool:
        return self.core.has_work()

    def check_health(self) -> None:
        pass

    def shutdown(self) -> None:
        self.core.shutdown()


class ProcessClient:
    """The core in a spawned process (module docstring). config: the front end's Config (picklable); parts: a
    picklable nanovllm_ref.Parts (its classes and functions importable by name in the child). Raises what the
    core raised while starting (a bad config, the weights), or EngineCoreDead if the process died then."""

    def __init__(self, config, parts):
        import zmq
        parts.check_picklable()
        self._zmq = zmq
        self._dir = tempfile.mkdtemp(prefix="nanovllm-core-")      # private (0700): the ipc sockets live here
        input_addr, output_addr = f"ipc://{self._dir}/input", f"ipc://{self._dir}/output"
        self._ctx = zmq.Context()
        self._input = self._ctx.socket(zmq.PUSH)
        self._output = self._ctx.socket(zmq.PULL)
        for sock in (self._input, self._output):
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.SNDHWM, 0)          # no high-water mark: a message is never dropped or blocked
            sock.setsockopt(zmq.RCVHWM, 0)
        self._input.bind(input_addr)
        self._output.bind(output_addr)
        self._encode, self._decode = input_encoder().encode, output_decoder().decode
        self.dead: str | None = None
        ctx = mp.get_context("spawn")
        ready, child = ctx.Pipe(duplex=False)
        # Daemonic unless it must spawn tensor-parallel workers itself (a daemon cannot have children).
        self.proc = ctx.Process(target=run_engine_core, name="nanovllm-engine-core",
                                args=(config, parts, input_addr, output_addr, child, os.getpid()),
                                daemon=config.tensor_parallel_size == 1)
        self._closed = False
        try:
            self.proc.start()
            child.close()
            info = self._handshake(ready)
        except BaseException:
            self.shutdown()
            raise
        self.config = config.derived(num_kvcache_blocks=info["num_kvcache_blocks"])
        self.async_scheduling = info["async_scheduling"]
        self.scheduler_cls, self.block_manager_cls = info["scheduler_cls"], info["block_manager_cls"]
        # A pipe another thread writes to (`wake`): get_outputs returns at once, so the caller can send the
        # core a request that arrived while it waited, instead of holding it until the core's next step ends.
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        os.set_blocking(self._wake_w, False)
        self._poller = zmq.Poller()
        self._poller.register(self._output, zmq.POLLIN)
        self._poller.register(self.proc.sentinel, zmq.POLLIN)
        self._poller.register(self._wake_r, zmq.POLLIN)

    def _handshake(self, ready) -> dict:
        """Wait for the core's ("ready", facts) or ("error", exception) while watching that it lives."""
        while not ready.poll(STARTUP_POLL_S):
            if not self.proc.is_alive():
                raise EngineCoreDead(f"the engine core process exited while starting (exit code {self.proc.exitcode})")
        try:
            kind, value = ready.recv()
        except (EOFError, OSError):
            # The pipe closed without a word: the process ended before it could report. The usual cause is
            # a script that starts a process core at its top level: spawn re-imports the script in the
            # child, whose own top level then tries to start a process before it has finished starting.
            self.proc.join(timeout=5)
            raise EngineCoreDead(
                f"the engine core process exited while starting (exit code {self.proc.exitcode}) before it "
                "reported; if a script starts it, put the script's top level under "
                "`if __name__ == \"__main__\":` (the core is started with multiprocessing's spawn, which "
                "imports the script again in the new process)") from None
        finally:
            ready.close()
        if kind == "error":
            raise value
        return value

    @property
    def pid(self) -> int:
        return self.proc.pid

    def _send(self, message) -> None:
        """Send without ever blocking on a dead core: a PUSH socket with no peer would wait forever."""
        frame = self._encode(message)
        while True:
            try:
                self._input.send(frame, self._zmq.NOBLOCK)
                return
            except self._zmq.Again:                      # no peer (yet, or any more)
                self.check_health()
                self._input.poll(100, self._zmq.POLLOUT)

    def add_request(self, request: EngineCoreRequest) -> None:
        self._send(request)

    def abort(self, items) -> None:
        """Best effort: a dead core has nothing left to abort."""
        try:
            for item in items:
                rid, index = (item, -1) if isinstance(item, str) else item
                self._send(EngineCoreAbort(rid, index))
        except EngineCoreDead:
            pass

    def abort_all(self, core_ids) -> None:
        self.abort(list(core_ids))

    def has_work(self) -> bool:
        return False              # the core's own loop takes in what is left

    def check_health(self) -> None:
        """Raise EngineCoreDead if the core failed or its process is gone."""
        if self.dead is None and not self.proc.is_alive():
            self.dead = (f"the engine core process died (exit code {self.proc.exitcode}"
                         + (f", signal {signal.Signals(-self.proc.exitcode).name}" if (self.proc.exitcode or 0) < 0
                            else "") + ")")
        if self.dead is not None:
            raise EngineCoreDead(self.dead)

    def wake(self) -> None:
        """From any thread: make a `get_outputs` waiting now (or the next one) return at once, [] if no step
        finished (the server's engine loop calls it when a request arrives). Never blocks."""
        try:
            os.write(self._wake_w, b"w")
        except (BlockingIOError, OSError):              # the pipe is full (a wake-up is pending) or closed
            pass

    def get_outputs(self, timeout_ms: int | None = None) -> list[EngineCoreOutputs]:
        """Every step message that arrived, waiting for the first (at most timeout_ms, or until `wake`; []
        then). Raises EngineCoreDead when the core reports a failure or its process is gone."""
        self.check_health()
        zmq = self._zmq
        while True:
            events = dict(self._poller.poll(timeout_ms))
            woken = self._wake_r in events
            if woken:
                try:
                    while os.read(self._wake_r, 4096):
                        pass
                except BlockingIOError:
                    pass
            if self._output in events:
                break
            if self.proc.sentinel in events:             # the process ended
                self.check_health()
            if woken or timeout_ms is not None:
                return []
        batches = []
        while True:
            try:
                frame = self._output.recv(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                break
            outs = self._decode(frame.buffer)
            if outs.error is not None:
                self.dead = f"the engine core failed: {outs.error}"
                raise EngineCoreDead(self.dead)
            batches.append(outs)
        return batches

    def shutdown(self, timeout: float = 10.0) -> None:
        """Ask the core to stop, wait for it (then terminate, then kill), close the sockets. Idempotent."""
        if self._closed:
            return
        self._closed = True
        try:
            if self.proc.pid is not None and self.proc.is_alive():
                try:
                    self._send(EngineCoreShutdown())
                except EngineCoreDead:
                    pass
                self.proc.join(timeout)
                if self.proc.is_alive():
                    self.proc.terminate()
                    self.proc.join(5)
                if self.proc.is_alive():
                    self.proc.kill()
                    self.proc.join(5)
            elif self.proc.pid is not None:
                self.proc.join(1)                        # reap it
        finally:
            self._input.close(0)
            self._output.close(0)
            self._ctx.term()
            for fd in (getattr(self, "_wake_r", None), getattr(self, "_wake_w", None)):
                if fd is not None:
                    os.close(fd)
            shutil.rmtree(self._dir, ignore_errors=True)


def _die_with_parent() -> None:
    """Linux: have the kernel SIGKILL this process when its parent dies (a kill -9 of the server leaves no core)."""
    if sys.platform.startswith("linux"):
        try:
            import ctypes
            ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)     # PR_SET_PDEATHSIG = 1
        except OSError:
            pass


def run_engine_core(config, parts, input_addr: str, output_addr: str, ready, parent_pid: int) -> None:
    """The core process (an importable function, as "spawn" requires): build an EngineCore, report
    ("ready", facts) or ("error", exception) on `ready`, then run the busy loop (module docstring)."""
    _die_with_parent()
    # Ctrl-C in a terminal reaches the whole process group: the front end decides what stops (it sends
    # EngineCoreShutdown); SIGTERM keeps its default (end now).
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    import zmq
    from nanovllm_ref.engine.core import EngineCore
    try:
        core = EngineCore(config, parts)
    except BaseException as exc:
        try:
            ready.send(("error", exc))
        except Exception:                                 # an exception that does not pickle
            ready.send(("error", RuntimeError(f"{type(exc).__name__}: {exc}")))
        return
    ctx = zmq.Context()
    inp, out = ctx.socket(zmq.PULL), ctx.socket(zmq.PUSH)
    for sock in (inp, out):
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.SNDHWM, 0)
        sock.setsockopt(zmq.RCVHWM, 0)
    inp.connect(input_addr)
    out.connect(output_addr)
    ready.send(("ready", {"num_kvcache_blocks": core.config.num_kvcache_blocks,
                          "async_scheduling": core.async_scheduling, "scheduler_cls": type(core.scheduler),
                          "block_manager_cls": type(core.scheduler.block_manager)}))
    ready.close()
    # Everything built so far (torch modules, compiled graphs, the scheduler's tables) lives as long as the core:
    # freeze it out of the garbage collector's view, so a full collection mid-run walks only what the steps
    # allocate, not the whole start-up heap (a pause there stalls every running stream).
    gc.collect()
    gc.freeze()
    decode, encode = input_decoder().decode, output_encoder().encode
    try:
        while True:
            if not core.has_work():
                while not inp.poll(IDLE_POLL_MS):          # idle: block on the input socket
                    if os.getppid() != parent_pid:         # orphaned (no PDEATHSIG here): stop
                        return
            stop = aborted = False
            while True:                                    # every add and abort that arrived, in order
                try:
                    message = decode(inp.recv(zmq.NOBLOCK, copy=False).buffer)
                except zmq.Again:
                    break
                if isinstance(message, EngineCoreRequest):
                    core.add_request(message)
                elif isinstance(message, EngineCoreAbort):
                    core.abort([message.request_id if message.index < 0 else (message.request_id, message.index)])
                    aborted = True
                else:
                    stop = True
            if stop:
                return
            if core.has_work():
                out.send(encode(core.step()), copy=False)
            elif aborted:                                  # no step follows: still report the freed seats and blocks
                out.send(encode(EngineCoreOutputs(scheduler_stats=core.scheduler_stats())), copy=False)
    except BaseException as exc:
        traceback.print_exc()
        out.send(encode(EngineCoreOutputs(error=f"{type(exc).__name__}: {exc}")))
        raise SystemExit(1)
    finally:
        try:
            core.shutdown()
        finally:
            inp.close(0)
            out.close(1000)                                # let the last message (an error) leave
            ctx.term()
