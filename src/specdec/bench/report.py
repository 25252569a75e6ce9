"""From runs to numbers: per configuration and task group summaries, the bound, and the outputs.

Definitions (the Markdown and the JSON use the same ones):

- tokens/s: new tokens (prompt excluded) / wall time of the whole generate calls, summed over the
  group's runs (a ratio of sums, so long outputs weigh by their length).
- speedup: tokens/s over that of the configuration's baseline, plain decoding of the *same* target
  (dtype, quantisation) on the same prompts in the same run; peers are compared with plain
  decoding of the default target.
- speedup interval: a 95% percentile bootstrap interval of the speedup over the prompts
  (`speedup_interval`). A run's speedup depends on which prompts it drew: three prompts a group
  give a wide interval, and two figures inside each other's interval are not told apart by the
  prompts. The interval does not cover the machine's own drift between runs.
- acceptance rate: accepted / drafted tokens. alpha: accepted / *verified* draft positions (a
  step verifies its accepted tokens and the first rejected one; positions after it were drafted
  but never tested), the per-token acceptance probability of Leviathan et al.'s model.
- mean accepted length: 1 + accepted tokens per step that drafted (vLLM's convention).
- acceptance by position i: accepted at draft index i / drafted at index i.
- forwards/token: target forwards (prefill included) per new token.
- decode speedup: the speedup with each run's prefill (the target's forward over the prompt,
  the same work in every configuration of a target) taken out of its time: new tokens / (wall -
  prefill), over the baseline's. It shows what speculation does to the part it can change; where
  prompts are long and the processor slow, prefill is a large share of plain decoding's time
  (`prefill share`: the baseline's summed prefill over its summed wall time) and the end-to-end
  speedup stays below the decode speedup by Amdahl's law. Needs wall-clock timing (not `--clock
  cpu`) and the engine's prefill time (not the peers').
- step cost: measured time of one speculative step (drafting + a verify forward of up to k + 1
  tokens + bookkeeping) over the time of one plain step. The bound assumes a verify forward costs
  one plain step; measured speedup ~ (tokens per step) / (step cost), so this column shows how much
  of the gap to the bound is the verify forward being dearer than a one-token forward.

The bound. Leviathan et al. (2023, eq. 1 and thm 3.8) give the expected speedup of a drafter whose
tokens are each accepted with probability alpha, drafting k tokens per step, where one draft token
costs c target steps (and verifying k + 1 tokens costs one target step)::

    S = (1 - alpha^(k+1)) / ((1 - alpha) (k c + 1))

the numerator being the expected tokens a step yields. Measured here: alpha as above; k = the mean
draft length of the steps that drafted (a lookup continuation can be shorter than the k asked for,
and adaptive k moves); c from time: the drafter's propose() time per step, divided by k and by the
time of one plain decoding step of the same target in the same group (plain decode time / decode
forwards). Lookup drafters sometimes propose nothing: such a step is a plain step (one token), so
with f the share of steps that drafted the expected tokens per step are
f (1 - alpha^(k+1)) / (1 - alpha) + (1 - f), while the drafting time (misses included) stays in
the cost. With f = 1 this is exactly the formula above; the JSON also gives that f = 1 value
(`bound_always_drafting`), the speedup if the drafter had always found a draft.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from ..errors import InvalidRequestError
from .common import BenchResult, Run

ALL = "all"
BOOTSTRAP_SAMPLES = 2000
INTERVAL_LEVEL = 0.95


def expected_tokens_per_step(alpha: float, k: float) -> float:
    """1 + alpha + ... + alpha^k = (1 - alpha^(k+1)) / (1 - alpha): tokens per verify step."""
    if not 0.0 <= alpha <= 1.0 or k < 0:
        raise ValueError(f"need 0 <= alpha <= 1 and k >= 0, got alpha={alpha}, k={k}")
    if alpha >= 1.0:
        return k + 1.0
    return (1.0 - alpha ** (k + 1)) / (1.0 - alpha)


def leviathan_bound(alpha: float, k: float, c: float, draft_share: float = 1.0) -> float:
    """Expected speedup (1 - alpha^(k+1)) / ((1 - alpha)(k c + 1)), steps without a draft (share
    1 - draft_share) counted as plain steps yielding one token (see the module doc)."""
    if not 0.0 <= draft_share <= 1.0 or c < 0:
        raise ValueError(f"need 0 <= draft_share <= 1 and c >= 0, got {draft_share}, {c}")
    tokens = draft_share * expected_tokens_per_step(alpha, k) + (1.0 - draft_share)
    return tokens / (k * c + 1.0)


@dataclass
class Summary:
    config: str
    group: str
    baseline: str
    target: str
    speculative: bool
    prompts: int
    runs: int
    new_tokens: int
    wall_s: float
    tokens_per_s: float
    speedup: float | None = None
    speedup_interval: tuple[float, float] | None = None  # 95% bootstrap over prompts
    decode_speedup: float | None = None  # the speedup with prefill taken out (module doc)
    prefill_share: float | None = None  # of this configuration's wall time
    bound: float | None = None
    bound_always_drafting: float | None = None
    mean_accepted_length: float | None = None
    acceptance_rate: float | None = None
    alpha: float | None = None
    acceptance_by_position: list[float] = field(default_factory=list)
    draft_share: float | None = None  # f: steps that drafted / decode steps
    draft_length: float | None = None  # k: mean draft length of the steps that drafted
    cost_ratio: float | None = None  # c: drafting time per draft token / plain step time
    step_cost: float | None = None  # measured time of one speculative step (draft + verify) / plain step time
    forwards_per_token: float | None = None
    identical: int | None = None  # runs whose output equals the baseline's
    compared: int | None = None
    first_divergence: int | None = None  # earliest differing token index over the runs
    peak_memory: int | None = None  # bytes, max over the runs


def speedup_interval(runs: list[Run], base_runs: list[Run], samples: int = BOOTSTRAP_SAMPLES,
                     level: float = INTERVAL_LEVEL, seed: int = 0) -> tuple[float, float] | None:
    """A percentile bootstrap interval of the speedup (a ratio of summed tokens/s, see the module
    doc) over the prompts: draw as many prompts as there are, with replacement, each bringing all
    its runs of both configurations (its repeats too, so a prompt's runs stay paired), take the
    speedup of the draw, and report the middle `level` of `samples` draws. Seeded, so a report
    reproduces. None with fewer than 2 prompts run by both.
    """
    per: dict[str, list[float]] = {}  # prompt -> [tokens, wall, base tokens, base wall]
    for r in runs:
        row = per.setdefault(r.prompt_id, [0.0, 0.0, 0.0, 0.0])
        row[0] += r.new_tokens
        row[1] += r.wall_s
    for r in base_runs:
        if r.prompt_id in per:
            per[r.prompt_id][2] += r.new_tokens
            per[r.prompt_id][3] += r.wall_s
    table = torch.tensor([row for row in per.values() if row[3] > 0 and row[2] > 0], dtype=torch.float64)  # [n, 4]
    n = table.shape[0]
    if n < 2:
        return None
    draws = torch.randint(n, (samples, n), generator=torch.Generator().manual_seed(seed))  # [samples, n]
    sums = table[draws].sum(dim=1)  # [samples, 4]
    ok = (sums[:, 1] > 0) & (sums[:, 0] > 0)
    ratios = ((sums[:, 0] / sums[:, 1]) / (sums[:, 2] / sums[:, 3]))[ok].sort().values
    if ratios.numel() == 0:
        return None
    tail = (1.0 - level) / 2
    low = ratios[int(tail * (ratios.numel() - 1))]
    high = ratios[int(round((1.0 - tail) * (ratios.numel() - 1)))]
    return float(low), float(high)


def _totals(runs: list[Run]) -> tuple[int, float]:
    return sum(r.new_tokens for r in runs), sum(r.wall_s for r in runs)


def _decode_rate(runs: list[Run]) -> float | None:
    """New tokens per second of decoding after the prefill, summed over the runs; None where a
    run has no engine prefill time."""
    if not runs or any(r.prefill_s is None for r in runs):
        return None
    decode = sum(r.wall_s - r.prefill_s for r in runs)
    return sum(r.new_tokens for r in runs) / decode if decode > 0 else None


def _plain_step_s(runs: list[Run]) -> float | None:
    """Seconds per decode step of plain decoding: (wall - prefill) / (forwards - 1), summed."""
    steps = sum((r.target_forwards or 1) - 1 for r in runs)
    if not runs or steps <= 0 or any(r.prefill_s is None for r in runs):
        return None
    return sum(r.wall_s - r.prefill_s for r in runs) / steps


def summarize(result: BenchResult) -> list[Summary]:
    """One Summary per (configuration, group), groups in prompt order, then ALL per configuration."""
    groups = list(dict.fromkeys(p.group for p in result.prompts))
    by: dict[tuple[str, str], list[Run]] = {}
    for r in result.runs:
        by.setdefault((r.config, r.group), []).append(r)
        by.setdefault((r.config, ALL), []).append(r)
    out = []
    for c in result.configs:
        for g in groups + [ALL]:
            runs = by.get((c.label, g), [])
            if not runs:
                continue
            base_label = result.baselines.get(c.label, c.label)
            out.append(_summary(c, g, runs, by.get((base_label, g), []), base_label, result.targets.get(c.label, "")))
    return out


def _summary(c, group: str, runs: list[Run], base_runs: list[Run], base_label: str, target: str) -> Summary:
    tokens, wall = _totals(runs)
    s = Summary(c.label, group, base_label, target, c.speculative, len({r.prompt_id for r in runs}), len(runs),
                tokens, wall, tokens / wall if wall > 0 else 0.0)
    btok, bwall = _totals(base_runs)
    if base_runs and bwall > 0 and btok > 0 and s.tokens_per_s > 0:
        s.speedup = s.tokens_per_s / (btok / bwall)
        if base_label != c.label:
            s.speedup_interval = speedup_interval(runs, base_runs)
        rate, base_rate = _decode_rate(runs), _decode_rate(base_runs)
        if rate and base_rate:
            s.decode_speedup = rate / base_rate
    if runs and wall > 0 and all(r.prefill_s is not None for r in runs):
        s.prefill_share = sum(r.prefill_s for r in runs) / wall
    if all(r.target_forwards is not None for r in runs) and tokens:
        s.forwards_per_token = sum(r.target_forwards for r in runs) / tokens
    peaks = [r.peak_memory for r in runs if r.peak_memory is not None]
    s.peak_memory = max(peaks) if peaks else None
    compared = [r for r in runs if r.identical is not None]
    if compared and base_label != c.label:
        s.compared = len(compared)
        s.identical = sum(r.identical for r in compared)
        divergences = [r.first_divergence for r in compared if r.first_divergence is not None]
        s.first_divergence = min(divergences) if divergences else None
    if c.family != "specdec" or not c.speculative:
        return s
    drafts = sum(r.drafts for r in runs)
    drafted = sum(r.draft_tokens for r in runs)
    accepted = sum(r.accepted_tokens for r in runs)
    tested = sum(r.tested_tokens for r in runs)
    steps = sum(r.target_forwards - 1 for r in runs)
    s.mean_accepted_length = 1.0 + accepted / drafts if drafts else 1.0
    s.acceptance_rate = accepted / drafted if drafted else None
    s.alpha = accepted / tested if tested else None
    width = max((len(r.drafted_per_position) for r in runs), default=0)
    acc = [sum(r.accepted_per_position[i] for r in runs if i < len(r.accepted_per_position)) for i in range(width)]
    dra = [sum(r.drafted_per_position[i] for r in runs if i < len(r.drafted_per_position)) for i in range(width)]
    s.acceptance_by_position = [a / d if d else 0.0 for a, d in zip(acc, dra)]
    s.draft_share = drafts / steps if steps else None
    s.draft_length = drafted / drafts if drafts else None
    step_s = _plain_step_s(base_runs)
    own_step_s = _plain_step_s(runs)  # the same formula over the speculative steps
    if step_s and own_step_s:
        s.step_cost = own_step_s / step_s
    if step_s and s.alpha is not None and s.draft_length and steps:
        # kc = drafting time per step (misses included) in units of one plain step.
        kc = sum(r.draft_s for r in runs) / steps / step_s
        s.cost_ratio = kc / s.draft_length
        s.bound = leviathan_bound(s.alpha, s.draft_length, s.cost_ratio, s.draft_share)
        s.bound_always_drafting = leviathan_bound(s.alpha, s.draft_length, s.cost_ratio)
    return s


@dataclass
class Versus:
    """This tree's configuration against the same configuration run by the --ref-src tree."""

    config: str
    ref: str
    tokens_per_s: float
    ref_tokens_per_s: float
    ratio: float  # this tree's tokens/s over the reference's: > 1 means this tree is faster
    interval: tuple[float, float] | None  # 95% bootstrap over the prompts, as for a speedup
    identical: int  # prompts (and repeats) where both gave the same tokens
    compared: int


def versus_reference(result: BenchResult) -> list[Versus]:
    """Every ref@ configuration whose counterpart ran: the ratio new / reference over all prompts."""
    by: dict[str, list[Run]] = {}
    for r in result.runs:
        by.setdefault(r.config, []).append(r)
    out = []
    for ref, mine in result.counterparts.items():
        runs, ref_runs = by.get(mine, []), by.get(ref, [])
        (tok, wall), (rtok, rwall) = _totals(runs), _totals(ref_runs)
        if not runs or not ref_runs or wall <= 0 or rwall <= 0 or rtok <= 0:
            continue
        theirs = {(r.prompt_id, r.repeat): r.token_ids for r in ref_runs}
        pairs = [(r.token_ids, theirs[(r.prompt_id, r.repeat)]) for r in runs if (r.prompt_id, r.repeat) in theirs]
        out.append(Versus(mine, ref, tok / wall, rtok / rwall, (tok / wall) / (rtok / rwall),
                          speedup_interval(runs, ref_runs), sum(a == b for a, b in pairs), len(pairs)))
    return out


def headline(result: BenchResult, summaries: list[Summary]) -> dict | None:
    """The fastest specdec configuration overall against its own plain decoding and every peer."""
    overall = {s.config: s for s in summaries if s.group == ALL}
    family = {c.label: c.family for c in result.configs}
    ours = [s for s in overall.values() if family[s.config] == "specdec"]
    if not ours:
        return None
    best = max(ours, key=lambda s: s.tokens_per_s)
    vs = {label: best.tokens_per_s / s.tokens_per_s for label, s in overall.items()
          if family[label] not in ("specdec", "worker") and s.tokens_per_s > 0}
    return {"best": best.config, "tokens_per_s": best.tokens_per_s, "vs_own_plain": best.speedup,
            "vs_own_plain_interval": best.speedup_interval, "baseline": best.baseline, "vs_peers": vs}


# -- output --------------------------------------------------------------------------------------

def _f(x, fmt: str, none: str = "–") -> str:
    return none if x is None else format(x, fmt)


def _interval(interval: tuple[float, float] | None) -> str:
    return "" if interval is None else f" [{interval[0]:.2f}, {interval[1]:.2f}]"


def _interval3(interval: tuple[float, float] | None) -> str:
    return "" if interval is None else f" [{interval[0]:.3f}, {interval[1]:.3f}]"


def _memory(n: int | None) -> str:
    return "–" if n is None else f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.0f} MiB"


def _identity(s: Summary) -> str:
    if s.config == s.baseline:
        return "(baseline)"
    if s.compared is None:
        return "–"
    text = f"{s.identical}/{s.compared}"
    return text if s.first_divergence is None else f"{text}, first diff @{s.first_divergence}"


def _decoding(st) -> str:
    t = getattr(st, "temperature", 0.0)
    return "greedy" if not t else f"sampled at temperature {t:g} (seed {st.seed} + 1000 x repeat + prompt index)"


def to_markdown(result: BenchResult, summaries: list[Summary], command: str | None = None) -> str:
    """The report: how it was run, the headline, the table of every configuration, then the task
    groups, the reference tree and acceptance by draft position where there are any."""
    st = result.settings
    groups = list(dict.fromkeys(s.group for s in summaries if s.group != ALL))
    lines = ["## specdec bench", ""]
    if command:
        lines += [f"`{command}`", ""]
    lines += _md_setup(result, groups) + _md_headline(result, summaries) + _md_table(summaries)
    lines += _md_groups(summaries, groups) + _md_versus(result) + _md_positions(summaries)
    lines += ["", f"Peak memory: {result.memory_kind} of the whole process (every loaded model counts)."
              if not st.device.startswith("cuda") else f"Peak memory: {result.memory_kind}."]
    return "\n".join(lines) + "\n"


def _md_setup(result: BenchResult, groups: list[str]) -> list[str]:
    """The bullet list: machine, model and decoding, what the figures mean, interruption, skips."""
    st, m = result.settings, result.machine
    machine = f"{m.get('cpu') or '?'}, {m.get('cores')} cores, {m.get('torch_threads')} torch threads"
    if m.get("gpu"):
        machine += f", {m['gpu']}"
    versions = ", ".join(f"{k} {m[k]}" for k in ("torch", "transformers", "llama_cpp") if k in m)
    counts = {g: sum(1 for p in result.prompts if p.group == g) for g in groups}
    lines = [
        f"- machine: {machine}; {m.get('platform')}; {versions}; device {st.device}",
        f"- model: {st.model}; {_decoding(st)}; up to {st.max_tokens} new tokens; {len(result.prompts)} prompts "
        f"({', '.join(f'{g} {n}' for g, n in counts.items())}); {st.repeats} repeat(s), interleaved, "
        f"after {st.warmup} warm-up round(s)",
        f"- tokens/s: new tokens / {'CPU time of the process during' if st.clock == 'cpu' else 'wall time of'} "
        "the whole generate call (prefill included); speedup: over "
        "plain decoding of the same target (dtype, quantisation) in the same run, peers over the default "
        "target's plain; [a, b]: its 95% bootstrap interval over the prompts (a run's figure depends on the "
        "prompts drawn; the machine's drift is not in it); decode speedup: the same with each run's prefill "
        "taken out of its time (prefill share: the prefill's share of the configuration's time); bound: "
        "Leviathan et al.'s expected speedup from the measured α, k and c",
    ]
    if result.interrupted:
        lines.append(f"- **{result.interrupted}**")
    for label, why in result.skipped.items():
        lines.append(f"- skipped `{label}`: {why}")
    return lines


def _md_headline(result: BenchResult, summaries: list[Summary]) -> list[str]:
    head = headline(result, summaries)
    if not head:
        return []
    parts = [f"{_f(head['vs_own_plain'], '.2f')}x{_interval(head['vs_own_plain_interval'])} its plain "
             f"(`{head['baseline']}`)"]
    parts += [f"{r:.2f}x `{label}`" for label, r in head["vs_peers"].items()]
    return ["", f"**Fastest specdec configuration: `{head['best']}`** at {head['tokens_per_s']:.1f} tokens/s: "
            + ", ".join(parts) + "."]


def _md_table(summaries: list[Summary]) -> list[str]:
    """One row per configuration over all prompts."""
    lines = ["", "| configuration | runs on | tokens/s | speedup | decode speedup | prefill share | bound | "
             "mean acc. length | acc. rate | α | k | c | step cost | forwards/token | identical to plain | peak memory |",
             "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|---:|"]
    for s in (s for s in summaries if s.group == ALL):
        lines.append(
            f"| `{s.config}` | {s.target} | {s.tokens_per_s:.1f} | {_f(s.speedup, '.2f')}x{_interval(s.speedup_interval)} | "
            f"{_f(s.decode_speedup, '.2f')}{'x' if s.decode_speedup is not None else ''} | {_f(s.prefill_share, '.2f')} | "
            f"{_f(s.bound, '.2f')}{'x' if s.bound is not None else ''} | {_f(s.mean_accepted_length, '.2f')} | "
            f"{_f(s.acceptance_rate, '.2f')} | {_f(s.alpha, '.2f')} | {_f(s.draft_length, '.1f')} | "
            f"{_f(s.cost_ratio, '.3f')} | {_f(s.step_cost, '.2f')} | {_f(s.forwards_per_token, '.2f')} | "
            f"{_identity(s)} | "
            f"{_memory(s.peak_memory)} |")
    return lines


def _md_groups(summaries: list[Summary], groups: list[str]) -> list[str]:
    """Speedup and tokens/s by task group, when the prompts have groups."""
    if not groups:
        return []
    lines = ["", "Speedup by task group (bound in brackets), tokens/s below it:", "",
             "| configuration | " + " | ".join(groups + [ALL]) + " |",
             "|---|" + "---:|" * (len(groups) + 1)]
    cell = {(s.config, s.group): s for s in summaries}
    for label in dict.fromkeys(s.config for s in summaries):
        row = []
        for g in groups + [ALL]:
            s = cell.get((label, g))
            if s is None:
                row.append("–")
                continue
            bound = f" ({s.bound:.2f}x)" if s.bound is not None else ""
            row.append(f"{_f(s.speedup, '.2f')}x{bound}<br>{s.tokens_per_s:.1f}")
        lines.append(f"| `{label}` | " + " | ".join(row) + " |")
    return lines


def _md_versus(result: BenchResult) -> list[str]:
    """This tree against the reference tree, for ref@ / this@ pairs."""
    versus = versus_reference(result)
    if not versus:
        return []
    lines = ["", f"Against the reference tree (`--ref-src {result.settings.ref_src}`): this tree's tokens/s over "
             "the same configuration's there, with its 95% bootstrap interval over the prompts:", "",
             "| configuration | reference | tokens/s | reference tokens/s | new / reference | same tokens |",
             "|---|---|---:|---:|---:|---:|"]
    for v in versus:
        lines.append(f"| `{v.config}` | `{v.ref}` | {v.tokens_per_s:.1f} | {v.ref_tokens_per_s:.1f} | "
                     f"{v.ratio:.3f}x{_interval3(v.interval)} | {v.identical}/{v.compared} |")
    return lines


def _md_positions(summaries: list[Summary]) -> list[str]:
    """Acceptance by draft position, for the configurations that drafted."""
    spec = [s for s in summaries if s.group == ALL and s.acceptance_by_position]
    if not spec:
        return []
    width = max(len(s.acceptance_by_position) for s in spec)
    lines = ["", "Acceptance by draft position (accepted / drafted at that position):", "",
             "| configuration | " + " | ".join(str(i + 1) for i in range(width)) + " |",
             "|---|" + "---:|" * width]
    for s in spec:
        cells = [f"{a:.2f}" for a in s.acceptance_by_position] + ["–"] * (width - len(s.acceptance_by_position))
        lines.append(f"| `{s.config}` | " + " | ".join(cells) + " |")
    return lines


def to_json(result: BenchResult, summaries: list[Summary], command: str | None = None) -> dict:
    return {
        "command": command,
        "settings": asdict(result.settings),
        "machine": result.machine,
        "memory_kind": result.memory_kind,
        "configs": [{"label": c.label, "kind": c.kind, "family": c.family, "options": c.options,
                     "baseline": result.baselines.get(c.label), "runs_on": result.targets.get(c.label)}
                    for c in result.configs],
        "skipped": result.skipped,
        "interrupted": result.interrupted,
        "prompts": [asdict(p) for p in result.prompts],
        "headline": headline(result, summaries),
        "versus_reference": [asdict(v) for v in versus_reference(result)],
        "summary": [asdict(s) for s in summaries],
        "runs": [asdict(r) | {"tokens_per_s": r.tokens_per_s} for r in result.runs],
    }


def write_json(path: str, data: dict) -> None:
    _write(path, json.dumps(data, indent=1) + "\n")


def write_text(path: str, text: str) -> None:
    _write(path, text)


def _write(path: str, text: str) -> None:
    try:
        Path(path).expanduser().write_text(text, encoding="utf-8")
    except OSError as exc:
        raise InvalidRequestError(f"cannot write {path}: {exc.strerror or exc}", "output") from None


def write_plot(path: str, result: BenchResult, summaries: list[Summary]) -> None:
    """Left: speedup per task group for each non-baseline configuration (bound as a tick);
    right: acceptance by draft position for each speculative configuration."""
    from ..extras import require

    require("bench", "a benchmark plot", "matplotlib")
    from matplotlib.figure import Figure  # the object API: no pyplot, no global backend state

    groups = list(dict.fromkeys(s.group for s in summaries if s.group != ALL)) + [ALL]
    cell = {(s.config, s.group): s for s in summaries}
    shown = [c.label for c in result.configs if result.baselines.get(c.label) != c.label]
    fig = Figure(figsize=(13, 4.8), layout="constrained")
    ax, ax2 = fig.subplots(1, 2, width_ratios=[2.2, 1])
    width = 0.8 / max(1, len(shown))
    bound_labelled = False
    for i, label in enumerate(shown):
        xs = [gi + (i - (len(shown) - 1) / 2) * width for gi in range(len(groups))]
        ys = [(cell[(label, g)].speedup or 0.0) if (label, g) in cell else 0.0 for g in groups]
        ax.bar(xs, ys, width, label=label)
        bounds = [(x, cell[(label, g)].bound) for x, g in zip(xs, groups)
                  if (label, g) in cell and cell[(label, g)].bound is not None]
        if bounds:
            ax.scatter([x for x, _ in bounds], [b for _, b in bounds], marker="_", s=200, color="black",
                       label=None if bound_labelled else "bound (Leviathan et al.)")
            bound_labelled = True
    ax.axhline(1.0, color="grey", linewidth=0.8)
    ax.set_xticks(range(len(groups)), groups, rotation=20)
    ax.set_ylabel("speedup over plain decoding (same target)")
    ax.set_title(f"{Path(result.settings.model).name}: speedup by task group")
    if shown:
        ax.legend(fontsize=8)
    for s in summaries:
        if s.group == ALL and s.acceptance_by_position:
            ax2.plot(range(1, len(s.acceptance_by_position) + 1), s.acceptance_by_position, marker="o", label=s.config)
    ax2.set_xlabel("draft position")
    ax2.xaxis.get_major_locator().set_params(integer=True)
    ax2.set_ylabel("accepted / drafted")
    ax2.set_ylim(0, 1.05)
    ax2.set_title("acceptance by position")
    if ax2.lines:
        ax2.legend(fontsize=8)
    try:
        fig.savefig(Path(path).expanduser(), dpi=110)
    except OSError as exc:
        raise InvalidRequestError(f"cannot write {path}: {exc.strerror or exc}", "plot") from None


__all__ = ["expected_tokens_per_step", "leviathan_bound", "summarize", "headline", "to_markdown", "to_json",
           "write_plot", "Summary"]
