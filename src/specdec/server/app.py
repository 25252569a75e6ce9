"""The FastAPI app: a thin adapter from OpenAI-shaped HTTP requests to the `BatchScheduler`.

Every request is checked in the same order: draining (503), body size (413, from Content-Length
before the body is read, and while reading it), API key (401: which tenant, `tenants.py`), model
loaded (503), content type (415), body (400), model name (404), the tenant's places (429 when it
has `concurrency` requests generating and `queue` waiting), prompt and limits (400), then queued
(429 when the scheduler's queue is full). Tokenising and rendering the chat template run in a
worker thread, so a large prompt never holds up the event loop (and `/health`). Errors are always the OpenAI error object `{"error": {"message", "type",
"param", "code"}}`, `code` being a string or null as in OpenAI's API; 429 and 503 carry
`Retry-After`. On the streaming path the same checks run before the first byte, so a bad streaming
request gets the same status and object. A fault after streaming started is sent as a
`data: {"error": ...}` event. An unexpected fault (a bug: 500) answers with `Connection: close`,
since the server drops that connection after it; every other error keeps the connection usable.

The model loads in a background thread so that `/health` can answer 503 while it loads; a load
that fails is logged (or handed to `on_load_error`, which `specdec serve` uses to exit with the
error) and every request then gets 503 with the reason; one that succeeds calls `on_ready` (where
`specdec serve` says it is serving).

Tenants and what they share. With keys set, every route but `/health` needs a key: `/v1/*` a
tenant's, `/metrics` a tenant's or the `metrics_key`, `/docs`, `/redoc` and `/openapi.json` any of
them. The prefix cache is partitioned by tenant and by the request's `cache_salt`
(`settings.cache_salt`, `tenants.cache_partition`); `usage.prompt_tokens_details.cached_tokens`
counts the request's own partition's hits. With several tenants a tenant's `/metrics` shows its
own requests only; the server-wide families (whose counters move with other tenants' requests)
need the metrics key. `/health` says only whether the server is up.

Draining (`begin_drain`, which `specdec serve` calls on SIGTERM): the listening socket stays open
and every new request gets 503 with `Connection: close` while the requests in flight finish;
`in_flight` counts them so the server knows when to stop.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Callable

from ..extras import SERVER_MODULES, require

require("server", "specdec.server.app", *SERVER_MODULES)

from fastapi import FastAPI, Request  # noqa: E402 (after the check that says what to install)
from fastapi.openapi.docs import get_redoc_html, get_swagger_ui_html
from fastapi.openapi.utils import get_openapi
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from .. import builder
from ..drafters.base import TreeShape
from ..drafters.prediction import Prediction
from ..errors import Fault, InvalidRequestError, SpecdecError
from ..models.transformer import Transformer
from ..sampling import SamplingParams
from ..scheduler import BatchScheduler, Delta, RequestHandle, TokenLogprob
from ..scheduler import Request as GenRequest
from ..scheduler import DEFAULT_PREFILL_CHUNK, DEFAULT_PREFIX_CACHE_TOKENS, serving_drafters
from ..settings import DEFAULT_NUM_SPECULATIVE_TOKENS, DecodingSettings
from ..tokenizer import Tokenizer
from .metrics import ServerMetrics
from .protocol import ChatCompletionRequest, CompletionRequest, _Sampling, parse
from .tenants import KeyRing, Tenant, TenantGate, cache_partition
from .toolapi import ToolStream, message_of, template_messages, tool_turn
from .wire import AccessLog, BodyLimit, BodyTooLarge, Totals, default_body_limit, error_body, too_large_body

DEFAULT_COMPLETION_MAX_TOKENS = 16  # the OpenAI completions default; chat defaults to the context left
MAX_JSON_DEPTH = 64  # request bodies nest 4 deep; anything near Python's recursion limit is an attack
RETRY_AFTER_S = {429: 1, 503: 5}  # a full queue frees up fast; a load or a drain takes longer
log = logging.getLogger("specdec.server")


@dataclass(frozen=True)
class ServerSettings:
    model: str = "default"
    served_model_name: str = "default"
    drafter: str = "none"
    draft_p_min: float | None = None  # a draft model's confidence cut-off (None: its default)
    draft_vocab: int | None = None  # a draft model's kept ids (FR-Spec; None: all)
    num_speculative_tokens: int = DEFAULT_NUM_SPECULATIVE_TOKENS
    draft_length: str | None = None  # each row's draft-length rule, as generate's (None: cost-aware)
    max_batch: int = 16
    max_queue: int = 64
    max_model_len: int = 2048
    spec_token_budget: int = 32
    prefill_chunk: int = DEFAULT_PREFILL_CHUNK  # prompt tokens per step while others run; 0 = whole prompts
    prefix_cache_tokens: int = DEFAULT_PREFIX_CACHE_TOKENS  # cached tokens kept for reuse; 0 = off
    speculation_control: str = "goodput"  # "goodput": learn when drafting pays; "budget": the ceiling only
    api_key: str | None = None  # one tenant, `default`
    api_keys_file: str | None = None  # one tenant a line, with its limits (`tenants.py`)
    metrics_key: str | None = None  # a key for /metrics alone (all tenants' and server-wide figures)
    cache_salt: str = "request"  # prefix-cache sharing: request | tenant | off (`tenants.cache_partition`)
    max_body_bytes: int | None = None  # None: sized to max_model_len (`wire.default_body_limit`)
    dtype: str = "auto"
    device: str = "cpu"
    quantize: str = "none"
    tensor_parallel: int = 1  # ranks the target is split over (`models/tensor_parallel.py`)
    kv_dtype: str = "auto"  # the target cache's elements (`kv_cache.resolve_kv_dtype`)
    # DEPTHxTOPKxBUDGET: the loaded drafters that draft trees (ngram, eagle, ngram+eagle) draft token
    # trees of this shape in every batch (the budget shrinks with the load cap); the others chains.
    draft_tree: str | None = None


@dataclass
class ServerState:
    settings: ServerSettings
    metrics: ServerMetrics = field(default_factory=ServerMetrics)
    scheduler: BatchScheduler | None = None
    tokenizer: Tokenizer | None = None
    load_error: str | None = None
    created: int = field(default_factory=lambda: int(time.time()))
    draining: bool = False  # set once (begin_drain); read by the gate in front of every request
    in_flight: int = 0  # HTTP requests inside the app (event-loop thread only)
    keys: KeyRing | None = None
    gate: TenantGate = field(default_factory=TenantGate)
    totals: Totals = field(default_factory=Totals)  # what the access log saw
    loop: asyncio.AbstractEventLoop | None = None  # the server's, once it runs

    def reload_keys(self) -> bool:
        """Read the keys file again (SIGHUP); a file that does not parse keeps the old keys."""
        reloaded = self.keys.reload()
        if reloaded:
            self.apply_shares()
        return reloaded

    def apply_shares(self) -> None:
        """Each tenant's part of the prefix cache, from its `cache_share`."""
        cache = self.scheduler.prefix_cache if self.scheduler is not None else None
        if cache is not None:
            cache.owner_budgets = {t.name: int(t.cache_share * cache.budget) for t in self.keys.tenants}

    def finished(self, request: GenRequest, delta: Delta) -> None:
        """The scheduler finished `request` (its thread): metrics, and the tenant's place back."""
        self.metrics.observe(request, delta)
        if self.loop is not None:
            self.loop.call_soon_threadsafe(self.gate.release, request.tenant)

    def begin_drain(self) -> None:
        """Answer 503 to every new request from now on; those in flight finish."""
        self.draining = True


class APIError(Exception):
    """An error with its HTTP status, for failures outside `SpecdecError` (auth, routing, media type)."""

    def __init__(self, status: int, message: str, error_type: str, param: str | None = None,
                 code: str | None = None):
        super().__init__(message)
        self.status, self.error_type, self.param, self.code = status, error_type, param, code


def error_response(status: int, message: str, error_type: str, param: str | None = None, code: str | None = None,
                   headers: dict[str, str] | None = None) -> JSONResponse:
    headers = dict(headers or {})
    if status in RETRY_AFTER_S:
        headers.setdefault("Retry-After", str(RETRY_AFTER_S[status]))
    return JSONResponse(error_body(message, error_type, param, code), status_code=status, headers=headers)


def _specdec_error_response(exc: SpecdecError) -> JSONResponse:
    code = exc.code or ("rate_limit_exceeded" if exc.http_status == 429 else None)
    return error_response(exc.http_status, str(exc), exc.error_type, getattr(exc, "param", None), code)


def load_model(settings: ServerSettings) -> tuple[Transformer, Tokenizer | None]:
    """Load the target model and its tokenizer. No drafter: `create_app` loads the server's drafters
    for it (`serving_drafters`), so a named pair's draft model is loaded once, there."""
    target = DecodingSettings(target=settings.model, drafter="none", device=settings.device, dtype=settings.dtype,
                              quantize=settings.quantize, tensor_parallel=settings.tensor_parallel,
                              kv_dtype=settings.kv_dtype)
    return builder.load_target(builder.resolve(target))


def create_app(settings: ServerSettings,
               load: Callable[[ServerSettings], tuple[Transformer, Tokenizer | None]] = load_model,
               on_load_error: Callable[[str], None] | None = None,
               on_ready: Callable[[], None] | None = None) -> FastAPI:
    """The app for `settings`; `load` makes the model (tests pass an already-loaded one).

    `on_load_error(reason)` is called (from the loading thread) when the load fails; without it the
    failure is logged. Either way requests then get 503 with the reason. `on_ready()` is called
    (from the loading thread) once requests are served.
    """
    state = ServerState(settings)
    state.keys = KeyRing.build(settings.api_key, settings.api_keys_file, settings.max_batch, settings.max_queue,
                               settings.metrics_key)
    body_limit = settings.max_body_bytes or default_body_limit(settings.max_model_len)

    def load_in_background() -> None:
        try:
            model, tokenizer = load(settings)
            # Every drafter a request may name is loaded now, once (a draft model, an EAGLE head).
            drafters, default = serving_drafters(settings.drafter, model, tokenizer, draft_p_min=settings.draft_p_min,
                                                 draft_vocab=settings.draft_vocab, kv_dtype=settings.kv_dtype)
            trees = {}
            if settings.draft_tree:
                shape = TreeShape.parse(settings.draft_tree)
                trees = {name: shape for name, d in drafters.items() if d is not None and d.needs.trees}
            scheduler = BatchScheduler(
                model, tokenizer, drafter=default, drafters=drafters, draft_trees=trees,
                num_speculative_tokens=settings.num_speculative_tokens, max_batch=settings.max_batch,
                max_queue=settings.max_queue, max_model_len=settings.max_model_len,
                spec_token_budget=settings.spec_token_budget, prefill_chunk=settings.prefill_chunk,
                prefix_cache_tokens=settings.prefix_cache_tokens,
                max_speculative_tokens=max(16, settings.num_speculative_tokens),
                adaptive=settings.speculation_control == "goodput", on_finish=state.finished,
                kv_dtype=settings.kv_dtype, draft_length=settings.draft_length)
            state.tokenizer = tokenizer
            state.scheduler = scheduler
            state.apply_shares()
            scheduler.start()
        except Exception as exc:  # reported by /health and every request
            state.load_error = f"{type(exc).__name__}: {exc}"
            if on_load_error is not None:
                on_load_error(state.load_error)
            else:
                log.error("specdec: the model failed to load: %s", state.load_error)
            return
        if on_ready is not None:
            on_ready()

    async def lifespan(app: FastAPI):
        state.loop = asyncio.get_running_loop()
        threading.Thread(target=load_in_background, name="specdec-load", daemon=True).start()
        yield
        # Uvicorn has already waited for in-flight HTTP requests (graceful shutdown); this drains
        # anything the scheduler still holds and stops its thread.
        if state.scheduler is not None:
            await asyncio.to_thread(state.scheduler.shutdown, True, 60.0)
        log.info("%s", state.totals.summary())

    # The docs and the schema are routes of their own below, behind the key.
    app = FastAPI(title="specdec", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.state.specdec = state
    app.add_middleware(BodyLimit, limit=body_limit)
    app.add_middleware(_Gate, state=state)
    app.add_middleware(AccessLog, totals=state.totals)  # outermost: every answer gets its line

    @app.exception_handler(BodyTooLarge)
    async def _too_large(request: Request, exc: BodyTooLarge):
        return JSONResponse(too_large_body(body_limit), status_code=413, headers={"Connection": "close"})

    @app.exception_handler(SpecdecError)
    async def _specdec_error(request: Request, exc: SpecdecError):
        return _specdec_error_response(exc)

    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError):
        return error_response(exc.status, str(exc), exc.error_type, exc.param, exc.code)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException):
        # Routing: 404 for an unknown path, 405 (with the `Allow` header Starlette sets) for a
        # known path and a wrong method.
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        return error_response(exc.status_code, str(exc.detail), kind, None, None, exc.headers)

    @app.exception_handler(Exception)
    async def _fault(request: Request, exc: Exception):
        # A bug. Starlette re-raises it after this response and uvicorn then closes the
        # connection, so say so: a pooling client must not send its next request on it.
        log.exception("specdec: internal error on %s %s", request.method, request.url.path)
        return error_response(500, f"internal error: {type(exc).__name__}: {exc}", "internal_error",
                              headers={"Connection": "close"})

    def check_key(request: Request) -> Tenant:
        """The request's tenant, by its key (401 for no or a wrong key)."""
        tenant = state.keys.identify(request.headers.get("authorization"))
        if tenant is None:
            raise APIError(401, "invalid or missing API key (send 'Authorization: Bearer <key>')",
                           "invalid_request_error", None, "invalid_api_key")
        request.scope["specdec.access"].tenant = tenant.name
        return tenant

    def metrics_scope(request: Request) -> str | None:
        """Whose figures the caller may read on /metrics: None = all (the metrics key, a server
        without keys or with one tenant), else its own tenant's name."""
        if state.keys.is_metrics_key(request.headers.get("authorization")):
            request.scope["specdec.access"].tenant = "(metrics)"
            return None
        tenant = check_key(request)
        return tenant.name if len(state.keys.tenants) > 1 else None

    async def submit(request: Request, tenant: Tenant, body: _Sampling, scheduler: BatchScheduler,
                     tokenize: Callable[[], list[int]], max_tokens: int | None, logprobs: int | None,
                     constraint=None) -> RequestHandle:
        """Wait for one of the tenant's places (429 when its queue is full), tokenise and compile its
        grammar off the event loop, and queue the request; its place is given back when the scheduler finishes it."""
        await state.gate.acquire(tenant)
        try:
            ids = await asyncio.to_thread(tokenize)
            # Off the loop too: compiling a grammar may take its whole work budget (seconds), and
            # tokenising a prediction is as long as its text.
            gen = await asyncio.to_thread(lambda: gen_request(body, ids, max_tokens, logprobs, scheduler,
                                                              prediction_of(body), constraint))
            gen = dataclasses.replace(gen, tenant=tenant.name, request_id=request.scope["specdec.access"].id,
                                      cache_partition=cache_partition(settings.cache_salt, tenant, body.cache_salt))
            handle = scheduler.submit(gen, asyncio.get_running_loop())
        except BaseException:
            state.gate.release(tenant.name)
            raise
        request.scope["specdec.access"].prompt_tokens = len(ids)
        return handle

    def ready() -> BatchScheduler:
        if state.load_error is not None:
            raise APIError(503, f"the model failed to load: {state.load_error}", "service_unavailable")
        if state.scheduler is None:
            raise APIError(503, "the model is still loading", "service_unavailable")
        return state.scheduler

    async def body_of(request: Request) -> object:
        """The request's JSON body: application/json in UTF-8 (RFC 8259), at most MAX_JSON_DEPTH deep."""
        content_type = request.headers.get("content-type")
        if content_type is not None:  # no header at all: taken as JSON, as most servers do
            media, *params = [part.strip().lower() for part in content_type.split(";")]
            if media != "application/json" and not (media.startswith("application/") and media.endswith("+json")):
                raise APIError(415, f"unsupported content type {media!r}: send the body as application/json",
                               "invalid_request_error", None, "unsupported_media_type")
            charset = next((p.split("=", 1)[1].strip('" ') for p in params if p.startswith("charset=")), "utf-8")
            if charset not in ("utf-8", "utf8"):
                raise APIError(415, f"unsupported charset {charset!r}: JSON bodies are UTF-8",
                               "invalid_request_error", None, "unsupported_media_type")
        raw = await request.body()
        try:
            # Decoded as UTF-8 first: json.loads(bytes) would also guess UTF-16 and UTF-32.
            body = json.loads(raw.decode("utf-8"), parse_constant=_no_constant)
        except UnicodeDecodeError as exc:
            raise InvalidRequestError(f"the request body is not UTF-8: {exc.reason} at byte {exc.start}") from None
        except RecursionError:
            raise InvalidRequestError(f"the request body nests deeper than {MAX_JSON_DEPTH} levels") from None
        except ValueError as exc:  # JSONDecodeError, NaN / Infinity, integers of more than 4300 digits
            raise InvalidRequestError(f"the request body is not valid JSON: {exc}") from None
        if _depth(body) > MAX_JSON_DEPTH:
            raise InvalidRequestError(f"the request body nests deeper than {MAX_JSON_DEPTH} levels")
        return body

    def check_model(name: str | None) -> None:
        if name is not None and name != settings.served_model_name:
            raise APIError(404, f"the model {name!r} does not exist; this server serves "
                                f"{settings.served_model_name!r}", "invalid_request_error", "model", "model_not_found")

    def prediction_of(body: _Sampling) -> Prediction | None:
        """The request's prediction tokenised on its own (off the event loop), or None."""
        text = body.prediction_text
        return None if text is None else Prediction.of(text, state.tokenizer)

    def gen_request(body: _Sampling, prompt_ids: list[int], max_tokens: int | None, logprobs: int | None,
                    scheduler: BatchScheduler, prediction: Prediction | None = None, constraint=None) -> GenRequest:
        if max_tokens is None:
            max_tokens = max(1, scheduler.max_model_len - len(prompt_ids))
        sampling = SamplingParams(body.temperature, max(0, body.top_k), body.top_p, body.min_p, body.seed,
                                  frequency_penalty=body.frequency_penalty, presence_penalty=body.presence_penalty,
                                  repetition_penalty=body.repetition_penalty, logit_bias=body.logit_bias_pairs,
                                  min_tokens=body.min_tokens, ignore_eos=body.ignore_eos)
        scheduler.engine.check_sampling(sampling)
        drafter, k = None, None
        if body.speculative is False:
            k = 0
        elif body.speculative is not None and body.speculative is not True:
            drafter, k = body.speculative.drafter, body.speculative.num_tokens
        spec = body.structured if constraint is None else constraint  # a tool turn's (toolapi.tool_turn)
        grammar = scheduler.engine.compile_structured(spec) if spec is not None else None
        return GenRequest(prompt_ids, max_tokens, sampling, body.stop_list, drafter, k, logprobs, grammar,
                          prediction=prediction)

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

    @app.get("/metrics", response_class=PlainTextResponse)
    async def metrics(request: Request):
        scope = metrics_scope(request)
        return PlainTextResponse(state.metrics.render(state.scheduler, settings.served_model_name, scope),
                                 media_type="text/plain; version=0.0.4")

    @app.get("/openapi.json", include_in_schema=False)
    async def openapi_json(request: Request):
        metrics_scope(request)
        return JSONResponse(app.openapi())

    @app.get("/docs", include_in_schema=False)
    async def docs(request: Request):
        metrics_scope(request)
        return get_swagger_ui_html(openapi_url="/openapi.json", title="specdec")

    @app.get("/redoc", include_in_schema=False)
    async def redoc(request: Request):
        metrics_scope(request)
        return get_redoc_html(openapi_url="/openapi.json", title="specdec")

    @app.get("/v1/models")
    async def models(request: Request):
        check_key(request)
        scheduler = state.scheduler
        return {"object": "list", "data": [{
            "id": settings.served_model_name, "object": "model", "created": state.created, "owned_by": "specdec",
            "max_model_len": scheduler.max_model_len if scheduler else settings.max_model_len}]}

    @app.post("/v1/completions")
    async def completions(request: Request):
        tenant = check_key(request)
        scheduler = ready()
        body = parse(CompletionRequest, await body_of(request))
        check_model(body.model)
        prompt = body.single_prompt
        handle = await submit(request, tenant, body, scheduler,
                              lambda: text_ids(prompt, "prompt") if isinstance(prompt, str) else list(prompt),
                              body.max_tokens or DEFAULT_COMPLETION_MAX_TOKENS, body.logprobs)
        access = request.scope["specdec.access"]
        rid, created = f"cmpl-{access.id}", int(time.time())
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
            if done is None:  # nobody reads this
                return error_response(499, "client disconnected", "cancelled")
            note(access, done[-1])
            raise_fault(done[-1])
            result = RequestHandle.collect(done)
            return {**base, "choices": [{"index": 0, "text": result.text, "logprobs": logprobs_of(result.logprobs, 0),
                                         "finish_reason": result.finish_reason}],
                    "usage": await usage_of(result.usage)}

        async def events():
            offset = 0
            async for delta in guarded(handle):
                note(access, delta)
                if delta.finish_reason == "error":
                    yield sse(fault_body(delta.error))
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
                    yield sse({**base, "choices": [], "usage": await usage_of(delta.usage)})
            yield "data: [DONE]\n\n"

        return StreamingResponse(events(), media_type="text/event-stream")

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        tenant = check_key(request)
        scheduler = ready()
        body = parse(ChatCompletionRequest, await body_of(request))
        check_model(body.model)
        tokenizer = state.tokenizer
        if tokenizer is None:
            raise InvalidRequestError("this model has no tokenizer, so no chat template: use /v1/completions "
                                      "with token ids", "messages")
        top = body.top_logprobs or 0
        turn = tool_turn(body, tokenizer)
        handle = await submit(request, tenant, body, scheduler, lambda: tokenizer.encode_chat(
            template_messages(body), body.add_generation_prompt, body.continue_final_message,
            turn and turn.template_tools), body.max_completion_tokens or body.max_tokens,
                              top if body.logprobs else None, turn and turn.constraint)
        access = request.scope["specdec.access"]
        rid, created = f"chatcmpl-{access.id}", int(time.time())
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
            if done is None:  # nobody reads this
                return error_response(499, "client disconnected", "cancelled")
            note(access, done[-1])
            raise_fault(done[-1])
            result = RequestHandle.collect(done)
            message, finish = {"role": "assistant", "content": result.text}, result.finish_reason
            if turn is not None:
                message, finish = message_of(turn, result.token_ids, tokenizer, finish)
            return {**base, "object": "chat.completion",
                    "choices": [{"index": 0, "message": message,
                                 "logprobs": logprobs_of(result.logprobs), "finish_reason": finish}],
                    "usage": await usage_of(result.usage)}

        async def events():
            head = {**base, "object": "chat.completion.chunk"}
            extra = {"usage": None} if body.include_usage else {}
            yield sse({**head, "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""},
                                            "logprobs": None, "finish_reason": None}], **extra})
            calls = ToolStream(turn, tokenizer) if turn is not None else None
            async for delta in guarded(handle):
                note(access, delta)
                if delta.finish_reason == "error":
                    yield sse(fault_body(delta.error))
                    break
                text = delta.text if calls is None else calls.push(delta.text, delta.token_ids)
                if text or delta.logprobs:
                    yield sse({**head, "choices": [{"index": 0, "delta": {"content": text},
                                                    "logprobs": logprobs_of(delta.logprobs),
                                                    "finish_reason": None}], **extra})
                if delta.finish_reason:
                    finish = delta.finish_reason
                    if calls is not None:
                        rest, chunks, finish = calls.finish(finish)
                        for part in ([{"content": rest}] if rest else []) + [{"tool_calls": [c]} for c in chunks]:
                            yield sse({**head, "choices": [{"index": 0, "delta": part, "logprobs": None,
                                                            "finish_reason": None}], **extra})
                    yield sse({**head, "choices": [{"index": 0, "delta": {}, "logprobs": None,
                                                    "finish_reason": finish}], **extra})
                    if body.include_usage:
                        yield sse({**head, "choices": [], "usage": await usage_of(delta.usage)})
            yield "data: [DONE]\n\n"

        return StreamingResponse(events(), media_type="text/event-stream")

    def openapi() -> dict:
        # The endpoints read their bodies themselves (so the checks run in the order above);
        # declare the request models here so that /openapi.json describes them.
        if app.openapi_schema is None:
            schema = get_openapi(title=app.title, version=app.version, routes=app.routes)
            components = schema.setdefault("components", {}).setdefault("schemas", {})
            for path, model in (("/v1/completions", CompletionRequest),
                                ("/v1/chat/completions", ChatCompletionRequest)):
                model_schema = model.model_json_schema(ref_template="#/components/schemas/{model}")
                components.update(model_schema.pop("$defs", {}))
                components[model.__name__] = model_schema
                schema["paths"][path]["post"]["requestBody"] = {"required": True, "content": {"application/json": {
                    "schema": {"$ref": f"#/components/schemas/{model.__name__}"}}}}
            app.openapi_schema = schema
        return app.openapi_schema

    app.openapi = openapi
    return app


class _Gate:
    """ASGI middleware in front of every route: 503 while draining, and the count of requests in
    flight (a streaming request counts until its last byte)."""

    def __init__(self, app, state: ServerState):
        self.app, self.state = app, state

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        if self.state.draining and scope["path"] != "/metrics":
            close = {"Connection": "close"}
            if scope["path"] == "/health":
                response = JSONResponse({"status": "draining"}, status_code=503, headers=close)
            else:
                response = error_response(503, "the server is shutting down", "service_unavailable", headers=close)
            return await response(scope, receive, send)
        self.state.in_flight += 1
        try:
            await self.app(scope, receive, send)
        finally:
            self.state.in_flight -= 1


def _no_constant(name: str):
    raise ValueError(f"{name} is not a JSON number")


def _depth(value: object) -> int:
    """How deep JSON containers nest in `value` (a scalar is 0), without recursion."""
    deepest, stack = 0, [(value, 1)]
    while stack:
        item, depth = stack.pop()
        children = item.values() if isinstance(item, dict) else item if isinstance(item, list) else None
        if children is not None:
            deepest = max(deepest, depth)
            if depth <= MAX_JSON_DEPTH:
                stack.extend((child, depth + 1) for child in children)
    return deepest


def sse(payload: dict) -> str:
    return f"data: {json.dumps(payload, ensure_ascii=False)}\n\n"


async def usage_of(usage) -> dict:
    """`usage_dict` worked out off the event loop (its prediction counts run difflib)."""
    return await asyncio.to_thread(usage_dict, usage)


def usage_dict(usage) -> dict:
    return {"prompt_tokens": usage.prompt_tokens, "completion_tokens": usage.completion_tokens,
            "total_tokens": usage.prompt_tokens + usage.completion_tokens,
            "prompt_tokens_details": {"cached_tokens": usage.cached_tokens},
            **({} if usage.prediction is None else {"completion_tokens_details": {
                "accepted_prediction_tokens": usage.prediction.accepted,
                "rejected_prediction_tokens": usage.prediction.rejected}})}


def note(access, delta: Delta) -> None:
    """What the access line says of a finished request (its last delta carries the totals)."""
    if delta.usage is not None:
        access.completion_tokens, access.cached_tokens = delta.usage.completion_tokens, delta.usage.cached_tokens
    if delta.stats is not None:
        access.forwards = delta.stats.target_forwards


class RowFault(APIError):
    """A request that failed inside the decoding loop (`errors.Fault`): its own error only."""

    def __init__(self, fault: Fault):
        super().__init__(fault.status, fault.message, fault.type, fault.param)


def raise_fault(last: Delta) -> None:
    if last.finish_reason == "error":
        raise RowFault(last.error)


def fault_body(fault: Fault) -> dict:
    """The SSE error event of a stream whose request failed after its first byte."""
    return error_body(fault.message, fault.type, fault.param)


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


async def collect(handle: RequestHandle, request: Request) -> list[Delta] | None:
    """All deltas of a non-streaming request; None (and the request cancelled) if the client left.

    Waits for the result and, at the same time, for the client's `http.disconnect`, which the
    server sends the moment the connection closes: an abandoned request frees its batch row at
    once rather than generating to its end.
    """

    async def everything() -> list[Delta]:
        return [delta async for delta in handle]

    async def disconnect() -> None:
        # The body has been read, so the next ASGI message is the disconnect (the server sends it
        # when the client goes away, or once the response is complete).
        while (await request.receive())["type"] != "http.disconnect":
            pass

    result, gone = asyncio.ensure_future(everything()), asyncio.ensure_future(disconnect())
    try:
        await asyncio.wait({result, gone}, return_when=asyncio.FIRST_COMPLETED)
        return result.result() if result.done() else None
    finally:
        result.cancel()
        gone.cancel()
        if not handle.consumed:
            handle.cancel()
