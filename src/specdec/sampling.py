"""Pure sampling functions: logits -> processed probabilities -> a token, with an explicit RNG.

`adjust_logits` applies what depends on the tokens before a position (logit bias, min_tokens,
repetition / frequency / presence penalties) to the raw logits; `process_logits` is then the one
place where temperature, top-k, top-p and min-p are applied. The engine
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
_FLOAT32_MAX = torch.finfo(torch.float32).max  # ~3.4e38
# The repetition penalty divides (or multiplies) raw logits: beyond this range it says nothing more
# than "never" or "always" again, and near float32's limits a logit overflows to inf (then NaN).
REPETITION_PENALTY_RANGE = (0.01, 100.0)


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0  # 0 = greedy
    top_k: int = 0  # keep the k most likely tokens; 0 = off
    top_p: float = 1.0  # nucleus mass, in (0, 1]; 1 = off
    min_p: float = 0.0  # drop tokens below min_p * max prob, in [0, 1); 0 = off
    seed: int | None = None  # None = fresh OS randomness per request
    # What `adjust_logits` applies, as vLLM defines them: frequency and presence penalties count
    # the generated tokens, the repetition penalty (HF's, dividing positive logits and multiplying
    # negative ones) every token of prompt and output.
    frequency_penalty: float = 0.0  # in [-2, 2]; 0 = off
    presence_penalty: float = 0.0  # in [-2, 2]; 0 = off
    repetition_penalty: float = 1.0  # in REPETITION_PENALTY_RANGE; 1 = off
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, bias added to its logit); a dict is accepted
    min_tokens: int = 0  # EOS is masked until this many tokens were generated
    ignore_eos: bool = False  # EOS does not end the output (it is emitted like any token)

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
        for name in ("frequency_penalty", "presence_penalty"):
            finite_number(name, getattr(self, name))
            if not -2 <= getattr(self, name) <= 2:
                raise InvalidRequestError(f"{name} must be in [-2, 2], got {getattr(self, name)}", name)
        finite_number("repetition_penalty", self.repetition_penalty)
        low, high = REPETITION_PENALTY_RANGE
        if not low <= self.repetition_penalty <= high:
            raise InvalidRequestError(f"repetition_penalty must be in [{low:g}, {high:g}], got "
                                      f"{self.repetition_penalty}", "repetition_penalty")
        integer("min_tokens", self.min_tokens)
        if self.min_tokens < 0:
            raise InvalidRequestError(f"min_tokens must be >= 0, got {self.min_tokens}", "min_tokens")
        if not isinstance(self.ignore_eos, bool):
            raise InvalidRequestError(f"ignore_eos must be true or false, got {self.ignore_eos!r}", "ignore_eos")
        bias = self.logit_bias.items() if isinstance(self.logit_bias, dict) else self.logit_bias
        pairs = []
        for token, value in bias:
            integer("logit_bias", token)
            finite_number("logit_bias", value)
            if token < 0:
                raise InvalidRequestError(f"logit_bias: token id {token} is negative", "logit_bias")
            if not -100 <= value <= 100:
                raise InvalidRequestError(f"logit_bias values must be in [-100, 100], got {value}", "logit_bias")
            pairs.append((int(token), float(value)))
        object.__setattr__(self, "logit_bias", tuple(sorted(pairs)))

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def adjusts_logits(self) -> bool:
        """Whether `adjust_logits` changes anything (the engine skips it, and keeps its screened
        greedy verification, when it does not)."""
        return bool(self.frequency_penalty or self.presence_penalty or self.repetition_penalty != 1
                    or self.logit_bias or self.min_tokens)


def adjust_logits(logits: Tensor, params: SamplingParams, prompt: list[int], output: list[int],
                  paths: list[list[int]], eos_ids) -> Tensor:
    """The raw logits of several positions, each adjusted for the tokens before it: logit bias,
    min_tokens (EOS masked), repetition penalty, then frequency and presence penalties (vLLM's
    order). Row j follows prompt + output + paths[j], and paths[j] counts as generated output, so
    a verify block's row i sees the draft tokens before it as if they had been emitted: exactly
    the logits plain decoding would adjust at that position, had the draft been accepted so far.

    logits: Tensor  # [n, vocab] raw, any float dtype
    paths: n token lists (a chain's row i: draft[:i]; a tree's row: the tokens on its node's path)
    returns: Tensor  # [n, vocab] float32
    """
    logits = logits.float().clone()
    n, vocab = logits.shape
    device = logits.device
    if params.logit_bias:
        ids = torch.tensor([t for t, _ in params.logit_bias], device=device)
        logits[:, ids] += torch.tensor([b for _, b in params.logit_bias], device=device)
    if params.min_tokens:
        early = [j for j, path in enumerate(paths) if len(output) + len(path) < params.min_tokens]
        eos = [e for e in eos_ids if e < vocab]
        if early and eos:
            logits[torch.tensor(early, device=device)[:, None], torch.tensor(eos, device=device)] = float("-inf")
    if params.repetition_penalty == 1 and not params.frequency_penalty and not params.presence_penalty:
        return logits
    # counts[j, t]: how often t was generated before row j; seen[j, t]: t is anywhere before it.
    row_of = [j for j, path in enumerate(paths) for _ in path]
    path_ids = [t for path in paths for t in path]
    counts = torch.bincount(torch.tensor(output, dtype=torch.long, device=device), minlength=vocab)[:vocab]
    counts = counts.to(torch.float32).repeat(n, 1)  # [n, vocab]
    if path_ids:
        counts.index_put_((torch.tensor(row_of, device=device), torch.tensor(path_ids, device=device)),
                          torch.ones(len(path_ids), device=device), accumulate=True)
    if params.repetition_penalty != 1:
        seen = counts > 0  # [n, vocab]
        seen[:, torch.tensor(prompt, dtype=torch.long, device=device)] = True
        penalised = torch.where(logits > 0, logits / params.repetition_penalty, logits * params.repetition_penalty)
        logits = torch.where(seen, penalised, logits)
    if params.frequency_penalty:
        logits -= params.frequency_penalty * counts
    if params.presence_penalty:
        logits -= params.presence_penalty * (counts > 0).float()
    return logits


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
    # A T above float32's range (1e39 is valid input) would round to inf as a float32 divisor
    # (-inf / inf = NaN at a masked token): it too divides in float64, toward the limit as
    # T -> inf, every allowed token alike.
    shifted = logits - logits.amax(-1, keepdim=True)  # [..., vocab], <= 0
    if _FLOAT32_TINY <= params.temperature <= _FLOAT32_MAX:
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
    models/cpu_kernels.cpp), several times faster than torch.argmax over a large vocabulary; every
    greedy step, plain or speculative, and a greedy model drafter's every draft token run it.
    """
    if logits.dtype == torch.float32 and logits.device.type == "cpu" and logits.dim() == 2 and logits.shape[1] > 0:
        from .models import cpu_kernels

        kernels = cpu_kernels.load()
        if kernels is not None:
            return kernels.argmax_rows(logits).tolist()
    return logits.argmax(-1).tolist()
