"""Where specdec keeps what it builds once per machine: converted models, compiled kernels.

A module of its own so that both the loader and the kernel build read it without importing each
other (the loader imports the Transformer, which imports the kernels).
"""

from __future__ import annotations

import os
from pathlib import Path


def cache_root() -> Path:
    """$SPECDEC_CACHE, else ~/.cache/specdec (read at each call: nothing is fixed at import)."""
    return Path(os.environ.get("SPECDEC_CACHE", Path.home() / ".cache" / "specdec"))
