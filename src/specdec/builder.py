"""Settings -> a loaded target, its tokenizer and drafters: the one place names are resolved and
things are loaded, for `Engine.load`, `generate` / `chat`, `serve` (and its Ray replicas) and `bench`.

    settings = DecodingSettings(target=..., drafter=..., ...)   # validated when made
    settings = resolve(settings)      # "auto" drafter / quantisation / vocabulary decided, names and
                                      # paths checked: every error before anything slow loads
    built = build(settings)           # the target (and its tokenizer), then the drafter for it

Drafter names resolve in one registry, `REGISTRY` (name -> `DrafterKind`: its factory and what
its drafters can do, their `DrafterNeeds`). `parse(name)` is the one parser of a drafter name:

    none | ngram | suffix                prompt lookup (free), or nothing
    eagle | eagle:DIR                    an EAGLE head (the shipped one, or a trained folder)
    PRESET | PATH                        a draft model (a preset of `specdec models`, an HF folder, a .gguf)
    ngram+LEARNED | suffix+LEARNED       lookup first, LEARNED (eagle[:DIR] or a draft model) where it
                                         finds nothing (`drafters/combined.py`)

An unknown name is one `InvalidRequestError` listing the known ones. `serving_drafters` is the set a
server offers (every request names one of them; each row gets a `spawn()`).
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

from .drafters.base import Drafter, DrafterNeeds
from .drafters.combined import combine_needs, lookup_first
from .drafters.draft_model import DEFAULT_DRAFT_P_MIN, DraftModelDrafter
from .drafters.eagle import EagleDrafter, check_head_folder
from .drafters.ngram import NgramDrafter
from .drafters.suffix import SuffixDrafter
from .errors import InvalidRequestError, SpecdecError
from .models import cpu_kernels, gguf_file, loader, presets, quant
from .models.transformer import Transformer
from .settings import DTYPES, DecodingSettings
from .tokenizer import Tokenizer

LOOKUPS = ("ngram", "suffix")  # the drafters a combination asks first


# -- devices, dtypes, quantisation ------------------------------------------------------------------


def resolve_dtype(dtype: str, device: str, quantize: str = "none") -> torch.dtype:
    if dtype == "auto":
        # bfloat16 halves the bytes read per token; CPUs without native bf16 would emulate it slowly.
        if device.startswith("cuda"):
            return torch.bfloat16
        if quantize != "none":
            # An int8 model on the CPU computes in float32 whatever the dtype (the compiled kernels'
            # activations, the float32 cache): bfloat16 would only round its norms' weights.
            return torch.float32
        return torch.bfloat16 if torch.backends.mkldnn.is_available() and _cpu_has_bf16() else torch.float32
    if dtype not in DTYPES:
        raise InvalidRequestError(f"unknown dtype {dtype!r}; choose auto, float32, bfloat16 or float16", "dtype")
    return DTYPES[dtype]


def _cpu_has_bf16() -> bool:
    flags = cpu_kernels.cpu_fields().get("flags", "").split()
    return "avx512_bf16" in flags or "amx_bf16" in flags


def resolve_device(device: str) -> str:
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise InvalidRequestError("--device cuda was asked for but no CUDA device is available", "device")
    if not (device == "cpu" or device.startswith("cuda")):
        raise InvalidRequestError(f"unknown device {device!r}; choose cpu or cuda", "device")
    return device


def source_is_quantised(target: str) -> bool:
    """Whether a target's weights come quantised: the default model, a preset, a .gguf file."""
    return str(target) == "default" or presets.is_preset(str(target)) or str(target).lower().endswith(".gguf")


def source_layer_bits(target: str) -> int | None:
    """Bits of most of a quantised source's decoder-layer weights (`gguf_file.layer_weight_bits`):
    the figure pinned for the default model and the presets (finding the default's file hashes it),
    else read from the GGUF header; None where unknown (a missing file: the load reports it)."""
    if str(target) == "default":
        return loader.DEFAULT_MODEL_LAYER_BITS
    if presets.is_preset(str(target)):
        return presets.get(str(target)).layer_bits
    try:
        return gguf_file.layer_weight_bits(Path(target).expanduser())
    except (SpecdecError, OSError):
        return None


def resolve_quantize(quantize: str, device: str, target: str) -> str:
    """"auto" -> on the CPU (where the int8 products are available), for a source whose weights are
    already quantised: int4 when most of its layer weights are 4-bit (a Q4_K file: the int4 path
    keeps their grid, reads 5/8 of int8's bytes, and follows llama.cpp's tokens on the same file
    about as closely as int8 does), where the compiled kernels are built; else int8 (a GGUF's 5-8
    bit blocks: int8 keeps more than they hold, and runs several times faster than bfloat16).
    Float weights are kept as they are (none)."""
    if quantize != "auto":
        return quantize
    if device != "cpu" or not quant.cpu_int8_available() or not source_is_quantised(target):
        return "none"
    if source_layer_bits(target) == 4 and cpu_kernels.load() is not None:
        return "int4"
    return "int8"


def draft_quantize_for(draft_quantize: str | None, target: Transformer) -> str:
    """The draft model's quantisation: as asked (checked by `DecodingSettings`), or ("auto" / None)
    the target's (int8, int4 or none)."""
    if draft_quantize in (None, "auto"):
        return quant.quantize_of(target)
    return draft_quantize


# -- the drafter registry ---------------------------------------------------------------------------


@dataclass(frozen=True)
class DrafterSpec:
    """A parsed drafter name: its registry `kind`, the file it loads (`path`: an EAGLE head's folder,
    a draft model), and for a combination the `lookup` drafter asked first."""

    name: str
    kind: str
    path: Path | None = None
    lookup: str | None = None

    @property
    def learned(self) -> bool:
        return REGISTRY[self.kind].learned


@dataclass(frozen=True)
class Made:
    """What a drafter is made for: the loaded target and its tokenizer (None for lookup drafters),
    the settings (p_min, draft quantisation and vocabulary, cache dtype) and a progress callback."""

    target: Transformer | None = None
    tokenizer: Tokenizer | None = None
    settings: DecodingSettings = DecodingSettings()
    progress: Callable | None = None


@dataclass(frozen=True)
class DrafterKind:
    """One entry of the registry: how a name of this kind is written, its factory, and what its
    drafters can do (`needs`, the capabilities they declare), or None for no drafter."""

    spelling: str
    make: Callable[[DrafterSpec, Made], Drafter | None]
    needs: DrafterNeeds | None
    learned: bool = False  # made for a loaded target (reads weights), after the target loads


def _make_eagle(spec: DrafterSpec, made: Made) -> Drafter:
    if made.target is None:
        raise ValueError("an EAGLE head is made for a loaded target: pass `target`")
    p_min = made.settings.draft_p_min
    return EagleDrafter.load(spec.path, made.target, 0.0 if p_min is None else p_min)


def _make_draft_model(spec: DrafterSpec, made: Made) -> Drafter:
    if made.target is None:
        raise ValueError("a draft model is made for a loaded target: pass `target`")
    s, weight = made.settings, made.target.embed_tokens.weight
    drafter = DraftModelDrafter.load(
        spec.path, made.target.config.vocab_size, weight.dtype, weight.device,
        draft_p_min=DEFAULT_DRAFT_P_MIN if s.draft_p_min is None else s.draft_p_min, target_tokenizer=made.tokenizer,
        progress=made.progress, quantize=draft_quantize_for(s.draft_quantize, made.target), vocab=s.draft_vocab,
        kv_dtype=s.kv_dtype)
    drafter.measure_cost(made.target)  # the policy's first price of a draft token, refined online
    return drafter


REGISTRY: dict[str, DrafterKind] = {
    "none": DrafterKind("none", lambda spec, made: None, None),
    "ngram": DrafterKind("ngram", lambda spec, made: NgramDrafter(), NgramDrafter.needs),
    "suffix": DrafterKind("suffix", lambda spec, made: SuffixDrafter(), SuffixDrafter.needs),
    "eagle": DrafterKind("eagle, eagle:DIR", _make_eagle, EagleDrafter.needs, learned=True),
    "draft_model": DrafterKind("a model preset or the path of a draft model (HF folder or .gguf file)",
                               _make_draft_model, DraftModelDrafter.needs, learned=True),
}


def known_names() -> str:
    """The names a drafter may be given, for error messages."""
    kinds = [REGISTRY[k].spelling for k in ("none", "ngram", "suffix", "eagle")]
    model = REGISTRY["draft_model"].spelling.replace("a model preset", f"a model preset ({', '.join(presets.PRESETS)})")
    return f"{', '.join(kinds)}, ngram+LEARNED or suffix+LEARNED (LEARNED: eagle[:DIR] or a draft model), {model}"


def parse(name: str | None) -> DrafterSpec:
    """The one parser of drafter names (module docstring); checks the file a learned drafter
    loads exists, so a bad name fails before anything slow."""
    if name in (None, "", "none"):
        return DrafterSpec("none", "none")
    if name in LOOKUPS:
        return DrafterSpec(name, name)
    lookup, plus, learned = name.partition("+")
    if plus and lookup in LOOKUPS:
        nested = learned.partition("+")[0] in LOOKUPS and "+" in learned
        part = None if learned in ("", "none", *LOOKUPS) or nested else parse(learned)
        if part is None or not part.learned:
            raise InvalidRequestError(f"drafter {name!r}: after {lookup}+ comes a learned drafter (eagle, "
                                      "eagle:DIR or a draft model's path)", "drafter")
        return dataclasses.replace(part, name=name, lookup=lookup)
    if name == "eagle" or name.startswith("eagle:"):
        return DrafterSpec(name, "eagle", check_head_folder(None if name == "eagle" else name[len("eagle:"):]))
    if presets.is_preset(name):
        return DrafterSpec(name, "draft_model", presets.path(name))
    path = Path(name).expanduser()
    if not path.exists():
        raise InvalidRequestError(f"unknown drafter {name!r}; choose {known_names()}", "drafter")
    return DrafterSpec(name, "draft_model", path)


def needs_of(spec: DrafterSpec) -> DrafterNeeds | None:
    """What the drafter `spec` names can do, before it is made (a combination: `combined.combine_needs`)."""
    needs = REGISTRY[spec.kind].needs
    return needs if spec.lookup is None else combine_needs(REGISTRY[spec.lookup].needs, needs)


def make_drafter(spec: DrafterSpec | str, made: Made = Made()) -> Drafter | None:
    """The drafter `spec` names, made for `made.target` (a learned one) by its registry entry."""
    spec = parse(spec) if isinstance(spec, str) else spec
    if spec.kind in ("none", *LOOKUPS) and made.settings.draft_p_min:
        raise InvalidRequestError("draft_p_min applies only to a draft model (a model path as drafter)",
                                  "draft_p_min")
    drafter = REGISTRY[spec.kind].make(spec, made)
    if spec.lookup is not None:
        return lookup_first(REGISTRY[spec.lookup].make(spec, made), drafter)
    return drafter


def check_tree_drafter(name: str) -> None:
    """A drafter name (before anything loads) that can draft token trees: ngram, eagle[:DIR],
    ngram+eagle[:DIR]; else the one-line error."""
    needs = needs_of(parse(name))
    if needs is None or not needs.trees:
        raise no_trees(name)


def no_trees(name: str) -> InvalidRequestError:
    return InvalidRequestError(f"drafter {name!r} cannot propose draft trees; eagle, ngram and ngram+eagle can",
                               "draft_tree")


def serving_drafters(name: str = "none", made: Made = Made()) -> tuple[dict[str, Drafter | None], str]:
    """The drafters a server loads at start, by the names requests may choose them with, and the
    name of the default one (`name`, as `--drafter` gives it).

    Always: none, ngram, suffix (free). With a learned drafter (`eagle`, `eagle:DIR`, a draft
    model's path, or a lookup+learned combination of them), loaded once: its own name (`eagle`,
    `draft_model`) and its combinations `ngram+NAME` and `suffix+NAME`. Requests name drafters only
    by these names, never by a path: every row gets a `spawn()` of one of them (own state, shared
    weights).
    """
    drafters: dict[str, Drafter | None] = {"none": None, "ngram": NgramDrafter(), "suffix": SuffixDrafter()}
    if name in drafters:
        return drafters, name
    spec = parse(name)
    learned = make_drafter(dataclasses.replace(spec, lookup=None), made)
    drafters[learned.name] = learned
    for lookup in LOOKUPS:
        drafters[f"{lookup}+{learned.name}"] = lookup_first(drafters[lookup].spawn(), learned)
    return drafters, (f"{spec.lookup}+{learned.name}" if spec.lookup else learned.name)


# -- settings -> what loads ------------------------------------------------------------------------


def resolve_drafter(drafter: str, target: str, draft_p_min: float | None = None) -> tuple[str, float | None]:
    """(drafter, draft_p_min): "auto" -> for a preset target, prompt lookup first and its paired
    draft model where lookup finds nothing (`ngram+DRAFT`), with the pair's confidence cut-off
    unless one is given; else prompt lookup, which the cost-aware draft length turns down where it
    finds nothing to copy. The lookup part costs nothing where it finds nothing, its weak matches
    give way to the model (`DraftController.learned_first`), and where the draft model does not read a long
    prompt (`policy.AskGate.reads`) lookup still drafts: on the pair's tuning prompts
    (scripts/draft_tuning_prompts.jsonl) the combination was as fast as the draft model alone on
    short prompts and 1.2-1.3x plain on the long summaries where the draft alone was plain."""
    if drafter != "auto":
        return drafter, draft_p_min
    if presets.is_preset(str(target)) and (pair := presets.get(str(target))).draft:
        return f"ngram+{pair.draft}", pair.draft_p_min if draft_p_min is None else draft_p_min
    return "ngram", draft_p_min


def pair_draft_vocab(target: str) -> int | None:
    """The reduced draft vocabulary of a preset target's paired draft model under `drafter="auto"`
    (None: all ids): measured the pair's best lossless setting (BENCHMARKS.md)."""
    if presets.is_preset(str(target)) and (pair := presets.get(str(target))).draft:
        return pair.draft_vocab
    return None


def check_tensor_parallel(world: int, device: str, drafter: str) -> None:
    """--tensor-parallel N against the device (N ranks' worth of cores or GPUs) and the drafter: an
    EAGLE head reads the target's own features and output head, which the split leaves on no rank."""
    if world == 1:
        return
    from .models.tensor_parallel import check_world  # multiprocessing machinery, for a split only

    check_world(world, device)
    if parse(drafter).kind == "eagle":
        raise InvalidRequestError("an EAGLE head reads the whole target's features and head, which "
                                  "--tensor-parallel splits; use ngram, suffix or a draft model", "drafter")


def resolve(settings: DecodingSettings) -> DecodingSettings:
    """What was asked -> what will load: the device checked, "auto" quantisation and drafter (with
    a pair's cut-off and vocabulary) decided, the dtype, the drafter's name and a tree drafter
    checked; every error here, before anything slow loads."""
    s = settings
    device = resolve_device(s.device)
    quantize = resolve_quantize(s.quantize, device, s.target)
    draft_vocab = pair_draft_vocab(s.target) if s.drafter == "auto" and s.draft_vocab is None else s.draft_vocab
    drafter, draft_p_min = resolve_drafter(s.drafter, s.target, s.draft_p_min)
    check_tensor_parallel(s.tensor_parallel, device, drafter)
    s = dataclasses.replace(s, device=device, quantize=quantize, drafter=drafter, draft_p_min=draft_p_min,
                            draft_vocab=draft_vocab)
    resolve_dtype(s.dtype, device, quantize)
    spec = parse(drafter)
    if not spec.learned:
        make_drafter(spec, Made(settings=s))  # a lookup drafter's options fail here, as a model's would
    if s.draft_tree is not None:
        check_tree_drafter(drafter)
    return s


@dataclass
class Built:
    """A loaded target, its tokenizer, the drafter `settings.drafter` names, and the resolved settings."""

    model: Transformer
    tokenizer: Tokenizer | None
    drafter: Drafter | None
    settings: DecodingSettings


def load_target(settings: DecodingSettings, progress=None) -> tuple[Transformer, Tokenizer | None]:
    """The target of resolved `settings` and its tokenizer (split over its ranks with
    `tensor_parallel` > 1)."""
    s, world = settings, settings.tensor_parallel
    # The tokenizer first: reading Gemma's 262k-token vocabulary peaks at ~0.5 GB of parser
    # temporaries, which are handed back before the weights arrive rather than on top of them.
    folder = loader.resolve(s.target, progress, s.quantize if world == 1 else "none")
    config = loader.read_config(folder)  # a bad config fails before the tokenizer is read
    dtype = resolve_dtype(s.dtype, s.device, s.quantize)
    if world != 1:
        from .models import tensor_parallel as tp  # multiprocessing machinery, for a split only

        tp.check_split(config, world)
    tokenizer = Tokenizer.from_folder(folder)
    loader.release_freed_memory()
    if world != 1:
        threads = max(1, torch.get_num_threads() // world)  # this process's threads shared out among the ranks
        model = tp.launch(tp.Launch(functools.partial(tp.load_whole, folder, dtype), world, s.quantize, s.device,
                                    threads))
    else:
        model, _ = loader.load(folder, dtype, s.device, progress, s.quantize)
    return model, tokenizer


def build(settings: DecodingSettings, progress=None) -> Built:
    """Resolve `settings`, load the target, then the drafter for it (a draft model takes the
    target's vocabulary, device and dtype)."""
    settings = resolve(settings)
    model, tokenizer = load_target(settings, progress)
    drafter = make_drafter(settings.drafter, Made(model, tokenizer, settings, progress))
    return Built(model, tokenizer, drafter, settings)
