"""specdec's compiled CPU kernels (`cpu_kernels.cpp`), built once per machine (and checkout) at first use.

A decoding step on a small model is mostly dispatch: Gemma 3 270M's int8 step ran ~900 PyTorch ops,
and the int8 input preparation and the RMSNorms alone took a large share of the step. The C++ file does the same row-by-row math in one call per op: Int8Linear's input
planes and rescaling (and chosen output columns alone), RMSNorm, a block's residual step with its norms, the rotary embedding with
the cache write, and the gated MLP activation, and
a decode or verify block's whole decoder layer in one call of those (`decoder_layer`). It
is compiled with PyTorch's own extension builder into the specdec cache (`SPECDEC_CACHE`, default
~/.cache/specdec/kernels; a compile the first time, then a quick load).

Where it cannot be built (no C++ compiler, or `SPECDEC_CPU_KERNELS=0`), `load()` returns None and
callers keep their pure-PyTorch paths, which compute the same thing.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import os
import platform
import sys
import warnings
from pathlib import Path

import torch

from .cache_dir import cache_root

SOURCE = Path(__file__).with_name("cpu_kernels.cpp")
# -ffp-contract=off: no multiply-add fused unless the source asks for it (std::fma), so results do
# not depend on what the compiler chose to contract. -fopenmp: at::parallel_for is OpenMP in
# PyTorch's CPU builds and runs on one thread without it (the soname resolves to the libgomp that
# torch has already loaded, so there is one thread pool).
CFLAGS = ["-O3", "-march=native", "-ffp-contract=off", "-fopenmp"]
LDFLAGS = ["-fopenmp"]


def enabled() -> bool:
    return os.environ.get("SPECDEC_CPU_KERNELS", "1") != "0"


@functools.lru_cache(maxsize=None)
def cpu_fields() -> dict[str, str]:
    """The first processor's block of /proc/cpuinfo as {field: value} ("model name", "cpu family",
    "flags", ...; empty where there is no such file). All cores of a machine match."""
    fields: dict[str, str] = {}
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as info:
            for line in info:
                key, _, value = line.partition(":")
                if not line.strip():
                    if fields:
                        break
                    continue
                fields.setdefault(key.strip(), value.strip())
    except OSError:
        pass
    return fields


def cpu_signature() -> str:
    """What -march=native compiles for: the processor's model and instruction-set flags.

    A build for one CPU can hold instructions another lacks (AVX-512 on a Zen 4 build, run on a Zen
    3 or an older Intel): loading it there dies with SIGILL at the first such instruction, with no
    message. So a cache folder shared between machines (a home directory on a network disk, an
    image built on one host and run on another) keeps one build per CPU.
    """
    keys = ("vendor_id", "cpu family", "model", "model name", "flags", "Features", "CPU part")
    fields = {key: value for key, value in cpu_fields().items() if key in keys}
    if fields:
        return " | ".join(f"{key}={value}" for key, value in sorted(fields.items()))
    return f"{platform.machine()} {platform.processor()}"


def build_dir() -> Path:
    # The source's path too: the build files name it, so two checkouts sharing one folder would
    # each see the other's build as stale and recompile at every switch between them.
    text = (SOURCE.read_bytes() + " ".join(CFLAGS).encode() + torch.__version__.encode()
            + str(SOURCE.resolve()).encode() + cpu_signature().encode())
    return cache_root() / "kernels" / hashlib.sha256(text).hexdigest()[:16]


@contextlib.contextmanager
def _build_guard(folder: Path):
    """Hold this build folder for one process at a time, with a lock the system releases when its
    holder dies. PyTorch's builder marks a build in progress with a plain file (`lock`) and makes
    every other builder wait until it is gone, with no time limit: a process killed while compiling
    (Ctrl-C during a first run) left it behind, and every later run waited on it forever. Under this
    lock no other specdec process can be building here, so such a file is a leftover and goes."""
    try:
        import fcntl
    except ImportError:  # not POSIX: PyTorch's own file lock only
        yield
        return
    with open(folder / "specdec-build.lock", "a") as guard:
        fcntl.flock(guard, fcntl.LOCK_EX)
        (folder / "lock").unlink(missing_ok=True)
        try:
            yield
        finally:
            fcntl.flock(guard, fcntl.LOCK_UN)


@functools.lru_cache(maxsize=None)  # one compiled library per process, like any extension module
def load():
    """The compiled module (int8_linear, int8_columns, int4_linear, rms_norm, residual_norm,
    rope_write, gated_activation, ...), or None where unavailable."""
    if not enabled():
        return None
    from torch.utils import cpp_extension

    folder = build_dir()
    folder.mkdir(parents=True, exist_ok=True)
    # The builder runs `ninja`; a virtual environment's own copy (pip's ninja) may not be on PATH
    # when its interpreter is run by full path.
    bin_dir = str(Path(sys.executable).parent)
    if bin_dir not in os.environ.get("PATH", "").split(os.pathsep):
        os.environ["PATH"] = bin_dir + os.pathsep + os.environ.get("PATH", "")
    fresh = not any(folder.glob("*.so"))
    if fresh:
        print("specdec: compiling the CPU kernels (once per machine and checkout, ~20 s)", file=sys.stderr, flush=True)
    try:
        with _build_guard(folder):
            return cpp_extension.load(
                name="specdec_cpu_kernels",
                sources=[str(SOURCE)],
                extra_cflags=CFLAGS,
                extra_ldflags=LDFLAGS,
                build_directory=str(folder),
                verbose=False,
            )
    except Exception as exc:  # no compiler, no ninja, a read-only cache: fall back, say why once
        warnings.warn(f"specdec CPU kernels unavailable, using the PyTorch path: {str(exc).splitlines()[0]}",
                      RuntimeWarning, stacklevel=2)
        return None
