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

Adjusted and masked targets. Penalties, logit bias and a grammar make the target's distribution at
a position depend on the tokens before it: p'_i is the target's logits after context + draft[:i],
adjusted as if draft[:i] had been emitted (`sampling.adjust_logits`) and masked to the tokens the
grammar allows after that prefix, then processed. The rules here only need each p'_i to be exactly
what plain decoding would sample from at that position once draft[:i] was accepted, which it is,
so the proof above holds with p' for p. A draft token the grammar forbids has p'_i(x) = 0: it is
always rejected there, and the recovered token comes from norm(max(0, p'_i - q_i)), never from p'_i
itself (cutting the draft at a forbidden token and sampling p'_i would over-weight the tokens
q_i also likes: the first branch of the sum above would be missing).

A drafter without probabilities (n-gram, suffix, ...) is a drafter whose q_i is one-hot at its
token x. The general rule then reads: accept with probability min(1, p(x)) = p(x); the residual
max(0, p - e_x) is p with entry x set to 0, renormalised. It runs through the same code path.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from .sampling import greedy_tokens


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
    best = greedy_tokens(target_logits)  # [k + 1], one device sync
    for i, token in enumerate(draft):
        if token != best[i]:
            return Verdict(list(draft[:i]), best[i], "recovered")
    return Verdict(list(draft), best[len(draft)], "bonus")


def first_proven_rejection(column_logits: Tensor, column_ids: Tensor, draft: list[int]) -> int:
    """The first draft position that the target is certain to reject, judged from a few columns
    of its logits; len(draft) when none is certain. Lets greedy verification pay for the full
    output head only on rows up to that position (`verify_greedy_rows`).

    column_logits: Tensor  # [>= k, m] the target's logits for the ids `column_ids`, row i after
                           # context + draft[:i], bit-identical to those columns of the full row
    column_ids: Tensor  # [m] int64, strictly increasing
    draft: k token ids

    Why a screened rejection is certain. Greedy verification accepts draft[i] iff it is the full
    row's argmax, ties going to the lowest id. Let a be the argmax over the screened columns (the
    lowest id among their maxima, since the ids increase) and suppose draft[i] is screened too. If
    a != draft[i], then either logit(a) > logit(draft[i]), so draft[i] is not a maximum of the full
    row, or the two are equal and a < draft[i], so a maximum with a lower id exists. Either way the
    full row's argmax is not draft[i]. (The converse does not hold: an unscreened id may beat a
    draft token that wins among the screened ones, so acceptance is never decided here.)
    """
    k = len(draft)
    if k == 0:
        return 0
    best = column_ids[column_logits[:k].argmax(-1)].tolist()  # [k]
    screened = torch.isin(torch.tensor(draft, device=column_ids.device), column_ids).tolist()
    for i, token in enumerate(draft):
        if screened[i] and best[i] != token:
            return i
    return k


def verify_greedy_rows(target_logits: Tensor, draft: list[int]) -> Verdict:
    """`verify_greedy` when only rows 0..j of the target's logits were computed, j being
    `first_proven_rejection` (j = len(draft): every row; j < len(draft): draft[j] is certainly
    rejected, so no row after it can matter). Gives the verdict `verify_greedy` gives on all rows.

    target_logits: Tensor  # [j + 1, vocab]
    """
    j = target_logits.shape[0] - 1
    if target_logits.dim() != 2 or not 0 <= j <= len(draft):
        raise ValueError(f"target_logits must be [j + 1, vocab] with j <= {len(draft)}, got {list(target_logits.shape)}")
    verdict = verify_greedy(target_logits, draft[:j])
    if verdict.kind == "bonus" and j < len(draft):
        if verdict.next_token == draft[j]:  # cannot happen when j came from a bit-identical screen
            raise RuntimeError(f"draft position {j} was screened as rejected, but the full row accepts it")
        return Verdict(verdict.accepted, verdict.next_token, "recovered")
    return verdict


def verify_greedy_best(best: list[int], draft: list[int]) -> Verdict:
    """`verify_greedy_rows` given the target's argmax of rows 0..j (`best`, j + 1 ids, ties to the
    lowest id) instead of their logits: all that greedy verification reads of them."""
    j = len(best) - 1
    if not 0 <= j <= len(draft):
        raise ValueError(f"best must hold 1 to {len(draft) + 1} ids, got {len(best)}")
    for i in range(j):
        if draft[i] != best[i]:
            return Verdict(list(draft[:i]), best[i], "recovered")
    if j < len(draft):
        if best[j] == draft[j]:  # cannot happen when j came from a bit-identical screen
            raise RuntimeError(f"draft position {j} was screened as rejected, but the full row accepts it")
        return Verdict(list(draft[:j]), best[j], "recovered")
    return Verdict(list(draft), best[j], "bonus")


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


# -- token trees ---------------------------------------------------------------------------------
#
# A tree draft offers several candidates per position. Node i holds token `tokens[i]` and hangs
# under `parents[i]` (-1 = the root, which is the lead token the engine feeds first; parents come
# before their children). The target scores root + all nodes in one pass with `TokenTree.mask()`
# as attention mask: row 0 of its output follows the root, row i + 1 follows node i.
#
# Greedy: walk from the root, moving to the child whose token is the target's argmax; the first
# node without such a child emits the argmax (recovered; bonus when the node has no children).
#
# Sampling: recursive rejection sampling over siblings (SpecInfer, Miao et al. 2024, "multi-step
# speculative sampling"; the same rule handles deterministic candidates as in Sequoia). At a node
# with target distribution p, let r = p and try its children x_1, x_2, ... in order, child j drawn
# from q_j (its row of `q`, or one-hot at x_j when q is None):
#
#     accept x_j with probability min(1, r(x_j) / q_j(x_j))  -> move to child j, r = its own p
#     else r <- norm(max(0, r - q_j))                         -> try the next sibling
#     no child left: emit a token drawn from r (recovered); a node without children: from p (bonus)
#
# Why it is exact. One sibling step is the single-draft rule of the module docstring with r in
# place of p: if x_j ~ q_j, then "accept x_j, or else draw from norm(max(0, r - q_j))" yields a
# token distributed as r. Chaining siblings: the token emitted at this node is distributed as
# r_1 = p as long as each later sibling's residual step emits ~ r_{j+1}, which holds by the same
# argument down to the last sibling, whose fallback is a direct draw from r_m+1. This needs x_j ~ q_j
# given everything the verifier has seen before it (its earlier siblings): true for i.i.d. draws
# from one q (SpecInfer), for deterministic candidates (q_j one-hot), and for draws without
# replacement when q_j is the drafter's distribution with the earlier siblings removed. Moving to
# an accepted child continues with that child's p, exactly as the chain rule does, so by induction
# over depth every emitted token follows the target.


@dataclass(frozen=True)
class TokenTree:
    tokens: list[int]  # node i's token
    parents: list[int]  # node i's parent node, -1 = the root (lead token); parents[i] < i

    def __post_init__(self) -> None:
        if len(self.tokens) != len(self.parents):
            raise ValueError("tokens and parents must have the same length")
        if any(not -1 <= p < i for i, p in enumerate(self.parents)):
            raise ValueError("every parent must be -1 or an earlier node")

    @classmethod
    def chain(cls, tokens: list[int]) -> "TokenTree":
        """A chain draft as a tree: node i hangs under node i - 1 (a path from the root)."""
        return cls(list(tokens), list(range(-1, len(tokens) - 1)))

    @property
    def is_chain(self) -> bool:
        """True when the tree is one path (empty included): the chain rules and a causal mask apply."""
        return all(p == i - 1 for i, p in enumerate(self.parents))

    def __len__(self) -> int:
        return len(self.tokens)

    def children(self, node: int) -> list[int]:
        """Children of `node` (-1 = root), in node order (the order siblings are tried)."""
        return [i for i, p in enumerate(self.parents) if p == node]

    def depths(self) -> list[int]:
        """Depth of each node (a root child is 1): its position offset from the root."""
        out: list[int] = []
        for p in self.parents:
            out.append(1 if p < 0 else out[p] + 1)
        return out

    def paths(self) -> list[list[int]]:
        """The draft tokens before each block position: [] for the root, then for node i the
        tokens on the path from the root to node i, itself included."""
        out: list[list[int]] = [[]]
        for token, p in zip(self.tokens, self.parents):
            out.append(out[p + 1] + [token])
        return out

    def mask(self) -> Tensor:
        """[n + 1, n + 1] bool: entry (i, j) = block position i may attend to block position j
        (position 0 = root, position i + 1 = node i): itself and its ancestors."""
        n = len(self.tokens)
        m = torch.zeros(n + 1, n + 1, dtype=torch.bool)
        m[:, 0] = True
        m[0, 0] = True
        for i, p in enumerate(self.parents):
            if p >= 0:
                m[i + 1] = m[p + 1]
            m[i + 1, i + 1] = True
        return m


@dataclass(frozen=True)
class TreeVerdict(Verdict):
    """A `Verdict` whose accepted tokens are a root-to-node path of a token tree."""

    path: list[int]  # accepted node indices, root side first (`accepted` holds their tokens)


def verify_tree_greedy(target_logits: Tensor, tree: TokenTree) -> TreeVerdict:
    """Follow the target's argmax through the tree.

    target_logits: Tensor  # [n + 1, vocab]; row 0 after the root, row i + 1 after node i
    """
    if target_logits.dim() != 2 or target_logits.shape[0] != len(tree) + 1:
        raise ValueError(f"target_logits must be [len(tree) + 1, vocab], got {list(target_logits.shape)}")
    best = greedy_tokens(target_logits)
    path: list[int] = []
    node = -1
    while True:
        want = best[node + 1]
        kids = tree.children(node)
        nxt = next((c for c in kids if tree.tokens[c] == want), None)
        if nxt is None:
            return TreeVerdict([tree.tokens[i] for i in path], want, "recovered" if kids else "bonus", path=path)
        path.append(nxt)
        node = nxt


def verify_tree_sampling(p: Tensor, q: Tensor | None, tree: TokenTree, generator: torch.Generator) -> TreeVerdict:
    """Recursive rejection sampling over siblings (see the block comment above).

    p: Tensor  # [n + 1, vocab] target's processed probabilities; row 0 after the root
    q: Tensor | None  # [n, vocab]: row i = the distribution node i's token was drawn from; None = one-hot
    """
    n, vocab = len(tree), p.shape[-1]
    if p.dim() != 2 or p.shape[0] != n + 1:
        raise ValueError(f"p must be [len(tree) + 1, vocab], got {list(p.shape)}")
    if q is not None and tuple(q.shape) != (n, vocab):
        raise ValueError(f"q must be [len(tree), vocab] = [{n}, {vocab}], got {list(q.shape)}")
    path: list[int] = []
    node = -1
    while True:
        kids = tree.children(node)
        r = p[node + 1]
        moved = False
        for c in kids:
            x = tree.tokens[c]
            q_c = torch.nn.functional.one_hot(torch.tensor(x, device=p.device), vocab).to(p.dtype) \
                if q is None else q[c].to(device=p.device, dtype=p.dtype)
            u = float(torch.rand(1, generator=generator, device=generator.device))
            if u * float(q_c[x]) < float(r[x]):
                path.append(c)
                node = c
                moved = True
                break
            residual = (r - q_c).clamp_min(0)
            # r == q_c numerically: the rejection had probability ~0 and r itself is exact.
            r = residual / residual.sum() if float(residual.sum()) > 0 else r
        if moved:
            continue
        token = int(torch.multinomial(r, 1, generator=generator))
        return TreeVerdict([tree.tokens[i] for i in path], token, "recovered" if kids else "bonus", path=path)
