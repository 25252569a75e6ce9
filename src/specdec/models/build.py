"""Reading model files and building a `Transformer` from them: HF config.json -> `ModelConfig`,
safetensors tensors read lazily (`StoredTensor`), GGUF tensors dequantised a block of rows at a
time (`GgufTensorSource`) with their HF names and config, the tokenizer a GGUF carries, and
`build_model` (tensors taken one at a time, quantised as they arrive where asked).

The layer below both ways of getting a model ready to load: the float32 conversion and the
resolution of a name to a folder (`loader.py`), and the kernel-layout cache (`mapped.py`).
"""

from __future__ import annotations

import contextlib
import json
import math
import sys
from pathlib import Path

import torch

from ..errors import ModelLoadError
from .gguf_file import GgufFile
from .transformer import ModelConfig, RopeSpec, Transformer

SUPPORTED_FAMILIES = ("gemma3", "llama", "mistral", "qwen2", "qwen3")




# --------------------------------------------------------------------------------------------
# HF config.json -> ModelConfig


def _rope_spec(params: dict | None, fallback_theta: float, scaling: dict | None = None) -> RopeSpec:
    """Build a RopeSpec from either transformers-5 `rope_parameters` or the older fields."""
    merged = dict(scaling or {})
    if params:
        merged.update(params)
    theta = float(merged.pop("rope_theta", fallback_theta))
    kind = merged.get("rope_type", merged.get("type", "default"))
    if kind == "default":
        return RopeSpec(theta)
    keep = {k: v for k, v in merged.items() if isinstance(v, (int, float, str)) and k != "type"}
    keep["rope_type"] = kind
    return RopeSpec(theta, tuple(sorted(keep.items())))


def config_from_hf(raw: dict) -> ModelConfig:
    if "text_config" in raw:  # multimodal Gemma 3 wrapper: the text model is what we run
        raw = {**raw["text_config"], "model_type": raw["text_config"].get("model_type", "gemma3_text")}
    model_type = raw.get("model_type", "")
    family = {"gemma3_text": "gemma3", "gemma3": "gemma3"}.get(model_type, model_type)
    if family not in SUPPORTED_FAMILIES:
        raise ModelLoadError(
            f"unsupported architecture {model_type!r}; supported: Gemma 3, Llama, Mistral, Qwen2, Qwen3"
        )
    try:
        hidden = raw["hidden_size"]
        heads = raw["num_attention_heads"]
        layers = raw["num_hidden_layers"]
        head_dim = raw.get("head_dim") or hidden // heads
        rope_params = raw.get("rope_parameters")
        eos = raw.get("eos_token_id")
        common = dict(
            family=family,
            vocab_size=raw["vocab_size"],
            hidden_size=hidden,
            intermediate_size=raw["intermediate_size"],
            num_layers=layers,
            num_heads=heads,
            num_kv_heads=raw.get("num_key_value_heads") or heads,
            head_dim=head_dim,
            rms_eps=raw.get("rms_norm_eps", 1e-6),
            max_position=raw.get("max_position_embeddings", 4096),
            bos_token_id=raw.get("bos_token_id"),
            eos_token_ids=tuple(eos if isinstance(eos, list) else ([] if eos is None else [eos])),
        )
        if family == "gemma3":
            if raw.get("attn_logit_softcapping"):
                raise ModelLoadError("attention logit soft-capping (Gemma 2) is not supported")
            window = raw.get("sliding_window")
            types = raw.get("layer_types") or [
                "full_attention" if (i + 1) % raw.get("sliding_window_pattern", 6) == 0 else "sliding_attention"
                for i in range(layers)
            ]
            if rope_params and "full_attention" in rope_params:
                global_rope = _rope_spec(rope_params["full_attention"], 1e6)
                local_rope = _rope_spec(rope_params.get("sliding_attention"), 1e4)
            else:
                global_rope = _rope_spec(None, raw.get("rope_theta", 1e6), raw.get("rope_scaling"))
                local_rope = RopeSpec(float(raw.get("rope_local_base_freq", 1e4)))
            local = [t == "sliding_attention" for t in types]
            return ModelConfig(
                **common,
                layer_rope=tuple(local_rope if s else global_rope for s in local),
                layer_window=tuple(window if s else None for s in local),
                norm_offset=1.0,
                sandwich_norms=True,
                qk_norm=True,
                activation="gelu_tanh",
                embed_scale=hidden**0.5,
                tie_embeddings=raw.get("tie_word_embeddings", True),
                query_scale=raw.get("query_pre_attn_scalar", head_dim) ** -0.5,
                final_logit_softcap=raw.get("final_logit_softcapping"),
            )
        act = raw.get("hidden_act", "silu")
        if act != "silu":
            raise ModelLoadError(f"unsupported activation {act!r} for {family}")
        rope = _rope_spec(rope_params, raw.get("rope_theta", 1e4), raw.get("rope_scaling"))
        window = raw.get("sliding_window") if family == "mistral" or raw.get("use_sliding_window") else None
        return ModelConfig(
            **common,
            layer_rope=(rope,) * layers,
            layer_window=(window,) * layers,
            qk_norm=family == "qwen3",
            qkv_bias=family == "qwen2" or bool(raw.get("attention_bias")),
            tie_embeddings=raw.get("tie_word_embeddings", False),
        )
    except KeyError as exc:
        raise ModelLoadError(f"config.json lacks the field {exc.args[0]!r}") from exc


def _strip_prefix(name: str) -> str | None:
    for prefix in ("model.language_model.", "language_model.model.", "model."):
        if name.startswith(prefix):
            return name[len(prefix) :]
    if name.startswith(("lm_head.", "language_model.lm_head.")):
        return "lm_head." + name.rsplit("lm_head.", 1)[1]
    return None  # vision tower and other parts we do not run


_ST_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
              "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
              "BOOL": torch.bool}
_ST_NAMES = {dtype: name for name, dtype in _ST_DTYPES.items()}
_CONVERT_BLOCK_BYTES = 16 << 20  # stored bytes read at a time when `StoredTensor.load` converts


class StoredTensor:
    """One tensor of a safetensors file, read on demand: `load()` all of it, `read_into` some rows.

    Reads are plain file reads into tensors: nothing is memory-mapped, so a load holds only the
    tensors it keeps plus the block it is reading. (A mapped file's touched pages count in the
    process's resident memory until it is unmapped: mapping Gemma 3 270M's 1 GB float32 file to
    quantise it would cost that gigabyte at the peak.) Quantising reads the output head a block of
    rows at a time (`quant.quantize_rows`).
    """

    def __init__(self, path: Path, dtype: torch.dtype, shape: tuple[int, ...], offset: int):
        self.path, self.dtype, self.shape, self.offset = path, dtype, shape, offset
        self.device = torch.device("cpu")

    def read_into(self, start: int, out: torch.Tensor) -> None:
        """Read rows start .. start + len(out) into `out` (converted to its dtype if need be)."""
        target = out if out.dtype == self.dtype and out.is_contiguous() else torch.empty(out.shape, dtype=self.dtype)
        raw = target.reshape(-1).view(torch.uint8).numpy()  # its bytes, to read into
        with open(self.path, "rb", buffering=0) as f:
            f.seek(self.offset + start * math.prod(self.shape[1:]) * target.element_size())
            done = 0
            while done < raw.nbytes:
                n = f.readinto(memoryview(raw)[done:])
                if not n:
                    raise ModelLoadError(f"{self.path}: file ends inside a tensor (truncated?)")
                done += n
        if target is not out:
            out.copy_(target)

    def load(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        """All of it, in `dtype` (default: as stored). A conversion goes through a buffer of at most
        ~16 MiB of stored rows: read whole and then converted, Gemma 3 270M's float32 embedding
        (640 MiB) sat beside its bfloat16 copy, and a bfloat16 load peaked at 1287 MiB against
        ~850 MiB kept. The values are what `.to(dtype)` gives."""
        dtype = self.dtype if dtype is None else dtype
        out = torch.empty(self.shape, dtype=dtype)
        if dtype == self.dtype or len(self.shape) == 0 or out.numel() == 0:
            self.read_into(0, out)
            return out
        row_bytes = math.prod(self.shape[1:]) * torch.empty(0, dtype=self.dtype).element_size()
        rows = max(1, _CONVERT_BLOCK_BYTES // max(1, row_bytes))
        for start in range(0, self.shape[0], rows):
            self.read_into(start, out[start : start + rows])
        return out


def _read_header(path: Path) -> dict:
    try:
        with open(path, "rb") as f:
            size = int.from_bytes(f.read(8), "little")
            if not 2 <= size <= 100_000_000:
                raise ValueError(f"header size {size}")
            header = json.loads(f.read(size))
    except (OSError, ValueError, UnicodeDecodeError) as exc:
        raise ModelLoadError(f"{path}: not a readable safetensors file ({exc})") from exc
    header.pop("__metadata__", None)
    return {name: (entry, 8 + size) for name, entry in header.items()}


def read_safetensors_folder(folder: Path) -> dict[str, StoredTensor]:
    """The tensors of a folder's *.safetensors files by their short names, not yet read."""
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise ModelLoadError(f"{folder}: no *.safetensors files")
    state = {}
    for file in files:
        for name, (entry, data_start) in _read_header(file).items():
            short = _strip_prefix(name)
            if short is None:
                continue
            try:
                dtype, shape, begin = _ST_DTYPES.get(entry["dtype"]), tuple(entry["shape"]), entry["data_offsets"][0]
            except (KeyError, TypeError, IndexError) as exc:
                raise ModelLoadError(f"{file}: tensor {name} has a malformed header entry ({exc!r})") from exc
            if dtype is None:
                raise ModelLoadError(f"{file}: tensor {name} has unsupported dtype {entry['dtype']!r}")
            state[short] = StoredTensor(file, dtype, shape, data_start + begin)
    return state


def _check_weights(model: Transformer, state: dict) -> set[str]:
    """The names `model` needs from `state` (all present, with the right shapes), else a clear error."""
    expected = set(model.state_dict().keys())
    if model.config.tie_embeddings:
        expected.discard("lm_head.weight")
    missing = sorted(expected - state.keys())
    if missing:
        raise ModelLoadError(f"weights lack {len(missing)} tensors, first: {missing[0]}")
    for name, param in model.state_dict().items():
        if name in state and tuple(state[name].shape) != tuple(param.shape):
            raise ModelLoadError(f"tensor {name} has shape {tuple(state[name].shape)}, expected {tuple(param.shape)}")
    return expected


@contextlib.contextmanager
def _skeleton():
    """Build modules on the meta device without running their random initialisers (PyTorch's own
    `nn.init` functions, swapped for no-ops meanwhile): the weights are about to be replaced, and
    initialising a meta tensor runs PyTorch's Python decompositions, whose first use imports hundreds
    of modules that stay resident for the life of the process. Loads run on one thread."""
    from torch.nn import init

    names = ("normal_", "uniform_", "kaiming_uniform_", "kaiming_normal_", "trunc_normal_", "xavier_uniform_",
             "xavier_normal_", "zeros_", "ones_", "constant_")
    saved = {name: getattr(init, name) for name in names}
    try:
        for name in names:
            setattr(init, name, lambda tensor, *args, **kwargs: tensor)
        with torch.device("meta"):
            yield
    finally:
        for name, fn in saved.items():
            setattr(init, name, fn)


def build_model(cfg: ModelConfig, state: dict, dtype: torch.dtype, device, quantize: str = "none") -> Transformer:
    """A `Transformer` from `state` (tensors, or `StoredTensor`s read one at a time as they are
    placed). `quantize="int8"` puts every linear layer and the output head on int8 as it reads
    them (`quant.quantize_model`), so the float weights are never all in memory at once."""
    from .quant import quantize_model

    with _skeleton():
        model = Transformer(cfg)
    expected = _check_weights(model, state)
    if quantize != "none":
        quantize_model(model, quantize, weights=state)  # replaces the linears and the embedding
        expected = {name for name, param in model.named_parameters() if param.is_meta}
    # Every tensor read is kept by the model, so reading them all before one assignment holds no
    # more than reading them one by one.
    read = {name: state[name].load(dtype) if isinstance(state[name], StoredTensor) else state[name].to(dtype)
            for name in sorted(expected)}
    model.load_state_dict(read, strict=False, assign=True)
    if cfg.tie_embeddings and quantize == "none":
        model.lm_head.weight = model.embed_tokens.weight
    # Non-persistent buffers (rope tables) were made on meta: rebuild them for real.
    for i, spec in enumerate(model._rope_specs):
        setattr(model, f"inv_freq_{i}", spec.inv_freq(cfg.head_dim).float())
    return model.to(device).eval()


def read_config(folder: Path) -> ModelConfig:
    config_file = folder / "config.json"
    if not config_file.is_file():
        raise ModelLoadError(f"{folder}: no config.json")
    try:
        raw = json.loads(config_file.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ModelLoadError(f"{config_file}: not valid JSON ({exc})") from exc
    return config_from_hf(raw)


def load_hf_folder(folder: Path) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    """A folder's config and all its tensors, read into memory."""
    return read_config(folder), {n: t.load() for n, t in read_safetensors_folder(folder).items()}


# --------------------------------------------------------------------------------------------
# GGUF

# llama.cpp's tensor names -> HF's, per block ("{i}" is the layer).
_GGUF_BLOCK_NAMES = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "attn_norm": "input_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "post_attention_norm": "post_attention_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
}
_SUPPORTED_QUANTS = ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q4_K", "Q5_K", "Q6_K")


def _gguf_config(gguf: GgufFile) -> dict:
    """GGUF metadata -> an HF-style config.json dict."""

    def get(key, default=None):
        return gguf.fields.get(key, default)

    arch = get("general.architecture")
    family = {"gemma3": "gemma3_text", "llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3"}.get(arch)
    if family is None:
        raise ModelLoadError(f"unsupported GGUF architecture {arch!r}; supported: gemma3, llama, qwen2, qwen3")
    embd = next((t for t in gguf.tensors if t.name == "token_embd.weight"), None)
    if embd is None:
        raise ModelLoadError("the GGUF file has no token_embd.weight")
    hidden = get(f"{arch}.embedding_length")
    heads = get(f"{arch}.attention.head_count")
    raw = {
        "model_type": family,
        "vocab_size": int(embd.shape[1]),
        "hidden_size": hidden,
        "intermediate_size": get(f"{arch}.feed_forward_length"),
        "num_hidden_layers": get(f"{arch}.block_count"),
        "num_attention_heads": heads,
        "num_key_value_heads": get(f"{arch}.attention.head_count_kv", heads),
        "head_dim": get(f"{arch}.attention.key_length", hidden // heads),
        "rms_norm_eps": get(f"{arch}.attention.layer_norm_rms_epsilon", 1e-6),
        "max_position_embeddings": get(f"{arch}.context_length", 4096),
        "rope_theta": get(f"{arch}.rope.freq_base", 1e4),
        "bos_token_id": get("tokenizer.ggml.bos_token_id"),
        "eos_token_id": get("tokenizer.ggml.eos_token_id"),
        "tie_word_embeddings": not any(t.name == "output.weight" for t in gguf.tensors),
    }
    scaling = get(f"{arch}.rope.scaling.type")
    if scaling == "linear":
        raw["rope_scaling"] = {"rope_type": "linear", "factor": get(f"{arch}.rope.scaling.factor")}
    if arch == "gemma3":
        # llama.cpp keeps Gemma 3's fixed layout implicit: 5 local layers then 1 global, local
        # rope base 10k, and the query scale from the head size.
        raw["sliding_window"] = get(f"{arch}.attention.sliding_window")
        raw["sliding_window_pattern"] = 6
        raw["rope_local_base_freq"] = 10000.0
        raw["query_pre_attn_scalar"] = raw["head_dim"]
    elif get(f"{arch}.attention.sliding_window"):
        raw["sliding_window"] = get(f"{arch}.attention.sliding_window")
        raw["use_sliding_window"] = True
    if any(t.name == "rope_freqs.weight" for t in gguf.tensors):
        raise ModelLoadError("GGUF files with rope_freqs (Llama 3.1 rope scaling) are not supported yet")
    return raw


def _unpermute_qk(w: torch.Tensor, heads: int) -> torch.Tensor:
    """llama.cpp stores Llama's q/k rows interleaved per head for its rope; undo that."""
    out = w.shape[0]
    return w.reshape(heads, out // heads // 2, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


def _gguf_name(gguf_name: str, arch: str) -> str:
    """llama.cpp's name of a tensor -> ours (HF's without the "model." prefix)."""
    if gguf_name == "token_embd.weight":
        return "embed_tokens.weight"
    if gguf_name == "output_norm.weight":
        return "norm.weight"
    if gguf_name == "output.weight":
        return "lm_head.weight"
    if gguf_name.startswith("blk."):
        _, layer, part, kind = gguf_name.split(".", 3)
        if part == "ffn_norm":  # the MLP's input norm: Gemma 3 calls it pre_feedforward
            target = "pre_feedforward_layernorm" if arch == "gemma3_text" else "post_attention_layernorm"
        else:
            target = _GGUF_BLOCK_NAMES.get(part)
        if target is not None:
            return f"layers.{layer}.{target}.{kind}"
    raise ModelLoadError(f"unexpected GGUF tensor {gguf_name}")


_GGUF_BLOCK_ROWS = 8192  # rows of a large GGUF tensor dequantised at a time (the 262k-row table)


def _gguf_row_wise(t, shape: tuple[int, ...], raw: dict) -> bool:
    """Whether rows of GGUF tensor `t` dequantise alone (a matrix that needs no reordering: the
    embedding table, the output head, most projections), not only the whole tensor at once."""
    permuted = raw["model_type"] == "llama" and (".attn_q." in t.name or ".attn_k." in t.name)
    return len(shape) == 2 and not permuted and t.data.shape[0] == shape[0]


def _gguf_rows(t, name: str, shape: tuple[int, ...], raw: dict, start: int = 0, stop: int | None = None) -> torch.Tensor:
    """Rows start .. stop of GGUF tensor `t` dequantised to float32 in our layout (all of it unless
    it is `_gguf_row_wise`): the values a conversion writes, whether read whole or a block at a time."""
    from gguf.quants import dequantize

    arch = raw["model_type"]
    data = t.data[start:stop] if _gguf_row_wise(t, shape, raw) else t.data
    array = dequantize(data, t.tensor_type).reshape(-1, *shape[1:]).astype("float32", copy=False)
    tensor = torch.from_numpy(array if array.flags.writeable else array.copy())  # F32 data is the mapped file
    if arch == "llama" and (".attn_q." in t.name or ".attn_k." in t.name):
        heads = raw["num_attention_heads"] if ".attn_q." in t.name else raw["num_key_value_heads"]
        tensor = _unpermute_qk(tensor, heads)
    if arch == "gemma3_text" and name.endswith("norm.weight"):
        # llama.cpp folds Gemma's (1 + w) into the stored weight; our RMSNorm adds the 1.
        tensor = tensor - 1.0
    return tensor


def _gguf_blocks(t, name: str, shape: tuple[int, ...], raw: dict):
    """One GGUF tensor dequantised to float32 in our layout: whole, or, for a large matrix that needs
    no reordering (the embedding table, the output head), in blocks of rows, so the conversion never
    holds a float copy of the whole table (671 MB for Gemma 3 270M's) with its temporaries."""
    step = _GGUF_BLOCK_ROWS if _gguf_row_wise(t, shape, raw) else shape[0]
    for start in range(0, shape[0], step):
        yield _gguf_rows(t, name, shape, raw, start, start + step)


class GgufTensorSource(StoredTensor):
    """One GGUF tensor as a `StoredTensor`: rows dequantised to float32 on demand (the values the
    conversion would have written), so quantising straight from the GGUF writes no float32 copy."""

    def __init__(self, t, name: str, raw: dict, on_first_read=None):
        super().__init__(Path(), torch.float32, tuple(reversed(t.shape)), 0)
        self.t, self.name, self.raw = t, name, raw
        self._on_first_read = on_first_read  # called once, at the first read (a progress counter)

    def read_into(self, start: int, out: torch.Tensor) -> None:
        if self._on_first_read is not None:
            self._on_first_read()
            self._on_first_read = None
        stop = start + (out.shape[0] if out.dim() else 1)
        rows = _gguf_rows(self.t, self.name, self.shape, self.raw, start, stop)
        if not _gguf_row_wise(self.t, self.shape, self.raw) and self.shape:
            rows = rows[start:stop]
        out.copy_(rows.view(out.shape))


def gguf_sources(gguf: GgufFile, raw: dict, on_first_read=None) -> dict[str, GgufTensorSource]:
    """Every tensor of `gguf` by our name, read on demand (`GgufTensorSource`)."""
    for t in gguf.tensors:
        if t.tensor_type.name not in _SUPPORTED_QUANTS:
            raise ModelLoadError(f"tensor {t.name}: unsupported quantisation type {t.tensor_type.name}")
    return {name: GgufTensorSource(t, name, raw, on_first_read)
            for t in gguf.tensors for name in [_gguf_name(t.name, raw["model_type"])]}


def _gguf_tokenizer(path: Path, out: Path, model_type: str) -> None:
    """Build an HF tokenizer from the GGUF metadata (transformers knows the format) and save it.

    Naming the tokenizer's type (`model_type`) spares transformers a second reading of the whole
    file for the model's config (slow for a large vocabulary with gguf's reader); the tokenizer is
    the same byte for byte (tests/test_models.py). Where transformers has no tokenizer class under
    that name (Llama's in transformers 5), it reads the config as before."""
    import logging

    from transformers import AutoTokenizer
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    logging.getLogger("transformers").setLevel(logging.ERROR)
    try:
        try:
            tok = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name, tokenizer_type=model_type)
        except Exception:
            tok = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    except Exception as exc:  # a GGUF without a tokenizer still loads; prompts are then ids
        print(f"specdec: no tokenizer in {path.name} ({exc}); prompts must be token ids", file=sys.stderr)
        return
    tok.save_pretrained(str(out))


def release_freed_memory() -> None:
    """Hand memory freed by a load back to the system. glibc keeps freed blocks for reuse, so the
    temporaries of reading a tokenizer or quantising a model would otherwise stay in the process's
    resident set for its whole life (a large share of the process after a big tokenizer)."""
    import ctypes

    try:
        ctypes.CDLL(None).malloc_trim(0)
    except (OSError, AttributeError):  # not glibc: nothing to do
        pass
