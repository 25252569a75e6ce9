"""Pure sampling functions: logits -> processed probabilities -> a token, with an explicit RNG.

`process_logits` is the one place where temperature, top-k, top-p and min-p are applied. The engine
runs the target's logits (p) and, for drafters with a distribution, the drafter's logits (q) through
it with the same `SamplingParams`; speculative sampling then reproduces exactly the processed target
distribution (see `verify.py`).

Randomness only ever comes from a `torch.Generator` passed in (one per request, from
`make_generator(params.seed, device)`); nothing here touches the global RNG.
"""

from __future__ import annotations

import math
import numbers
import os
from dataclasses import dataclass

import torch
from torch import Tensor

from .errors import InvalidRequestError

_FLOAT32_TINY = torch.finfo(torch.float32).tiny  # the smallest normal float32, ~1.18e-38


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0  # 0 = greedy
    top_k: int = 0  # keep the k most likely tokens; 0 = off
    top_p: float = 1.0  # nucleus mass, in (0, 1]; 1 = off
    min_p: float = 0.0  # drop tokens below min_p * max prob, in [0, 1); 0 = off
    seed: int | None = None  # None = fresh OS randomness per request

    def __post_init__(self):
        def finite_number(name: str, value) -> None:
            if isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(value):
                raise InvalidRequestError(f"{name} must be a finite number, got {value!r}", name)

        def integer(name: str, value) -> None:
            if isinstance(value, bool) or not isinstance(value, numbers.Integral):
                raise InvalidRequestError(f"{name} must be an integer, got {value!r}", name)

        finite_number("temperature", self.temperature)
        finite_number("top_p", self.top_p)
        finite_number("min_p", self.min_p)
        integer("top_k", self.top_k)
        if self.seed is not None:
            integer("seed", self.seed)
        if self.temperature < 0:
            raise InvalidRequestError(f"temperature must be >= 0, got {self.temperature}", "temperature")
        if self.top_k < 0:
            raise InvalidRequestError(f"top_k must be >= 0 (0 turns it off), got {self.top_k}", "top_k")
        if not 0 < self.top_p <= 1:
            raise InvalidRequestError(f"top_p must be in (0, 1], got {self.top_p}", "top_p")
        if not 0 <= self.min_p < 1:
            raise InvalidRequestError(f"min_p must be in [0, 1), got {self.min_p}", "min_p")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def make_generator(seed: int | None, device) -> torch.Generator:
    """A generator on `device`, seeded from `seed`, or from fresh OS randomness when `seed` is None.

    Any Python int is accepted; it is folded into [0, 2**63) (torch's seed range).
    """
    generator = torch.Generator(device=device)
    if seed is None:
        seed = int.from_bytes(os.urandom(8), "little")
    generator.manual_seed(int(seed) % (2**63))
    return generator


def process_logits(logits: Tensor, params: SamplingParams) -> Tensor:
    """Logits -> processed probabilities, applied per row over the last dimension.

    logits: Tensor  # [..., vocab], any float dtype
    returns: Tensor  # [..., vocab] float32, every row sums to 1

    Order as in HF transformers / vLLM: temperature, top-k, top-p, min-p, renormalise.
    Greedy (temperature 0) gives a one-hot at the argmax (ties -> lowest index, as `torch.argmax`).
    Ties at the top-k boundary are all kept (as HF does), so a row may keep more than k tokens.
    """
    logits = logits.float()
    vocab = logits.shape[-1]
    if params.greedy:
        return torch.nn.functional.one_hot(logits.argmax(-1), vocab).float()

    # Temperature: softmax(l / T) = softmax((l - max l) / T), in log space: every scaled logit is
    # <= 0, exactly 0 at the row's maximum, so nothing overflows to +inf and the softmax below
    # never sees inf - inf. A T below float32's smallest normal number (1e-100, 5e-324 are valid
    # input) would round to 0 or lose precision as a float32 divisor (0 / 0 = NaN at the
    # maximum), so such a T divides in float64, where it is exact; the quotients then round to
    # float32 as 0 at the maximum and -inf (probability 0) almost everywhere else. That is the
    # limit of softmax(l / T) as T -> 0: all the mass on the argmax (shared evenly by exact ties).
    shifted = logits - logits.amax(-1, keepdim=True)  # [..., vocab], <= 0
    if params.temperature >= _FLOAT32_TINY:
        logits = shifted / params.temperature
    else:
        logits = (shifted.double() / params.temperature).float()

    # Top-k: mask every logit strictly below the k-th largest.
    if 0 < params.top_k < vocab:
        kth = logits.topk(params.top_k, dim=-1).values[..., -1:]  # [..., 1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = logits.softmax(-1)  # [..., vocab]

    # Top-p (nucleus): in descending order, keep a token when the mass strictly before it is below
    # top_p. That is the smallest prefix whose mass reaches top_p, and always the top token
    # (its "mass before" is 0 < top_p). A stable sort makes tie-breaking deterministic.
    if params.top_p < 1.0:
        sorted_probs, order = probs.sort(dim=-1, descending=True, stable=True)  # [..., vocab] each
        mass_before = sorted_probs.cumsum(-1) - sorted_probs  # [..., vocab]
        keep_sorted = mass_before < params.top_p  # [..., vocab] bool, in sorted order
        # The top token stays explicitly: a top_p below float32's range (5e-324) compares as 0.
        keep_sorted[..., 0] = True
        keep = torch.zeros_like(keep_sorted).scatter(-1, order, keep_sorted)  # back to vocab order
        probs = probs * keep

    # Min-p: drop tokens with prob < min_p * max prob. The ratio test is invariant to the
    # renormalisation after top-p, so it can run on the unnormalised masses; the top token survives.
    if params.min_p > 0:
        probs = probs * (probs >= params.min_p * probs.amax(-1, keepdim=True))

    return probs / probs.sum(-1, keepdim=True)


def sample(probs: Tensor, generator: torch.Generator) -> Tensor:
    """Draw one token per row, with `generator` only (never the global RNG).

    probs: Tensor  # [..., vocab], non-negative, rows need not be normalised
    returns: Tensor  # [...] long token ids
    """
    flat = probs.reshape(-1, probs.shape[-1])  # [rows, vocab]
    ids = torch.multinomial(flat, 1, generator=generator).squeeze(-1)  # [rows]
    return ids.reshape(probs.shape[:-1])


def greedy_tokens(logits: Tensor) -> list[int]:
    """The argmax of each row as Python ints: ties go to the lowest id (and a NaN wins), exactly as
    `torch.argmax`. logits: Tensor  # [rows, vocab]

    On the CPU in float32 this is the compiled kernel's two vectorised passes (`argmax_rows` in
    models/cpu_kernels.cpp): 37 against 277 us a row over Gemma 3's 262k logits here, which every
    greedy step, plain or speculative, and a greedy model drafter's every draft token run.
    """
    if logits.dtype == torch.float32 and logits.device.type == "cpu" and logits.dim() == 2 and logits.shape[1] > 0:
        from .models import cpu_kernels

        kernels = cpu_kernels.load()
        if kernels is not None:
            return kernels.argmax_rows(logits).tolist()
    return logits.argmax(-1).tolist()
