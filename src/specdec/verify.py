"""Verification of drafted tokens: pure functions, no models or caches.

Notation (Leviathan, Kalman & Matias 2022, "Fast Inference from Transformers via Speculative
Decoding"; Chen et al. 2023, "Accelerating Large Language Model Decoding with Speculative
Sampling"), used across specdec:

  p_i  the target's processed distribution at draft position i, i.e. after context + draft[:i]
       (`sampling.process_logits` of the target's logits); p has k + 1 rows, p_k follows the
       last draft token;
  q_i  the drafter's processed distribution that draft[i] was sampled from (k rows).

One step emits the *accepted* draft tokens (a prefix of the draft) plus exactly one more token:
the *recovered* token, drawn from norm(max(0, p_i - q_i)) at the first rejected position i, or
the *bonus* token, drawn from p_k when all k drafts were accepted.

Why this is exact. Draft x ~ q_i is kept with probability min(1, p_i(x) / q_i(x)), so

    P(emit x) = q(x) min(1, p(x)/q(x)) + P(reject) * r(x)
              = min(p, q)(x) + (1 - sum_y min(p, q)(y)) * max(0, p - q)(x) / sum_y max(0, p - q)(y)
              = min(p, q)(x) + max(0, p - q)(x) = p(x),

because sum_y max(0, p - q)(y) = 1 - sum_y min(p, q)(y) (both p and q sum to 1). Position i + 1
is only reached after x was accepted, and then p_{i+1} is exactly the target's distribution given
that prefix, so by induction every emitted token follows the target.

A drafter without probabilities (n-gram, suffix, ...) is a drafter whose q_i is one-hot at its
token x. The general rule then reads: accept with probability min(1, p(x)) = p(x); the residual
max(0, p - e_x) is p with entry x set to 0, renormalised. It runs through the same code path.
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
        """Everything this step emits: accepted drafts + the one next token."""
        return self.accepted + [self.next_token]


def _check_shapes(rows: Tensor, draft: list[int], name: str) -> None:
    # Programming errors inside the engine, not user input: plain ValueError.
    if rows.dim() != 2 or rows.shape[0] != len(draft) + 1:
        raise ValueError(f"{name} must be [len(draft) + 1, vocab] = [{len(draft) + 1}, vocab], got {list(rows.shape)}")


def verify_greedy(target_logits: Tensor, draft: list[int]) -> Verdict:
    """Accept while each draft token is the target's argmax (ties -> lowest index).

    target_logits: Tensor  # [k + 1, vocab]; row i = target's logits after context + draft[:i]
    """
    _check_shapes(target_logits, draft, "target_logits")
    best = target_logits.argmax(-1).tolist()  # [k + 1], one device sync
    for i, token in enumerate(draft):
        if token != best[i]:
            return Verdict(list(draft[:i]), best[i], "recovered")
    return Verdict(list(draft), best[len(draft)], "bonus")


def verify_sampling(p: Tensor, q: Tensor | None, draft: list[int], generator: torch.Generator) -> Verdict:
    """Speculative (rejection) sampling of a chain draft; see the module docstring for the math.

    p: Tensor  # [k + 1, vocab] target's processed probabilities
    q: Tensor | None  # [k, vocab] drafter's processed probabilities; None = one-hot at the draft
    draft: k token ids, draft[i] sampled from q[i]
    generator: the request's RNG; all randomness comes from it.

    With greedy params (one-hot p) this agrees with `verify_greedy` on the same logits.
    """
    _check_shapes(p, draft, "p")
    k, vocab = len(draft), p.shape[-1]
    idx = torch.tensor(draft, dtype=torch.long, device=p.device)  # [k]
    rows = torch.arange(k, device=p.device)  # [k]
    if q is None:
        # No distribution from the drafter: it put all its mass on its token.
        q = torch.nn.functional.one_hot(idx, vocab).to(p.dtype)  # [k, vocab]
    else:
        if q.shape != (k, vocab):
            raise ValueError(f"q must be [len(draft), vocab] = [{k}, {vocab}], got {list(q.shape)}")
        q = q.to(device=p.device, dtype=p.dtype)

    if k:
        # Accept draft[i] iff u_i < p_i(x) / q_i(x), written as u * q < p to avoid dividing
        # (q(x) = 0 cannot be drawn from q; if it happens anyway it is rejected). p(x) >= q(x)
        # always accepts since u < 1. One uniform per position, all drawn up front.
        u = torch.rand(k, generator=generator, device=generator.device).to(p.device)  # [k]
        p_x, q_x = p[rows, idx], q[rows, idx]  # [k] each
        accept = u * q_x < p_x  # [k] bool
        # Length of the accepted prefix: count of leading Trues.
        n = int(accept.to(torch.int64).cumprod(0).sum())  # one device sync
    else:
        n = 0

    if n < k:
        # First rejection at position n: draw the recovered token from norm(max(0, p_n - q_n)).
        residual = (p[n] - q[n]).clamp_min(0)  # [vocab]
        if float(residual.sum()) <= 0:
            # p_n == q_n numerically: the residual has no mass (and a rejection had probability
            # ~0); p_n itself is then the exact distribution to draw from.
            residual = p[n]
        token = int(torch.multinomial(residual, 1, generator=generator))  # multinomial normalises
        return Verdict(list(draft[:n]), token, "recovered")

    # All k accepted: the bonus token comes from the target's distribution after the last draft.
    bonus = int(torch.multinomial(p[k], 1, generator=generator))
    return Verdict(list(draft), bonus, "bonus")
