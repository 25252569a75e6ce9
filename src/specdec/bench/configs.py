"""What `--configs` means: a comma-separated list of configurations, each `NAME[:OPTION]...`.

An option is `key=value` or a bare flag (`adaptive`). Examples::

    plain                      specdec, no drafter
    ngram:k=5                  prompt lookup, 5 draft tokens per step
    ngram:k=8:adaptive         ... with the +2/-1 adaptive draft length starting at 8
    ngram:tree=4x3x12          ... drafting token trees (DEPTHxTOPKxBUDGET; ngram and eagle)
    ngram:k=8:fixed            ... always 8 (without a flag: the engine's default, the cost-aware
                               draft length, per match length and at most k)
    suffix:k=5                 suffix cache (learns across the requests of the run)
    draft:model=PATH:k=4       a draft model (or give --draft-model PATH once; a named model's pair is
                               the default); it runs quantised as the target does (draft_quantize=none|int8|int4)
    draft:k=4:lookup=ngram     prompt lookup first, the draft model where lookup finds nothing
    draft:k=4:vocab=16384      the draft scores only its 16384 most frequent ids (FR-Spec)
    draft:window=256           the draft reads only the prompt's first 32 and last 256 tokens
    draft:vocab=32768:p_min=0.5:lookup=ngram
                               what `--drafter auto` runs for the named Qwen pair (a draft: config's
                               confidence cut-off p_min is 0, off, unless given)
    eagle:k=5                  the shipped EAGLE head (eagle:head=DIR for another one)
    eagle:k=8:lookup=ngram     prompt lookup first, the EAGLE head where lookup finds nothing
    ngram:prediction           a prompt's prediction first (`--tasks edits`: the code to change), then
                               prompt lookup (any ngram, suffix, draft or eagle configuration takes the flag)
    ngram:unrelated-prediction  ... with another task's prediction instead (the next task's code: text
                               that does not match the answer), to price a useless prediction
    plain:quantize=int8        the same target quantised (when Engine.load takes `quantize`)
    hf                         HF transformers generate, greedy, float32
    hf-lookup:k=10             HF prompt-lookup assisted generation (prompt_lookup_num_tokens)
    hf-assist:model=PATH:k=5   HF assisted generation with a draft model (assistant_model)
    llama-cpp                  llama-cpp-python on the GGUF, plain greedy
    llama-cpp-lookup:k=10      llama-cpp-python with its prompt-lookup drafter
    llama-spec:k=4             llama.cpp's `llama-speculative` program with a draft model (model=, or the
                               draft model of draft configurations), greedy; bin=PATH, else
                               $SPECDEC_LLAMA_SPECULATIVE or llama-speculative on the PATH
    ref@ngram:k=5              the same specdec configuration run by ANOTHER specdec source tree
                               (`--ref-src DIR`, e.g. an older commit's checkout), in a worker process
                               through the public `Engine.load` / `generate` that every version has; so
                               one run compares two versions of specdec side by side (any plain, ngram,
                               suffix, draft or eagle configuration after `ref@`)
    this@ngram:k=5             ... run by this tree, in the same kind of worker process: the side to
                               compare ref@ with, since a process's own speed varies (see runner.py)

The label of a configuration is its text as written, so it is what the tables show. Parsing is pure
(no models are touched), so a bad list fails at once, before anything slow.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from ..builder import parse as parse_drafter
from ..errors import InvalidRequestError
from ..settings import DEFAULT_NUM_SPECULATIVE_TOKENS

# kind -> (family, {option: type}); "flag" options take no value.
_DTYPE = str
DTYPE_NAMES = ("auto", "float32", "fp32", "bfloat16", "bf16", "float16", "fp16")  # as Engine.load takes them
QUANTIZE_NAMES = ("none", "int8", "int4")
_PREDICTION = {"prediction": "flag", "unrelated_prediction": "flag"}  # what any drafting configuration drafts from first
KINDS: dict[str, tuple[str, dict[str, object]]] = {
    "plain": ("specdec", {"dtype": _DTYPE, "quantize": str}),
    "ngram": ("specdec", {**_PREDICTION, "k": int, "adaptive": "flag", "cost": "flag", "fixed": "flag", "tree": str,
                          "max_ngram": int, "min_ngram": int,
                          "dtype": _DTYPE, "quantize": str}),
    "suffix": ("specdec", {**_PREDICTION, "k": int, "adaptive": "flag", "cost": "flag", "fixed": "flag", "max_ngram": int, "min_ngram": int,
                           "dtype": _DTYPE, "quantize": str}),
    "draft": ("specdec", {**_PREDICTION, "k": int, "adaptive": "flag", "cost": "flag", "fixed": "flag", "model": str, "p_min": float,
                          "lookup": str, "draft_quantize": str, "vocab": int, "window": int, "dtype": _DTYPE,
                          "quantize": str}),
    "eagle": ("specdec", {**_PREDICTION, "k": int, "adaptive": "flag", "cost": "flag", "fixed": "flag", "tree": str, "head": str, "p_min": float,
                          "lookup": str, "dtype": _DTYPE, "quantize": str}),
    "hf": ("hf", {"dtype": _DTYPE}),
    "hf-lookup": ("hf", {"k": int, "n": int, "dtype": _DTYPE}),
    "hf-assist": ("hf", {"k": int, "adaptive": "flag", "model": str, "dtype": _DTYPE}),
    "llama-cpp": ("llama-cpp", {"threads": int, "model": str}),
    "llama-cpp-lookup": ("llama-cpp", {"k": int, "n": int, "threads": int, "model": str}),
    "llama-spec": ("llama-cpp", {"k": int, "threads": int, "model": str, "bin": str}),
}

# Defaults per kind where an option is left out. specdec's k matches Engine's default; the HF and
# llama.cpp lookup defaults are their own libraries' documented ones (10 tokens, 2-gram match).
DEFAULTS: dict[str, dict[str, object]] = {
    "ngram": {"k": 5}, "suffix": {"k": 5}, "draft": {"k": 5}, "eagle": {"k": 5},
    "hf-lookup": {"k": 10, "n": 2}, "hf-assist": {"k": 5},
    "llama-cpp-lookup": {"k": 10, "n": 2}, "llama-spec": {"k": 4},
}

DEFAULT_CONFIGS = "plain,ngram:k=5,suffix:k=5,hf,hf-lookup,llama-cpp,llama-cpp-lookup"


@dataclass(frozen=True)
class BenchConfig:
    """One configuration to measure. `options` holds every option, defaults filled in."""

    label: str
    kind: str
    options: dict = field(default_factory=dict)
    worker: str | None = None  # "ref" (`ref@`: the --ref-src tree) or "this" (`this@`), in a worker process

    @property
    def ref(self) -> bool:
        """Runs in a worker process (`ref@` or `this@`)."""
        return self.worker is not None

    @property
    def family(self) -> str:
        """"specdec", "worker" (a specdec configuration in a worker process), "hf" or "llama-cpp"."""
        return "worker" if self.ref else KINDS[self.kind][0]

    @property
    def speculative(self) -> bool:
        return self.kind not in ("plain", "hf", "llama-cpp")

    @property
    def k(self) -> int | None:
        return self.options.get("k")

    @property
    def adaptive(self) -> bool:
        return bool(self.options.get("adaptive"))

    @property
    def draft_length(self) -> str:
        """Engine's draft_length: fixed, adaptive (+2/-1), cost, or None for the engine's default."""
        return next((name for name in ("fixed", "adaptive", "cost") if self.options.get(name)), None)


def parse_configs(text: str, draft_model: str | None = None) -> list[BenchConfig]:
    """Parse a `--configs` list. `draft_model` fills `model=` of draft / hf-assist when left out."""
    items = [item.strip() for item in (text or "").split(",")]
    if not any(items):
        raise InvalidRequestError("--configs is empty; e.g. --configs plain,ngram:k=5", "configs")
    configs: list[BenchConfig] = []
    for item in items:
        if not item:
            raise InvalidRequestError(f"--configs {text!r} has an empty entry", "configs")
        configs.append(parse_config(item, draft_model))
    seen = set()
    for c in configs:
        if c.label in seen:
            raise InvalidRequestError(f"configuration {c.label!r} is listed twice", "configs")
        seen.add(c.label)
    return configs


WORKER_PREFIXES = {"ref@": "ref", "this@": "this"}
# Options a ref@ configuration cannot pass on: the worker reaches the other tree only through
# `Engine.load`'s keywords and a plain generate call: the n-gram range, the draft's prompt window
# and a prediction are not among them.
REF_UNSUPPORTED = ("max_ngram", "min_ngram", "window", "prediction", "unrelated_prediction")


def parse_config(item: str, draft_model: str | None = None) -> BenchConfig:
    prefix = next((p for p in WORKER_PREFIXES if item.strip().lower().startswith(p)), None)
    if prefix is not None:
        inner = parse_config(item.strip()[len(prefix):], draft_model)
        if inner.family != "specdec":
            raise InvalidRequestError(f"{item!r}: {prefix} takes a specdec configuration (plain, ngram, suffix, "
                                      "draft, eagle)", "configs")
        if bad := [key for key in REF_UNSUPPORTED if key in inner.options]:
            raise InvalidRequestError(f"{item!r}: {bad[0]} cannot be passed to a worker process "
                                      "(it reaches the other tree only through Engine.load and generate)", "configs")
        return BenchConfig(item.strip(), inner.kind, inner.options, worker=WORKER_PREFIXES[prefix])
    kind, *parts = item.split(":")
    kind = kind.strip().lower()
    if kind not in KINDS:
        raise InvalidRequestError(
            f"unknown configuration {kind!r} in {item!r}; choose from {', '.join(KINDS)}", "configs")
    allowed = KINDS[kind][1]
    options: dict[str, object] = dict(DEFAULTS.get(kind, {}))
    for part in parts:
        key, eq, value = part.partition("=")
        key = key.strip().lower().replace("-", "_")
        if key not in allowed:
            names = ", ".join(allowed) or "none"
            raise InvalidRequestError(
                f"{item!r}: unknown option {key!r} for {kind} (its options: {names})", "configs")
        kind_of = allowed[key]
        if kind_of == "flag":
            if eq and value.strip().lower() not in ("1", "true", "yes", "on"):
                raise InvalidRequestError(f"{item!r}: {key} is a flag; write it without a value", "configs")
            options[key] = True
            continue
        if not eq or not value.strip():
            raise InvalidRequestError(f"{item!r}: option {key} needs a value ({key}=...)", "configs")
        options[key] = _convert(item, key, value.strip(), kind_of)
    if options.get("prediction") and options.get("unrelated_prediction"):
        raise InvalidRequestError(f"{item!r}: choose one of prediction and unrelated-prediction", "configs")
    if sum(bool(options.get(name)) for name in ("fixed", "adaptive", "cost")) > 1:
        raise InvalidRequestError(f"{item!r}: choose one of fixed, adaptive and cost", "configs")
    if "tree" in options:
        from ..drafters.base import TreeShape

        try:
            TreeShape.parse(options["tree"])
        except InvalidRequestError as exc:
            raise InvalidRequestError(f"{item!r}: {exc}", "configs") from None
        if options.get("adaptive") or options.get("cost"):
            raise InvalidRequestError(f"{item!r}: a tree has a fixed shape; drop adaptive / cost", "configs")
    if kind in ("draft", "hf-assist", "llama-spec"):
        options.setdefault("model", draft_model)
        if not options["model"]:
            raise InvalidRequestError(f"{item!r} needs a draft model: add :model=PATH or pass --draft-model PATH",
                                      "configs")
    if kind == "eagle":
        if options.get("lookup") == "suffix" and "tree" in options:
            raise InvalidRequestError(f"{item!r}: suffix lookup drafts no trees; use lookup=ngram", "configs")
        try:  # a missing head fails now, not after the target loads
            parse_drafter(eagle_name({**options, "lookup": None}))
        except InvalidRequestError as exc:
            raise InvalidRequestError(f"{item!r}: {exc}", "configs") from None
    if kind in ("ngram", "suffix"):
        # The drafter's own constructor knows its defaults and limits; building one is instant and
        # touches no model, so a bad n-gram range fails here, before anything slow.
        try:
            lookup_drafter(kind, options)
        except InvalidRequestError as exc:
            raise InvalidRequestError(f"{item!r}: {exc}", "configs") from None
    return BenchConfig(item.strip(), kind, options)


def eagle_name(options: dict) -> str:
    """The drafter name Engine.load / builder.parse take: `eagle` or `eagle:DIR`, after `LOOKUP+`
    with the lookup option."""
    head = f"eagle:{options['head']}" if options.get("head") else "eagle"
    return f"{options['lookup']}+{head}" if options.get("lookup") else head


def counterparts(configs: list[BenchConfig]) -> dict[str, str]:
    """ref@ configuration label -> the label of the same configuration run by this tree (same kind,
    same options once defaults are filled in): its this@ twin where there is one (measured alike, in
    a worker), else the in-process one."""
    out = {}
    for r in configs:
        if r.worker == "ref":
            same = [c for c in configs if c.worker != "ref" and c.kind == r.kind and c.options == r.options]
            same.sort(key=lambda c: c.worker != "this")
            if same:
                out[r.label] = same[0].label
    return out


def ref_drafter_name(config: BenchConfig) -> str:
    """The `drafter` argument of Engine.load that makes this configuration's drafter."""
    o = config.options
    if config.kind == "plain":
        return "none"
    if config.kind in ("ngram", "suffix"):
        return config.kind
    if config.kind == "eagle":
        return eagle_name(o)
    return f"{o['lookup']}+{o['model']}" if o.get("lookup") else str(o["model"])


def ref_load_options(config: BenchConfig, dtype: str, quantize: str | None, device: str) -> dict:
    """Engine.load's keywords for a ref@ configuration on the target (dtype, quantize). Options left
    out are None; the worker drops a None the other tree's Engine.load does not know."""
    o = config.options
    return {"drafter": ref_drafter_name(config), "device": device,
            "num_speculative_tokens": config.k or DEFAULT_NUM_SPECULATIVE_TOKENS,
            "dtype": dtype, "quantize": quantize or "none", "draft_length": config.draft_length,
            "draft_tree": o.get("tree"), "draft_p_min": o.get("p_min"),
            "draft_quantize": o.get("draft_quantize"), "draft_vocab": o.get("vocab")}


def lookup_drafter(kind: str, options: dict):
    """A fresh ngram / suffix drafter with the configuration's n-gram options."""
    from ..drafters import NgramDrafter, SuffixDrafter

    cls = NgramDrafter if kind == "ngram" else SuffixDrafter
    return cls(**{key: options[key] for key in ("max_ngram", "min_ngram") if key in options})


def _convert(item: str, key: str, value: str, kind_of) -> object:
    try:
        converted = kind_of(value)
    except ValueError:
        raise InvalidRequestError(f"{item!r}: {key}={value!r} is not a valid {kind_of.__name__}", "configs") from None
    if key in ("k", "n", "threads", "max_ngram", "min_ngram", "window") and converted < 1:
        raise InvalidRequestError(f"{item!r}: {key} must be >= 1", "configs")
    if key == "vocab" and converted < 0:
        raise InvalidRequestError(f"{item!r}: vocab must be >= 0 (0 = the full vocabulary)", "configs")
    if key == "p_min" and not 0.0 <= converted <= 1.0:
        raise InvalidRequestError(f"{item!r}: p_min must be in [0, 1]", "configs")
    if key == "dtype" and converted not in DTYPE_NAMES:
        raise InvalidRequestError(f"{item!r}: dtype must be one of {', '.join(DTYPE_NAMES)}", "configs")
    if key == "lookup" and converted not in ("ngram", "suffix"):
        raise InvalidRequestError(f"{item!r}: lookup must be ngram or suffix", "configs")
    if key in ("quantize", "draft_quantize") and converted not in QUANTIZE_NAMES:
        raise InvalidRequestError(f"{item!r}: {key} must be one of {', '.join(QUANTIZE_NAMES)}", "configs")
    return converted


def _as_named(name: str, quantize: str | None = None) -> str:
    return name


def target_key(config: BenchConfig, dtype: str, quantize: str | None,
               canonical: Callable[..., str] = _as_named) -> tuple[str, str | None]:
    """Which loaded specdec target a configuration runs on: (dtype, quantize).

    `canonical(dtype, quantize)` maps a dtype name to the one it resolves to (the runner passes one
    that turns "auto" / "bf16" into "bfloat16" for the device, and "auto" into "float32" for an int8
    target on the CPU), so two spellings of one target share it.
    """
    quantize = config.options.get("quantize", quantize)
    return canonical(str(config.options.get("dtype", dtype)), quantize), quantize


def with_baselines(configs: list[BenchConfig], dtype: str, quantize: str | None,
                   canonical: Callable[..., str] = _as_named) -> tuple[list[BenchConfig], dict[str, str]]:
    """Make sure every specdec target variant has a plain run; map each label to its baseline's.

    A speculative configuration is compared with plain decoding *of the same target* (same dtype,
    same quantisation): quantisation changes the model, so another plain run would not be "its own".
    Peers are compared with plain decoding of the default target (--dtype / --quantize), or the first
    plain configuration when no configuration runs on the default target. A missing plain
    configuration is added right before its first user (first in the list for the peers' one).
    """
    configs = list(configs)
    # Worker configurations run on the same target as this tree's: their baseline is this tree's plain.
    key_of = {c.label: target_key(c, dtype, quantize, canonical) for c in configs if c.family in ("specdec", "worker")}
    plain_of: dict[tuple, str] = {}
    for c in configs:
        if c.kind == "plain" and not c.ref:
            plain_of.setdefault(key_of[c.label], c.label)
    default_key = (canonical(dtype, quantize), quantize)

    def add_plain(key: tuple, options: dict, at: int) -> None:
        label = ":".join(["plain"] + [f"{k}={v}" for k, v in options.items()])
        while any(x.label == label for x in configs):
            label += "'"
        configs.insert(at, BenchConfig(label, "plain", options))
        key_of[label] = key
        plain_of[key] = label

    if any(c.family != "specdec" for c in configs) and not plain_of:
        add_plain(default_key, {}, 0)
    for c in list(configs):
        if c.family in ("specdec", "worker") and key_of[c.label] not in plain_of:
            add_plain(key_of[c.label], {k: v for k, v in c.options.items() if k in ("dtype", "quantize")},
                      configs.index(c))
    peer_baseline = plain_of.get(default_key) or next(c.label for c in configs if c.kind == "plain" and not c.ref)
    baselines = {c.label: plain_of[key_of[c.label]] if c.label in key_of else peer_baseline for c in configs}
    return configs, baselines
