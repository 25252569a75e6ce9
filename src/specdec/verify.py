"""Verification of drafted tokens: pure functions, no models or caches.

Notation (Leviathan, Kalman & Matias 2022; Chen et al. 2023), used across specdec:
  p_i  the target's processed distribution at draft position i (after context + draft[:i]);
  q_i  the drafter's processed distribution that draft[i] was sampled from.
One step emits the *accepted* draft tokens plus one more: the *recovered* token, drawn from
norm(max(0, p_i - q_i)) at the first rejection i, or the *bonus* token, drawn from p_k when all
k drafts were accepted.

Why it is exact: draft x ~ q is kept with probability min(1, p(x)/q(x)), so
P(emit x) = q(x) min(1, p/q) + P(reject) * residual(x) = min(p, q)(x) + (1 - sum min(p, q)) *
max(0, p - q)(x) / sum max(0, p - q) = p(x), since sum max(0, p - q) = 1 - sum min(p, q).
A drafter without probabilities has q one-hot at its token: it is kept with probability p(x) and
the residual is p with x removed.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor


@dataclass(frozen=True)
class Verdict:
    accepted: list[int]  # accepted draft tokens (a prefix of the draft)
    next_token: int  # recovered (first rejection) or bonus (all accepted)
    kind: str  # "recovered" | "bonus"

    @property
    def num_accepted(self) -> int:
        return len(self.accepted)

    @property
    def tokens(self) -> list[int]:
        return self.accepted + [self.next_token]


def verify_greedy(target_logits: Tensor, draft: list[int]) -> Verdict:
    """target_logits [k + 1, vocab]: accept while draft[i] is the target's argmax."""
    best = target_logits.argmax(-1).tolist()  # [k + 1]
    for i, token in enumerate(draft):
        if token != best[i]:
            return Verdict(list(draft[:i]), best[i], "recovered")
    return Verdict(list(draft), best[len(draft)], "bonus")


def verify_sampling(p: Tensor, q: Tensor | None, draft: list[int], generator: torch.Generator) -> Verdict:
    """Speculative sampling. p [k + 1, vocab] target probs; q [k, vocab] draft probs or None (one-hot)."""
    k = len(draft)
    if q is None:
        q = torch.zeros(k, p.shape[-1], dtype=p.dtype, device=p.device)
        if k:
            q[torch.arange(k), torch.tensor(draft, device=p.device)] = 1.0
    u = torch.rand(k, generator=generator, device=generator.device).to(p.device) if k else None
    for i, token in enumerate(draft):
        p_x, q_x = float(p[i, token]), float(q[i, token])
        if q_x > 0 and float(u[i]) * q_x < p_x:  # u < p/q, written without dividing
            continue
        residual = (p[i] - q[i]).clamp_min(0)
        if float(residual.sum()) <= 0:  # p == q up to rounding: the residual is empty, p is exact
            residual = p[i]
        token_out = int(torch.multinomial(residual / residual.sum(), 1, generator=generator))
        return Verdict(list(draft[:i]), token_out, "recovered")
    bonus = int(torch.multinomial(p[k], 1, generator=generator))
    return Verdict(list(draft), bonus, "bonus")
