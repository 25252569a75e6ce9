"""The decoding settings that `generate`, `serve`, `bench` and `Engine` share: one frozen object
that says everything needed to build an engine (target, drafter, quantisation, device, dtype,
cache, draft length rule, k, tree shape, draft model options), each default and its reason written
once, below; validated once, when it is made.

`builder.resolve` turns what was asked ("auto" drafter, quantisation) into what will load and
`builder.build` loads it; `Engine.load(**keywords)` is this object made from its keywords and
built. The CLIs make it from their arguments before anything slow happens (a bad value is one
error line and a nonzero exit; in the server, the process does not start). Every check lives in
`__post_init__`, with the messages and the `param` names the CLI and the server report.
Per-request values (prompt ids, sampling parameters, token limits) are checked per request, where
they arrive, not here.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .drafters.base import TreeShape
from .errors import InvalidRequestError

from .models.kv_cache import KV_DTYPES
from .models.quant import QUANT_MODES
from .policy import DRAFT_LENGTHS, default_draft_length


# The most draft tokens a chain step asks for (k), the one default every entry point refers to: 5
# measured best for prompt lookup on the Spec-Bench mix (BENCHMARKS.md); the cost-aware rule drafts
# fewer where that pays more.
DEFAULT_NUM_SPECULATIVE_TOKENS = 5

# The dtype names the settings take ("auto" is resolved per device by `builder.resolve_dtype`).
DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
          "float16": torch.float16, "fp16": torch.float16}


@dataclass(frozen=True)
class DecodingSettings:
    # The target: "default" (the Gemma 3 270M GGUF from its PyPI package), a preset name
    # (`specdec models`), or a model folder / file.
    target: str = "default"
    # The drafter by its registry name (`builder.REGISTRY`: none, ngram, suffix, eagle[:DIR], a
    # draft model's preset or path, LOOKUP+LEARNED). "auto": prompt lookup, or for a preset target
    # with a paired draft model lookup first and that model where lookup finds nothing
    # (`builder.resolve_drafter`): the combination the pair's tuning measured best.
    drafter: str = "auto"
    # The target's weights: int8 / int4 weight-only products on the CPU, or as loaded ("none").
    # "auto": int4 / int8 for a source that comes quantised (a GGUF), kept as loaded for float
    # weights (`builder.resolve_quantize`, which knows the source).
    quantize: str = "auto"
    # Where the target runs: the CPU unless asked; "cuda" is checked available by `builder.resolve`.
    device: str = "cpu"
    # The target's compute dtype: "auto" = bfloat16 on a GPU or a CPU with native bf16, float32
    # otherwise and under int8 / int4 (`builder.resolve_dtype`); or a name of `DTYPES`.
    dtype: str = "auto"
    # Ranks the target is split over (`models/tensor_parallel.py`); 1: one process, no split.
    tensor_parallel: int = 1
    num_speculative_tokens: int = DEFAULT_NUM_SPECULATIVE_TOKENS
    # The chain rule: "cost" (priced per kind of proposal), "fixed", "adaptive" (+2/-1). None:
    # "cost" for chains, "fixed" for a tree, whose shape is fixed (`policy.default_draft_length`).
    # Under "cost" a draft model sizes each chain from its own confidences (`policy.ChainStop`),
    # since they track the target's acceptance token by token, which one acceptance rate does not.
    draft_length: str | None = None
    # Token trees instead of chains (DEPTHxTOPKxBUDGET or a TreeShape); None: chains.
    draft_tree: TreeShape | str | None = None
    # The cost-aware rule's price of a verify pass: None = the measured defaults per hardware
    # (policy.DEFAULT_VERIFY_COSTS); a number overrides them for every target.
    verify_cost: float | None = None
    verify_overhead: float | None = None
    # A draft model's confidence cut-off: it stops drafting below this probability (a floor under
    # the cost rule's chain stop, the only stop under a fixed or adaptive length). None: the
    # drafter's own default; 0 = off.
    draft_p_min: float | None = None
    # The draft model's quantisation: None / "auto" = the target's (an int8 target drafts with
    # int8 products too).
    draft_quantize: str | None = None
    # FR-Spec: the draft model scores only its N most frequent ids; None / 0 = its whole vocabulary.
    draft_vocab: int | None = None
    # The target's KV cache elements (`kv_cache.resolve_kv_dtype`): "auto" = float16 under a float32
    # model on the CPU, else the model's dtype; "float32" or "float16" as named.
    kv_dtype: str = "auto"
    # Greedy chains on a target whose head scores chosen columns exactly (int8 on the CPU) verify
    # with the full head only up to the first certain rejection: same verdict, fewer columns.
    screen_verify: bool = True

    def __post_init__(self) -> None:
        if self.quantize != "auto":
            check_quantize(self.quantize, self.device)
        if self.dtype != "auto" and self.dtype not in DTYPES:
            raise InvalidRequestError(f"unknown dtype {self.dtype!r}; choose auto, float32, bfloat16 or float16",
                                      "dtype")
        if self.kv_dtype not in KV_DTYPES:
            raise InvalidRequestError(f"kv_dtype must be one of {', '.join(KV_DTYPES)}; got {self.kv_dtype!r}",
                                      "kv_dtype")
        if self.draft_quantize not in (None, "auto"):
            check_quantize(self.draft_quantize, self.device, "draft_quantize")
        k = self.num_speculative_tokens
        if not _is_int(k) or k < 1:
            raise InvalidRequestError("num_speculative_tokens must be >= 1", "num_speculative_tokens")
        tree = self.draft_tree
        if isinstance(tree, str):
            tree = TreeShape.parse(tree)  # its own messages: DEPTHxTOPKxBUDGET
            object.__setattr__(self, "draft_tree", tree)
        if self.draft_length is None:
            object.__setattr__(self, "draft_length", default_draft_length(None, tree))
        if self.draft_length not in DRAFT_LENGTHS:
            raise InvalidRequestError(f"draft_length must be one of {', '.join(DRAFT_LENGTHS)}; "
                                      f"got {self.draft_length!r}", "draft_length")
        if tree is not None and self.draft_length != "fixed":
            raise InvalidRequestError(f"draft_length {self.draft_length!r} moves a chain's length; a draft tree "
                                      "has a fixed shape", "draft_length")
        cost, overhead = self.verify_cost, self.verify_overhead
        if cost is not None and not (_is_number(cost) and 0 < cost <= 10):
            raise InvalidRequestError(f"verify_cost must be a number in (0, 10], got {cost!r}", "verify_cost")
        if overhead is not None and not (_is_number(overhead) and 0 <= overhead <= 10):
            raise InvalidRequestError(f"verify_overhead must be a number in [0, 10], got {overhead!r}",
                                      "verify_overhead")
        p_min = self.draft_p_min
        if p_min is not None and not (_is_number(p_min) and 0 <= p_min <= 1):
            raise InvalidRequestError(f"draft_p_min must be a number in [0, 1] (0 = off), got {p_min!r}",
                                      "draft_p_min")
        vocab = self.draft_vocab
        if vocab is not None and (not _is_int(vocab) or vocab < 0):
            raise InvalidRequestError(f"the draft vocabulary must be a number of ids >= 0 (0 = all), got {vocab!r}",
                                      "draft_vocab")


def check_quantize(quantize: str, device: str, param: str = "quantize") -> None:
    """`quantize` on a resolved device: int8 and int4 run on the CPU (int4 with the compiled kernels)."""
    from .models.quant import cpu_int8_available

    if quantize not in QUANT_MODES:
        raise InvalidRequestError(f"unknown {param} {quantize!r}; choose {' or '.join(QUANT_MODES)}", param)
    if quantize != "none" and (device != "cpu" or not cpu_int8_available()):
        raise InvalidRequestError(f"{param}={quantize} needs the CPU with PyTorch's fbgemm backend", param)
    if quantize == "int4":
        from .models import cpu_kernels

        if cpu_kernels.load() is None:  # int4 has no PyTorch fallback
            raise InvalidRequestError(f"{param}=int4 needs specdec's compiled CPU kernels, which did not build "
                                      "here (a C++ compiler and ninja are needed)", param)


def _is_int(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _is_number(x: object) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)
