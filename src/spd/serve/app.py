"""The FastAPI app: OpenAI-compatible routes over the worker, errors, streaming, and `run()`.

Every generation request is checked (model, n, prompt length) before it takes a queue slot, so
the errors come back as plain HTTP statuses, always in OpenAI's error JSON: 400 for a body that
does not parse or a request this server cannot serve (`param` names the field), 404 for another
model, 429 when the queue is full, 503 while the pipeline is down; a 500 only for a server fault.
A client that goes away (mid-stream, or while waiting) cancels its job.
"""

from __future__ import annotations

import asyncio
import json
import logging
from contextlib import asynccontextmanager

import anyio
from fastapi import FastAPI, Request  # the ASGI app: routes, pydantic bodies, OpenAPI docs
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from starlette.exceptions import HTTPException

from .metrics import render as render_metrics
from .protocol import (
    APIError,
    ChatRequest,
    CompletionRequest,
    SamplingFields,
    Shape,
    chat_prompt_ids,
    completion_budget,
    completion_prompt_ids,
)
from .worker import Job, QueueFull, Scheduler

log = logging.getLogger(__name__)

COMPLETION_DEFAULT_MAX_TOKENS = 16   # OpenAI's default for /v1/completions; chat fills the context


def create_app(backend, queue_size: int = 16) -> FastAPI:
    """An app serving `backend` one request at a time, with `queue_size` more waiting."""
    scheduler = Scheduler(backend, queue_size)

    @asynccontextmanager
    async def lifespan(app):
        scheduler.start()
        yield
        await asyncio.to_thread(scheduler.stop)

    app = FastAPI(title="spd", summary="OpenAI-compatible server over Speculative Pipeline Decoding",
                  lifespan=lifespan)
    app.state.scheduler = scheduler

    @app.exception_handler(APIError)
    async def api_error(request, err: APIError):
        return error_response(err)

    @app.exception_handler(RequestValidationError)
    async def bad_body(request, err: RequestValidationError):
        errors = err.errors()
        return error_response(APIError(400, describe(errors), error_param(errors)))

    @app.exception_handler(HTTPException)
    async def http_error(request, err: HTTPException):
        return error_response(APIError(err.status_code, str(err.detail)))

    @app.exception_handler(Exception)
    async def server_fault(request, err: Exception):   # a bug, not a bad request: still OpenAI's JSON
        log.error("unhandled error answering %s", request.url.path, exc_info=err)
        return error_response(APIError(500, f"internal server error: {type(err).__name__}", kind="server_error"))

    @app.get("/health")
    async def health():
        status = backend.state   # ok; recovering (stages restarting); failed (for good)
        state = {"status": status, "model": backend.name, "n_stages": backend.n_stages,
                 "restarts": backend.restarts, **scheduler.snapshot()}
        if status != "ok":
            state["reason"] = backend.failure
        return JSONResponse(state, status_code=200 if status == "ok" else 503)

    @app.get("/metrics")
    async def metrics():
        return PlainTextResponse(render_metrics(backend, scheduler), media_type="text/plain; version=0.0.4")

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": backend.name, "object": "model", "created": 0,
                                            "owned_by": "spd", "max_model_len": backend.max_model_len}]}

    @app.post("/v1/chat/completions")
    async def chat(body: ChatRequest, request: Request):
        prompt_ids = chat_prompt_ids(backend.tokenizer, body.messages)
        asked = body.max_completion_tokens or body.max_tokens
        return await generate(request, body, prompt_ids, asked, None, chat=True)

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request):
        prompt_ids = completion_prompt_ids(backend.tokenizer, body.prompt)
        return await generate(request, body, prompt_ids, body.max_tokens, COMPLETION_DEFAULT_MAX_TOKENS,
                              chat=False)

    async def generate(request: Request, body: SamplingFields, prompt_ids: list[int],
                       asked: int | None, default: int | None, chat: bool):
        """Check the request, queue its job, and answer as one body or as a stream."""
        check_request(backend, body, prompt_ids)
        params = body.sampling()
        budget = completion_budget(len(prompt_ids), asked, default, backend.max_model_len)
        eos = () if body.ignore_eos else backend.eos_token_ids
        job = Job(prompt_ids, params, budget, eos, body.stop_strings(), asyncio.get_running_loop())
        shape = Shape(chat, backend.name, body.return_token_ids)
        try:
            scheduler.submit(job)
        except QueueFull as err:
            raise APIError(429, str(err), kind="rate_limit_error") from None
        if body.stream:
            include_usage = bool(body.stream_options and body.stream_options.include_usage)
            return JobStream(job, sse(job, shape, len(prompt_ids), include_usage))
        return JSONResponse(await collect(job, request, shape))

    return app


class ErrorJSON(JSONResponse):
    """JSON with non-ASCII escaped: a message that quotes a client's lone surrogate still encodes."""

    def render(self, content) -> bytes:
        return json.dumps(content).encode("ascii")


def error_response(err: APIError) -> JSONResponse:
    headers = {"Retry-After": "1"} if err.status in (429, 503) else None
    return ErrorJSON(err.body(), status_code=err.status, headers=headers)


def error_param(errors: list[dict]) -> str | None:
    """The request field the first validation error is about (OpenAI's `param`): 'temperature',
    'messages[0]'; None when the body as a whole is wrong (not JSON, not an object)."""
    for e in errors:
        loc = e["loc"][1:] if e["loc"] and e["loc"][0] == "body" else e["loc"]
        if e["type"] == "json_invalid" or not loc or not isinstance(loc[0], str):
            continue
        if len(loc) > 1 and isinstance(loc[1], int):
            return f"{loc[0]}[{loc[1]}]"
        return loc[0]
    return None


def describe(errors: list[dict]) -> str:
    """pydantic's validation errors -> one line naming each bad field."""
    if any(e["type"] == "json_invalid" for e in errors):
        where = next(e for e in errors if e["type"] == "json_invalid")["loc"][-1]
        return f"the request body is not valid JSON (JSON decode error at character {where})"
    fields = "; ".join(f"{'.'.join(str(p) for p in e['loc'][1:]) or 'body'}: {e['msg']}" for e in errors)
    return f"invalid request body: {fields}"


def check_request(backend, body: SamplingFields, prompt_ids: list[int]) -> None:
    if backend.state == "failed":   # while "recovering", requests wait in the queue for the restart
        raise APIError(503, f"the decoding pipeline failed and this server cannot decode any more: "
                            f"{backend.failure}", None, "server_error")
    if body.model is not None and body.model != backend.name:
        raise APIError(404, f"model {body.model!r} is not served here; this server serves "
                            f"{backend.name!r} (see /v1/models)", "model", "not_found_error")
    if body.n != 1:
        raise APIError(400, f"n={body.n}: SPD decodes one sequence at a time; send n=1 "
                            f"(or n separate requests)", "n")
    if not prompt_ids:
        raise APIError(400, "the prompt is empty once tokenized (no tokens); send some text or token ids",
                       "prompt")
    bad = [i for i in prompt_ids if not 0 <= i < backend.vocab_size]
    if bad:
        raise APIError(400, f"prompt token ids must lie in [0, {backend.vocab_size}); got {bad[:5]}",
                       "prompt")
    if body.stop_strings() and backend.tokenizer is None:
        raise APIError(400, "stop strings need a tokenizer, and this model has none", "stop")


async def collect(job: Job, request: Request, shape: Shape) -> dict:
    """Wait for a whole non-streamed completion; cancel it if the client goes away meanwhile."""
    whole = asyncio.ensure_future(gather_outputs(job, shape))
    gone = asyncio.ensure_future(disconnected(request))
    await asyncio.wait({whole, gone}, return_when=asyncio.FIRST_COMPLETED)
    if whole.done():
        gone.cancel()
        return whole.result()
    job.cancel()
    whole.cancel()
    raise APIError(499, "client closed the request")


async def disconnected(request: Request) -> None:
    """Returns when the client has gone away (the request body is already read)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def gather_outputs(job: Job, shape: Shape) -> dict:
    text, tokens = [], []
    while True:
        out = await job.outputs.get()
        if out.error is not None:
            raise APIError(500, out.error, kind="server_error")
        text.append(out.text)
        tokens += [] if out.token is None else [out.token]
        if out.last:
            return shape.response("".join(text), tokens, out.finish_reason, job.prompt_ids, out.stats)


def event(body: dict) -> str:
    return f"data: {json.dumps(body)}\n\n"


async def sse(job: Job, shape: Shape, prompt_len: int, include_usage: bool):
    """Server-sent events of one job: a chunk per token with new text, the finish, [DONE]."""
    first = shape.first_chunk()
    if first is not None:
        yield event(first)
    count = 0
    while True:
        out = await job.outputs.get()
        if out.error is not None:
            yield event({"error": {"message": out.error, "type": "server_error", "code": 500}})
            break
        count += out.token is not None
        if out.text or (shape.with_token_ids and out.token is not None):
            yield event(shape.chunk(out.text, [] if out.token is None else [out.token]))
        if out.last:
            yield event(shape.last_chunk(out.finish_reason, prompt_len, count, out.stats))
            if include_usage:
                yield event(shape.usage_chunk(prompt_len, count))
            break
    yield "data: [DONE]\n\n"


class JobStream(StreamingResponse):
    """An SSE response that cancels its job when the client disconnects, even between tokens."""

    def __init__(self, job: Job, body):
        super().__init__(body, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
        self.job = job

    async def __call__(self, scope, receive, send) -> None:
        try:
            async with anyio.create_task_group() as group:
                async def stream() -> None:
                    try:
                        await self.stream_response(send)
                    except OSError:  # the client went away mid-write
                        pass
                    group.cancel_scope.cancel()

                group.start_soon(stream)
                await self.listen_for_disconnect(receive)
                group.cancel_scope.cancel()
        finally:
            self.job.cancel()  # a no-op once the job has finished


def run(backend, host: str = "127.0.0.1", port: int = 8000, queue_size: int = 16,
        log_level: str = "info") -> None:
    """Serve until interrupted."""
    import uvicorn  # the ASGI server: HTTP/1.1, keep-alive, graceful shutdown

    log.info("serving %s (n=%d stages) on http://%s:%d", backend.name, backend.n_stages, host, port)
    uvicorn.run(create_app(backend, queue_size), host=host, port=port, log_level=log_level,
                timeout_graceful_shutdown=5)
