"""Command line: argument parsing -> Engine -> printed output. No logic of its own."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from .errors import SpecdecError
from .settings import DEFAULT_NUM_SPECULATIVE_TOKENS

MARK_PLAIN = {"accepted": ("[", "]"), "recovered": ("{", "}"), "bonus": ("<", ">")}
MARK_COLOUR = {"accepted": ("\033[32m", "\033[0m"), "recovered": ("\033[31m", "\033[0m"), "bonus": ("\033[34m", "\033[0m")}


class _Parser(argparse.ArgumentParser):
    """argparse with its errors on one line (the problem and where help is), exit status 2: the
    usage block argparse prints first buries the one line that says what is wrong. Subcommands'
    parsers are made of this class too (`add_subparsers` uses the parent's)."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message} (see `{self.prog} --help`)\n")


def _parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="specdec", description="Lossless speculative decoding.")
    sub = parser.add_subparsers(dest="command", required=True)
    gen = sub.add_parser("generate", help="generate a continuation of a prompt")
    gen.add_argument("--prompt", help="prompt text (with --chat: the user's message)")
    gen.add_argument("--message", help="a user message, rendered with the model's chat template (implies --chat)")
    gen.add_argument("--system", help="a system message before the user's (implies --chat)")
    gen.add_argument("--chat", action="store_true",
                     help="render the prompt with the model's chat template (as /v1/chat/completions does) and "
                          "stop at the end of the assistant's turn")
    gen.add_argument("--prompt-ids", help="comma-separated token ids (for models without a tokenizer)")
    add_decoding_arguments(gen)
    form = gen.add_mutually_exclusive_group()
    form.add_argument("--json-schema", metavar="FILE", help="the output is JSON valid against this schema")
    form.add_argument("--json-object", action="store_true", help="the output is a JSON object")
    form.add_argument("--regex", help="the output matches this regular expression")
    form.add_argument("--grammar", metavar="FILE", help="the output follows this Lark (or GBNF) grammar")
    gen.add_argument("--prediction", metavar="FILE|-",
                     help="the text the output is expected to be, mostly (an edit of a file: the file), from FILE "
                          "or - for stdin: drafted from wherever the output follows it; the output is unchanged")
    gen.add_argument("--stream", action="store_true", help="print text as it is generated")
    gen.add_argument("--json", action="store_true", help="print one JSON object")
    gen.add_argument("--compare", action="store_true", help="run plain and speculative decoding, compare")
    gen.add_argument("--show-drafts", action="store_true", help="mark accepted [..], recovered {..}, bonus <..>")
    # Each other subcommand owns its arguments and its runner in its own module; this file only
    # wires them up (imports stay lazy so `specdec generate` does not pay for the server's).
    for name, module, help_text in SUBCOMMANDS:
        _import(module).add_arguments(sub.add_parser(name, help=help_text))
    return parser


def add_decoding_arguments(gen: argparse.ArgumentParser) -> None:
    """The model, drafter, sampling and device options: `generate`'s, which `chat` takes too."""
    gen.add_argument("--model", default="default",
                     help="HF folder, .gguf file, or a named model (`specdec models`, e.g. qwen2.5-coder-1.5b-instruct) "
                          "(default: Gemma 3 270M)")
    gen.add_argument("--drafter", default="auto",
                     help="auto (default: for a named model with a paired draft model, prompt lookup first and that "
                          "draft model with its confidence cut-off where lookup finds nothing (ngram+DRAFT); otherwise prompt lookup, ngram; the cost-aware draft length "
                          "drafts only where it pays, a draft model's tokens priced at its measured cost and "
                          "its chains ended where the product of its confidences stops paying) | none | ngram | suffix | eagle (the shipped head of the default model) | "
                          "eagle:DIR (a trained head) | a named model or the PATH of a draft model (HF folder or .gguf) "
                          "sharing the vocabulary | ngram+eagle, suffix+eagle, ngram+PATH... (lookup "
                          "where it finds a match, the learned drafter where it does not)")
    gen.add_argument("--draft-p-min", type=float, default=None,
                     help="draft model: stop drafting below this top probability (0 = off)")
    gen.add_argument("--quantize", default="auto", choices=["auto", "none", "int8", "int4"],
                     help="int8: int8 weights for every linear and the output head, activations on two "
                          "7-bit planes per row (CPU, fbgemm); changes the target, plain and "
                          "speculative then share it; int4: the decoder layers' weights on 4 bits in "
                          "groups of 32 (head int8), 5/8 of int8's bytes. auto (default), on the CPU when the "
                          "weights come quantised already (the default model, a named model, a .gguf file): "
                          "int4 where most layer weights are 4-bit (Q4_K: int4 keeps their grid, as faithful "
                          "to llama.cpp as int8 and faster), else int8; none for float weights")
    gen.add_argument("--kv-dtype", default="auto", choices=["auto", "float32", "float16"],
                     help="the KV cache elements of the target and of a quantised draft model: auto (default) = "
                          "float16 under a float32 model on the CPU, else the model's dtype (a float draft keeps "
                          "its own); float32 keeps the models' own numbers")
    gen.add_argument("--draft-quantize", default="auto", choices=["auto", "none", "int8", "int4"],
                     help="the draft model's quantisation (auto, the default: the target's). A 4-bit draft also "
                          "scores with a 4-bit copy of its head; a draft's numbers only move its acceptance")
    gen.add_argument("--draft-vocab", type=int, default=None, metavar="N",
                     help="the draft model scores only its N most frequent ids (FR-Spec: the first N and the special "
                          "ones; 0 = all); lossless, the target still verifies over its full vocabulary. "
                          "Default: all, or the pair's 32768 under --drafter auto with a named target")
    gen.add_argument("-k", "--num-speculative-tokens", type=int, default=DEFAULT_NUM_SPECULATIVE_TOKENS,
                     help="draft tokens per step (the most, with --draft-length cost)")
    gen.add_argument("--draft-length", default=None, choices=["fixed", "adaptive", "cost"],
                     help="cost (default): per kind of proposal (n-gram match length), the length up to k "
                          "with the best expected speedup for the acceptance measured so far and "
                          "--verify-cost; fixed: k tokens a step; adaptive: +2 after a fully accepted "
                          "step, -1 otherwise")
    gen.add_argument("--verify-cost", type=float, default=None,
                     help="with --draft-length cost: a verify pass over k drafts costs 1 + OVERHEAD + COST*k "
                          "one-token passes; this is COST (default: fitted per device and quantisation, "
                          "policy.DEFAULT_VERIFY_COSTS)")
    gen.add_argument("--verify-overhead", type=float, default=None,
                     help="... and this OVERHEAD (default: fitted, as for --verify-cost)")
    gen.add_argument("--tree", metavar="DEPTHxTOPKxBUDGET", default=None,
                     help="draft token trees instead of chains (eagle, ngram): DEPTH levels, up to TOPK "
                          "candidates per node, at most BUDGET nodes scored in one target pass, e.g. 4x3x12; "
                          "-k and --draft-length then do not apply")
    gen.add_argument("--max-tokens", type=int, default=64)
    gen.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    gen.add_argument("--top-k", type=int, default=0)
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--min-p", type=float, default=0.0)
    gen.add_argument("--seed", type=int)
    gen.add_argument("--frequency-penalty", type=float, default=0.0, help="in [-2, 2], per generated occurrence")
    gen.add_argument("--presence-penalty", type=float, default=0.0, help="in [-2, 2], once per generated token")
    gen.add_argument("--repetition-penalty", type=float, default=1.0, help="> 0 (HF's: 1 = off)")
    gen.add_argument("--logit-bias", default="", metavar="ID:BIAS,...", help="added to those tokens' logits")
    gen.add_argument("--min-tokens", type=int, default=0, help="EOS is masked before this many tokens")
    gen.add_argument("--ignore-eos", action="store_true", help="EOS does not end the output")
    gen.add_argument("--stop", action="append", help="stop string (repeatable)")
    gen.add_argument("--dtype", default="auto",
                     help="auto (bfloat16 on CUDA and on CPUs with native bfloat16, float32 otherwise and for int8) "
                          "| float32 | bfloat16 | float16")
    gen.add_argument("--device", default="cpu", help="cpu | cuda")
    gen.add_argument("--tensor-parallel", type=int, default=1, metavar="N",
                     help="split the target over N processes (attention heads, MLP columns and the output "
                          "head's vocabulary; gloo on the CPU, NCCL on CUDA, one GPU a rank): specdec spawns "
                          "ranks 1..N-1 itself, or run it under `torchrun --nproc-per-node N`; the drafter "
                          "and verification run on rank 0 (README, Tensor parallelism)")


# (subcommand, module with add_arguments(parser) and run(args) -> exit code, help)
SUBCOMMANDS = [
    ("serve", "specdec.server.cli", "run the OpenAI-compatible HTTP server"),
    ("bench", "specdec.bench.cli", "benchmark configurations on Spec-Bench prompts"),
    ("chat", "specdec.chat",
     "talk with a model turn by turn, kept loaded: its chat template, a system prompt, /reset, /drafts"),
    ("models", "specdec.models.models_cli", "list the named models (--model / --drafter NAME) and whether they are installed"),
    ("train-draft", "specdec.train",
     "train a drafter for a target by self-distillation: an EAGLE-style head or a small draft model"),
]


def _import(module: str):
    import importlib

    return importlib.import_module(module)


def _progress(done: int, total: int) -> None:
    if done == 0:
        print("specdec: converting the GGUF file once (later loads are fast)...", file=sys.stderr)
    if total and done % 40 == 0 or done == total:
        print(f"\r  {done}/{total} tensors", end="\n" if done == total else "", file=sys.stderr, flush=True)


def _show_drafts(engine, generation, colour: bool) -> str:
    marks = MARK_COLOUR if colour else MARK_PLAIN
    tok = engine.tokenizer
    pieces = []
    for step in generation.steps:
        if step.kind == "prefill":
            pieces.append(tok.decode([step.next_token]))
            continue
        if step.accepted:
            a, b = marks["accepted"]
            pieces.append(a + tok.decode(step.accepted) + b)
        a, b = marks[step.kind]
        pieces.append(a + tok.decode([step.next_token]) + b)
    return "".join(pieces)


def sampling_from_args(args):
    """The `SamplingParams` of the decoding options (`add_decoding_arguments`)."""
    from .sampling import SamplingParams

    try:
        bias = {int(t): float(b) for t, b in (pair.split(":") for pair in args.logit_bias.split(",") if pair)}
    except ValueError:
        raise SpecdecError("--logit-bias must be ID:BIAS pairs separated by commas, e.g. 13:-5,42:2.5") from None
    return SamplingParams(args.temperature, args.top_k, args.top_p, args.min_p, args.seed,
                          frequency_penalty=args.frequency_penalty, presence_penalty=args.presence_penalty,
                          repetition_penalty=args.repetition_penalty, logit_bias=bias,
                          min_tokens=args.min_tokens, ignore_eos=args.ignore_eos)


def decoding_settings(args):
    """The `DecodingSettings` of the decoding options (`add_decoding_arguments`), validated."""
    from .settings import DecodingSettings

    return DecodingSettings(target=args.model, drafter=args.drafter, num_speculative_tokens=args.num_speculative_tokens,
                            device=args.device, dtype=args.dtype, draft_length=args.draft_length,
                            draft_p_min=args.draft_p_min, quantize=args.quantize, draft_tree=args.tree,
                            verify_cost=args.verify_cost, verify_overhead=args.verify_overhead,
                            draft_quantize=args.draft_quantize, draft_vocab=args.draft_vocab,
                            tensor_parallel=args.tensor_parallel, kv_dtype=args.kv_dtype)


def load_engine(args, settings=None):
    """The engine the decoding options name (or their `settings`, already made), built with the
    CLI's progress lines."""
    from .engine import Engine

    settings = settings or decoding_settings(args)
    print("specdec: loading the model...", file=sys.stderr)
    return Engine.build(settings, _progress)


def _compare(engine, kwargs: dict, args) -> int:
    """--compare: plain and speculative decoding of the same request, both printed (or one JSON)."""
    engine.generate(**{**kwargs, "max_new_tokens": 4})  # warm-up so the first timing is fair
    plain = engine.generate(**kwargs, speculative=False)
    spec = engine.generate(**kwargs)
    result = {
        "plain": {"text": plain.text, "tokens_per_s": plain.stats.tokens_per_s},
        "speculative": {"text": spec.text, "tokens_per_s": spec.stats.tokens_per_s,
                        "stats": spec.stats.as_dict(), **_prediction_usage(spec)},
        "speedup": spec.stats.tokens_per_s / plain.stats.tokens_per_s if plain.stats.tokens_per_s else 0.0,
        "identical": plain.token_ids == spec.token_ids,
    }
    if args.json:
        print(json.dumps(result))
        return 0
    print(f"--- plain ({plain.stats.tokens_per_s:.1f} tokens/s)\n{plain.text}")
    print(f"--- speculative, drafter {getattr(engine.drafter, 'name', 'none')} ({spec.stats.tokens_per_s:.1f} tokens/s, "
          f"mean accepted length {spec.stats.mean_accepted_length:.2f})\n{spec.text}")
    print(f"--- speedup {result['speedup']:.2f}x; texts identical: {result['identical']}")
    return 0


def _generate(args) -> int:
    from .tokenizer import check_text

    sampling = sampling_from_args(args)
    prompt_ids = None
    if args.prompt_ids:
        try:
            prompt_ids = [int(x) for x in args.prompt_ids.split(",")]
        except ValueError:
            raise SpecdecError("--prompt-ids must be comma-separated integers") from None
    chat = args.chat or args.message is not None or args.system is not None
    if args.message is not None and args.prompt is not None:
        raise SpecdecError("give the user's message once: --message or --prompt")
    if chat and prompt_ids is not None:
        raise SpecdecError("--chat renders text through the chat template: give --message or --prompt, not --prompt-ids")
    user = args.message if args.message is not None else args.prompt
    if chat and user is None:
        raise SpecdecError("--chat needs the user's message: --message TEXT")
    if not chat and (args.prompt is None) == (prompt_ids is None):
        raise SpecdecError("give exactly one of --prompt or --prompt-ids")
    # Before the load: invalid UTF-8 in an argument is a lone surrogate here.
    for flag, text in (("--prompt", args.prompt), ("--message", args.message), ("--system", args.system)):
        if text is not None:
            check_text(text, flag, "prompt")
    for stop in args.stop or ():
        check_text(stop, "--stop", "stop")
    if args.stream and (args.json or args.compare):
        raise SpecdecError(f"--stream cannot be combined with {'--json' if args.json else '--compare'}, "
                           "which print the whole result at the end")
    if args.max_tokens < 1:  # before the load, like every other option the engine checks
        raise SpecdecError(f"--max-tokens must be >= 1, got {args.max_tokens}")
    structured = None
    if args.json_schema or args.grammar:  # read before the load: a missing file fails fast
        path = args.json_schema or args.grammar
        try:
            text = Path(path).read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as exc:
            raise SpecdecError(f"cannot read {path}: {exc}") from None
        structured = {"json": text} if args.json_schema else {"grammar": text}
    elif args.json_object:
        structured = {"json_object": True}
    elif args.regex is not None:
        structured = {"regex": args.regex}
    prediction = _read_prediction(args.prediction)
    engine = load_engine(args)
    prompt = args.prompt
    if chat:
        if engine.tokenizer is None:
            raise SpecdecError("--chat: this model has no tokenizer, so no chat template")
        messages = ([{"role": "system", "content": args.system}] if args.system is not None else []) + \
            [{"role": "user", "content": user}]
        # The reply ends at the template's end-of-turn token, which is the model's EOS (Qwen's <|im_end|>).
        prompt, prompt_ids = None, engine.tokenizer.encode_chat(messages)
    kwargs = dict(prompt=prompt, prompt_ids=prompt_ids, max_new_tokens=args.max_tokens, sampling=sampling,
                  stop=args.stop, structured=structured, prediction=prediction)
    if args.compare:
        return _compare(engine, kwargs, args)
    on_text = (lambda d: print(d, end="", flush=True)) if args.stream and not args.json else None
    out = engine.generate(**kwargs, on_text=on_text)
    if args.json:
        print(json.dumps({"text": out.text, "token_ids": out.token_ids, "finish_reason": out.finish_reason,
                          "stats": out.stats.as_dict(), **_prediction_usage(out)}))
        return 0
    if args.show_drafts and engine.tokenizer is not None:
        print(_show_drafts(engine, out, sys.stdout.isatty()))
    elif on_text is None:
        print(out.text)
    else:
        print()
    s = out.stats
    predicted = "".join(f", {k.split('_')[0]} prediction tokens {v}" for k, v in _prediction_usage(out).items())
    print(f"[{s.new_tokens} tokens, {s.tokens_per_s:.1f} tokens/s, {s.target_forwards} target forwards, "
          f"mean accepted length {s.mean_accepted_length:.2f}{predicted}, finish: {out.finish_reason}]", file=sys.stderr)
    return 0


def _read_prediction(source: str | None) -> str | None:
    """--prediction's text: FILE's or, for -, standard input's (UTF-8); one-line errors."""
    if source is None:
        return None
    from .tokenizer import check_text

    try:
        text = sys.stdin.buffer.read().decode("utf-8") if source == "-" else Path(source).read_text(encoding="utf-8")
    except UnicodeDecodeError as exc:
        raise SpecdecError(f"--prediction {source}: not UTF-8 text ({exc.reason} at byte {exc.start})") from None
    except OSError as exc:
        raise SpecdecError(f"--prediction: cannot read {source}: {exc.strerror or exc}") from None
    return check_text(text, "--prediction", "prediction")


def _prediction_usage(out) -> dict:
    """OpenAI's usage fields of a generation's prediction (none without one)."""
    if out.prediction is None:
        return {}
    return {"accepted_prediction_tokens": out.prediction.accepted,
            "rejected_prediction_tokens": out.prediction.rejected}


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        if args.command == "generate":
            return _generate(args)
        return _import(dict((n, m) for n, m, _ in SUBCOMMANDS)[args.command]).run(args)
    except SpecdecError as exc:
        print(f"specdec: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
