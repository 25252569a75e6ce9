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

The app in parts: `create_app` (here) builds one `ServerState` (`state.py`), the middleware and the
routes (`routes.py`) that read it; `intake.py` turns a request into the scheduler's, `responses.py`
turns what comes back into OpenAI's objects, `http_errors.py` answers every failure, and the
settings come from `options.py`.

Draining (`begin_drain`, which `specdec serve` calls on SIGTERM): the listening socket stays open
and every new request gets 503 with `Connection: close` while the requests in flight finish;
`in_flight` counts them so the server knows when to stop.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import threading
from typing import Callable

from ..extras import SERVER_MODULES, require

require("server", "specdec.server.app", *SERVER_MODULES)

from fastapi import FastAPI  # noqa: E402 (after the check that says what to install)
from fastapi.responses import JSONResponse

from .. import builder
from ..drafters.base import TreeShape
from ..models.transformer import Transformer
from ..scheduler import BatchScheduler, serving_drafters
from ..settings import DecodingSettings
from ..tokenizer import Tokenizer
from .http_errors import add_error_handlers, error_response
from .options import ServerSettings
from .routes import add_routes, openapi_schema
from .web import add_web_routes
from .state import ServerState
from .wire import AccessLog, BodyLimit

log = logging.getLogger("specdec.server")
Load = Callable[[ServerSettings], tuple[Transformer, Tokenizer | None]]


def load_model(settings: ServerSettings) -> tuple[Transformer, Tokenizer | None]:
    """Load the target model and its tokenizer. No drafter: `create_app` loads the server's drafters
    for it (`serving_drafters`), so a named pair's draft model is loaded once, there."""
    target = DecodingSettings(target=settings.model, drafter="none", device=settings.device, dtype=settings.dtype,
                              quantize=settings.quantize, tensor_parallel=settings.tensor_parallel,
                              kv_dtype=settings.kv_dtype)
    return builder.load_target(builder.resolve(target))


def build_scheduler(settings: ServerSettings, model: Transformer, tokenizer: Tokenizer | None,
                    on_finish) -> BatchScheduler:
    """The scheduler of `settings` around a loaded model, not yet started."""
    # Every drafter a request may name is loaded now, once (a draft model, an EAGLE head).
    drafters, default = serving_drafters(settings.drafter, model, tokenizer, draft_p_min=settings.draft_p_min,
                                         draft_vocab=settings.draft_vocab, kv_dtype=settings.kv_dtype)
    trees = {}
    if settings.draft_tree:
        shape = TreeShape.parse(settings.draft_tree)
        trees = {name: shape for name, d in drafters.items() if d is not None and d.needs.trees}
    return BatchScheduler(
        model, tokenizer, drafter=default, drafters=drafters, draft_trees=trees,
        num_speculative_tokens=settings.num_speculative_tokens, max_batch=settings.max_batch,
        max_queue=settings.max_queue, max_model_len=settings.max_model_len,
        spec_token_budget=settings.spec_token_budget, prefill_chunk=settings.prefill_chunk,
        prefix_cache_tokens=settings.prefix_cache_tokens,
        max_speculative_tokens=max(16, settings.num_speculative_tokens),
        adaptive=settings.speculation_control == "goodput", on_finish=on_finish,
        kv_dtype=settings.kv_dtype, draft_length=settings.draft_length, memory_share=settings.memory_share)


class Startup:
    """The app's lifespan: the model loaded in a background thread while /health answers 503, and
    at shutdown the scheduler drained and stopped."""

    def __init__(self, state: ServerState, load: Load, on_load_error: Callable[[str], None] | None,
                 on_ready: Callable[[], None] | None):
        self.state, self.load, self.on_load_error, self.on_ready = state, load, on_load_error, on_ready

    def load_in_background(self) -> None:
        state = self.state
        try:
            model, tokenizer = self.load(state.settings)
            state.serve(tokenizer, build_scheduler(state.settings, model, tokenizer, state.finished))
        except Exception as exc:  # reported by /health and every request
            state.load_error = f"{type(exc).__name__}: {exc}"
            if self.on_load_error is not None:
                self.on_load_error(state.load_error)
            else:
                log.error("specdec: the model failed to load: %s", state.load_error)
            return
        if self.on_ready is not None:
            self.on_ready()

    async def lifespan(self, app: FastAPI):
        state = self.state
        state.loop = asyncio.get_running_loop()
        threading.Thread(target=self.load_in_background, name="specdec-load", daemon=True).start()
        yield
        # Uvicorn has already waited for in-flight HTTP requests (graceful shutdown); this drains
        # anything the scheduler still holds and stops its thread.
        if state.scheduler is not None:
            await asyncio.to_thread(state.scheduler.shutdown, True, 60.0)
        log.info("%s", state.totals.summary())


def create_app(settings: ServerSettings, load: Load = load_model,
               on_load_error: Callable[[str], None] | None = None,
               on_ready: Callable[[], None] | None = None) -> FastAPI:
    """The app for `settings`; `load` makes the model (tests pass an already-loaded one).

    `on_load_error(reason)` is called (from the loading thread) when the load fails; without it the
    failure is logged. Either way requests then get 503 with the reason. `on_ready()` is called
    (from the loading thread) once requests are served.
    """
    state = ServerState.build(settings)
    startup = Startup(state, load, on_load_error, on_ready)
    # The docs and the schema are routes of their own (`routes.py`), behind the key.
    app = FastAPI(title="specdec", lifespan=startup.lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.state.specdec = state
    app.add_middleware(BodyLimit, limit=lambda: state.body_limit)  # sized once the context is known
    app.add_middleware(_Gate, state=state)
    app.add_middleware(AccessLog, totals=state.totals)  # outermost: every answer gets its line
    add_error_handlers(app)
    add_routes(app)
    add_web_routes(app)  # the chat page at / (server/web.py)
    app.openapi = functools.partial(openapi_schema, app)
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
