"""Run every configuration on every prompt, interleaved, and record what each run did.

Order. After a warm-up (each configuration generates a few tokens on the first prompt, so one-time
costs such as thread-pool start-up and allocator growth are paid outside the measurement), the
runs go prompt by prompt, and for each prompt every configuration in turn: A B C, A B C, ... A slow
drift of the machine (another process, thermal state) then hits every configuration alike instead
of whichever happened to run last. `repeats` repeats this whole pass.

Cross-request state. The suffix drafter learns from earlier requests, which is its point; but a
repeat of the same prompt (or the warm-up) would let it replay an output it has already seen. So
lookup drafters are rebuilt at the start of every pass: within a pass they learn across different
prompts, never from the same prompt's earlier run.

One target, many configurations. Every specdec configuration with the same (dtype, quantize) runs
on one loaded `Transformer`: each gets its own light `Engine` around the shared model and its own
drafter. A draft model is loaded once per (path, dtype) and shared the same way. HF peers share
one HF model per dtype.

Timing. Every configuration, specdec and peers alike, is timed the same way: the wall time of the
whole generate call on pre-tokenised ids (prefill included, tokenisation excluded), and tokens/s
counts new tokens only (the prompt is excluded; an EOS that ended the output counts, as one
generated token). `clock="cpu"` (`--clock cpu`) times the same calls by the
process's CPU time instead: on a machine shared with other work, wall time also counts the time
the process waited for a core, CPU time does not (it is the measure for one-thread runs; the
prefill time and drafting time behind the bound and step cost stay wall-clock).

Greedy or sampled. Runs are greedy unless `temperature` > 0. Sampled runs draw with a seed fixed per
(prompt, repeat), the same for every configuration, so a rerun draws the same texts; speculative
and plain outputs then differ (they consume the random stream differently) while both follow the
target's distribution, so "identical to plain" is not asked of them. Peers sample with their own
samplers and are left out of sampled runs.
"""

from __future__ import annotations

import contextlib
import gc
import importlib.metadata
import os
import platform
import resource
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

from .. import builder
from ..builder import resolve_device, resolve_dtype
from ..errors import InvalidRequestError, SpecdecError
from ..settings import DEFAULT_NUM_SPECULATIVE_TOKENS, DecodingSettings
from .common import BenchResult, PromptInfo, Run, Settings, load_progress, sync
from .configs import (BenchConfig, counterparts, eagle_name, lookup_drafter, ref_load_options, target_key,
                      with_baselines)
from .peers import load_peers
from .prompts import BenchPrompt

WARMUP_TOKENS = 16  # tokens per warm-up generation: enough to run the decode loop, cheap
CLOCKS = {"wall": time.perf_counter, "cpu": time.process_time}  # --clock: what a run's seconds are


class MemoryProbe:
    """Peak memory of one run.

    CPU: Linux lets a process reset its peak-RSS mark (writing 5 to /proc/self/clear_refs), and
    VmHWM in /proc/self/status is then the peak since that reset, so each run gets its own peak (of
    the whole process: every loaded model counts). Where the reset is refused, ru_maxrss gives the
    process's peak so far. CUDA: torch's max_memory_allocated since a reset of its peak statistics.
    """

    def __init__(self, device: str):
        self.cuda = device.startswith("cuda")
        self.resettable = not self.cuda and self._reset_rss()
        self.kind = ("cuda max allocated" if self.cuda else
                     "peak RSS" if self.resettable else "peak RSS of the process so far")

    def start(self) -> None:
        if self.cuda:
            torch.cuda.reset_peak_memory_stats()
        elif self.resettable:
            self._reset_rss()

    def peak(self) -> int | None:
        if self.cuda:
            return int(torch.cuda.max_memory_allocated())
        if self.resettable:
            hwm = _vm_hwm()
            if hwm is not None:
                return hwm
        # ru_maxrss is in KiB on Linux (bytes on macOS).
        maxrss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        return maxrss if sys.platform == "darwin" else maxrss * 1024

    @staticmethod
    def _reset_rss() -> bool:
        try:
            Path("/proc/self/clear_refs").write_text("5")
        except OSError:
            return False
        return _vm_hwm() is not None


def _vm_hwm() -> int | None:
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


class TimedDrafter:
    """A drafter that also adds up the time its proposals take (the drafting cost of the bound):
    `propose`, `propose_tree`, and a lookup-first combination's `propose_free` and
    `propose_learned`, which the core calls in place of `propose`.

    Everything else, including optional hooks such as `observe`, goes to the wrapped drafter.
    """

    def __init__(self, inner):
        self.inner = inner
        self.name = inner.name
        self.seconds = 0.0

    def begin(self, prompt_ids, sampling=None, generator=None, **options) -> None:
        self.inner.begin(prompt_ids, sampling, generator, **options)  # options: a prompt window

    def _timed(self, method: str, *args, **options):
        start = time.perf_counter()
        made = getattr(self.inner, method)(*args, **options)
        self.seconds += time.perf_counter() - start
        return made

    def propose(self, context: list[int], k: int, **options):
        return self._timed("propose", context, k, **options)

    def propose_tree(self, context: list[int], *shape):
        return self._timed("propose_tree", context, *shape)

    def propose_free(self, context: list[int], k: int, learned_first=None):
        return self._timed("propose_free", context, k, learned_first)

    def propose_learned(self, context: list[int], n: int):
        return self._timed("propose_learned", context, n)

    def feedback(self, num_accepted: int) -> None:
        self.inner.feedback(num_accepted)

    def end(self, output_ids: list[int]) -> None:
        self.inner.end(output_ids)

    def __getattr__(self, name):  # only reached for attributes not defined above
        return getattr(self.inner, name)

    def take_seconds(self) -> float:
        seconds, self.seconds = self.seconds, 0.0
        return seconds


class SpecdecRunner:
    """A specdec configuration: an Engine around a shared target, with its own drafter."""

    clock = staticmethod(time.perf_counter)  # run_bench sets the chosen one on every runner

    def __init__(self, config: BenchConfig, model, tokenizer, make_drafter: Callable[[], object], device: str,
                 temperature: float = 0.0):
        self.config = config
        self.temperature = temperature
        self.seed: int | None = None  # set by run_bench before each sampled run
        self.model = model
        self.tokenizer = tokenizer
        self.make_drafter = make_drafter
        self.device = device
        self.engine = None
        self.drafter: TimedDrafter | None = None
        self.predictions: dict[tuple[int, ...], str] = {}  # prompt ids -> its prediction (`:prediction`)
        self.new_pass()

    def new_pass(self) -> None:
        """Fresh drafter state (see the module doc: no replay of an earlier run's output)."""
        from ..engine import Engine

        inner = self.make_drafter()
        self.drafter = TimedDrafter(inner) if inner is not None else None
        self.engine = Engine(self.model, self.tokenizer, drafter=self.drafter,
                             num_speculative_tokens=self.config.k or DEFAULT_NUM_SPECULATIVE_TOKENS,
                             draft_length=self.config.draft_length, draft_tree=self.config.options.get("tree"))

    def generate(self, ids: tuple[int, ...], max_new: int) -> Run:
        from ..sampling import SamplingParams

        if self.drafter is not None:
            self.drafter.take_seconds()
        sync(self.device)
        start = self.clock()
        sampling = SamplingParams(temperature=self.temperature, seed=self.seed) if self.temperature > 0 else SamplingParams()
        prediction = self.predictions.get(ids)
        gen = self.engine.generate(prompt_ids=list(ids), max_new_tokens=max_new, sampling=sampling,
                                   prediction=prediction)
        sync(self.device)
        wall = self.clock() - start
        s = gen.stats
        # Positions verified per step: every accepted draft token plus the first rejected one (the
        # target never looks past it). Accepted / verified is the per-token acceptance probability
        # alpha of Leviathan et al.'s model; accepted / drafted undercounts it, because drafts
        # after a rejection are counted as drafted but were never really tested.
        tested = sum(len(st.accepted) + (len(st.accepted) < st.drafted) for st in gen.steps if st.kind != "prefill")
        return Run(self.config.label, "", "", 0, len(ids), s.new_tokens, wall, list(gen.token_ids),
                   prefill_s=s.prefill_s, target_forwards=s.target_forwards, drafts=s.drafts,
                   draft_tokens=s.draft_tokens, accepted_tokens=s.accepted_tokens, tested_tokens=tested,
                   accepted_per_position=list(s.accepted_per_position),
                   drafted_per_position=list(s.drafted_per_position),
                   draft_s=self.drafter.take_seconds() if self.drafter is not None else 0.0)


class RefRunner:
    """A `ref@` configuration: the same specdec configuration run by another source tree, in a
    worker process (`ref_worker.py`) that loads its own target through that tree's `Engine.load`
    (`this@`: this tree, in the same kind of process, so the two sides are measured alike).

    The worker times the generate call itself, exactly as `SpecdecRunner` does (pre-tokenised ids,
    prefill included), so the pipe is not in the figure. It runs with this process's thread count
    and CPU affinity (inherited). Its peak memory is not reported (another process). Its drafter is
    not wrapped in `TimedDrafter`, so the report gives it no bound; its speed, identity and drafting
    counts are measured like the others'.
    """

    def __init__(self, config: BenchConfig, src: Path, target: str, load: dict, log, clock: str = "wall"):
        self.config = config
        self.src, self.passes = src, 0
        self.warm: tuple | None = None  # the first generate call (the warm-up), repeated by each new process
        self.load = {"op": "load", "target": target, "load": load, "threads": torch.get_num_threads(), "clock": clock}
        log(f"loading the target {target} in a worker on {src} for {config.label}")
        self._start()

    def _start(self) -> None:
        import subprocess

        worker = Path(__file__).with_name("ref_worker.py")
        env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}  # the worker sets its own path
        self.proc = subprocess.Popen([sys.executable, str(worker), str(self.src)], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, text=True, env=env)
        try:
            self.package = self._ask(self.load)["specdec"]
        except BaseException:
            self.close()
            raise

    def _ask(self, request: dict) -> dict:
        import json

        if self.proc.poll() is not None:
            raise SpecdecError(f"{self.config.label}: the reference worker exited ({self.proc.returncode})")
        self.proc.stdin.write(json.dumps(request) + "\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        if not line:
            raise SpecdecError(f"{self.config.label}: the reference worker exited ({self.proc.wait()}); "
                               "its stderr above says why")
        reply = json.loads(line)
        if "error" in reply:
            raise SpecdecError(f"{self.config.label}: the reference tree failed: {reply['error']}")
        return reply

    def new_pass(self) -> None:
        """A fresh worker process for every pass: how fast a process runs the same code varies with
        where its memory landed (same-tree workers side by side differed by several percent on a
        shared machine), so each pass draws a new process instead of keeping one draw for all."""
        if self.passes:
            self.close()
            self._start()  # (a fresh process also starts its lookup drafters afresh)
            if self.warm is not None:
                self.generate(*self.warm)  # its own warm-up, as the first process had
        self.passes += 1

    def generate(self, ids: tuple[int, ...], max_new: int) -> Run:
        if self.warm is None:
            self.warm = (ids, max_new)
        r = self._ask({"op": "generate", "ids": list(ids), "max_new": max_new})
        run = Run(self.config.label, "", "", 0, len(ids), r["new_tokens"], r["wall_s"], r["token_ids"],
                  prefill_s=r["prefill_s"], target_forwards=r["target_forwards"], drafts=r["drafts"],
                  draft_tokens=r["draft_tokens"], accepted_tokens=r["accepted_tokens"],
                  tested_tokens=r["tested_tokens"], accepted_per_position=r["accepted_per_position"],
                  drafted_per_position=r["drafted_per_position"])
        return run

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                self.proc.stdin.write('{"op": "exit"}\n')
                self.proc.stdin.close()
                self.proc.wait(timeout=30)
            except (OSError, ValueError):
                pass
            except Exception:  # noqa: BLE001 - a hung worker is ended, by its own process id
                self.proc.kill()


def ref_source(path: str | None) -> Path:
    """--ref-src: a specdec source tree's `src` folder (or the checkout holding one)."""
    if not path:
        raise InvalidRequestError("ref@ configurations need --ref-src DIR (another specdec checkout or its src "
                                  "folder)", "ref_src")
    root = Path(path).expanduser().resolve()
    for candidate in (root, root / "src"):
        if (candidate / "specdec" / "engine.py").is_file():
            return candidate
    raise InvalidRequestError(f"--ref-src {path}: no specdec package there (looked for specdec/engine.py in it "
                              "and in its src folder)", "ref_src")


def canonical_dtype(device: str) -> Callable[..., str]:
    """(dtype name, quantisation) -> the torch dtype it resolves to on `device`, as a name ("auto" ->
    "float32")."""
    return lambda name, quantize=None: str(resolve_dtype(name, device, quantize or "none")).removeprefix("torch.")


# The instruction sets the CPU kernels and PyTorch choose paths by, as /proc/cpuinfo names them.
_ISA_FLAGS = {"avx2": "AVX2", "avx512f": "AVX-512", "avx512_vnni": "VNNI", "avx512_bf16": "BF16", "amx_tile": "AMX"}


def cpu_description() -> str:
    """The CPU's name, and on Linux its family / model and vector instruction sets: "AMD EPYC" alone
    named both a Zen 3 (AVX2 only) and a Zen 4 (AVX-512) machine, whose speed ratios differ."""
    from ..models.cpu_kernels import cpu_fields

    fields = cpu_fields()
    cpu = fields.get("model name") or platform.processor() or ""
    details = []
    if "cpu family" in fields and "model" in fields:
        details.append(f"family {fields['cpu family']}, model {fields['model']}")
    flags = set(fields.get("flags", "").split())
    isa = [name for flag, name in _ISA_FLAGS.items() if flag in flags]
    if isa:
        details.append(", ".join(isa))
    return f"{cpu} ({'; '.join(details)})" if details else cpu


def machine_info(device: str) -> dict:
    info = {"cpu": cpu_description(), "cores": os.cpu_count(), "torch_threads": torch.get_num_threads(),
            "platform": platform.platform(), "python": platform.python_version(), "torch": torch.__version__,
            "device": device}
    if device.startswith("cuda") and torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name(0)
    # The peers' versions from their installed metadata, never by importing them: a run has already
    # loaded what it used, and an import here, after every run, could only fail (llama-cpp-python
    # raises FileNotFoundError where its library is missing) and lose the run's results.
    for package, key in (("transformers", "transformers"), ("llama_cpp_python", "llama_cpp")):
        with contextlib.suppress(importlib.metadata.PackageNotFoundError):
            info[key] = importlib.metadata.version(package)
    return info


def run_bench(settings: Settings, configs: list[BenchConfig], prompts: list[BenchPrompt],
              progress: Callable[[str], None] | None = None, log: Callable[[str], None] | None = None,
              total: Callable[[int], None] | None = None) -> BenchResult:
    """Load what the configurations need, run them interleaved, and return every run.

    `log(message)` gets one-line notes (loading, skipped peers); `total(n)` the number of runs
    about to happen (warm-up included); `progress(label)` is called after each run.
    """
    log = log or (lambda message: None)
    progress = progress or (lambda label: None)
    if settings.max_tokens < 1:
        raise InvalidRequestError("--max-tokens must be >= 1", "max_tokens")
    if settings.repeats < 1:
        raise InvalidRequestError("--repeats must be >= 1", "repeats")
    if settings.warmup < 0:
        raise InvalidRequestError("--warmup must be >= 0", "warmup")
    if not (0 <= settings.temperature <= 2):
        raise InvalidRequestError("--temperature must be in [0, 2]", "temperature")
    if settings.temperature > 0 and any(c.ref for c in configs):
        raise InvalidRequestError("ref@ / this@ configurations run greedy only: leave out --temperature", "temperature")
    if settings.clock not in CLOCKS:
        raise InvalidRequestError(f"--clock must be one of {', '.join(CLOCKS)}", "clock")
    if settings.clock != "wall" and any(c.kind == "llama-spec" for c in configs):
        raise InvalidRequestError("--clock cpu cannot time llama-spec (another process, timed by its own log)",
                                  "clock")
    device = resolve_device(settings.device)
    canon = canonical_dtype(device)
    canon(settings.dtype)  # a bad --dtype fails here
    ref_src = ref_source(settings.ref_src) if any(c.worker == "ref" for c in configs) else None
    configs, baselines = with_baselines(configs, settings.dtype, settings.quantize, canon)
    runners: dict[str, object] = {}
    try:
        return _run_bench(settings, configs, baselines, prompts, device, canon, ref_src, runners, progress, log,
                          total)
    finally:
        for r in runners.values():
            if isinstance(r, RefRunner):
                r.close()


def _run_bench(settings: Settings, configs: list[BenchConfig], baselines: dict[str, str],
               prompts: list[BenchPrompt], device: str, canon, ref_src: Path | None, runners: dict,
               progress, log, total) -> BenchResult:
    described: dict[str, str] = {}
    skipped: dict[str, str] = {}
    targets = _load_specdec(settings, configs, device, canon, ref_src, runners, described, log)
    first = next(iter(targets.values()))
    tokenizer, cfg = first.tokenizer, first.model.config
    prompt_ids = _prompt_ids(settings, prompts, tokenizer, cfg)
    infos = [PromptInfo(p.id, p.group, len(ids)) for p, ids in zip(prompts, prompt_ids)]
    load_peers(settings, configs, device, canon, tokenizer, list(cfg.eos_token_ids), prompt_ids, runners, described,
               skipped, log)
    configs = [c for c in configs if c.label not in skipped]
    baselines = {label: base for label, base in baselines.items() if label not in skipped}
    probe = MemoryProbe(device)
    runs, interrupted = _interleaved_runs(settings, [runners[c.label] for c in configs], prompts, prompt_ids, probe,
                                          progress, log, total)
    done = {r.prompt_id for r in runs}
    if not settings.temperature > 0:  # greedy
        compare_outputs(runs, baselines)
    return BenchResult(settings, configs, baselines, described, [i for i in infos if i.id in done], runs, skipped,
                       probe.kind, machine_info(device), interrupted, counterparts(configs))


def _load_specdec(settings: Settings, configs: list[BenchConfig], device: str, canon, ref_src: Path | None,
                  runners: dict, described: dict[str, str], log) -> dict:
    """The runners of the specdec configurations (into `runners`) and what each runs on (into
    `described`): one target load per (dtype, quantize), shared by every configuration on it, and
    a worker per ref@ / this@ configuration; returns the loaded targets by (dtype, quantize)."""
    from ..engine import Engine

    targets: dict[tuple, Engine] = {}
    drafts: dict[tuple, tuple] = {}  # (path, dtype) -> (draft model, its tokenizer)
    for c in configs:
        if c.family != "specdec":
            continue
        key = target_key(c, settings.dtype, settings.quantize, canon)
        if key not in targets:
            log(f"loading the target {settings.model} ({key[0]}{', ' + key[1] if key[1] != 'none' else ''})")
            targets[key] = Engine.build(DecodingSettings(target=settings.model, drafter="none", device=device,
                                                         dtype=key[0], quantize=key[1]), load_progress(log))
        base = targets[key]
        described[c.label] = f"specdec {key[0]}" + (f" {key[1]}" if key[1] != "none" else "")
        runners[c.label] = SpecdecRunner(c, base.model, base.tokenizer, _drafter_factory(c, base, drafts, log),
                                         device, settings.temperature)
    for c in configs:
        if c.ref:
            key = target_key(c, settings.dtype, settings.quantize, canon)
            src = ref_src if c.worker == "ref" else Path(__file__).resolve().parents[2]  # this tree's src
            runners[c.label] = RefRunner(c, src, settings.model, ref_load_options(c, key[0], key[1], device), log,
                                         settings.clock)
            described[c.label] = f"{runners[c.label].package} {key[0]}" + (f" {key[1]}" if key[1] != "none" else "")
    return targets


def _prompt_ids(settings: Settings, prompts: list[BenchPrompt], tokenizer, cfg) -> list[tuple[int, ...]]:
    """Every prompt as token ids, checked (vocabulary, a tokenizer for text, the context) before
    anything runs."""
    prompt_ids: list[tuple[int, ...]] = []
    for p in prompts:
        if p.ids is not None:
            ids = tuple(p.ids)
            if max(ids) >= cfg.vocab_size:
                raise InvalidRequestError(f"prompt {p.id}: token ids must be < the vocabulary size {cfg.vocab_size}",
                                          "prompts")
        elif tokenizer is None:
            raise InvalidRequestError(f"prompt {p.id} is text but {settings.model} has no tokenizer: give prompt_ids "
                                      "in a --prompts file (and --tasks none)", "prompts")
        elif p.chat:  # the user's first turn, as a chat client would send it
            ids = tuple(tokenizer.encode_chat([{"role": "user", "content": p.text}]))
        else:
            ids = tuple(tokenizer.encode(p.text))
        # + k + 1: a verify block may reach that far past the last kept token.
        if len(ids) + settings.max_tokens + 17 > cfg.max_position:
            raise InvalidRequestError(f"prompt {p.id} has {len(ids)} tokens: with --max-tokens {settings.max_tokens} "
                                      f"it exceeds the model's context of {cfg.max_position}", "prompts")
        prompt_ids.append(ids)
    return prompt_ids


def predictions_for(config, prompts: list[BenchPrompt], prompt_ids: list[tuple[int, ...]]) -> dict:
    """Prompt ids -> the prediction a configuration drafts from: each prompt's own (`:prediction`),
    the next prompt's with one (`:unrelated-prediction`: text unrelated to the answer), or none."""
    own = [(ids, p.prediction) for p, ids in zip(prompts, prompt_ids) if p.prediction is not None]
    if config.options.get("prediction"):
        return dict(own)
    if config.options.get("unrelated_prediction") and len(own) > 1:
        return {ids: own[(i + 1) % len(own)][1] for i, (ids, _) in enumerate(own)}
    return {}


def _interleaved_runs(settings: Settings, order: list, prompts: list[BenchPrompt],
                      prompt_ids: list[tuple[int, ...]], probe: MemoryProbe, progress, log,
                      total) -> tuple[list[Run], str | None]:
    """The warm-up, then `settings.repeats` passes of every runner in `order` on each prompt in
    turn (the module docstring says why interleaved); returns the runs and, after Ctrl-C, a note
    saying how far it got."""
    sampled = settings.temperature > 0
    for r in order:  # a `:prediction` configuration drafts from each prompt's prediction
        if isinstance(r, SpecdecRunner):
            r.predictions = predictions_for(r.config, prompts, prompt_ids)
    for r in order:
        if not isinstance(r, RefRunner):  # the worker was told its clock when it started
            r.clock = CLOCKS[settings.clock]
    if total:
        total(settings.warmup * len(order) + settings.repeats * len(prompts) * len(order))
    for _ in range(settings.warmup):
        for r in order:
            r.generate(prompt_ids[0], min(WARMUP_TOKENS, settings.max_tokens))
            progress(f"warm-up {r.config.label}")
    runs: list[Run] = []
    try:
        for repeat in range(settings.repeats):
            for r in order:
                r.new_pass()
            for i, (p, ids) in enumerate(zip(prompts, prompt_ids)):
                for r in order:
                    if sampled:
                        r.seed = settings.seed + 1000 * repeat + i
                    # Collect the previous run's garbage now, so a collection it triggers is not
                    # timed as part of this run.
                    gc.collect()
                    probe.start()
                    run = r.generate(ids, settings.max_tokens)
                    run.peak_memory = None if isinstance(r, RefRunner) else probe.peak()
                    if settings.clock != "wall":
                        run.prefill_s = None  # the engine's is wall time: no step cost / bound from it
                    run.prompt_id, run.group, run.repeat = p.id, p.group, repeat
                    runs.append(run)
                    progress(r.config.label)
    except KeyboardInterrupt:
        # Ctrl-C in a long run: report what is complete. A prompt that not every configuration
        # ran is dropped, so every configuration is still measured on the same prompts.
        if not runs:
            raise
        cut = len(runs) - len(runs) % len(order)
        interrupted = f"interrupted: {cut // len(order)} of {settings.repeats * len(prompts)} prompt rounds complete"
        log(interrupted)
        runs = runs[:cut]
        if not runs:
            raise
        return runs, interrupted
    return runs, None


def compare_outputs(runs: list[Run], baselines: dict[str, str]) -> None:
    """Mark each run identical or not to its baseline's run on the same prompt and repeat."""
    by_key = {(r.config, r.prompt_id, r.repeat): r for r in runs}
    for r in runs:
        base = by_key.get((baselines.get(r.config), r.prompt_id, r.repeat))
        if base is None:
            continue
        r.identical = r.token_ids == base.token_ids
        r.first_divergence = None if r.identical else first_divergence(r.token_ids, base.token_ids)


def first_divergence(a: list[int], b: list[int]) -> int:
    """Index of the first token where two outputs differ (the shorter length if one is a prefix)."""
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return min(len(a), len(b))


def _drafter_factory(c: BenchConfig, base, drafts: dict, log) -> Callable[[], object]:
    """A function returning the configuration's drafter: a fresh lookup drafter per call, or the
    draft model loaded once (its per-request state is reset by `begin` anyway)."""
    if c.kind == "plain":
        return lambda: None
    if c.kind in ("ngram", "suffix"):
        return lambda: lookup_drafter(c.kind, c.options)
    if c.kind == "eagle":
        log(f"loading the EAGLE head {c.options.get('head') or '(shipped)'}")
        made = builder.Made(base.model, base.tokenizer, DecodingSettings(draft_p_min=c.options.get("p_min")))
        drafter = builder.make_drafter(eagle_name(c.options), made)
        return lambda: drafter
    from ..drafters.combined import lookup_first
    from ..drafters.draft_model import DEFAULT_DRAFT_P_MIN, DraftModelDrafter
    from ..models import loader
    from ..tokenizer import Tokenizer

    weight = base.model.embed_tokens.weight
    quantize = builder.draft_quantize_for(c.options.get("draft_quantize"), base.model)  # default: the target's
    key = (str(c.options["model"]), weight.dtype, quantize)
    if key not in drafts:
        log(f"loading the draft model {c.options['model']}{' (int8)' if quantize == 'int8' else ''}")
        model, folder = loader.load(c.options["model"], weight.dtype, weight.device, load_progress(log),
                                    quantize=quantize)
        drafts[key] = (model, Tokenizer.from_folder(folder))
    model, tokenizer = drafts[key]
    p_min = c.options.get("p_min", DEFAULT_DRAFT_P_MIN)
    drafter = DraftModelDrafter(model, base.model.config.vocab_size, p_min, tokenizer, base.tokenizer,
                                c.options.get("vocab"), window=c.options.get("window"))
    drafter.measure_cost(base.model)  # the cost-aware draft length's price of a draft token
    if c.options.get("lookup"):  # prompt lookup first, the draft model where it finds nothing
        return lambda: lookup_first(lookup_drafter(c.options["lookup"], {}), drafter)
    return lambda: drafter
