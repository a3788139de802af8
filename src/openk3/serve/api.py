"""The OpenAI-compatible HTTP API over the engine (FastAPI).

POST /v1/completions, POST /v1/chat/completions (the chat template of `openk3.tokenizer`; `image_url` content
parts with inline data: URLs for a model with a vision tower, openk3.serve.vision), both with
`stream: true` as server-sent events ending in `data: [DONE]`; GET /v1/models (its `input_modalities` hold "image"
for a model with a vision tower); GET or HEAD /health (200 once the engine runs); GET /metrics (Prometheus text,
openk3.serve.metrics); GET / (the chat page, static/chat.html: one self-contained file, nothing fetched from
elsewhere, which its Content-Security-Policy enforces). `usage.prompt_tokens_details.cached_tokens` is the
prefix-cache hit. A request with `n` choices becomes n engine requests (the first with the request's `seed`, the
others with seeds derived from it: `openk3.sampling.choice_seed`); with the prefix cache on, the others are admitted
once the first has prefilled, so they reuse its prompt. Response objects: openk3.serve.responses.
Errors use OpenAI's shape {"error": {"message", "type", "param", "code"}} (openk3.serve.schema): 400 for malformed
JSON, wrong types, missing fields and out-of-range values, 404 for an unknown model or URL, 405 for a wrong
method, 413 for a prompt longer than the context (or an oversized body), 429 when the queue is full, and 500 for
a request whose own sequence failed in the engine (the others keep running; a stream ends with finish_reason
"error" instead).

Request text is encoded with `encode_plain` (special-token strings stay text: only the chat template inserts
control tokens). Parsing, validation and tokenization run on a worker thread, never on the event loop, so
/health and other requests are answered while a large body is tokenized. A client that disconnects, streaming
or not, has its request cancelled at the engine's next step, which frees its sequence. The engine runs on its own
thread and hands each step's events to the event loop at once; a request without `stream` gets only its first
token's event (for the time-to-first-token metric) and its last. A stream that falls behind its engine sends the
events queued meanwhile in one write (the same events, fewer socket sends: bench/api_host.py).
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from contextlib import asynccontextmanager
from dataclasses import replace
from importlib import resources

from fastapi import FastAPI, Request
from fastapi.responses import HTMLResponse, JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect

from openk3.sampling import choice_seed
from openk3.serve.core import LocalCore, ProcessCore
from openk3.serve.engine import Engine
from openk3.serve.metrics import RequestTimer, ServerMetrics
from openk3.serve.responses import Reply, TokenNames
from openk3.serve.scheduler import QueueFull, RequestEvent
from openk3.serve.schema import APIError, ChatBody, CompletionBody, SamplingFields, parse_body, sampling_params
from openk3.serve.vision import RemoteImages, chat_messages
from openk3.tokenizer import PromptTooLong, encode_chat

MAX_BODY_BYTES = 8 << 20
CHAT_PAGE = resources.files("openk3.serve") / "static" / "chat.html"
# the page's own inline script and style, requests to this server, and images the user attached (data: URLs)
CHAT_PAGE_POLICY = ("default-src 'none'; script-src 'unsafe-inline'; style-src 'unsafe-inline'; connect-src 'self'; "
                    "img-src 'self' data:; base-uri 'none'; form-action 'none'")
log = logging.getLogger(__name__)


def create_app(engine: Engine | LocalCore | ProcessCore, model_name: str,
               remote_images: RemoteImages | None = None) -> FastAPI:
    """The app over an engine: an `Engine` (run on a thread of this process) or a core (openk3.serve.core)."""
    core = LocalCore(engine) if isinstance(engine, Engine) else engine
    info, tokenizer = core.info, core.tokenizer
    state = {"ready": False, "created": int(time.time())}
    metrics = ServerMetrics(core)
    names = TokenNames(tokenizer, set(info.stop_ids))
    chat_page = CHAT_PAGE.read_text(encoding="utf-8")
    modalities = ["text"] if info.model_config.vision is None else ["text", "image"]

    @asynccontextmanager
    async def lifespan(_app: FastAPI):
        event_loop = asyncio.get_running_loop()
        # each engine step's events reach the event loop in one hand-over (a wake-up per step, not per token)
        core.start(lambda events: event_loop.call_soon_threadsafe(deliver, events))
        state["ready"] = True
        yield
        state["ready"] = False
        core.stop()

    app = FastAPI(title="openk3", lifespan=lifespan)

    @app.exception_handler(APIError)
    async def api_error(_request: Request, exc: APIError) -> JSONResponse:
        return exc.response()

    @app.exception_handler(StarletteHTTPException)
    async def routing_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        """404 / 405 from the router in OpenAI's shape (the 405 keeps its Allow header)."""
        code = {404: "unknown_url", 405: "method_not_allowed"}.get(exc.status_code)
        message = f"{exc.detail} ({request.method} {request.url.path})"
        return APIError(exc.status_code, message, code=code).response(exc.headers)

    @app.exception_handler(Exception)
    async def internal_error(_request: Request, exc: Exception) -> JSONResponse:
        return APIError(500, f"internal error: {type(exc).__name__}", kind="server_error").response()

    @app.api_route("/health", methods=["GET", "HEAD"])  # HEAD: load balancers' probes
    async def health():
        if not state["ready"]:
            return JSONResponse({"status": "starting"}, status_code=503)
        if not core.alive():
            return JSONResponse({"status": "engine stopped"}, status_code=503)
        return {"status": "ok"}

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": model_name, "object": "model", "created": state["created"],
                                            "owned_by": "openk3", "input_modalities": modalities}]}

    @app.get("/", include_in_schema=False)
    async def index():
        return HTMLResponse(chat_page, headers={"Content-Security-Policy": CHAT_PAGE_POLICY})

    @app.get("/metrics")
    async def prometheus():
        return Response(metrics.text(), media_type=metrics.content_type)

    def completion_request(raw: bytes) -> tuple[CompletionBody, list[int]]:
        body = parse_body(raw, CompletionBody, model_name)
        if isinstance(body.prompt, str):
            return body, tokenizer.encode_plain(body.prompt)
        if body.prompt and all(isinstance(p, str) for p in body.prompt):
            if len(body.prompt) != 1:
                raise APIError(400, "only one prompt per request is supported", "prompt")
            return body, tokenizer.encode_plain(body.prompt[0])
        return body, list(body.prompt)

    def chat_request(raw: bytes) -> tuple[ChatBody, list[int], list]:
        body = parse_body(raw, ChatBody, model_name)
        messages, images = chat_messages(body, info.model_config, remote_images)  # image parts -> placeholder runs
        try:  # stops encoding once the prompt cannot fit
            prompt = encode_chat(tokenizer, messages, limit=info.max_model_len)
        except PromptTooLong as exc:
            raise APIError(413, f"{exc} (--max-model-len)", "messages", "context_length_exceeded") from None
        return body, prompt, images

    @app.post("/v1/completions")
    async def completions(request: Request):
        arrival = time.perf_counter()
        body, prompt = await asyncio.to_thread(completion_request, await read_body(request))  # off the event loop
        return await generate(request, body, prompt, arrival, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        arrival = time.perf_counter()
        body, prompt, images = await asyncio.to_thread(chat_request, await read_body(request))
        return await generate(request, body, prompt, arrival, chat=True, images=images)

    async def generate(request: Request, body: SamplingFields, prompt: list[int], arrival: float, chat: bool,
                       images: list | None = None):
        params = sampling_params(body, info.max_model_len, info.vocab_limit, len(prompt))
        max_queue = info.max_queue
        if body.n > max_queue:  # its choices wait in the queue together: never admitted, so a 429 would mislead
            raise APIError(400, f"n={body.n} choices can never be queued: this server queues at most "
                                f"max_queue={max_queue} requests (openk3 serve --max-queue)", "n", "invalid_value")
        events = Inbox()
        rid = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex[:24]}"
        rids = [rid] if body.n == 1 else [f"{rid}-{i}" for i in range(body.n)]  # one engine request per choice
        try:
            for i, sub in enumerate(rids):
                seed = params.seed if params.seed is None else choice_seed(params.seed, i)
                submit = lambda event, i=i: events.put((i, event))  # on the event loop (`deliver`)
                core.add_request(prompt, replace(params, seed=seed), rid=sub, on_event=submit,
                                 after=rids[0] if i else None, images=images, every_token=body.stream)
        except QueueFull as exc:
            cancel(rids)
            raise APIError(429, str(exc), code="queue_full", kind="rate_limit_error") from exc
        except ValueError as exc:  # token ids, images (the prompt's length is checked with the token limit)
            raise APIError(400, str(exc), "messages" if chat else "prompt") from exc
        reply = Reply(rid, model_name, chat, body.n, body.include_usage, names, params.logprobs is not None)
        timer = metrics.timer(arrival, body.n)
        if body.stream:
            return StreamingResponse(stream(events, reply, timer, rids), media_type="text/event-stream")
        return await collect(request, events, reply, timer, rids)

    def cancel(rids: list[str]) -> None:
        for rid in rids:
            core.cancel(rid)

    async def stream(events: Inbox, reply: Reply, timer: RequestTimer, rids: list[str]):
        try:
            while not reply.finished:
                # every event that has arrived, in one write: a stream behind its engine otherwise pays the send
                # path once per token
                sse = ""
                for index, event in await events.take():
                    timer.observe(index, event)
                    sse += reply.sse(index, event)
                if sse:
                    yield sse
            timer.finish(event.at, reply.reasons())
            yield "data: [DONE]\n\n"
        finally:
            if not reply.finished:  # the client went away mid-stream
                cancel(rids)

    async def cancel_on_disconnect(request: Request, rids: list[str]) -> None:
        """Wait for the client to drop the connection (the body is read: the next ASGI message is the disconnect),
        then cancel its requests; the engine answers with "cancelled" events at its next step."""
        while (await request.receive())["type"] != "http.disconnect":
            pass
        cancel(rids)

    async def collect(request: Request, events: Inbox, reply: Reply, timer: RequestTimer, rids: list[str]):
        watcher = asyncio.create_task(cancel_on_disconnect(request, rids))
        try:
            event = None
            while not reply.finished and not failed(event):
                for index, event in await events.take():
                    timer.observe(index, event)
                    reply.collect(index, event)
                    if failed(event):
                        break
        finally:
            watcher.cancel()
        if event.finish_reason == "cancelled":
            raise APIError(499, "the client closed the connection")
        if event.finish_reason == "error":
            cancel(rids)  # the other choices, if any
            raise APIError(500, "the engine failed while running this request", kind="server_error")
        timer.finish(event.at, reply.reasons())
        return reply.full()

    return app


def failed(event: RequestEvent | None) -> bool:
    return event is not None and event.finish_reason in ("cancelled", "error")


class Inbox:
    """One request's engine events on the event loop: `deliver` puts each as it comes, the request's task takes
    all that have arrived at once (waiting only while there are none), so a stream that fell behind its engine
    writes what queued meanwhile in one send."""

    def __init__(self):
        self._items: list = []
        self._waiter: asyncio.Future | None = None

    def put(self, item) -> None:
        self._items.append(item)
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)

    async def take(self) -> list:
        while not self._items:
            self._waiter = asyncio.get_running_loop().create_future()
            await self._waiter
        items, self._items = self._items, []
        return items


def deliver(events: list) -> None:
    """On the event loop: one engine step's events to their requests' inboxes."""
    for on_event, event in events:
        on_event(event)


async def read_body(request: Request) -> bytes:
    """The body, refused with 413 as soon as it passes MAX_BODY_BYTES (never held whole beyond that). A client that
    leaves before sending all of it is noted in one line at INFO (nobody is there to read the 499)."""
    chunks, size = [], 0
    try:
        async for chunk in request.stream():
            size += len(chunk)
            if size > MAX_BODY_BYTES:
                raise APIError(413, f"the request body exceeds {MAX_BODY_BYTES} bytes", code="request_too_large")
            chunks.append(chunk)
    except ClientDisconnect:
        log.info("%s %s: the client disconnected after %d bytes of the body", request.method, request.url.path, size)
        raise APIError(499, "the client closed the connection before sending the whole body") from None
    return b"".join(chunks)
