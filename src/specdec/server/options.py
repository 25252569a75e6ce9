"""`specdec serve`'s options: `ServerSettings` (what one server is, frozen), the argument parser,
the checks that turn parsed arguments into `ServerSettings`, and the listening socket. One module
that both front ends import: `cli.py` (one process under uvicorn) and `ray_app.py` (replicas under
Ray Serve, including its `serve run specdec.server.ray_app:build` builder), so neither imports the
other for them, and the app (`app.py`) takes the settings from here.
"""

from __future__ import annotations

import errno
import socket
from dataclasses import dataclass
from pathlib import Path

from ..drafters.base import TreeShape
from ..builder import check_tree_drafter, pair_draft_vocab, resolve_drafter
from ..errors import InvalidRequestError, SpecdecError
from ..policy import DRAFT_LENGTHS
from ..scheduler import CONTEXT_MEMORY_SHARE, DEFAULT_PREFILL_CHUNK, DEFAULT_PREFIX_CACHE_TOKENS
from ..settings import DEFAULT_NUM_SPECULATIVE_TOKENS
from .tenants import KeyRing


@dataclass(frozen=True)
class ServerSettings:
    """One server: its model, drafters, batch, limits and keys (`settings_from_args` from the command
    line; tests and the Ray builder make it directly)."""

    model: str = "default"
    served_model_name: str = "default"
    drafter: str = "none"
    draft_p_min: float | None = None  # a draft model's confidence cut-off (None: its default)
    draft_vocab: int | None = None  # a draft model's kept ids (FR-Spec; None: all)
    num_speculative_tokens: int = DEFAULT_NUM_SPECULATIVE_TOKENS
    draft_length: str | None = None  # each row's draft-length rule, as generate's (None: cost-aware)
    max_batch: int = 16
    max_queue: int = 64
    max_model_len: int | None = None  # None: the model's context, within memory (`scheduler.fitting_context`)
    memory_share: float = CONTEXT_MEMORY_SHARE  # of the memory free at start, for that default (a replica's part)
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


def add_arguments(parser) -> None:
    """`specdec serve`'s options (and `ray_app.build`'s, by the same names)."""
    _model_arguments(parser)
    _serving_arguments(parser)
    _access_arguments(parser)
    _device_arguments(parser)
    _ray_arguments(parser.add_argument_group("replicas under Ray Serve (pip install 'specdec[ray]')"))


def _model_arguments(parser) -> None:
    """The model, its name and how it drafts."""
    parser.add_argument("--model", default="default",
                        help="HF folder, .gguf file or a named model (`specdec models`) (default: Gemma 3 270M)")
    parser.add_argument("--served-model-name", default=None,
                        help="the name clients send as `model` (default: derived from --model)")
    parser.add_argument("--drafter", default="auto",
                        help="default drafter, loaded at start: auto (the paired draft model of a named model, else ngram, which drafts only where --speculation-control finds it pays) | none | ngram | suffix | eagle | eagle:DIR | a draft "
                             "model's path | ngram+LEARNED | suffix+LEARNED; requests may choose another loaded one "
                             "by name with `speculative` (none, ngram, suffix, and eagle / draft_model and their "
                             "ngram+ / suffix+ combinations when one was loaded)")
    parser.add_argument("--draft-vocab", type=int, default=None, metavar="N",
                        help="a draft model scores only its N most frequent ids (FR-Spec; verification still "
                             "scores every id, so output is unchanged); 0 = all; default: the named pair's "
                             "setting under --drafter auto, else all ids")
    parser.add_argument("-k", "--num-speculative-tokens", type=int, default=DEFAULT_NUM_SPECULATIVE_TOKENS, help="draft tokens per step")
    parser.add_argument("--draft-length", default=None, choices=DRAFT_LENGTHS,
                        help="each request's draft-length rule, as in `specdec generate` (default: cost), under the "
                             "batch's caps below")
    parser.add_argument("--draft-tree", metavar="DEPTHxTOPKxBUDGET", default=None,
                        help="draft token trees of this shape (e.g. 3x2x6) in every batch with the loaded drafters "
                             "that draft trees (ngram, eagle, ngram+eagle; --drafter must be one), their rows beside "
                             "the others' chains; the budget shrinks with the load like a chain's k; a request's "
                             "speculative.num_tokens 0 turns drafting off, another value sets chains' length only")
    parser.add_argument("--spec-token-budget", type=int, default=32,
                        help="tokens one batched forward may score: with n running requests each drafts at most "
                             "budget // n - 1 tokens (speculation fades out under load)")
    parser.add_argument("--speculation-control", default="goodput", choices=["goodput", "budget"],
                        help="goodput: also learn the step cost and acceptance rate online and draft the k with the "
                             "most expected tokens/s (0 when drafting does not pay); budget: the budget rule only")


def _serving_arguments(parser) -> None:
    """Where it listens, and what its batch, queue and caches hold."""
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--max-batch", type=int, default=16, help="requests decoded together (KV cache rows)")
    parser.add_argument("--max-queue", type=int, default=64, help="requests waiting for a row; more get 429")
    parser.add_argument("--max-model-len", type=int, default=None,
                        help="prompt + generated tokens per request (default: the model's own context, cut "
                             "where every row's KV caches at full length would pass half of the memory free "
                             "at start; the ready line says it). The caches take memory as rows fill.")
    parser.add_argument("--prefill-chunk", type=int, default=DEFAULT_PREFILL_CHUNK,
                        help="prompt tokens prefilled per step while other requests are decoding, so a long prompt "
                             "delays them by one chunk per step; 0 = each prompt in one forward")
    parser.add_argument("--prefix-cache-tokens", type=int, default=DEFAULT_PREFIX_CACHE_TOKENS,
                        help="tokens of finished requests whose KV entries are kept for later requests with the "
                             "same prefix (system prompt, earlier turns), least recently used evicted first (a "
                             "draft model's rows are kept too, within the request's tenant and salt); "
                             "memory: this times the KV bytes per token (18 KiB for Gemma 3 270M in float16, the default "
                             "on the CPU; 36 KiB in float32); "
                             "0 = off")


def _access_arguments(parser) -> None:
    """Who may call it (keys, tenants), what they share and how large a request may be."""
    parser.add_argument("--api-key", default=None,
                        help="require 'Authorization: Bearer KEY' on every route but /health (one tenant, 'default')")
    parser.add_argument("--api-keys-file", default=None, metavar="FILE",
                        help="several keys, one tenant a line: 'TENANT KEY [concurrency=N] [queue=N] "
                             "[cache_share=F]' (defaults: --max-batch, --max-queue, 1/number of tenants; README, "
                             "Security); cached prompt prefixes are never shared between tenants; reloaded on SIGHUP")
    parser.add_argument("--metrics-key", default=None, metavar="KEY",
                        help="a key that reads /metrics, with the server-wide figures, and the docs, and cannot "
                             "generate (with several tenants a tenant's key reads its own figures only)")
    parser.add_argument("--cache-salt", default="request", choices=["request", "tenant", "off"],
                        help="who shares cached prompt prefixes: request = requests of one tenant with the same "
                             "`cache_salt` field (none is a salt too); tenant = every request of one tenant "
                             "(salts ignored); off = nothing is shared")
    parser.add_argument("--max-body-bytes", type=int, default=None, metavar="N",
                        help="request bodies larger than this get 413 (default: 64 bytes per token of "
                             "--max-model-len, at least 1 MiB)")


def _device_arguments(parser) -> None:
    """Where and in what numbers the model runs, and the log."""
    parser.add_argument("--dtype", default="auto",
                        help="auto (bfloat16 on CUDA and on CPUs with native bfloat16, float32 otherwise and for "
                             "int8) | float32 | bfloat16 | float16")
    parser.add_argument("--device", default="cpu", help="cpu | cuda")
    parser.add_argument("--kv-dtype", default="auto", choices=["auto", "float32", "float16"],
                        help="the KV cache's elements (the target's and a quantised draft model's): auto (default) = float16 under a float32 model on the CPU "
                             "(half the bytes a step reads; float16 keys and values move the numbers slightly), "
                             "else the model's dtype; float32 keeps the model's own numbers")
    parser.add_argument("--quantize", default="auto", choices=["auto", "none", "int8", "int4"],
                        help="auto (default): on the CPU when the weights come quantised (the default model, a named "
                             "model, a .gguf file), int4 where its layer weights are mostly 4-bit (Q4_K), else "
                             "int8; none for float weights")
    parser.add_argument("--tensor-parallel", type=int, default=1, metavar="N",
                        help="split the target over N processes (gloo on the CPU, NCCL on CUDA; README, Tensor "
                             "parallelism); the drafters run on rank 0; turns the prefix cache off (each rank "
                             "would keep its own share of a prefix)")
    parser.add_argument("--log-level", default="warning", help="uvicorn log level")


def _ray_arguments(ray) -> None:
    """Replicas under Ray Serve (`ray_app.py`)."""
    ray.add_argument("--replicas", type=int, default=0,
                     help="run N copies of the server under Ray Serve behind one endpoint (0: one process, no Ray)")
    ray.add_argument("--min-replicas", type=int, default=None,
                     help="autoscaling lower bound (default: --replicas; below --max-replicas turns autoscaling on)")
    ray.add_argument("--max-replicas", type=int, default=None, help="autoscaling upper bound (default: --replicas)")
    ray.add_argument("--target-ongoing-requests", type=float, default=None,
                     help="autoscaling target of requests in flight per replica (default: --max-batch)")
    ray.add_argument("--session-affinity", action="store_true",
                     help="route requests with the same X-Session-Id header to the same replica (its suffix cache "
                          "has seen the conversation)")
    ray.add_argument("--replica-cpus", type=float, default=1.0, help="CPUs Ray reserves per replica")
    ray.add_argument("--ray-address", default=None,
                     help="join this Ray cluster (e.g. auto, or HEAD_IP:6379) instead of starting a local one")
    ray.add_argument("--ray-num-cpus", type=int, default=None, help="CPUs of the local Ray (default: all)")
    ray.add_argument("--proxy-location", default="HeadOnly", choices=["HeadOnly", "EveryNode"],
                     help="Ray's HTTP proxy on the head node only (one endpoint) or on every node")


def settings_from_args(args) -> ServerSettings:
    for name in ("num_speculative_tokens", "max_batch", "max_model_len", "spec_token_budget"):
        if getattr(args, name) is not None and getattr(args, name) < 1:
            raise InvalidRequestError(f"--{name.replace('_', '-')} must be >= 1", name)
    if args.draft_vocab is not None and args.draft_vocab < 0:
        raise InvalidRequestError(f"--draft-vocab must be >= 0 (0 = all ids), got {args.draft_vocab}", "draft_vocab")
    for name in ("max_queue", "prefill_chunk", "prefix_cache_tokens"):
        if getattr(args, name) < 0:
            raise InvalidRequestError(f"--{name.replace('_', '-')} must be >= 0", name)
    if args.max_body_bytes is not None and args.max_body_bytes < 1:
        raise InvalidRequestError("--max-body-bytes must be >= 1", "max_body_bytes")
    # A keys file that does not parse: one line naming it (never a key), before the port is bound.
    KeyRing.build(args.api_key, args.api_keys_file, args.max_batch, args.max_queue, args.metrics_key)
    replica_flags = ("min_replicas", "max_replicas", "target_ongoing_requests", "ray_address", "ray_num_cpus")
    if args.replicas < 0:
        raise InvalidRequestError("--replicas must be >= 0", "replicas")
    if args.replicas == 0 and (args.session_affinity or any(getattr(args, f) is not None for f in replica_flags)):
        raise InvalidRequestError("--min-replicas, --max-replicas, --target-ongoing-requests, --session-affinity "
                                  "and --ray-* need --replicas N (Ray Serve)", "replicas")
    lo = args.replicas if args.min_replicas is None else args.min_replicas
    hi = args.replicas if args.max_replicas is None else args.max_replicas
    if args.replicas and not 0 <= lo <= args.replicas <= hi:
        raise InvalidRequestError(f"need 0 <= --min-replicas ({lo}) <= --replicas ({args.replicas}) <= "
                                  f"--max-replicas ({hi})", "replicas")
    if args.target_ongoing_requests is not None and not args.target_ongoing_requests > 0:
        raise InvalidRequestError("--target-ongoing-requests must be > 0", "target_ongoing_requests")
    if args.tensor_parallel != 1 and args.replicas:
        raise InvalidRequestError("--tensor-parallel and --replicas together are not supported: each replica "
                                  "would need its own ranks", "tensor_parallel")
    if args.replica_cpus < 0:
        raise InvalidRequestError("--replica-cpus must be >= 0", "replica_cpus")
    name = args.served_model_name
    if name is None:
        name = "gemma-3-270m" if args.model == "default" else Path(args.model).name.removesuffix(".gguf")
    # "auto": prompt lookup first and a named model's paired draft model (with its confidence
    # cut-off), else prompt lookup.
    drafter, draft_p_min = resolve_drafter(args.drafter, args.model)
    draft_vocab = args.draft_vocab
    if args.drafter == "auto" and draft_vocab is None:
        draft_vocab = pair_draft_vocab(args.model)  # the pair's measured setting, as `Engine.load` picks it
    if args.draft_tree is not None:
        TreeShape.parse(args.draft_tree)  # a malformed shape: one line, before the drafter's name
        check_tree_drafter(drafter)
    return ServerSettings(model=args.model, served_model_name=name, drafter=drafter, draft_p_min=draft_p_min,
                          draft_vocab=draft_vocab,
                          num_speculative_tokens=args.num_speculative_tokens, max_batch=args.max_batch,
                          max_queue=args.max_queue, max_model_len=args.max_model_len,
                          spec_token_budget=args.spec_token_budget, prefill_chunk=args.prefill_chunk,
                          prefix_cache_tokens=0 if args.tensor_parallel != 1 else args.prefix_cache_tokens,
                          speculation_control=args.speculation_control, api_key=args.api_key,
                          api_keys_file=args.api_keys_file, metrics_key=args.metrics_key, cache_salt=args.cache_salt,
                          max_body_bytes=args.max_body_bytes, dtype=args.dtype,
                          device=args.device, quantize=args.quantize, tensor_parallel=args.tensor_parallel,
                          draft_tree=args.draft_tree, kv_dtype=args.kv_dtype, draft_length=args.draft_length)


def bind(host: str, port: int) -> socket.socket:
    """The listening socket for `host`:`port`, bound here (not by uvicorn) so that a port in use is
    one clear error before anything says "serving", with no window for another process to take
    the port in between."""
    if not 0 <= port <= 65535:  # getaddrinfo would take 70000 as 70000 % 65536
        raise InvalidRequestError(f"--port must be in [0, 65535], got {port}", "port")
    try:
        family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM,
                                                             flags=socket.AI_PASSIVE)[0]
    except (socket.gaierror, UnicodeError) as exc:
        raise InvalidRequestError(f"--host {host!r}: cannot resolve it ({exc})", "host") from None
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn does: TIME_WAIT is no conflict
        sock.bind(address)
        sock.set_inheritable(True)
    except OSError as exc:
        sock.close()
        if exc.errno == errno.EADDRINUSE:
            raise SpecdecError(f"port {port} on {host} is already in use (another server?): pick another "
                               "with --port") from None
        raise SpecdecError(f"cannot listen on {host}:{port}: {exc.strerror or exc}") from None
    return sock
