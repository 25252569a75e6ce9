"""`specdec serve`: arguments -> `ServerSettings` -> uvicorn running the app.

Exit status: 0 after a drain (SIGTERM or Ctrl-C); 2 with one error line for bad options, a model
path that cannot be a model, a port that is taken, or a model that fails to load in the background.

What it says on stderr: "loading" once the port is bound, "ready: serving ... on URL" once the
model is loaded (never before: a model that fails to load prints its error instead), one access
line per request (`wire.py`; never the prompt or the key), and a summary line at shutdown. SIGHUP
reloads the keys file (`tenants.py`).
"""

from __future__ import annotations

import logging
import os
import signal
import sys

from .. import builder
from ..errors import ModelLoadError, SpecdecError
from ..extras import SERVER_MODULES, require
from ..models.loader import check_path
from ..settings import DecodingSettings
# add_arguments(parser) and run(args) are this subcommand's interface to specdec/cli.py.
from .options import add_arguments, bind, settings_from_args  # noqa: F401
from .wire import http_protocol


def run(args) -> int:
    # The server's extras (fastapi, uvicorn, ...) are optional: imported here, after the check that
    # names what to install, and only by the subcommand that needs them.
    require("server", "specdec serve", *SERVER_MODULES)
    import uvicorn

    from .app import create_app

    settings = settings_from_args(args)
    # Fail on a bad device, dtype, quantisation, model path or port before saying "serving"; the
    # model itself loads in the background while /health answers 503, and a load that fails stops
    # the server with the load error (exit status 2).
    # The decoding options, validated and resolved once by the builder (one error line, before the
    # port is bound): an unknown drafter or a missing path fails here. The server's decoding
    # settings are these (`app.load_model` loads the target of the same ones). The draft length rule
    # is left out: in the server a tree shape applies only to the drafters that draw trees.
    decoding = DecodingSettings(
        target=settings.model, drafter=settings.drafter, quantize=settings.quantize, device=settings.device,
        dtype=settings.dtype, tensor_parallel=settings.tensor_parallel, kv_dtype=settings.kv_dtype,
        num_speculative_tokens=settings.num_speculative_tokens, draft_tree=settings.draft_tree,
        draft_p_min=settings.draft_p_min, draft_vocab=settings.draft_vocab)
    if settings.model != "default":
        check_path(settings.model)
    builder.resolve(decoding)
    if args.replicas:
        if args.ray_address is None:
            # The local Ray started for this server stays on this machine's loopback; Ray otherwise
            # turns 127.0.0.1 into the machine's address (read when ray is imported).
            os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
        try:
            from . import ray_app
        except ImportError as exc:
            raise SpecdecError(f"--replicas needs Ray Serve: pip install 'specdec[ray]' ({exc})") from None
        return ray_app.run(args, settings)
    sock = bind(args.host, args.port)
    load_errors: list[str] = []
    port = sock.getsockname()[1]  # --port 0: the one the system picked
    url = f"http://{args.host}:{port}"

    def on_load_error(reason: str) -> None:  # the loading thread
        load_errors.append(reason)
        server.should_exit = True

    def on_ready() -> None:  # the loading thread
        print(f"specdec: ready: serving {settings.served_model_name!r} on {url} (context {state.context:,} tokens a "
              f"request, {settings.max_batch} at once)", file=sys.stderr, flush=True)

    _log_to_stderr()
    app = create_app(settings, on_load_error=on_load_error, on_ready=on_ready)
    state = app.state.specdec
    server = _draining_server(uvicorn.Config(app, log_level=args.log_level, http=http_protocol()), state)
    # After a second signal uvicorn raises it again once it has stopped, under the handler that
    # was there before; for SIGTERM that handler does nothing, so the exit status stays 0.
    signal.signal(signal.SIGTERM, lambda signum, frame: None)
    if hasattr(signal, "SIGHUP"):
        signal.signal(signal.SIGHUP, lambda signum, frame: state.reload_keys())
    print(f"specdec: loading {settings.model!r} (listening on {url}; /health answers 503 until it is ready)",
          file=sys.stderr, flush=True)
    server.run(sockets=[sock])
    if load_errors:
        raise ModelLoadError(f"the model failed to load: {load_errors[0]}")
    return 0


def _log_to_stderr() -> None:
    """The access lines, the keys file's reloads and the summary at shutdown, one line each."""
    logger = logging.getLogger("specdec.server")
    if not logger.handlers:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("%(message)s"))
        logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    logger.propagate = False


def _draining_server(config, state):
    """Uvicorn, with SIGTERM / SIGINT draining while still listening.

    Plain uvicorn closes its listening socket on the signal, so new clients see "connection
    refused" while the requests in flight finish. Here the first signal only starts the drain
    (`ServerState.begin_drain`: new requests get 503 with `Connection: close`); once no request is
    in flight, uvicorn's own shutdown runs, then the app's, which stops the scheduler, and the
    exit status is 0. A second signal is uvicorn's usual one (stop listening, wait); a second
    Ctrl-C after that forces the exit.
    """
    import uvicorn  # the server extra, as in `run`

    class DrainingServer(uvicorn.Server):
        def handle_exit(self, sig, frame) -> None:
            if state.draining or self.should_exit:
                super().handle_exit(sig, frame)
            else:
                state.begin_drain()

        async def on_tick(self, counter: int) -> bool:
            if state.draining and state.in_flight == 0:
                return True
            return await super().on_tick(counter)

    return DrainingServer(config)
