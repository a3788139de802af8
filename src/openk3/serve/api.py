"""The OpenAI-compatible HTTP API over the engine (FastAPI).

POST /v1/completions, POST /v1/chat/completions (the chat template of `openk3.tokenizer`; `image_url` content
parts with inline data: URLs for a model with a vision tower, openk3.serve.vision), both with
`stream: true` as server-sent events ending in `data: [DONE]`; GET /v1/models; GET /health (200 once the engine
runs); GET /metrics (Prometheus text). `usage.prompt_tokens_details.cached_tokens` is the prefix-cache hit.
Errors use OpenAI's shape {"error": {"message", "type", "param", "code"}} (openk3.serve.schema): 400 for malformed
JSON, wrong types, missing fields and out-of-range values, 404 for an unknown model or URL, 405 for a wrong
method, 413 for a prompt longer than the context (or an oversized body), 429 when the queue is full, and 500 for
a request whose own sequence failed in the engine (the others keep running; a stream ends with finish_reason
"error" instead).

Request text is encoded with `encode_plain` (special-token strings stay text: only the chat template inserts
control tokens). Parsing, validation and tokenization run on a worker thread, never on the event loop, so
/health and other requests are answered while a large body is tokenized. A client that disconnects, streaming
or not, has its request cancelled at the engine's next step, which frees its sequence.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from openk3.serve.engine import Engine, EngineLoop
from openk3.serve.scheduler import QueueFull, RequestEvent
from openk3.serve.schema import APIError, ChatBody, CompletionBody, SamplingFields, parse_body, sampling_params
from openk3.serve.vision import chat_messages
from openk3.tokenizer import encode_chat

MAX_BODY_BYTES = 8 << 20


def create_app(engine: Engine, model_name: str) -> FastAPI:
    state = {"ready": False, "created": int(time.time())}

    @asynccontextmanager
    async def lifespan(_app: FastAPI):
        loop = EngineLoop(engine).start()
        state["ready"] = True
        yield
        state["ready"] = False
        loop.stop()

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

    @app.get("/health")
    async def health():
        if not state["ready"]:
            return JSONResponse({"status": "starting"}, status_code=503)
        return {"status": "ok"}

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": model_name, "object": "model", "created": state["created"],
                                            "owned_by": "openk3"}]}

    @app.get("/metrics")
    async def metrics():
        return PlainTextResponse(prometheus_text(engine), media_type="text/plain; version=0.0.4")

    def completion_request(raw: bytes) -> tuple[CompletionBody, list[int]]:
        body = parse_body(raw, CompletionBody, model_name)
        if isinstance(body.prompt, str):
            return body, engine.tokenizer.encode_plain(body.prompt)
        if body.prompt and all(isinstance(p, str) for p in body.prompt):
            if len(body.prompt) != 1:
                raise APIError(400, "only one prompt per request is supported", "prompt")
            return body, engine.tokenizer.encode_plain(body.prompt[0])
        return body, list(body.prompt)

    def chat_request(raw: bytes) -> tuple[ChatBody, list[int], list]:
        body = parse_body(raw, ChatBody, model_name)
        messages, images = chat_messages(body, engine.model_config)  # image parts -> placeholder runs (vision.py)
        return body, encode_chat(engine.tokenizer, messages), images

    @app.post("/v1/completions")
    async def completions(request: Request):
        body, prompt = await asyncio.to_thread(completion_request, await read_body(request))  # off the event loop
        return await generate(request, body, prompt, body.max_tokens, "max_tokens", chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        body, prompt, images = await asyncio.to_thread(chat_request, await read_body(request))
        return await generate(request, body, prompt, *body.token_limit(), chat=True, images=images)

    async def generate(request: Request, body: SamplingFields, prompt: list[int], max_tokens: int | None,
                       max_tokens_param: str, chat: bool, images: list | None = None):
        params = sampling_params(body, max_tokens, max_tokens_param, engine.model_config.max_seq_len)
        loop, events = asyncio.get_running_loop(), asyncio.Queue()
        rid = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex[:24]}"
        submit = lambda event: loop.call_soon_threadsafe(events.put_nowait, event)
        try:
            engine.add_request(prompt, params, rid=rid, on_event=submit, images=images)
        except QueueFull as exc:
            raise APIError(429, str(exc), code="queue_full", kind="rate_limit_error") from exc
        except ValueError as exc:
            too_long = len(prompt) >= engine.model_config.max_seq_len
            raise APIError(413 if too_long else 400, str(exc), "messages" if chat else "prompt",
                           "context_length_exceeded" if too_long else None) from exc
        reply = Reply(rid, model_name, chat, body.include_usage)
        if body.stream:
            return StreamingResponse(stream(events, reply, rid), media_type="text/event-stream")
        return await collect(request, events, reply, rid)

    async def stream(events: asyncio.Queue, reply: Reply, rid: str):
        finished = False
        try:
            while not finished:
                event: RequestEvent = await events.get()
                finished = event.finished
                for chunk in reply.chunks(event):
                    yield f"data: {json.dumps(chunk)}\n\n"
            yield "data: [DONE]\n\n"
        finally:
            if not finished:  # the client went away mid-stream
                engine.cancel(rid)

    async def cancel_on_disconnect(request: Request, rid: str) -> None:
        """Wait for the client to drop the connection (the body is read: the next ASGI message is the disconnect),
        then cancel its request; the engine answers with a "cancelled" event at its next step."""
        while (await request.receive())["type"] != "http.disconnect":
            pass
        engine.cancel(rid)

    async def collect(request: Request, events: asyncio.Queue, reply: Reply, rid: str):
        watcher = asyncio.create_task(cancel_on_disconnect(request, rid))
        text = []
        try:
            while True:
                event: RequestEvent = await events.get()
                text.append(event.text)
                if event.finished:
                    break
        finally:
            watcher.cancel()
        if event.finish_reason == "cancelled":
            raise APIError(499, "the client closed the connection")
        if event.finish_reason == "error":
            raise APIError(500, "the engine failed while running this request", kind="server_error")
        return reply.full("".join(text), event)

    return app


async def read_body(request: Request) -> bytes:
    """The body, refused with 413 as soon as it passes MAX_BODY_BYTES (never held whole beyond that)."""
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > MAX_BODY_BYTES:
            raise APIError(413, f"the request body exceeds {MAX_BODY_BYTES} bytes", code="request_too_large")
        chunks.append(chunk)
    return b"".join(chunks)


class Reply:
    """OpenAI response objects for one request."""

    def __init__(self, rid: str, model: str, chat: bool, include_usage: bool):
        self.rid, self.model, self.chat, self.include_usage = rid, model, chat, include_usage
        self.created = int(time.time())
        self.sent_role = False

    def usage(self, event: RequestEvent) -> dict:
        return {"prompt_tokens": event.prompt_tokens, "completion_tokens": event.completion_tokens,
                "total_tokens": event.prompt_tokens + event.completion_tokens,
                "prompt_tokens_details": {"cached_tokens": event.cached_tokens}}

    def _envelope(self, choices: list[dict], chunk: bool) -> dict:
        kind = ("chat.completion.chunk" if chunk else "chat.completion") if self.chat else "text_completion"
        return {"id": self.rid, "object": kind, "created": self.created, "model": self.model, "choices": choices}

    def chunks(self, event: RequestEvent) -> list[dict]:
        reason = event.finish_reason if event.finished else None
        if self.chat:
            delta = {"content": event.text}
            if not self.sent_role:
                delta, self.sent_role = {"role": "assistant", **delta}, True
            choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": reason}
        else:
            choice = {"index": 0, "text": event.text, "logprobs": None, "finish_reason": reason}
        out = [self._envelope([choice], chunk=True)]
        if event.finished and self.include_usage:
            out.append({**self._envelope([], chunk=True), "usage": self.usage(event)})
        return out

    def full(self, text: str, event: RequestEvent) -> dict:
        if self.chat:
            choice = {"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": None,
                      "finish_reason": event.finish_reason}
        else:
            choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": event.finish_reason}
        return {**self._envelope([choice], chunk=False), "usage": self.usage(event)}


def prometheus_text(engine: Engine) -> str:
    """The engine's counters and gauges in the Prometheus text format (version 0.0.4)."""
    m, lines = engine.metrics, []

    def metric(name: str, kind: str, help_text: str, samples: list[tuple[str, float]]) -> None:
        lines.extend([f"# HELP openk3_{name} {help_text}", f"# TYPE openk3_{name} {kind}"])
        lines.extend(f"openk3_{name}{labels} {value}" for labels, value in samples)

    metric("requests_received_total", "counter", "Requests accepted.", [("", m.requests_received)])
    metric("requests_finished_total", "counter", "Requests finished, by reason.",
           [(f'{{reason="{r}"}}', n) for r, n in sorted(m.requests_finished.items())] or [('{reason="stop"}', 0)])
    metric("prompt_tokens_total", "counter", "Prompt tokens of admitted requests.", [("", m.prompt_tokens)])
    metric("generation_tokens_total", "counter", "Generated tokens.", [("", m.generation_tokens)])
    metric("queue_requests", "gauge", "Requests waiting for admission.", [("", len(engine.scheduler.waiting))])
    metric("running_requests", "gauge", "Requests being prefilled or decoded.", [("", len(engine.scheduler.running))])
    metric("engine_steps_total", "counter", "Engine steps.", [("", m.steps)])
    metric("time_to_first_token_seconds_sum", "counter", "Sum of times to first token.", [("", m.ttft_seconds_sum)])
    metric("time_to_first_token_seconds_count", "counter", "Requests with a first token.", [("", m.ttft_count)])
    cache = engine.prefix_cache
    stats = cache.stats if cache is not None else None
    metric("prefix_cache_queried_tokens_total", "counter", "Prompt tokens looked up in the prefix cache.",
           [("", stats.queried_tokens if stats else 0)])
    metric("prefix_cache_hit_tokens_total", "counter", "Prompt tokens served from the prefix cache.",
           [("", stats.hit_tokens if stats else 0)])
    metric("prefix_cache_utilisation", "gauge", "Used fraction of the prefix cache's device tier.",
           [("", cache.utilisation if cache is not None else 0.0)])
    return "\n".join(lines) + "\n"
