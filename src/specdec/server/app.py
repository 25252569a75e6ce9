"""The FastAPI app: a thin adapter from OpenAI-shaped HTTP requests to the `BatchScheduler`.

Every request is checked in the same order: API key (401), model loaded (503), body (400), model
name (404), prompt and limits (400), then queued (429 when the queue is full). Errors are always
the OpenAI error object `{"error": {"message", "type", "param", "code"}}`; on the streaming path
the same checks run before the first byte, so a bad streaming request gets the same status and
object. A fault after streaming started is sent as a `data: {"error": ...}` event.

The model loads in a background thread so that `/health` can answer 503 while it loads.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
import uuid
from dataclasses import dataclass, field
from typing import Callable

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from ..errors import InvalidRequestError, SpecdecError
from ..models.transformer import Transformer
from ..sampling import SamplingParams
from ..scheduler import BatchScheduler, Delta, RequestHandle, TokenLogprob
from ..scheduler import Request as GenRequest
from ..scheduler import serving_drafters
from ..tokenizer import Tokenizer
from .metrics import ServerMetrics
from .protocol import ChatCompletionRequest, CompletionRequest, _Sampling, parse

DEFAULT_COMPLETION_MAX_TOKENS = 16  # the OpenAI completions default; chat defaults to the context left


@dataclass(frozen=True)
class ServerSettings:
    model: str = "default"
    served_model_name: str = "default"
    drafter: str = "none"
    num_speculative_tokens: int = 5
    max_batch: int = 16
    max_queue: int = 64
    max_model_len: int = 2048
    spec_token_budget: int = 32
    speculation_control: str = "goodput"  # "goodput": learn when drafting pays; "budget": the ceiling only
    api_key: str | None = None
    dtype: str = "auto"
    device: str = "cpu"
    quantize: str = "none"


@dataclass
class ServerState:
    settings: ServerSettings
    metrics: ServerMetrics = field(default_factory=ServerMetrics)
    scheduler: BatchScheduler | None = None
    tokenizer: Tokenizer | None = None
    load_error: str | None = None
    created: int = field(default_factory=lambda: int(time.time()))


class APIError(Exception):
    """An error with its HTTP status, for failures outside `SpecdecError` (auth, routing)."""

    def __init__(self, status: int, message: str, error_type: str, param: str | None = None,
                 code: str | None = None):
        super().__init__(message)
        self.status, self.error_type, self.param, self.code = status, error_type, param, code


def error_body(message: str, error_type: str, param: str | None = None, code: str | int | None = None) -> dict:
    return {"error": {"message": message, "type": error_type, "param": param, "code": code}}


def _specdec_error_response(exc: SpecdecError) -> JSONResponse:
    return JSONResponse(error_body(str(exc), exc.error_type, getattr(exc, "param", None), exc.http_status),
                        status_code=exc.http_status)


def load_model(settings: ServerSettings) -> tuple[Transformer, Tokenizer | None]:
    """Load the target model and its tokenizer (the drafters are loaded for it by `create_app`)."""
    from ..engine import Engine

    engine = Engine.load(settings.model, device=settings.device, dtype=settings.dtype, quantize=settings.quantize)
    return engine.model, engine.tokenizer


def create_app(settings: ServerSettings,
               load: Callable[[ServerSettings], tuple[Transformer, Tokenizer | None]] = load_model) -> FastAPI:
    """The app for `settings`; `load` makes the model (tests pass an already-loaded one)."""
    state = ServerState(settings)

    def load_in_background() -> None:
        try:
            model, tokenizer = load(settings)
            # Every drafter a request may name is loaded now, once (a draft model, an EAGLE head).
            drafters, default = serving_drafters(settings.drafter, model, tokenizer)
            scheduler = BatchScheduler(
                model, tokenizer, drafter=default, drafters=drafters,
                num_speculative_tokens=settings.num_speculative_tokens, max_batch=settings.max_batch,
                max_queue=settings.max_queue, max_model_len=settings.max_model_len,
                spec_token_budget=settings.spec_token_budget,
                max_speculative_tokens=max(16, settings.num_speculative_tokens),
                adaptive=settings.speculation_control == "goodput", on_finish=state.metrics.observe)
            state.tokenizer = tokenizer
            state.scheduler = scheduler.start()
        except Exception as exc:  # reported by /health and every request
            state.load_error = f"{type(exc).__name__}: {exc}"

    async def lifespan(app: FastAPI):
        threading.Thread(target=load_in_background, name="specdec-load", daemon=True).start()
        yield
        # Uvicorn has already waited for in-flight HTTP requests (graceful shutdown); this drains
        # anything the scheduler still holds and stops its thread.
        if state.scheduler is not None:
            await asyncio.to_thread(state.scheduler.shutdown, True, 60.0)

    app = FastAPI(title="specdec", lifespan=lifespan)
    app.state.specdec = state

    @app.exception_handler(SpecdecError)
    async def _specdec_error(request: Request, exc: SpecdecError):
        return _specdec_error_response(exc)

    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError):
        return JSONResponse(error_body(str(exc), exc.error_type, exc.param, exc.code), status_code=exc.status)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException):
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        return JSONResponse(error_body(str(exc.detail), kind, None, exc.status_code), status_code=exc.status_code)

    @app.exception_handler(Exception)
    async def _fault(request: Request, exc: Exception):
        return JSONResponse(error_body(f"internal error: {type(exc).__name__}: {exc}", "internal_error", None, 500),
                            status_code=500)

    def check_key(request: Request) -> None:
        if settings.api_key is None:
            return
        header = request.headers.get("authorization", "")
        if header != f"Bearer {settings.api_key}":
            raise APIError(401, "invalid or missing API key (send 'Authorization: Bearer <key>')",
                           "invalid_request_error", None, "invalid_api_key")

    def ready() -> BatchScheduler:
        if state.load_error is not None:
            raise APIError(503, f"the model failed to load: {state.load_error}", "service_unavailable")
        if state.scheduler is None:
            raise APIError(503, "the model is still loading", "service_unavailable")
        return state.scheduler

    async def body_of(request: Request) -> object:
        try:
            return json.loads(await request.body())
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise InvalidRequestError(f"the request body is not valid JSON: {exc}") from None

    def check_model(name: str | None) -> None:
        if name is not None and name != settings.served_model_name:
            raise APIError(404, f"the model {name!r} does not exist; this server serves "
                                f"{settings.served_model_name!r}", "invalid_request_error", "model", "model_not_found")

    def gen_request(body: _Sampling, prompt_ids: list[int], max_tokens: int | None, logprobs: int | None,
                    scheduler: BatchScheduler) -> GenRequest:
        if max_tokens is None:
            max_tokens = max(1, scheduler.max_model_len - len(prompt_ids))
        sampling = SamplingParams(body.temperature, max(0, body.top_k), body.top_p, body.min_p, body.seed)
        drafter, k = None, None
        if body.speculative is False:
            k = 0
        elif body.speculative is not None and body.speculative is not True:
            drafter, k = body.speculative.drafter, body.speculative.num_tokens
        return GenRequest(prompt_ids, max_tokens, sampling, body.stop_list, drafter, k, logprobs)

    def text_ids(text: str, param: str) -> list[int]:
        if not text:
            raise InvalidRequestError("the prompt is empty", param)
        if state.tokenizer is None:
            raise InvalidRequestError("this model has no tokenizer: send the prompt as a list of token ids", param)
        return state.tokenizer.encode(text)

    def token_text(token: int) -> str:
        return state.tokenizer.decode([token]) if state.tokenizer is not None else ""

    # -- endpoints ------------------------------------------------------------------------------

    @app.get("/health")
    async def health():
        if state.load_error is not None:
            return JSONResponse({"status": "error", "error": state.load_error}, status_code=503)
        if state.scheduler is None:
            return JSONResponse({"status": "loading"}, status_code=503)
        return {"status": "ok"}

    @app.get("/metrics")
    async def metrics():
        return PlainTextResponse(state.metrics.render(state.scheduler, settings.served_model_name),
                                 media_type="text/plain; version=0.0.4")

    @app.get("/v1/models")
    async def models(request: Request):
        check_key(request)
        scheduler = state.scheduler
        return {"object": "list", "data": [{
            "id": settings.served_model_name, "object": "model", "created": state.created, "owned_by": "specdec",
            "max_model_len": scheduler.max_model_len if scheduler else settings.max_model_len}]}

    @app.post("/v1/completions")
    async def completions(request: Request):
        check_key(request)
        scheduler = ready()
        body = parse(CompletionRequest, await body_of(request))
        check_model(body.model)
        prompt = body.single_prompt
        ids = text_ids(prompt, "prompt") if isinstance(prompt, str) else list(prompt)
        gen = gen_request(body, ids, body.max_tokens or DEFAULT_COMPLETION_MAX_TOKENS, body.logprobs, scheduler)
        handle = scheduler.submit(gen, asyncio.get_running_loop())
        rid, created = f"cmpl-{uuid.uuid4().hex}", int(time.time())
        base = {"id": rid, "object": "text_completion", "created": created, "model": settings.served_model_name}

        def logprobs_of(items: list[TokenLogprob] | None, offset: int) -> dict | None:
            if items is None:
                return None
            tokens = [token_text(i.token) for i in items]
            offsets, at = [], offset
            for t in tokens:
                offsets.append(at)
                at += len(t)
            return {"tokens": tokens, "token_logprobs": [i.logprob for i in items],
                    "top_logprobs": [{token_text(t): lp for t, lp in i.top} for i in items],
                    "text_offset": offsets}

        if not body.stream:
            done = await collect(handle, request)
            if done is None:
                return JSONResponse(error_body("client disconnected", "cancelled"), status_code=499)
            raise_fault(done[-1])
            result = RequestHandle.collect(done)
            return {**base, "choices": [{"index": 0, "text": result.text, "logprobs": logprobs_of(result.logprobs, 0),
                                         "finish_reason": result.finish_reason}],
                    "usage": usage_dict(result.usage)}

        async def events():
            offset = 0
            async for delta in guarded(handle):
                if delta.finish_reason == "error":
                    yield sse(error_body(delta.error or "generation failed", "internal_error", None, 500))
                    break
                if delta.text or delta.finish_reason or delta.logprobs:
                    chunk = {**base, "choices": [{"index": 0, "text": delta.text,
                                                  "logprobs": logprobs_of(delta.logprobs, offset),
                                                  "finish_reason": delta.finish_reason}]}
                    if body.include_usage:
                        chunk["usage"] = None
                    yield sse(chunk)
                    offset += len(delta.text)
                if delta.finish_reason and body.include_usage:
                    yield sse({**base, "choices": [], "usage": usage_dict(delta.usage)})
            yield "data: [DONE]\n\n"

        return StreamingResponse(events(), media_type="text/event-stream")

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        check_key(request)
        scheduler = ready()
        body = parse(ChatCompletionRequest, await body_of(request))
        check_model(body.model)
        if state.tokenizer is None:
            raise InvalidRequestError("this model has no tokenizer, so no chat template: use /v1/completions "
                                      "with token ids", "messages")
        ids = state.tokenizer.encode_chat([m.as_template_dict() for m in body.messages])
        top = body.top_logprobs or 0
        gen = gen_request(body, ids, body.max_completion_tokens or body.max_tokens, top if body.logprobs else None,
                          scheduler)
        handle = scheduler.submit(gen, asyncio.get_running_loop())
        rid, created = f"chatcmpl-{uuid.uuid4().hex}", int(time.time())
        base = {"id": rid, "created": created, "model": settings.served_model_name}

        def logprobs_of(items: list[TokenLogprob] | None) -> dict | None:
            if items is None:
                return None

            def entry(token: int, lp: float) -> dict:
                text = token_text(token)
                return {"token": text, "logprob": lp, "bytes": list(text.encode("utf-8"))}

            return {"content": [{**entry(i.token, i.logprob), "top_logprobs": [entry(t, lp) for t, lp in i.top]}
                                for i in items]}

        if not body.stream:
            done = await collect(handle, request)
            if done is None:
                return JSONResponse(error_body("client disconnected", "cancelled"), status_code=499)
            raise_fault(done[-1])
            result = RequestHandle.collect(done)
            return {**base, "object": "chat.completion",
                    "choices": [{"index": 0, "message": {"role": "assistant", "content": result.text},
                                 "logprobs": logprobs_of(result.logprobs), "finish_reason": result.finish_reason}],
                    "usage": usage_dict(result.usage)}

        async def events():
            head = {**base, "object": "chat.completion.chunk"}
            extra = {"usage": None} if body.include_usage else {}
            yield sse({**head, "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""},
                                            "logprobs": None, "finish_reason": None}], **extra})
            async for delta in guarded(handle):
                if delta.finish_reason == "error":
                    yield sse(error_body(delta.error or "generation failed", "internal_error", None, 500))
                    break
                if delta.text or delta.logprobs:
                    yield sse({**head, "choices": [{"index": 0, "delta": {"content": delta.text},
                                                    "logprobs": logprobs_of(delta.logprobs),
                                                    "finish_reason": None}], **extra})
                if delta.finish_reason:
                    yield sse({**head, "choices": [{"index": 0, "delta": {}, "logprobs": None,
                                                    "finish_reason": delta.finish_reason}], **extra})
                    if body.include_usage:
                        yield sse({**head, "choices": [], "usage": usage_dict(delta.usage)})
            yield "data: [DONE]\n\n"

        return StreamingResponse(events(), media_type="text/event-stream")

    return app


def sse(payload: dict) -> str:
    return f"data: {json.dumps(payload, ensure_ascii=False)}\n\n"


def usage_dict(usage) -> dict:
    return {"prompt_tokens": usage.prompt_tokens, "completion_tokens": usage.completion_tokens,
            "total_tokens": usage.prompt_tokens + usage.completion_tokens}


def raise_fault(last: Delta) -> None:
    if last.finish_reason == "error":
        raise SpecdecError(f"generation failed: {last.error}")


async def guarded(handle: RequestHandle):
    """The handle's deltas; if the consumer goes away (client disconnect), cancel the request.

    Starlette cancels the streaming task when the client disconnects (or the next write fails);
    either way this generator is closed, and `finally` frees the batch row.
    """
    try:
        async for delta in handle:
            yield delta
    finally:
        if not handle.consumed:
            handle.cancel()


async def collect(handle: RequestHandle, request: Request, poll_s: float = 0.25) -> list[Delta] | None:
    """All deltas of a non-streaming request; None (and the request cancelled) if the client left."""
    deltas: list[Delta] = []
    iterator = handle.__aiter__()
    try:
        while True:
            step = asyncio.ensure_future(iterator.__anext__())
            while True:
                finished, _ = await asyncio.wait({step}, timeout=poll_s)
                if finished:
                    break
                if await request.is_disconnected():
                    step.cancel()
                    handle.cancel()
                    return None
            try:
                deltas.append(step.result())
            except StopAsyncIteration:
                return deltas
    finally:
        if not handle.consumed:
            handle.cancel()
