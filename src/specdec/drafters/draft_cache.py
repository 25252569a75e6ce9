"""What a draft model keeps beside its kernel-layout entry (`models/mapped.py`) from one load to the
next: its measured price per draft token and its reduced output head.

Both used to be made at every load of a pair, and together took a quarter of a warm load.

- The price (`DraftModelDrafter.measure_cost`: one draft token in one-token target steps) is kept
  per (machine, target entry, draft entry, threads, drafting head, cache dtype) in
  `draft_costs.json`: the first `SAMPLES` loads measure it, later ones read the lowest of their measurements. It only prices drafts for the draft-length rule (`policy.py`), which chooses
  how many tokens to propose and never which token is emitted: verification decides that, so a kept
  price cannot change an output, and the rule refines it online as the request runs. A price is
  machine-bound, so the key holds the processor's signature, core count, kernel build and torch's
  thread count: a change in any of them measures again.
- The reduced head (`draft_model._rows_of` with 4-bit rows: the FR-Spec subset of the head's rows
  quantised again) is kept as the packed table the kernels read, `sub_head-KEY.pt`, KEY a hash of
  the kept ids. It lives in the entry's folder, so a rebuilt entry (a changed source or layout)
  starts without it.

A model not loaded from an entry (`cache_entry`, set by `mapped.load_entry`) keeps nothing.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
from pathlib import Path

import torch

from specdec.models import cpu_kernels
from specdec.models.quant import Int4Linear

COSTS = "draft_costs.json"
SAMPLES = 3  # loads that measure a price before the lowest of their measurements is kept


def entry_of(model) -> str | None:
    """The kernel-layout entry `model` was loaded from (`mapped.load_entry`), None for any other."""
    return getattr(model, "cache_entry", None)


def machine_signature() -> str:
    """What a measured price depends on besides the two models: the processor, its core count, the
    kernels' source and flags (not the checkout's path, which names the build folder), torch's
    version and its thread count."""
    kernels = hashlib.sha256(cpu_kernels.SOURCE.read_bytes() + " ".join(cpu_kernels.CFLAGS).encode()).hexdigest()
    parts = [cpu_kernels.cpu_signature(), str(os.cpu_count()), kernels[:16], torch.__version__,
             f"threads={torch.get_num_threads()}"]
    return hashlib.sha256("|".join(parts).encode()).hexdigest()[:16]


def _ids_digest(ids) -> str:
    return "all" if ids is None else hashlib.sha256(ids.to(torch.int64).numpy().tobytes()).hexdigest()[:16]


def cost_key(target, drafter, context: int, repeats: int) -> str | None:
    """The key of `drafter`'s price against `target` (module doc); None where either model is not
    from an entry."""
    target_entry, draft_entry = entry_of(target), entry_of(drafter.model)
    if target_entry is None or draft_entry is None:
        return None
    head = type(drafter._sub_head).__name__ if drafter._sub_head is not None else "own"
    return "|".join([machine_signature(), target_entry, draft_entry, head, _ids_digest(drafter.vocab_ids),
                     str(drafter.kv_dtype), f"{context}x{repeats}"])


def _costs(folder: Path) -> dict:
    try:
        data = json.loads((folder / COSTS).read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def kept_cost(folder: Path | None, key: str | None) -> float | None:
    """The price kept under `key` in entry `folder`: the lowest of its first `SAMPLES` measurements
    once there are that many, else None. The lowest: other processes on the cores inflate a
    measurement (on a shared machine, several-fold), and a price kept from a busy moment would
    stay for every later load."""
    if folder is None or key is None:
        return None
    samples = _samples(_costs(folder).get(key))
    return min(samples) if len(samples) >= SAMPLES else None


def _samples(value) -> list[float]:
    if not isinstance(value, list):
        return []
    return [float(v) for v in value if isinstance(v, (int, float)) and v > 0]


def keep_cost(folder: Path | None, key: str | None, cost: float) -> float:
    """Add measurement `cost` under `key` (the file written whole and renamed into place: a reader
    never sees half); returns the price to use now: this measurement, or the kept price once there
    are `SAMPLES` measurements."""
    if folder is None or key is None:
        return cost
    data = _costs(folder)
    samples = (_samples(data.get(key)) + [cost])[:SAMPLES]
    data[key] = samples
    tmp = folder / f"{COSTS}.tmp-{os.getpid()}"
    with contextlib.suppress(OSError):  # a read-only cache: measured again next time
        tmp.write_text(json.dumps(data, indent=1))
        os.replace(tmp, folder / COSTS)
    return min(samples) if len(samples) >= SAMPLES else cost


def sub_head(folder: Path | None, ids, make):
    """The 4-bit drafting head of rows `ids` (None: all) of the head of entry `folder`'s model: as
    kept there, else `make()` (then kept, where there is a folder)."""
    if folder is None:
        return make()
    file = folder / f"sub_head-{_ids_digest(ids)}.pt"
    kernels = cpu_kernels.load()
    with contextlib.suppress(OSError, RuntimeError, KeyError, ValueError, EOFError):
        kept = torch.load(file, weights_only=True, mmap=True)
        packed = kept["packed"]  # into a table of its own, on huge pages where it is large enough
        table = kernels.table_empty(list(packed.shape), packed.dtype).copy_(packed)
        bias = None if kept["bias"] is None else kept["bias"].clone()
        return Int4Linear.from_packed(table, tuple(kept["shape"]), bias)
    layer = make()
    tmp = file.with_name(f"{file.name}.tmp-{os.getpid()}")
    with contextlib.suppress(OSError):
        torch.save({"packed": layer._q, "shape": [layer.out_features, layer.in_features],
                    "bias": None if layer.bias is None else layer.bias.data}, tmp)
        os.replace(tmp, file)
    return layer
