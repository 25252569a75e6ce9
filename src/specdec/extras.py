"""Optional parts of specdec and the pip extra that installs each.

`pip install specdec` is the library and `specdec generate`; the server, the benchmark's plots,
replicas under Ray and structured output need more (pyproject.toml's optional dependencies). A
feature checks for its modules where it starts, so that a missing extra is one line naming what to
install rather than an ImportError deep inside.
"""

from __future__ import annotations

import importlib.util

from .errors import SpecdecError


class MissingExtraError(SpecdecError):
    """A feature whose optional dependencies are not installed."""

    error_type = "missing_dependency"


def require(extra: str, feature: str, *modules: str) -> None:
    """Raise `MissingExtraError` unless every module in `modules` can be imported; looks them up
    without importing them."""
    missing = [m for m in modules if importlib.util.find_spec(m) is None]
    if missing:
        raise MissingExtraError(f"{feature} needs {', '.join(missing)}, which is not installed: "
                                f"pip install 'specdec[{extra}]'")


SERVER_MODULES = ("fastapi", "uvicorn", "pydantic", "httpx", "prometheus_client")
