"""One app's shared state and the checks every route makes against it.

`create_app` builds one `ServerState`; the routes read it as `request.app.state.specdec`, the
middleware and the loading thread are handed it. It holds what the app shares between requests
(the scheduler once loaded, the tokenizer, the keys and the tenants' places, the metrics, the
access totals, the drain flag) and answers the questions asked of it on every request: which
tenant sent it (`check_key`, 401), whose figures it may read (`metrics_scope`), whether the model is
there (`ready`, 503) and whether it names the served model (`check_model`, 404).
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field

from starlette.requests import Request

from ..request import Delta
from ..request import Request as GenRequest
from ..scheduler import CONTEXT_FLOOR, BatchScheduler
from ..tokenizer import Tokenizer
from .http_errors import APIError
from .metrics import ServerMetrics
from .options import ServerSettings
from .tenants import KeyRing, Tenant, TenantGate
from .wire import Totals, default_body_limit


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

    @classmethod
    def build(cls, settings: ServerSettings) -> "ServerState":
        """The state of a new app: its keys read (a keys file that does not parse raises here)."""
        state = cls(settings)
        state.keys = KeyRing.build(settings.api_key, settings.api_keys_file, settings.max_batch, settings.max_queue,
                                   settings.metrics_key)
        return state

    @property
    def context(self) -> int:
        """Tokens a request may hold, prompt and output: the scheduler's once loaded (where no
        --max-model-len was given it sizes the context itself), else what was asked or the floor."""
        if self.scheduler is not None:
            return self.scheduler.max_model_len
        return self.settings.max_model_len or CONTEXT_FLOOR

    @property
    def body_limit(self) -> int:
        return self.settings.max_body_bytes or default_body_limit(self.context)

    def serve(self, tokenizer: Tokenizer | None, scheduler: BatchScheduler) -> None:
        """The model is loaded (the loading thread): requests are served from now on."""
        self.tokenizer = tokenizer
        self.scheduler = scheduler
        self.apply_shares()
        scheduler.start()

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

    # -- the checks of every request ----------------------------------------------------------------

    def check_key(self, request: Request) -> Tenant:
        """The request's tenant, by its key (401 for no or a wrong key)."""
        tenant = self.keys.identify(request.headers.get("authorization"))
        if tenant is None:
            raise APIError(401, "invalid or missing API key (send 'Authorization: Bearer <key>')",
                           "invalid_request_error", None, "invalid_api_key")
        request.scope["specdec.access"].tenant = tenant.name
        return tenant

    def metrics_scope(self, request: Request) -> str | None:
        """Whose figures the caller may read on /metrics: None = all (the metrics key, a server
        without keys or with one tenant), else its own tenant's name."""
        if self.keys.is_metrics_key(request.headers.get("authorization")):
            request.scope["specdec.access"].tenant = "(metrics)"
            return None
        tenant = self.check_key(request)
        return tenant.name if len(self.keys.tenants) > 1 else None

    def ready(self) -> BatchScheduler:
        if self.load_error is not None:
            raise APIError(503, f"the model failed to load: {self.load_error}", "service_unavailable")
        if self.scheduler is None:
            raise APIError(503, "the model is still loading", "service_unavailable")
        return self.scheduler

    def check_model(self, name: str | None) -> None:
        served = self.settings.served_model_name
        if name is not None and name != served:
            raise APIError(404, f"the model {name!r} does not exist; this server serves {served!r}",
                           "invalid_request_error", "model", "model_not_found")
