"""One background loop owns the engine; HTTP handlers talk to it through queues (serving chapter).

    event loop (HTTP)                              engine thread (the loop)
    handler ──submit()──▶ pending adds ───┐    (and engine.wake(): a step() waiting on a process core returns)
    handler ──abort()───▶ pending aborts ─┴──▶ tick: aborts, adds, one engine.step()
    handler ◀── group queue ◀── deliver ◀──── call_soon_threadsafe(outputs)
    handler ◀── admitted future (ok, or the engine's ValueError: a 400)

The loop runs on its own thread, so the event loop keeps serving HTTP while the engine computes. Each tick
takes the aborts and adds gathered since the last one, then runs one `engine.step()`, and hands the step's
outputs to the event loop. Requests therefore join and leave the running batch between steps: continuous
batching across HTTP clients, with the engine's own scheduler deciding who runs (the server schedules
nothing). Every engine call happens on that thread, one at a time (serving_engine.py's contract). The thread
sleeps on a condition while there is nothing to do.

Back-pressure: at most `max_queued_requests` engine requests are held at once (waiting to join, or in the
engine unfinished); `submit` beyond that raises Overloaded at once (a 503), so a flood of clients gets
quick refusals instead of a queue that grows without bound. An HTTP request with several prompts takes
one place per prompt and is admitted whole or not at all; one with more prompts than there are places could
never be, and raises TooLarge (a 400) instead.

Abort: a handler whose client went away calls `RequestGroup.abort()`; its unfinished requests are aborted
in the engine at the next tick (`abort_request` frees their KV blocks), or dropped before they reach it.

Failure and shutdown: if `step()` raises, the engine is dead: every open request gets the error, and
later submits raise EngineDead (503). With the engine core in its own process (`serve --engine-core
process`, engine/core_client.py) that covers the core dying: `step()` waits on the core's output socket and
its process sentinel together, so a core that raised, was killed or ran out of memory fails the step at once;
while idle the loop asks `engine.check_health()` every HEALTH_POLL_S, and takes its stats again (a process core
reports the seats and blocks that aborts freed after the loop went idle). `begin_shutdown()` (on SIGTERM)
refuses new requests, aborts every open one and runs the `on_shutdown` callbacks (the server's requests still
being tokenized); `shutdown()` then stops the thread, which applies those aborts and calls `engine.exit()`.

Threads: the groups and their queues belong to the event loop; the pending adds and aborts are shared, under
one lock; the engine belongs to the engine thread. Python's GIL lets only one of the two threads run Python
at a time, so host work in `step()` and the HTTP side's per-chunk work slow each other down. With a process
core (vLLM's split), that thread only does the front end's part of a step (detokenizing, stop strings,
RequestOutputs: engine/output_processor.py) and waits on the core's socket, GIL released, the rest of the
time; scheduling and the model run in the core's process.
"""
import asyncio
import itertools
import logging
import threading
import time

logger = logging.getLogger("uvicorn.error")          # the server's log (uvicorn configures it)
HEALTH_POLL_S = 0.2                                    # how often an idle loop asks the engine check_health()


class Overloaded(Exception):
    """The server holds max_queued_requests requests already (answered with 503)."""


class TooLarge(Exception):
    """The HTTP request has more prompts than max_queued_requests: it could never be admitted (a 400)."""


class EngineDead(Exception):
    """The engine failed or the server is shutting down: no new request can run (answered with 503)."""


class Aborted(Exception):
    """Put in a group's queue when its requests were aborted by shutdown."""


def apply_pending(engine, adds, aborts) -> dict:
    """What the engine thread does between two steps, before the next one: first every pending abort
    (`engine.abort_request(id)`: the KV blocks and batch seats they free are there for this very step), then
    every pending add in arrival order (`engine.add_request(prompt_token_ids, sampling_params, id)`).

    adds: list of (group, request_id, input) with `input.prompt_token_ids` and `input.sampling_params`; the
    requests of one HTTP request share a group (any hashable object), and a group is admitted whole or not at
    all: when the engine refuses one of its requests (ValueError or TypeError, its answer to a request it can
    never run), the group's requests already added in this call are aborted again, its later ones are not
    added, and the others go on. aborts: request ids (in the engine, or unknown to it: ignored). Any other
    exception (the engine is broken) propagates. Returns {group: the exception} for every group refused.
    """
    for rid in aborts:
        engine.abort_request(rid)
    refused, added = {}, []
    for group, rid, item in adds:
        if group in refused:
            continue                                  # a sibling was refused: the group is not admitted
        try:
            engine.add_request(item.prompt_token_ids, item.sampling_params, rid)
        except (ValueError, TypeError) as exc:
            refused[group] = exc
            for other, orid in added:                 # undo the siblings already added
                if other is group:
                    engine.abort_request(orid)
            continue
        added.append((group, rid))
    return refused


class RequestGroup:
    """The engine requests of one HTTP request (one per prompt). Iterate with `async for prompt_index, output
    in group`; it ends once every request has finished. `admitted` resolves when the loop has handed them
    all to the engine, or raises the engine's ValueError / TypeError for one it refused."""

    def __init__(self, loop: "EngineLoop", request_ids: list[str], inputs: list):
        self.request_ids = request_ids
        self.inputs = inputs
        self.index = {rid: i for i, rid in enumerate(request_ids)}
        self.unfinished = set(request_ids)
        self.queue: asyncio.Queue = asyncio.Queue()
        self.admitted: asyncio.Future = asyncio.get_running_loop().create_future()
        self._loop = loop

    def abort(self) -> None:
        """Abort every unfinished request of the group (idempotent; nothing happens once all finished)."""
        self._loop._abort_group(self)

    def __aiter__(self):
        return self

    async def __anext__(self):
        if not self.unfinished and self.queue.empty():
            raise StopAsyncIteration
        item = await self.queue.get()
        if isinstance(item, BaseException):
            raise item
        return item

    def drain(self) -> list:
        """Every item already queued, without waiting (a slow client's stream coalesces several steps into
        one chunk). Raises the first error found among them."""
        items = []
        while not self.queue.empty():
            item = self.queue.get_nowait()
            if isinstance(item, BaseException):
                raise item
            items.append(item)
        return items


class EngineLoop:
    """engine: a ServingEngine. max_queued_requests: int >= 1, the most engine requests held at once."""

    def __init__(self, engine, max_queued_requests: int = 1024):
        if isinstance(max_queued_requests, bool) or not isinstance(max_queued_requests, int) or max_queued_requests < 1:
            raise ValueError(f"max_queued_requests must be an int >= 1, got {max_queued_requests!r}")
        self.engine = engine
        self.max_queued_requests = max_queued_requests
        self._groups: dict[str, RequestGroup] = {}        # request id -> its group, until it finishes
        self._ids = itertools.count()
        # Shared with the engine thread, under _cond:
        self._cond = threading.Condition()
        self._pending_adds: list[tuple[RequestGroup, str, object]] = []
        self._pending_aborts: set[str] = set()
        self._stop = False
        self._shutdown_callbacks: list = []
        self._thread: threading.Thread | None = None
        self._stopped: asyncio.Future | None = None         # set when the thread has called engine.exit()
        self.dead: BaseException | None = None               # why the engine cannot run requests any more
        self.num_steps = 0
        self.engine_stats: dict = {}                         # engine.stats() after the last tick, if it has one
        # Host time of the loop, in seconds summed over its life (GET /health shows them): engine.step() calls
        # and their time, whole ticks (aborts + adds + step + stats), whole cycles of the loop while requests
        # were unfinished (a tick, the hand-off, the lock, waiting for the GIL), the engine thread's CPU time
        # in ticks, and _deliver on the event loop.
        self.timing = {"steps": 0, "step_s": 0.0, "tick_s": 0.0, "busy_s": 0.0, "engine_cpu_s": 0.0,
                       "deliver_s": 0.0}

    # -- lifecycle -------------------------------------------------------------------------------------
    async def start(self) -> None:
        """Start the engine thread; its results go to the running event loop (the app's lifespan calls it)."""
        self._event_loop = asyncio.get_running_loop()
        self._stopped = self._event_loop.create_future()
        stats = getattr(self.engine, "stats", None)
        if stats is not None:                                # /health has the engine's numbers from the start
            self.engine_stats = stats()
        self._thread = threading.Thread(target=self._engine_main, name="engine-loop", daemon=True)
        self._thread.start()

    def request_shutdown(self) -> None:
        """begin_shutdown, from a signal handler or another thread (it runs on the event loop soon after)."""
        if self._thread is not None:
            self._event_loop.call_soon_threadsafe(self.begin_shutdown)

    def on_shutdown(self, callback) -> None:
        """callback() runs on the event loop when begin_shutdown does (the server's requests still being
        tokenized, which this loop does not hold yet, are answered then)."""
        self._shutdown_callbacks.append(callback)

    def begin_shutdown(self) -> None:
        """Refuse new requests and abort every open one (SIGTERM); then the on_shutdown callbacks. Safe to
        call twice."""
        if self.dead is None:
            self.dead = EngineDead("the server is shutting down")
        for group in {id(g): g for g in self._groups.values()}.values():
            group.queue.put_nowait(Aborted("the server is shutting down"))
            self._abort_group(group)
        for callback in self._shutdown_callbacks:
            callback()

    async def shutdown(self) -> None:
        """Abort what is open, stop the engine thread after its current tick, wait until it called exit()."""
        self.begin_shutdown()
        if self._thread is None:
            self.engine.exit()
            return
        with self._cond:
            self._stop = True
            self._cond.notify()
        await self._stopped

    @property
    def num_open(self) -> int:
        """Engine requests held now (waiting to join, or unfinished in the engine)."""
        return len(self._groups)

    # -- handler side (event loop thread) --------------------------------------------------------------
    def submit(self, inputs: list) -> RequestGroup:
        """Queue the engine requests of one HTTP request: inputs is a list of objects with
        `.prompt_token_ids` and `.sampling_params`. Raises TooLarge (more prompts than max_queued_requests:
        waiting would never help), Overloaded or EngineDead at once."""
        if len(inputs) > self.max_queued_requests:
            raise TooLarge(f"the request has {len(inputs)} prompts and this server holds at most "
                           f"{self.max_queued_requests} at once (--max-queued-requests); send at most "
                           f"{self.max_queued_requests} prompts per request")
        if self.dead is not None:
            raise EngineDead(str(self.dead))
        if self._thread is None or not self._thread.is_alive():
            raise EngineDead("the engine loop is not running")
        if self.num_open + len(inputs) > self.max_queued_requests:
            raise Overloaded(f"the server holds {self.num_open} requests (--max-queued-requests "
                             f"{self.max_queued_requests}); retry later")
        request_ids = [f"req-{next(self._ids)}" for _ in inputs]
        group = RequestGroup(self, request_ids, inputs)
        for rid in request_ids:
            self._groups[rid] = group
        with self._cond:
            self._pending_adds += [(group, rid, item) for rid, item in zip(request_ids, inputs)]
            self._cond.notify()
        self._wake_engine()
        return group

    def _wake_engine(self) -> None:
        """An engine thread waiting inside step() on a process core returns now and hands the new work to the
        core (LLMEngine.wake), instead of after the core's next step: that step's time would be added to the
        new request's time to first token."""
        wake = getattr(self.engine, "wake", None)
        if wake is not None:
            wake()

    def _abort_group(self, group: RequestGroup) -> None:
        with self._cond:
            queued = {rid for g, rid, _ in self._pending_adds if g is group}
            self._pending_adds = [a for a in self._pending_adds if a[0] is not group]
            for rid in list(group.unfinished):
                group.unfinished.discard(rid)
                if self._groups.get(rid) is group:
                    del self._groups[rid]
                if rid not in queued:                   # never reached the engine: nothing to free there
                    self._pending_aborts.add(rid)
            self._cond.notify()
        self._wake_engine()
        if not group.admitted.done():
            group.admitted.set_exception(Aborted("aborted before admission"))
            group.admitted.exception()                  # retrieved: no "never retrieved" warning

    # -- the loop (engine thread) ----------------------------------------------------------------------
    def _engine_main(self) -> None:
        has_unfinished, cycle_start = False, None
        # An engine whose core can die on its own (a process core) is asked while idle too, so a core killed
        # between requests fails the loop within HEALTH_POLL_S, not at the next request.
        check_health = getattr(self.engine, "check_health", None)
        try:
            while True:
                if has_unfinished and cycle_start is not None:      # one whole cycle while requests ran
                    self.timing["busy_s"] += time.perf_counter() - cycle_start
                with self._cond:
                    while not (self._pending_adds or self._pending_aborts or has_unfinished or self._stop):
                        self._cond.wait(HEALTH_POLL_S if check_health is not None else None)
                        if check_health is not None:
                            check_health()
                            # such a core may report after the loop went idle (the stats after aborts)
                            self._refresh_stats()
                    adds, self._pending_adds = self._pending_adds, []
                    aborts, self._pending_aborts = self._pending_aborts, set()
                    stop = self._stop
                if stop:
                    for rid in aborts:
                        self.engine.abort_request(rid)
                    break
                cycle_start = time.perf_counter()
                refused, outputs, has_unfinished = self._tick(adds, aborts)
                self._event_loop.call_soon_threadsafe(self._deliver, adds, refused, outputs)
        except BaseException as exc:                     # the engine failed mid-step: nothing can run now
            logger.exception("engine step failed; the server answers 503 from now on")
            self._event_loop.call_soon_threadsafe(self._fail_all, exc)
        finally:
            try:
                self.engine.exit()
            finally:
                self._event_loop.call_soon_threadsafe(self._set_stopped)

    def _set_stopped(self) -> None:
        if not self._stopped.done():
            self._stopped.set_result(None)

    def _tick(self, adds, aborts):
        """On the engine thread: the pending aborts and adds (apply_pending), then one step."""
        start, cpu_start = time.perf_counter(), time.thread_time()
        refused = apply_pending(self.engine, adds, aborts)
        outputs = []
        if self.engine.has_unfinished_requests():
            before = time.perf_counter()
            outputs = self.engine.step()
            self.timing["steps"] += 1
            self.timing["step_s"] += time.perf_counter() - before
        self.num_steps += bool(outputs)
        self._refresh_stats()
        self.timing["tick_s"] += time.perf_counter() - start
        self.timing["engine_cpu_s"] += time.thread_time() - cpu_start
        return refused, outputs, self.engine.has_unfinished_requests()

    def _refresh_stats(self) -> None:
        """On the engine thread: engine_stats from the engine's stats(), if it has one."""
        stats = getattr(self.engine, "stats", None)
        if stats is not None:
            self.engine_stats = stats()

    def _deliver(self, adds, refused, outputs) -> None:
        start = time.perf_counter()
        self._deliver_outputs(adds, refused, outputs)
        self.timing["deliver_s"] += time.perf_counter() - start

    def _deliver_outputs(self, adds, refused, outputs) -> None:
        for group, exc in refused.items():
            for rid in group.request_ids:
                self._groups.pop(rid, None)
            group.unfinished.clear()
            if not group.admitted.done():
                group.admitted.set_exception(exc)
        for group, rid, _ in adds:
            if group not in refused and not group.admitted.done():
                group.admitted.set_result(True)
        for out in outputs:
            group = self._groups.get(out.request_id)
            if group is None:                             # aborted while the step ran
                continue
            if out.finished:
                group.unfinished.discard(out.request_id)
                del self._groups[out.request_id]
            group.queue.put_nowait((group.index[out.request_id], out))

    def _fail_all(self, exc: BaseException) -> None:
        self.dead = EngineDead(f"the engine failed: {type(exc).__name__}: {exc}")
        for group in {id(g): g for g in self._groups.values()}.values():
            if not group.admitted.done():
                group.admitted.set_exception(self.dead)
                group.admitted.exception()
            group.queue.put_nowait(self.dead)
            group.unfinished.clear()
        self._groups.clear()
        with self._cond:
            self._pending_adds.clear()
