"""specdec's OpenAI server as N replicas under Ray Serve, one endpoint in front (`pip install 'specdec[ray]'`).

Each replica is the app of `create_app` (same routes, checks and errors as `specdec serve`), run
by a Ray Serve deployment; Ray's HTTP proxy routes every request to one replica (power of two
choices on ongoing requests by default), retries a request that no replica has started yet, and
replaces a replica that dies or fails its health check. Three ways in:

    specdec serve --replicas 2                                  # starts a local Ray, or joins --ray-address
    serve run specdec.server.ray_app:app                        # one replica, default model and settings
    serve run specdec.server.ray_app:build replicas=2 drafter=suffix session-affinity=true

(`build` takes the options of `specdec serve`, each `name=value` without the dashes.)

Health: a replica loads its model in its constructor, so Ray sends it no traffic before the model
is there; Ray's periodic `check_health` then asks the replica's own `GET /health` and also checks
that the scheduler thread is alive; a failure makes Ray replace the replica.

Metrics: `GET /metrics` through the endpoint answers every replica's series, each sample labelled
`replica="<Ray replica id>"` (not summed: sum over the label in Prometheus). Replicas push their
exposition text to one small `SpecdecMetricsHub` deployment every PUSH_S seconds, and the replica
answering a scrape pushes its own first; another replica's samples are at most PUSH_S old, and a
replica silent for STALE_S (dead, replaced) drops out. `specdec:replica_info` names each replica's
node and process.

Session affinity (`session_affinity`): Ray's consistent-hash router sends every request with the
same `X-Session-Id` header (Ray's session header, renamed with RAY_SERVE_SESSION_ID_HEADER_KEY) to
the same replica, falling back to the next replica on the ring when that one is full, so one
conversation keeps hitting the replica whose suffix cache has seen it. Ray's proxy routes before
the body is read, so the `user` field of the body cannot be the key: clients send the header.
Requests without it are spread by a per-request hash.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import logging
import os
import signal
import sys
import threading
import time

import httpx
import ray
from fastapi.responses import PlainTextResponse
from ray import serve
from ray.serve.config import RequestRouterConfig

from ..errors import ModelLoadError
from .app import create_app, load_model
from .http_errors import error_response
from .options import ServerSettings, add_arguments, bind, settings_from_args

PUSH_S = 2.0  # how often a replica pushes its metrics text to the hub
STALE_S = 30.0  # a replica that has not pushed for this long (dead or replaced) drops out of /metrics
STARTUP_S = 120.0  # the longest the first health check waits for the scheduler to be built
APP_NAME = "specdec"
log = logging.getLogger("specdec.server.ray")


@serve.deployment(num_replicas=1, ray_actor_options={"num_cpus": 0}, logging_config={"enable_access_log": False})
class SpecdecMetricsHub:
    """The latest /metrics text of every replica; renders them as one exposition labelled by replica."""

    def __init__(self):
        self._texts: dict[str, tuple[float, str]] = {}

    def put(self, replica: str, text: str) -> None:
        self._texts[replica] = (time.monotonic(), text)

    def render(self) -> str:
        now = time.monotonic()
        self._texts = {r: (t, text) for r, (t, text) in self._texts.items() if now - t <= STALE_S}
        return merge_metrics({r: text for r, (_, text) in self._texts.items()})


def merge_metrics(texts: dict[str, str]) -> str:
    """Prometheus texts of several replicas -> one text: each family once (HELP and TYPE once, then
    every replica's samples), each sample with `replica="<id>"` as its first label."""
    order: list[str] = []
    headers: dict[str, list[str]] = {}
    samples: dict[str, list[str]] = {}
    for replica, text in sorted(texts.items()):
        family = None
        for line in text.splitlines():
            if line.startswith(("# HELP ", "# TYPE ")):
                family = line.split(" ", 3)[2]
                if family not in headers:
                    order.append(family)
                    headers[family], samples[family] = [], []
                if len(headers[family]) < 2 and line not in headers[family]:
                    headers[family].append(line)
            elif line and not line.startswith("#"):
                name, brace, rest = line.partition("{")
                labelled = (f'{name}{{replica="{replica}",{rest}' if brace else
                            f'{name.split(" ")[0]}{{replica="{replica}"}} {name.split(" ", 1)[1]}')
                if family is None:  # a sample outside any family: its own
                    family = name.split(" ")[0]
                    order.append(family)
                    headers[family], samples[family] = [], []
                samples[family].append(labelled)
    lines: list[str] = []
    for family in order:
        lines += headers[family] + samples[family]
    return "\n".join(lines) + "\n"


@serve.deployment(ray_actor_options={"num_cpus": 1}, graceful_shutdown_timeout_s=60,
                  health_check_timeout_s=STARTUP_S + 10)
@serve.ingress()
class SpecdecServer:
    """One replica: the model loaded in the constructor, then `create_app` serving it."""

    async def __init__(self, settings: ServerSettings, hub=None):
        self._settings = settings
        self._hub = hub
        context = serve.get_replica_context()
        self._replica = context.replica_id.unique_id
        self._info = (f'specdec:replica_info{{model_name="{settings.served_model_name}",'
                      f'node_id="{ray.get_runtime_context().get_node_id()}",'
                      f'node_ip="{ray.util.get_node_ip_address()}",pid="{os.getpid()}"}} 1')
        # Loaded here, not in the app's background thread: Ray routes nothing to a replica before
        # its constructor returns, so no client sees "the model is still loading".
        self._loaded = await asyncio.to_thread(load_model, settings)
        if hub is not None:
            self._pusher = asyncio.get_running_loop().create_task(self._push_forever())

    def __serve_build_asgi_app__(self):
        app = create_app(self._settings, load=lambda settings: self._loaded)
        if self._hub is not None:
            app.router.routes[:] = [r for r in app.router.routes if getattr(r, "path", None) != "/metrics"]

            async def all_replicas_metrics(request):  # a plain Starlette route: called with the request
                # Every replica's server-wide figures: the metrics key's (or the one tenant's).
                keys, header = app.state.specdec.keys, request.headers.get("authorization")
                if not (keys.open or keys.is_metrics_key(header)
                        or (len(keys.tenants) == 1 and keys.identify(header) is not None)):
                    return error_response(401, "the combined /metrics needs the metrics key (--metrics-key)",
                                          "invalid_request_error", None, "invalid_api_key")
                await self._push()
                return PlainTextResponse(await self._hub.render.remote(), media_type="text/plain; version=0.0.4")

            app.add_route("/metrics", all_replicas_metrics, methods=["GET"])
        return app

    def _own_metrics(self) -> str:
        state = self.app.state.specdec
        return (state.metrics.render(state.scheduler, self._settings.served_model_name)
                + "# HELP specdec:replica_info The replica's node and process.\n"
                + "# TYPE specdec:replica_info gauge\n" + self._info + "\n")

    async def _push(self) -> None:
        await self._hub.put.remote(self._replica, self._own_metrics())

    async def _push_forever(self) -> None:
        while True:
            await asyncio.sleep(PUSH_S)
            try:
                await self._push()
            except Exception as exc:  # the hub restarting: the next push catches up
                log.warning("specdec: metrics push failed: %s", exc)

    async def check_health(self) -> None:
        """Ray's periodic health check: the replica's own GET /health, and a live scheduler thread."""
        state = self.app.state.specdec
        # The first check comes right after the app's startup, while its thread still builds the
        # scheduler around the loaded model (seconds): wait for that rather than fail.
        deadline = time.monotonic() + STARTUP_S
        while state.scheduler is None and state.load_error is None and time.monotonic() < deadline:
            await asyncio.sleep(0.1)
        transport = httpx.ASGITransport(app=self.app)
        async with httpx.AsyncClient(transport=transport, base_url="http://replica") as http:
            res = await http.get("/health")
        if res.status_code != 200:
            raise RuntimeError(f"GET /health answered {res.status_code}: {res.text}")
        scheduler = state.scheduler
        thread = getattr(scheduler, "_thread", None)
        if thread is not None and not thread.is_alive():
            raise RuntimeError("the scheduler thread has stopped")


def deployment_options(replicas: int, min_replicas: int | None = None, max_replicas: int | None = None,
                       target_ongoing_requests: float | None = None, session_affinity: bool = False,
                       replica_cpus: float = 1.0, settings: ServerSettings | None = None,
                       log_level: str = "INFO") -> dict:
    """`SpecdecServer.options(...)` for these bounds; autoscaling when min < max."""
    settings = settings or ServerSettings()
    lo = replicas if min_replicas is None else min_replicas
    hi = replicas if max_replicas is None else max_replicas
    if not 0 <= lo <= replicas <= hi or hi < 1:
        raise ValueError(f"need 0 <= min replicas ({lo}) <= replicas ({replicas}) <= max replicas ({hi}), "
                         "max >= 1")
    actor = {"num_cpus": replica_cpus}
    if settings.device.startswith("cuda"):
        actor["num_gpus"] = 1
    # A replica takes what its batch and queue hold (past that it would answer 429); Ray's router
    # holds the rest and sends each to whichever replica frees up.
    options = dict(ray_actor_options=actor, max_ongoing_requests=settings.max_batch + settings.max_queue,
                   logging_config={"log_level": "DEBUG" if log_level.lower() == "trace" else log_level.upper()})
    if lo == hi:
        options["num_replicas"] = replicas
    else:
        options["autoscaling_config"] = {
            "min_replicas": lo, "max_replicas": hi, "initial_replicas": replicas,
            "target_ongoing_requests": target_ongoing_requests or settings.max_batch}
    if session_affinity:
        options["request_router_config"] = RequestRouterConfig(
            request_router_class="ray.serve.experimental.consistent_hash_router.ConsistentHashRouter")
    return options


def application(settings: ServerSettings, replicas: int = 1, min_replicas: int | None = None,
                max_replicas: int | None = None, target_ongoing_requests: float | None = None,
                session_affinity: bool = False, replica_cpus: float = 1.0, log_level: str = "INFO"):
    """The Ray Serve application: the replicas of `settings`, and the metrics hub they push to.
    Each replica sizes its default context for its part of the memory (replicas may share a node,
    and their caches take memory only as they fill, so each alone would see it all free)."""
    options = deployment_options(replicas, min_replicas, max_replicas, target_ongoing_requests, session_affinity,
                                 replica_cpus, settings, log_level)
    most = options["autoscaling_config"]["max_replicas"] if "autoscaling_config" in options else options["num_replicas"]
    settings = dataclasses.replace(settings, memory_share=settings.memory_share / most)
    return SpecdecServer.options(**options).bind(settings, SpecdecMetricsHub.bind())


def build(args: dict[str, str]):
    """Application builder for `serve run specdec.server.ray_app:build name=value ...`: the names
    are `specdec serve`'s options without the leading dashes."""
    parser = argparse.ArgumentParser(prog="serve run specdec.server.ray_app:build", add_help=False)
    add_arguments(parser)
    argv: list[str] = [] if "replicas" in args else ["--replicas", "1"]
    for key, value in args.items():
        value = str(value)
        if value.lower() == "false":  # a flag left off
            continue
        argv.append("--" + key.replace("_", "-"))
        if value.lower() not in ("true", ""):  # a flag: name=true
            argv.append(value)
    ns = parser.parse_args(argv)
    return application(settings_from_args(ns), **replica_arguments(ns))


def replica_arguments(ns) -> dict:
    return dict(replicas=ns.replicas or 1, min_replicas=ns.min_replicas, max_replicas=ns.max_replicas,
                target_ongoing_requests=ns.target_ongoing_requests, session_affinity=ns.session_affinity,
                replica_cpus=ns.replica_cpus, log_level=ns.log_level)


app = application(ServerSettings(served_model_name="gemma-3-270m"))


def run(args, settings: ServerSettings) -> int:
    """`specdec serve --replicas N`: Ray Serve on a local Ray (started here) or the cluster at
    `--ray-address`, the application deployed, then wait for SIGTERM / Ctrl-C and take it down."""
    options = replica_arguments(args)
    deployment_options(settings=settings, **options)  # bad bounds: one error before Ray starts
    if args.ray_address is None:
        # The proxy binds in another process: check the port here so that "in use" is one clear error.
        sock = bind(args.host, args.port)
        port = sock.getsockname()[1]
        sock.close()
    else:
        port = args.port  # the proxy runs on the cluster's head node, not necessarily here
    ray.init(address=args.ray_address, include_dashboard=False, logging_level=logging.WARNING,
             **({"num_cpus": args.ray_num_cpus} if args.ray_num_cpus and args.ray_address is None else {}))
    stop = threading.Event()

    def interrupt(signum, frame):  # before "serving": leave the deploy wait, then clean up below
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, interrupt)
    try:
        serve.start(http_options={"host": args.host, "port": port, "location": args.proxy_location})
        try:
            serve.run(application(settings, **options), name=APP_NAME, route_prefix="/", blocking=False)
        except Exception as exc:  # a replica constructor failed (the model did not load) and Ray gave up
            raise ModelLoadError(f"the replicas failed to start: {str(exc).splitlines()[0]}") from None
        print(f"specdec: serving {settings.served_model_name!r} on http://{args.host}:{port} with Ray Serve "
              f"({options['replicas']} replicas; GET /metrics labels each replica's series)", file=sys.stderr)
        for signum in (signal.SIGTERM, signal.SIGINT):
            signal.signal(signum, lambda *_: stop.set())
        while not stop.wait(1.0):
            pass
        print("specdec: stopping the replicas (requests in flight finish first)", file=sys.stderr)
    finally:
        try:
            if args.ray_address is None:
                serve.shutdown()
            else:
                serve.delete(APP_NAME)  # the cluster and its other applications stay
        except Exception as exc:
            print(f"specdec: Ray Serve shutdown: {exc}", file=sys.stderr)
        ray.shutdown()
    return 0
