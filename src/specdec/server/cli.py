"""`specdec serve`: arguments -> `ServerSettings` -> uvicorn running the app."""

from __future__ import annotations

import signal
import sys
from pathlib import Path

from ..errors import InvalidRequestError


def add_arguments(parser) -> None:
    parser.add_argument("--model", default="default",
                        help="HF folder, .gguf file or a named model (`specdec models`) (default: Gemma 3 270M)")
    parser.add_argument("--served-model-name", default=None,
                        help="the name clients send as `model` (default: derived from --model)")
    parser.add_argument("--drafter", default="ngram", choices=["none", "ngram", "suffix"],
                        help="default lookup drafter (requests may override it with `speculative`); the default, "
                             "ngram, drafts only where --speculation-control finds it pays")
    parser.add_argument("-k", "--num-speculative-tokens", type=int, default=5, help="draft tokens per step")
    parser.add_argument("--spec-token-budget", type=int, default=32,
                        help="tokens one batched forward may score: with n running requests each drafts at most "
                             "budget // n - 1 tokens (speculation fades out under load)")
    parser.add_argument("--speculation-control", default="goodput", choices=["goodput", "budget"],
                        help="goodput: also learn the step cost and acceptance rate online and draft the k with the "
                             "most expected tokens/s (0 when drafting does not pay); budget: the budget rule only")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--max-batch", type=int, default=16, help="requests decoded together (KV cache rows)")
    parser.add_argument("--max-queue", type=int, default=64, help="requests waiting for a row; more get 429")
    parser.add_argument("--max-model-len", type=int, default=2048,
                        help="prompt + generated tokens per request (sizes the preallocated KV cache)")
    parser.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY' on /v1/*")
    parser.add_argument("--dtype", default="auto",
                        help="auto (bfloat16 on CUDA and on CPUs with native bfloat16, float32 otherwise and for "
                             "int8) | float32 | bfloat16 | float16")
    parser.add_argument("--device", default="cpu", help="cpu | cuda")
    parser.add_argument("--quantize", default="auto", choices=["auto", "none", "int8"],
                        help="auto (default): int8 on the CPU when the weights come quantised (the default model, a "
                             "named model, a .gguf file), else none")
    parser.add_argument("--log-level", default="warning", help="uvicorn log level")


def settings_from_args(args):
    from .app import ServerSettings

    for name in ("num_speculative_tokens", "max_batch", "max_model_len", "spec_token_budget"):
        if getattr(args, name) < 1:
            raise InvalidRequestError(f"--{name.replace('_', '-')} must be >= 1", name)
    if args.max_queue < 0:
        raise InvalidRequestError("--max-queue must be >= 0", "max_queue")
    name = args.served_model_name
    if name is None:
        name = "gemma-3-270m" if args.model == "default" else Path(args.model).name.removesuffix(".gguf")
    return ServerSettings(model=args.model, served_model_name=name, drafter=args.drafter,
                          num_speculative_tokens=args.num_speculative_tokens, max_batch=args.max_batch,
                          max_queue=args.max_queue, max_model_len=args.max_model_len,
                          spec_token_budget=args.spec_token_budget,
                          speculation_control=args.speculation_control, api_key=args.api_key, dtype=args.dtype,
                          device=args.device, quantize=args.quantize)


def run(args) -> int:
    import uvicorn

    from ..engine import check_quantize, resolve_device, resolve_dtype, resolve_quantize
    from ..models.loader import check_path
    from .app import create_app

    settings = settings_from_args(args)
    # Fail on a bad device, dtype, quantisation or model path before binding the port; the model
    # itself loads in the background while /health answers 503.
    device = resolve_device(settings.device)
    quantize = resolve_quantize(settings.quantize, device, settings.model)
    resolve_dtype(settings.dtype, device, quantize)
    check_quantize(quantize, device)
    if settings.model != "default":
        check_path(settings.model)
    print(f"specdec: serving {settings.served_model_name!r} on http://{args.host}:{args.port} "
          f"(model loads in the background; GET /health says when it is ready)", file=sys.stderr)
    # Uvicorn handles SIGTERM / SIGINT: it stops accepting, waits for in-flight requests (streams
    # included) and then runs the app's shutdown, which drains the scheduler. Afterwards it raises
    # the signal again under the handler that was there before; for SIGTERM that handler does
    # nothing, so a drained server ends with exit status 0 rather than being killed by the signal.
    signal.signal(signal.SIGTERM, lambda signum, frame: None)
    server = uvicorn.Server(uvicorn.Config(create_app(settings), host=args.host, port=args.port,
                                           log_level=args.log_level))
    server.run()
    return 0
