"""The OpenAI-compatible HTTP server: `python -m nanovllm_ref serve --model PATH` (serving chapter).

FastAPI routes (vLLM's `vllm/entrypoints/openai/api_server.py` serves the same ones):

| route | answers |
|---|---|
| GET /health | 200 while the engine loop runs (with the engine's stats() after the last step and the loop's host time), 503 once it failed or is shutting down |
| GET /v1/models | the one served model, with its max_model_len |
| POST /v1/completions | text for a prompt (str, token ids, or a batch of either) |
| POST /v1/chat/completions | the assistant's next message for a conversation (the model's chat template) |

Both POST routes stream with `"stream": true`: server-sent events, one `data: {chunk}` per piece of new text,
a chunk with the finish_reason when a choice ends, a usage chunk when `stream_options.include_usage` (the
other chunks then carry "usage": null; without it they have no usage key, as in OpenAI's API), then
`data: [DONE]`. A chunk may carry the text of several engine steps when the client reads slower than the
engine writes. Without streaming, the answer is one JSON body; both carry `usage` and `finish_reason`, and
`logprobs` when asked for (serving.py builds OpenAI's shapes; a stream's chunks carry each token's once).

Browser clients: every route answers CORS preflights (OPTIONS with Origin and Access-Control-Request-Method),
and every answer to another origin, errors included, carries Access-Control-Allow-Origin as --allowed-origins,
--allowed-methods, --allowed-headers and --allow-credentials say (Starlette's CORSMiddleware, as vLLM).

Every error, whatever its origin (the checks here, FastAPI's routing and body parsing, an unexpected
failure), uses OpenAI's body, `{"error": {"message", "type", "param", "code"}}`, with `param` naming the
field: 400 for a body that is not UTF-8 JSON, a bad or unknown field, text the tokenizer cannot encode, a
field the engine cannot honour, or a request that can never run (max_model_len, the KV cache, more prompts
than --max-queued-requests); 404 for another model's name or an unknown route; 405 for a route's other
methods; 413 for a body over --max-request-bytes; 500 for a server fault; 503 when the server already holds
`--max-queued-requests` requests, or is stopping. A client that disconnects has its requests aborted
(their KV blocks are freed at the next step). SIGTERM or Ctrl-C: in-flight requests are aborted (streams end
with finish_reason "abort", unanswered requests get 503, those still being tokenized too), then the engine's
exit() runs and the process exits with status 0 (without waiting for a prompt still being encoded).

The event loop only moves bytes: prompts are tokenized and chat templates rendered on one worker thread, so
a long prompt delays its own answer, never the other clients' streams or /health (tokenizers release the
GIL while they encode). One thread, because a transformers tokenizer is not documented as safe under
concurrent calls; --max-request-bytes bounds how long one request can hold it.
"""
import asyncio
import gc
import itertools
import json
import logging
import queue
import signal
import socket
import sys
import threading
import time
from concurrent.futures import Executor, Future
from contextlib import asynccontextmanager

import uvicorn
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException

from nanovllm_ref.entrypoints.cli_args import DEFAULT_CORS, DEFAULT_MAX_REQUEST_BYTES
from nanovllm_ref.entrypoints.openai.engine_loop import Aborted, EngineDead, EngineLoop, Overloaded, TooLarge
from nanovllm_ref.entrypoints.openai.protocol import (APIError, AssistantMessage, ChatChoice, ChatChunkChoice,
                                                      ChatCompletionChunk, ChatCompletionRequest,
                                                      ChatCompletionResponse, CompletionChoice,
                                                      CompletionRequest, CompletionResponse, DeltaMessage,
                                                      ModelCard, ModelList, random_id,
                                                      stream_chunk_head)
from nanovllm_ref.entrypoints.openai.sampling import request_param
from nanovllm_ref.entrypoints.openai.serving import (Choices, TextOffsets, chat_inputs, chat_logprobs,
                                                     completion_inputs, completion_logprobs, needs_tokenizer)
from nanovllm_ref.errors import RequestError

logger = logging.getLogger("uvicorn.error")          # uvicorn configures it: one log for the server


class ClientGone(Exception):
    """Put in a group's queue when the client disconnected."""


# What a field of several accepted shapes (a pydantic union) takes, for its 400: pydantic reports one error
# per shape ("prompt.str: Input should be a valid string" first), which names none of the others.
UNION_FORMS = {
    "prompt": "a str, a list of str, a list of int token ids, or a list of token-id lists (a batch's prompts are "
              "all texts or all token-id lists)",
    "content": 'a str or a list of text parts ({"type": "text", "text": ...}); this server serves text only',
    "stop": "a str or a list of str",
}


def _dotted(loc) -> str:
    return "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in loc).lstrip(".")


def _union_error(errors: list[dict]) -> APIError | None:
    """The 400 for a value that fits none of a union's shapes, or None if the first error is not one: the
    shapes it may take (UNION_FORMS), and where the shape that got furthest failed."""
    locs = [[p for p in e.get("loc", ()) if p != "body"] for e in errors]
    first = locs[0]
    for i, tag in enumerate(first):
        # a union of UNION_FORMS: its members appear as string tags right after the field, in 2+ errors (other
        # fields of one message, or a dict's keys, also differ at one position: those are not unions)
        if i == 0 or first[i - 1] not in UNION_FORMS or not isinstance(tag, str) or not any(
                len(o) > i and o[:i] == first[:i] and isinstance(o[i], str) and o[i] != tag for o in locs):
            continue
        branches: dict[str, list] = {}
        for o, e in zip(locs, errors):
            if len(o) > i and o[:i] == first[:i]:
                branches.setdefault(o[i], []).append((o, e))
        # the shape that got furthest: its errors the deepest, then the fewest of them, then its first error the
        # furthest along; reported at that first error (pydantic lists them in order), the earliest bad element
        shape = max(branches.values(), key=lambda b: (max(len(o) for o, _ in b), -len(b),
                                                      [p for p in b[0][0][i + 1:] if isinstance(p, int)]))
        depth = max(len(o) for o, _ in shape)
        deepest, err = next((o, e) for o, e in shape if len(o) == depth)
        where, forms = _dotted(first[:i]), UNION_FORMS[first[i - 1]]
        at = _dotted(first[:i] + deepest[i + 1:])
        got = err.get("input")
        got = f" (got {got!r:.60})" if isinstance(got, (str, int, float)) and not isinstance(got, bool) else ""
        return APIError(f"{where} must be {forms}; at {at}: {err.get('msg')}{got}", param=str(first[0]))
    return None


def _validation_error(exc: RequestValidationError) -> APIError:
    """The first pydantic error as an OpenAI error body naming its top-level field."""
    errors = exc.errors()
    err = errors[0]
    loc = [p for p in err.get("loc", ()) if p != "body"]
    if err.get("type") == "json_invalid":
        return APIError(f"malformed JSON body: {err.get('msg')} (at character {loc[0] if loc else '?'})",
                        param=None)
    if not loc:
        return APIError(f"the request body is missing or not a JSON object: {err.get('msg')}", param=None)
    union = _union_error(errors)
    if union is not None:
        return union
    field, path = str(loc[0]), ".".join(str(p) for p in loc)
    if err.get("type") == "extra_forbidden":
        return APIError(f"unknown field `{path}`: this server does not know it (a typo?)", param=field)
    return APIError(f"{path}: {err.get('msg')}", param=field)


class _ErrorJSON(JSONResponse):
    """An error body, ASCII-escaped: its message may quote what the client sent (a field name, a model name),
    and text that is not valid Unicode (a lone surrogate) must still make a 4xx, not a failure to encode."""

    def render(self, content) -> bytes:
        return json.dumps(content, ensure_ascii=True, separators=(",", ":")).encode("ascii")


def _error_response(err: APIError, headers: dict | None = None) -> JSONResponse:
    if err.status == 503:
        headers = {**(headers or {}), "Retry-After": "1"}
    return _ErrorJSON(err.body(), status_code=err.status, headers=headers)


def _http_error(method: str, path: str, exc: HTTPException) -> APIError:
    """Starlette's and FastAPI's own errors (no route, a route's other method, a body that does not parse)
    in OpenAI's shape."""
    if exc.status_code == 404:
        return APIError(f"no route {method} {path}; this server has GET /health, GET /v1/models, "
                        "POST /v1/completions and POST /v1/chat/completions", status=404, type="not_found_error")
    if exc.status_code == 405:
        return APIError(f"{method} is not allowed on {path}; use {(exc.headers or {}).get('Allow', 'another method')}",
                        status=405)
    if exc.status_code == 400:                  # FastAPI: the body is not UTF-8, or JSON nested too deep to parse
        return APIError(f"the request body could not be parsed as JSON ({exc.detail}): it must be a UTF-8 JSON "
                        "object, not nested too deep")
    return APIError(str(exc.detail), status=exc.status_code,
                    type="invalid_request_error" if exc.status_code < 500 else "internal_server_error")


class _BodyLimit:
    """ASGI middleware: a request whose body exceeds max_bytes is answered 413 before the app reads it (one
    client must not make the server parse and tokenize without bound). A declared Content-Length is checked
    at once (the HTTP parser holds the body to it); a chunked body is read up to the limit, then passed on."""

    def __init__(self, app, max_bytes: int):
        self.app, self.max_bytes = app, max_bytes

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        length = dict(scope["headers"]).get(b"content-length")
        if length is not None:
            if length.isdigit() and int(length) > self.max_bytes:      # a malformed one: the parser answers
                return await self._refuse(scope, send, f"{int(length)}")
            return await self.app(scope, receive, send)
        parts, size = [], 0
        while True:
            message = await receive()
            if message["type"] != "http.request":     # the client left while sending
                return
            parts.append(message.get("body", b""))
            size += len(parts[-1])
            if size > self.max_bytes:
                return await self._refuse(scope, send, f"more than {self.max_bytes}")
            if not message.get("more_body", False):
                break
        body = [{"type": "http.request", "body": b"".join(parts), "more_body": False}]

        async def replay():                            # the body once, then the client's own messages
            return body.pop() if body else await receive()
        return await self.app(scope, replay, send)

    async def _refuse(self, scope, send, size: str):
        err = APIError(f"the request body is {size} bytes; this server accepts at most {self.max_bytes} bytes "
                       "(--max-request-bytes)", status=413)
        await _error_response(err)(scope, None, send)


class _ServerFault:
    """ASGI middleware: an exception no handler turned into an answer (a bug, not the client's fault) is logged
    with its traceback and answered 500 in OpenAI's shape, here, inside the CORS middleware, so a browser
    client can read it too (Starlette's own 500 comes from outside every middleware, without CORS headers).
    Once the answer has started (a stream) nothing can be sent instead: the exception goes on to uvicorn,
    which closes the connection."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        started = False

        async def send_and_note(message):
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)
        try:
            await self.app(scope, receive, send_and_note)
        except Exception as exc:
            if started:
                raise
            logger.exception("the server failed on %s %s", scope.get("method"), scope.get("path"))
            err = APIError(f"the server failed on this request ({type(exc).__name__}); see its log", status=500,
                           type="internal_server_error")
            await _error_response(err)(scope, receive, send)


def _sse(chunk) -> str:
    return f"data: {chunk.model_dump_json()}\n\n"


class _TextChunk:
    """The SSE line of a text chunk, cut once per request from the pydantic chunk's own JSON around two marks
    (the choice index and the text), then filled by string joins: the stream's hot path runs once per token
    of every client, thousands of times a second, and building a pydantic model each time would cost more
    than the rest of the server. The shape stays the model's, since the pieces come from its output.

    build(index, text) -> the chunk model. The marks are chosen so each occurs exactly once in the sample's
    JSON (index first): the one occurrence is then the one placed there, whatever the model name, id or
    creation time hold (a name containing a mark would otherwise be cut in two); the next marks are tried
    until they do."""

    def __init__(self, build):
        for k in itertools.count():
            index, text = 987654321 + k, f"@@text{k}@@"
            line, index_mark, text_mark = build(index, text).model_dump_json(), str(index), json.dumps(text)
            if (line.count(index_mark) == 1 and line.count(text_mark) == 1
                    and line.index(index_mark) < line.index(text_mark)):
                break
        head, rest = line.split(index_mark)
        middle, tail = rest.split(text_mark)
        self.head, self.middle, self.tail = "data: " + head, middle, tail + "\n\n"

    def __call__(self, index: int, text: str) -> str:
        return f"{self.head}{index}{self.middle}{json.dumps(text, ensure_ascii=False)}{self.tail}"


def _watch_disconnect(raw: Request, group) -> asyncio.Task:
    """A task that aborts `group` when the client disconnects (uvicorn reports it through receive(); a send
    to a gone client is silently dropped, so waiting for a failed write would never abort)."""
    async def watch():
        while (await raw.receive())["type"] != "http.disconnect":
            pass
        group.abort()
        group.queue.put_nowait(ClientGone())
    return asyncio.create_task(watch())


class _TokenizeThread(Executor):
    """The one tokenizing thread (module docstring), a daemon: a ThreadPoolExecutor's threads are joined when
    the interpreter exits, so a long prompt still being encoded at SIGTERM would hold up the exit for as long as
    it takes (seconds for a few MB of text). Its callers stop waiting for it at shutdown (build_app's off_loop);
    what it was encoding is dropped with the process."""

    def __init__(self):
        self._work: queue.SimpleQueue = queue.SimpleQueue()
        threading.Thread(target=self._run, name="tokenize", daemon=True).start()

    def submit(self, fn, /, *args, **kwargs) -> Future:
        future = Future()
        self._work.put((future, fn, args, kwargs))
        return future

    def shutdown(self, wait: bool = True, *, cancel_futures: bool = False) -> None:
        """Stop after the current call; cancel_futures: cancel the calls not started. Never waits (wait is
        taken for Executor's signature)."""
        if cancel_futures:
            while True:
                try:
                    item = self._work.get_nowait()
                except queue.Empty:
                    break
                if item is not None:
                    item[0].cancel()
        self._work.put(None)

    def _run(self) -> None:
        while (item := self._work.get()) is not None:
            future, fn, args, kwargs = item
            if not future.set_running_or_notify_cancel():       # cancelled before it started
                continue
            try:
                future.set_result(fn(*args, **kwargs))
            except BaseException as exc:
                future.set_exception(exc)


def build_app(engine_loop: EngineLoop, model_name: str, max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES,
              cors: dict | None = None) -> FastAPI:
    """The FastAPI app over `engine_loop` (started and shut down by the app's lifespan). model_name: the name
    /v1/models lists and requests must use (or leave out). max_request_bytes: the largest request body
    accepted (413 beyond it). cors: CORSMiddleware's allow_origins, allow_methods, allow_headers (lists of
    str) and allow_credentials (bool), the --allowed-origins ... flags; None: their defaults (any origin,
    method and header; no credentials), as vLLM's."""
    engine = engine_loop.engine
    if isinstance(max_request_bytes, bool) or not isinstance(max_request_bytes, int) or max_request_bytes < 1:
        raise ValueError(f"max_request_bytes must be an int >= 1, got {max_request_bytes!r}")
    cors = {**DEFAULT_CORS, **(cors or {})}
    if set(cors) != set(DEFAULT_CORS):
        raise ValueError(f"cors takes the keys {sorted(DEFAULT_CORS)}, got {sorted(cors)}")
    tokenize_pool = _TokenizeThread()
    tokenizing: set[asyncio.Future] = set()            # the off_loop calls waiting for the tokenizing thread

    def stop_tokenizing():
        """On SIGTERM (EngineLoop.begin_shutdown): the requests still being tokenized are answered 503 now, not
        after their tokenizing ends (or uvicorn's graceful timeout cancels them with a plain-text 500)."""
        for future in tokenizing:
            future.cancel()
    engine_loop.on_shutdown(stop_tokenizing)

    @asynccontextmanager
    async def lifespan(app):
        await engine_loop.start()
        try:
            yield
        finally:
            tokenize_pool.shutdown(wait=False, cancel_futures=True)
            await engine_loop.shutdown()

    app = FastAPI(title="nanovllm_ref OpenAI-compatible server", lifespan=lifespan)
    # The last one added is the outermost: CORS sees every answer, the 413s and 500s included, so a page on
    # another origin can read them too (a browser hides an answer without Access-Control-Allow-Origin).
    app.add_middleware(_BodyLimit, max_bytes=max_request_bytes)
    app.add_middleware(_ServerFault)
    app.add_middleware(CORSMiddleware, **cors)

    @app.exception_handler(APIError)
    async def api_error(request, exc: APIError):
        return _error_response(exc)

    @app.exception_handler(RequestValidationError)
    async def validation_error(request, exc: RequestValidationError):
        return _error_response(_validation_error(exc))

    @app.exception_handler(HTTPException)
    async def http_error(request, exc: HTTPException):
        return _error_response(_http_error(request.method, request.url.path, exc), headers=exc.headers)

    def not_run():
        return APIError(f"the request was not run: {engine_loop.dead}", status=503, type="service_unavailable")

    async def off_loop(fn, *args):
        """fn(*args) on the tokenizing thread (a long prompt must not stall the event loop). Raises the 503
        APIError when the server stops (or the engine failed) before or while it runs."""
        if engine_loop.dead is not None:
            raise not_run()
        future = asyncio.get_running_loop().run_in_executor(tokenize_pool, fn, *args)
        tokenizing.add(future)
        try:
            return await future
        except asyncio.CancelledError:
            # stop_tokenizing cancelled the future (the server is stopping): 503. Otherwise the handler itself
            # is cancelled (Task.cancelling, Python >= 3.11): let it end.
            cancelling = getattr(asyncio.current_task(), "cancelling", None)
            if engine_loop.dead is None or (cancelling is not None and cancelling()):
                raise
            raise not_run() from None
        finally:
            tokenizing.discard(future)

    @app.get("/health")
    async def health():
        if engine_loop.dead is not None:
            raise APIError(str(engine_loop.dead), status=503, type="service_unavailable")
        return {"status": "ok", "open_requests": engine_loop.num_open, "engine": engine_loop.engine_stats,
                "loop": {**engine_loop.timing, "process_cpu_s": time.process_time()}}

    @app.get("/v1/models")
    async def models() -> ModelList:
        return ModelList(data=[ModelCard(id=model_name, max_model_len=engine.max_model_len)])

    def check_model(name):
        if name is not None and name != model_name:
            raise APIError(f"the model `{name}` does not exist; this server serves `{model_name}`",
                           param="model", status=404, type="not_found_error")

    async def admit(body, inputs, raw: Request):
        """Submit to the loop and wait until the engine took them. Returns (group, disconnect watcher)."""
        try:
            group = engine_loop.submit(inputs)
        except TooLarge as exc:
            raise APIError(str(exc), param="prompt") from exc
        except Overloaded as exc:
            raise APIError(str(exc), status=503, type="service_unavailable") from exc
        except EngineDead as exc:
            raise APIError(str(exc), status=503, type="service_unavailable") from exc
        watcher = _watch_disconnect(raw, group)
        try:
            await group.admitted
        except (ValueError, TypeError) as exc:          # the engine refused a request the checks let through
            watcher.cancel()
            param = request_param(body, exc.field) if isinstance(exc, RequestError) else None
            raise APIError(f"the engine refused the request: {exc}", param=param) from exc
        except (Aborted, EngineDead) as exc:
            watcher.cancel()
            raise APIError(f"the request was not run: {engine_loop.dead or exc}", status=503,
                           type="service_unavailable") from exc
        except BaseException:
            watcher.cancel()
            group.abort()
            raise
        return group, watcher

    async def collect(group, choices: Choices):
        async for prompt_index, out in group:
            choices.update(prompt_index, out)

    async def run(body, raw: Request, inputs, chat: bool):
        n = getattr(inputs[0].sampling_params, "n", 1)
        choices = Choices([len(i.prompt_token_ids) for i in inputs], n)
        # One id and one creation time for the response and every chunk of its stream, as OpenAI's.
        head = dict(id=random_id("chatcmpl" if chat else "cmpl"), model=model_name, created=int(time.time()))
        group, watcher = await admit(body, inputs, raw)
        top = inputs[0].sampling_params.logprobs            # None: no logprobs asked for
        if body.stream:
            include_usage = bool(body.stream_options and body.stream_options.include_usage)
            stream = (_chat_stream if chat else _completion_stream)(group, watcher, choices, head, include_usage,
                                                                    _LogprobsBuilder(engine.tokenizer, top))
            return StreamingResponse(stream, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
        try:
            await collect(group, choices)
        except ClientGone:
            return Response(status_code=499)            # nobody reads it
        except (Aborted, EngineDead) as exc:
            raise APIError(f"the request was not finished: {exc}", status=503, type="service_unavailable") from exc
        finally:
            watcher.cancel()
            group.abort()
        usage, logprobs = choices.usage(), _LogprobsBuilder(engine.tokenizer, top)
        if chat:
            return ChatCompletionResponse(**head, usage=usage, choices=[
                ChatChoice(index=i, message=AssistantMessage(content=c.text), finish_reason=c.finish_reason,
                           stop_reason=c.stop_reason, logprobs=logprobs.chat(c.token_ids, c.logprobs))
                for i, c in choices.final()])
        return CompletionResponse(**head, usage=usage, choices=[
            CompletionChoice(index=i, text=c.text, finish_reason=c.finish_reason, stop_reason=c.stop_reason,
                             logprobs=logprobs.completion(i, c.token_ids, c.logprobs))
            for i, c in choices.final()])

    @app.post("/v1/completions", response_model=None)
    async def completions(body: CompletionRequest, raw: Request):
        check_model(body.model)
        if needs_tokenizer(body.prompt):
            inputs = await off_loop(completion_inputs, body, engine)
        else:
            # Token ids need no tokenizer: checked here, a few microseconds, instead of two thread hand-offs
            # (each waits for the GIL; 256 requests at once queued behind them for ~0.3 s, issue 28).
            inputs = completion_inputs(body, engine)
        return await run(body, raw, inputs, chat=False)

    @app.post("/v1/chat/completions", response_model=None)
    async def chat_completions(body: ChatCompletionRequest, raw: Request):
        check_model(body.model)
        return await run(body, raw, await off_loop(chat_inputs, body, engine), chat=True)

    return app


async def _stream_deltas(group, watcher, choices: Choices):
    """Yield (deltas, error) as outputs arrive; error is "abort" (shutdown) or an error message, then stops.
    Always aborts what is left of the group and stops the watcher at the end."""
    try:
        async for prompt_index, out in group:
            deltas = choices.update(prompt_index, out)
            for more_index, more in group.drain():
                deltas += choices.update(more_index, more)
            yield deltas, None
    except ClientGone:
        return
    except Aborted:
        yield [], "abort"
    except EngineDead as exc:
        yield [], str(exc)
    finally:
        watcher.cancel()
        group.abort()


def _usage_and_done(chunk_cls, head, choices, include_usage, error):
    if error not in (None, "abort"):
        yield f"data: {json.dumps({'error': {'message': error, 'type': 'service_unavailable'}})}\n\n"
    if include_usage:
        yield _sse(chunk_cls(**head, choices=[], usage=choices.usage()))
    yield "data: [DONE]\n\n"


async def _events(group, watcher, choices: Choices, head: dict, include_usage: bool, chunk_cls, text_chunk,
                  finish_chunk):
    """The SSE lines of a stream after any opening chunks, for either endpoint: a chunk per piece of new text
    (`text_chunk(delta)`), one per choice that finishes (`finish_chunk(delta, finish_reason, stop_reason)`;
    the delta's logprobs go with its text chunk when it has text, else with this one), "abort" for every open
    choice when the stream ends early, then usage and [DONE]."""
    error = None
    async for deltas, error in _stream_deltas(group, watcher, choices):
        for d in deltas:
            if d.text:
                yield text_chunk(d)
            if d.finish_reason is not None:
                yield finish_chunk(d if not d.text else None, d.index, d.finish_reason, d.stop_reason)
    if error is not None:                              # shutdown or a dead engine: every choice still ends
        for i, c in choices.final():
            if c.finish_reason is None:
                yield finish_chunk(None, i, "abort", None)
    for line in _usage_and_done(chunk_cls, head, choices, include_usage, error):
        yield line


class _LogprobsBuilder:
    """A request's logprobs in OpenAI's shapes (serving.py), for SamplingParams.logprobs = `top` (None: none
    asked for, and every method returns None). Keeps each completion choice's text_offset across the chunks of
    a stream, so the chunks' logprobs joined equal the non-streamed answer's."""

    def __init__(self, tokenizer, top: int | None):
        self.tokenizer, self.top, self.offsets = tokenizer, top, {}

    def _asked(self, dicts) -> bool:
        if self.top is None:
            return False
        if dicts is None:                              # the engine broke its contract (serving_engine.py)
            raise RuntimeError("the engine returned no logprobs although the request asked for them")
        return True

    def completion(self, index: int, token_ids, dicts):
        if not self._asked(dicts):
            return None
        return completion_logprobs(token_ids, dicts, self.tokenizer, self.offsets.setdefault(index, TextOffsets()))

    def chat(self, token_ids, dicts):
        return chat_logprobs(token_ids, dicts, self.top, self.tokenizer) if self._asked(dicts) else None


async def _completion_stream(group, watcher, choices: Choices, head: dict, include_usage: bool,
                             logprobs: _LogprobsBuilder | None = None):
    logprobs = logprobs or _LogprobsBuilder(None, None)
    chunk_head = stream_chunk_head(head, include_usage)
    fast = _TextChunk(lambda index, text: CompletionResponse(**chunk_head, choices=[CompletionChoice(
        index=index, text=text)]))

    def chunk(index, text, delta, finish_reason=None, stop_reason=None):
        lps = logprobs.completion(index, delta.token_ids, delta.logprobs) if delta is not None else None
        return _sse(CompletionResponse(**chunk_head, choices=[CompletionChoice(
            index=index, text=text, logprobs=lps, finish_reason=finish_reason, stop_reason=stop_reason)]))

    def text_chunk(d):                                 # the hot path, unless logprobs are asked for
        return fast(d.index, d.text) if logprobs.top is None else chunk(d.index, d.text, d)
    async for line in _events(group, watcher, choices, head, include_usage, CompletionResponse, text_chunk,
                              lambda d, index, finish_reason, stop_reason: chunk(index, "", d, finish_reason,
                                                                                 stop_reason)):
        yield line


async def _chat_stream(group, watcher, choices: Choices, head: dict, include_usage: bool,
                       logprobs: _LogprobsBuilder | None = None):
    logprobs = logprobs or _LogprobsBuilder(None, None)
    chunk_head = stream_chunk_head(head, include_usage)

    def chunk(index, delta, d=None, finish_reason=None, stop_reason=None):
        lps = logprobs.chat(d.token_ids, d.logprobs) if d is not None else None
        return _sse(ChatCompletionChunk(**chunk_head, choices=[ChatChunkChoice(
            index=index, delta=delta, logprobs=lps, finish_reason=finish_reason, stop_reason=stop_reason)]))
    fast = _TextChunk(lambda index, text: ChatCompletionChunk(**chunk_head, choices=[ChatChunkChoice(
        index=index, delta=DeltaMessage(content=text))]))

    def text_chunk(d):
        return fast(d.index, d.text) if logprobs.top is None else chunk(d.index, DeltaMessage(content=d.text), d)
    for i, _ in choices.final():                       # OpenAI's first chunk of a choice names the role
        yield chunk(i, DeltaMessage(role="assistant", content=""))
    async for line in _events(group, watcher, choices, head, include_usage, ChatCompletionChunk, text_chunk,
                              lambda d, index, finish_reason, stop_reason: chunk(index, DeltaMessage(), d,
                                                                                 finish_reason, stop_reason)):
        yield line


class _Server(uvicorn.Server):
    """uvicorn's server that, on SIGTERM / SIGINT, first aborts the open requests (so streaming connections
    end at once instead of holding up the graceful shutdown), then stops as uvicorn does."""

    def __init__(self, config, engine_loop: EngineLoop):
        super().__init__(config)
        self.engine_loop = engine_loop

    def handle_exit(self, sig, frame):
        if not self.should_exit:
            logger.info("signal %s: aborting %d open requests, then shutting down", sig, self.engine_loop.num_open)
            self.engine_loop.request_shutdown()
        super().handle_exit(sig, frame)


def check_can_listen(host: str, port: int) -> None:
    """Raise OSError if a server could not listen on host:port now (the port is taken, or the host is not an
    address of this machine): bind every address the host resolves to, as uvicorn will, and let go again."""
    infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    for family, kind, proto, _, address in dict.fromkeys((i[0], i[1], i[2], "", i[4]) for i in infos):
        with socket.socket(family, kind, proto) as sock:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            if family == socket.AF_INET6:
                sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
            sock.bind(address)


def run_server(args, model_path: str, engine_args: dict) -> int:
    """Build the engine, serve until SIGTERM / SIGINT, return the exit status (0 after a clean shutdown).
    args: the parsed `serve` flags (entrypoints/cli_args.py). Raises ValueError / TypeError for bad flags."""
    from nanovllm_ref.entrypoints.openai.serving_engine import build_engine, resolve_engine_core
    engine_core = resolve_engine_core(getattr(args, "engine_core", None), engine_args.get("device", "auto"))
    try:
        check_can_listen(args.host, args.port)         # before the engine loads: a taken port fails in a second
    except OSError as exc:
        print(f"error: cannot listen on {args.host}:{args.port}: {exc}", file=sys.stderr)
        return 1
    engine = build_engine(model_path, engine_args, args.engine_factory, args.engine_factory_kwargs, engine_core)
    # The engine and the app live as long as the server: keep the start-up heap out of the garbage collector's
    # full collections, which would otherwise walk it while streams wait (the core process does the same).
    gc.collect()
    gc.freeze()
    try:
        engine_loop = EngineLoop(engine, args.max_queued_requests)
        app = build_app(engine_loop, args.served_model_name or args.model, args.max_request_bytes,
                        cors=dict(allow_origins=args.allowed_origins, allow_methods=args.allowed_methods,
                                  allow_headers=args.allowed_headers, allow_credentials=args.allow_credentials))
    except BaseException:
        engine.exit()
        raise
    config = uvicorn.Config(app, host=args.host, port=args.port, log_level=args.log_level,
                            access_log=args.access_log, lifespan="on", timeout_graceful_shutdown=10)
    server = _Server(config, engine_loop)
    # uvicorn restores the handlers it found and re-raises the signal it caught once it has stopped; with
    # these in place that second delivery does nothing, and the process exits 0 after a clean shutdown.
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: None)
    try:
        server.run()
    except SystemExit:                                 # uvicorn could not start (the port is taken: it logged why)
        engine.exit()
        return 1
    return 0
