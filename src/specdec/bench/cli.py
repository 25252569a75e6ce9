"""`specdec bench`: arguments -> prompts, configurations -> runner -> Markdown / JSON / plot."""

from __future__ import annotations

import shlex
import sys

from .configs import DEFAULT_CONFIGS
from .prompts import DEFAULT_TASKS, DEFAULT_TEMPLATE

DEFAULT_PER_GROUP = 1  # 6 prompts x 128 tokens x 5 configurations: a few minutes on 2 quiet cores


def add_arguments(parser) -> None:
    parser.description = (
        "Measure plain and speculative decoding (and installed peers) on Spec-Bench prompts, greedy or "
        "seeded sampling, "
        "interleaved after a warm-up. Prints a Markdown table (each speedup with its 95% bootstrap interval over "
        "the prompts); --json / --markdown / --plot save more.")
    parser.add_argument("--model", default="default",
                        help="target: HF folder, .gguf or a named model (`specdec models`) (default: Gemma 3 270M)")
    parser.add_argument("--configs", default=DEFAULT_CONFIGS,
                        help="comma-separated configurations, e.g. plain,ngram:k=5,suffix:k=5,draft:k=4,"
                             "hf,hf-lookup:k=10,hf-assist,llama-cpp,llama-cpp-lookup; options dtype=, quantize= "
                             f"(default: {DEFAULT_CONFIGS})")
    parser.add_argument("--tasks", default=DEFAULT_TASKS,
                        help="spec_bench (its six groups) | all (+ code) | none | comma-separated groups: mt_bench, "
                             "translation, summarization, qa, math_reasoning, rag, code, or one MT-bench category")
    parser.add_argument("--per-group", type=int, default=DEFAULT_PER_GROUP,
                        help=f"prompts per task group, evenly spread over it; 0 = all (default {DEFAULT_PER_GROUP})")
    parser.add_argument("--prompts", action="append", default=[], metavar="FILE.jsonl",
                        help="extra prompts: one JSON object a line with prompt | turns | prompt_ids "
                             "(+ optional group, id); repeatable")
    parser.add_argument("--spec-bench", metavar="FILE", help="Spec-Bench question.jsonl (default: ../shared/spec_bench)")
    parser.add_argument("--chat", action="store_true",
                        help="feed each question as the user's first turn through the model's chat template "
                             "(instruct models), instead of --template")
    parser.add_argument("--template", default=DEFAULT_TEMPLATE.replace("\n", "\\n"),
                        help="how a question is fed to the (base) model; {prompt} is the question, \\n a newline "
                             "(default: %(default)s)")
    parser.add_argument("--max-tokens", type=int, default=128, help="new tokens per prompt (default 128)")
    parser.add_argument("--dtype", default="auto", help="specdec targets: auto | float32 | bfloat16 | float16 (HF peers run float32 unless hf:dtype=...)")
    parser.add_argument("--quantize", default="auto", choices=["auto", "none", "int8", "int4"],
                        help="specdec targets' quantisation; auto (default): on the CPU for a GGUF source (the default "
                             "model, a named model, a .gguf file) int4 where its layer weights are mostly 4-bit "
                             "(Q4_K), else int8; none otherwise")
    parser.add_argument("--draft-model", metavar="PATH",
                        help="draft model for draft / hf-assist configurations (default: a named target's paired "
                             "draft model)")
    parser.add_argument("--temperature", type=float, default=0.0,
                        help="0 (default): greedy, every output checked against plain; > 0: seeded sampling, the "
                             "same seed per prompt for every configuration (peers are left out)")
    parser.add_argument("--seed", type=int, default=0, help="base seed of sampled runs (default 0)")
    parser.add_argument("--ref-src", metavar="DIR",
                        help="another specdec source tree (a checkout or its src folder) that ref@CONFIG "
                             "configurations run in a worker process (this@CONFIG: this tree in the same kind of "
                             "process, the side to compare with), e.g. --configs this@plain,ref@plain --ref-src "
                             "../old: two versions of specdec side by side in one run")
    parser.add_argument("--clock", default="wall", choices=["wall", "cpu"],
                        help="what a run's seconds are: wall (default) or the process's CPU time, which leaves "
                             "out the time spent waiting for a core on a shared machine (for 1-thread runs)")
    parser.add_argument("--device", default="cpu", help="cpu | cuda")
    parser.add_argument("--repeats", type=int, default=1, help="interleaved passes over the prompts (default 1)")
    parser.add_argument("--warmup", type=int, default=1, help="warm-up rounds before measuring (default 1)")
    parser.add_argument("--json", metavar="FILE", help="write every run and summary as JSON")
    parser.add_argument("--markdown", metavar="FILE", help="also write the Markdown report to FILE")
    parser.add_argument("--plot", metavar="FILE.png", help="speedup per task group and acceptance by position")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")


def command_line(args) -> str:
    """The command that reproduces this run, every option spelled out."""
    parts = ["specdec", "bench", "--model", args.model, "--configs", args.configs, "--tasks", args.tasks,
             "--per-group", str(args.per_group)]
    for f in args.prompts:
        parts += ["--prompts", f]
    if args.spec_bench:
        parts += ["--spec-bench", args.spec_bench]
    if args.chat:
        parts += ["--chat"]
    elif args.template != DEFAULT_TEMPLATE.replace("\n", "\\n"):
        parts += ["--template", args.template]
    parts += ["--max-tokens", str(args.max_tokens), "--dtype", args.dtype, "--quantize", args.quantize]
    if args.draft_model:
        parts += ["--draft-model", args.draft_model]
    if args.temperature:
        parts += ["--temperature", f"{args.temperature:g}", "--seed", str(args.seed)]
    if args.ref_src:
        parts += ["--ref-src", args.ref_src]
    parts += ["--device", args.device, "--repeats", str(args.repeats), "--warmup", str(args.warmup)]
    if args.clock != "wall":
        parts += ["--clock", args.clock]
    return shlex.join(parts)


def run(args) -> int:
    from . import report
    from .configs import parse_configs
    from .prompts import parse_tasks, select_prompts, spec_bench_path
    from .runner import Settings, run_bench

    # Everything that can be checked without a model is checked first: bad input fails at once.
    _check_outputs(args)
    from ..builder import resolve_quantize
    from ..models import presets

    draft_model = args.draft_model
    if draft_model is None and presets.is_preset(args.model):
        draft_model = presets.get(args.model).draft
    configs = parse_configs(args.configs, draft_model)
    if any(c.ref for c in configs):
        from .runner import ref_source

        ref_source(args.ref_src)  # a missing or wrong --ref-src fails before any load
    groups = parse_tasks(args.tasks)
    template = args.template.replace("\\n", "\n")
    prompts = select_prompts(groups, args.per_group, spec_bench_path(args.spec_bench), args.prompts, template,
                             args.chat)
    quantize = resolve_quantize(args.quantize, args.device, args.model)
    settings = Settings(args.model, args.max_tokens, args.dtype, quantize, args.device, args.repeats, args.warmup,
                        args.temperature, args.seed, args.ref_src, args.clock)

    def log(message: str) -> None:
        (bar.write if bar is not None else lambda m: print(m, file=sys.stderr))(f"bench: {message}")

    bar = None
    hooks = {}
    if not args.no_progress:
        try:
            from tqdm import tqdm
        except ImportError:  # pragma: no cover - tqdm comes with transformers
            tqdm = None
        if tqdm is not None:
            def total(n: int) -> None:
                nonlocal bar
                bar = tqdm(total=n, file=sys.stderr, unit="run", dynamic_ncols=True, mininterval=0.5)

            def progress(label: str) -> None:
                bar.set_postfix_str(label, refresh=False)
                bar.update(1)

            hooks = {"total": total, "progress": progress}
    try:
        result = run_bench(settings, configs, prompts, log=log, **hooks)
    finally:
        if bar is not None:
            bar.close()
    summaries = report.summarize(result)
    command = command_line(args)
    markdown = report.to_markdown(result, summaries, command)
    if any(p.prediction is not None for p in prompts):
        markdown += _edits_markdown(result, prompts, args.model)
    print(markdown, end="")
    if args.markdown:
        report.write_text(args.markdown, markdown)
    if args.json:
        report.write_json(args.json, report.to_json(result, summaries, command))
    if args.plot:
        report.write_plot(args.plot, result, summaries)
    return 0


def _edits_markdown(result, prompts, model: str) -> str:
    """The edit tasks' results by changed-line fraction (`edits.to_markdown`)."""
    from ..models import loader
    from ..tokenizer import Tokenizer
    from . import edits

    tokenizer = Tokenizer.from_folder(loader.resolve(model))
    return edits.to_markdown(result, prompts, tokenizer.decode) if tokenizer is not None else ""


def _check_outputs(args) -> None:
    """Output paths are checked before the (long) run, not after it."""
    from pathlib import Path

    from ..errors import InvalidRequestError

    for option, path in (("--json", args.json), ("--markdown", args.markdown), ("--plot", args.plot)):
        if path and not Path(path).expanduser().resolve().parent.is_dir():
            raise InvalidRequestError(f"{option} {path}: its folder does not exist", "output")
    if args.plot and Path(args.plot).suffix.lower() not in (".png", ".svg", ".pdf"):
        raise InvalidRequestError(f"--plot {args.plot}: give a .png, .svg or .pdf file", "plot")
    if args.plot:
        from ..extras import require

        require("bench", "--plot", "matplotlib")
