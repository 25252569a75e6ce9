"""Pure sampling functions: logits -> processed probabilities -> a token, with an explicit RNG."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

from .errors import InvalidRequestError


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0  # 0 = greedy
    top_k: int = 0  # 0 = off
    top_p: float = 1.0  # nucleus mass, in (0, 1]
    min_p: float = 0.0  # drop tokens below min_p * max prob, in [0, 1)
    seed: int | None = None

    def __post_init__(self):
        def number(name, value):
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
                raise InvalidRequestError(f"{name} must be a finite number, got {value!r}", name)

        number("temperature", self.temperature)
        number("top_p", self.top_p)
        number("min_p", self.min_p)
        if self.temperature < 0:
            raise InvalidRequestError(f"temperature must be >= 0, got {self.temperature}", "temperature")
        if not 0 < self.top_p <= 1:
            raise InvalidRequestError(f"top_p must be in (0, 1], got {self.top_p}", "top_p")
        if not 0 <= self.min_p < 1:
            raise InvalidRequestError(f"min_p must be in [0, 1), got {self.min_p}", "min_p")
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, int) or self.top_k < 0:
            raise InvalidRequestError(f"top_k must be an integer >= 0, got {self.top_k!r}", "top_k")
        if self.seed is not None and (isinstance(self.seed, bool) or not isinstance(self.seed, int)):
            raise InvalidRequestError(f"seed must be an integer, got {self.seed!r}", "seed")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def make_generator(seed: int | None, device) -> torch.Generator:
    gen = torch.Generator(device=device)
    if seed is None:
        gen.seed()
    else:
        gen.manual_seed(seed % (2**63))
    return gen


def process_logits(logits: Tensor, params: SamplingParams) -> Tensor:
    """logits [..., vocab] -> probs [..., vocab] float32 after temperature, top-k, top-p, min-p.

    Greedy (temperature 0) gives a one-hot at the argmax. The same function processes the target's
    p and the drafter's q, which is what keeps speculative sampling exact for every setting.
    """
    logits = logits.float()
    if params.greedy:
        return torch.nn.functional.one_hot(logits.argmax(-1), logits.shape[-1]).float()
    logits = logits / params.temperature
    vocab = logits.shape[-1]
    if 0 < params.top_k < vocab:
        kth = logits.topk(params.top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = logits.softmax(-1)
    if params.top_p < 1.0:
        sorted_p, order = probs.sort(-1, descending=True)
        # Keep a token when the mass strictly before it is below top_p: the smallest set whose
        # mass reaches top_p, and always the top token.
        before = sorted_p.cumsum(-1) - sorted_p
        keep_sorted = before < params.top_p
        keep = torch.zeros_like(keep_sorted).scatter(-1, order, keep_sorted)
        probs = probs * keep
    if params.min_p > 0:
        probs = probs * (probs >= params.min_p * probs.amax(-1, keepdim=True))
    return probs / probs.sum(-1, keepdim=True)


def sample(probs: Tensor, generator: torch.Generator) -> Tensor:
    """probs [..., vocab] -> ids [...] (long), drawn with `generator` only."""
    flat = probs.reshape(-1, probs.shape[-1])
    ids = torch.multinomial(flat, 1, generator=generator).squeeze(-1)
    return ids.reshape(probs.shape[:-1])
