"""specdec: lossless speculative decoding on a native PyTorch runtime."""

from .engine import Engine, Generation, Stats
from .errors import InvalidRequestError, ModelLoadError, SpecdecError
from .sampling import SamplingParams

__all__ = ["Engine", "Generation", "Stats", "SamplingParams", "SpecdecError", "InvalidRequestError", "ModelLoadError"]
