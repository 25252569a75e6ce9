"""Where specdec keeps what it builds once per machine: converted models, compiled kernels.

A module of its own so that both the loader and the kernel build read it without importing each
other (the loader imports the Transformer, which imports the kernels).
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path


def cache_root() -> Path:
    """$SPECDEC_CACHE, else ~/.cache/specdec (read at each call: nothing is fixed at import)."""
    return Path(os.environ.get("SPECDEC_CACHE", Path.home() / ".cache" / "specdec"))


@contextlib.contextmanager
def build_lock(folder: Path):
    """Hold `folder`'s build for one process at a time (a lock file beside it, released by the
    system if its holder dies): a second builder waits, then finds the folder built."""
    folder.parent.mkdir(parents=True, exist_ok=True)
    try:
        import fcntl
    except ImportError:  # not POSIX: no lock
        yield
        return
    with open(folder.with_name(folder.name + ".lock"), "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)
