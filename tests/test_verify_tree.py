"""Tree verification: greedy walk, and recursive rejection sampling over siblings that follows the
target's exact distribution (enumeration + chi-square, with a power check on a broken rule).

Toy target and drafter as in test_verify_distribution: first-order Markov chains over 5 tokens, so
the exact joint distribution of the first three emitted tokens can be enumerated.
"""

import itertools
import random

import pytest
import torch
from helpers import pooled_chisquare_p

from specdec.sampling import SamplingParams, make_generator, process_logits
from specdec.verify import TokenTree, TreeVerdict, verify_greedy, verify_tree_greedy, verify_tree_sampling

V, N, SAMPLES = 5, 3, 4000
g = torch.Generator().manual_seed(4321)
TARGET = torch.randn(V, V, generator=g) * 1.5  # [last token, vocab]
DRAFT = TARGET + torch.randn(V, V, generator=g) * 1.2


def draft_tree(last: int, q_table, mode: str, rng, branch=2, depth=2):
    """A full tree, `branch` children per node, `depth` levels, in breadth-first order.

    iid: children drawn independently from q (SpecInfer); top: the q's most likely tokens,
    deterministic (q = None, one-hot); without: drawn one after another without replacement,
    each with q renormalised over the tokens not drawn yet (its true conditional distribution).
    """
    tokens, parents, qs = [], [], []
    frontier = [(-1, last)]
    for _ in range(depth):
        nxt = []
        for parent, tok in frontier:
            q = q_table[tok]  # [V] processed draft distribution after `tok`
            weights = q.tolist()
            if mode == "top":
                kids = q.topk(branch).indices.tolist()
                rows = [None] * branch
            elif mode == "iid":
                kids = rng.choices(range(V), weights, k=branch)
                rows = [q] * branch
            else:
                kids, rows, left = [], [], q.clone()
                for _ in range(branch):
                    if float(left.sum()) <= 0:
                        break
                    row = left / left.sum()
                    kids.append(rng.choices(range(V), row.tolist())[0])
                    rows.append(row)
                    left[kids[-1]] = 0
            for kid, row in zip(kids, rows):
                tokens.append(kid)
                parents.append(parent)
                qs.append(row)
                nxt.append((len(tokens) - 1, kid))
        frontier = nxt
    tree = TokenTree(tokens, parents)
    q = None if mode == "top" else torch.stack(qs)
    return tree, q


def target_rows(last: int, tree: TokenTree, p_table):
    """p after the root and after every node: the Markov target only reads the last token."""
    return p_table[[last] + tree.tokens]  # [n + 1, V]


def no_residual_rule(p, q, tree, generator):
    """Broken on purpose: a rejected sibling does not reduce r, so later siblings are accepted
    too often (the power check)."""
    node, path = -1, []
    while True:
        kids = tree.children(node)
        r = p[node + 1]
        for c in kids:
            x = tree.tokens[c]
            qx = 1.0 if q is None else float(q[c, x])
            if float(torch.rand(1, generator=generator)) * qx < float(r[x]):
                path.append(c)
                node = c
                break
        else:
            token = int(torch.multinomial(r, 1, generator=generator))
            return TreeVerdict([tree.tokens[i] for i in path], token, "recovered", path=path)


def tree_sample(p_table, q_table, mode, rule, generator, rng):
    ctx, out = [0], []
    while len(out) < N:
        tree, q = draft_tree(ctx[-1], q_table, mode, rng)
        verdict = rule(target_rows(ctx[-1], tree, p_table), q, tree, generator)
        out += verdict.tokens
        ctx += verdict.tokens
    return tuple(out[:N])


def p_value(params, mode, rule, seed):
    generator = make_generator(seed, "cpu")
    rng = random.Random(seed)  # the drafter's own randomness (it is not the verifier's)
    p_table, q_table = process_logits(TARGET, params), process_logits(DRAFT, params)  # [V, V] each
    counts = {}
    for _ in range(SAMPLES):
        key = tree_sample(p_table, q_table, mode, rule, generator, rng)
        counts[key] = counts.get(key, 0) + 1
    p = process_logits(TARGET, params)
    cells, probs = list(itertools.product(range(V), repeat=N)), []
    for cell in cells:
        prob, last = 1.0, 0
        for t in cell:
            prob *= float(p[last, t])
            last = t
        if prob == 0:
            assert counts.get(cell, 0) == 0 or rule is no_residual_rule
        probs.append(prob)
    return pooled_chisquare_p(counts, cells, probs, SAMPLES)


@pytest.mark.parametrize("mode,params", [
    ("iid", SamplingParams(temperature=1.0)),
    ("top", SamplingParams(temperature=1.0)),
    ("without", SamplingParams(temperature=0.7, top_k=3)),
])
def test_tree_sampling_is_exact(mode, params):
    assert p_value(params, mode, verify_tree_sampling, seed=21) > 1e-3


def test_broken_sibling_rule_is_caught():
    assert p_value(SamplingParams(temperature=1.0), "iid", no_residual_rule, seed=22) < 1e-6


# -- greedy and structure -----------------------------------------------------------------------------


def test_greedy_walk_takes_the_argmax_branch():
    #        root
    #      /      \
    #   n0:3      n1:1
    #   |         /   \
    #  n2:4    n3:2   n4:0
    tree = TokenTree([3, 1, 4, 2, 0], [-1, -1, 0, 1, 1])
    logits = torch.full((6, V), -5.0)
    for row, best in enumerate([1, 0, 0, 4, 3, 2]):  # after root: 1 -> n1; after n1 (row 2): 0 -> n4
        logits[row, best] = 5.0
    v = verify_tree_greedy(logits, tree)
    assert v.path == [1, 4] and v.accepted == [1, 0] and v.next_token == 2 and v.kind == "bonus"
    logits[2] = -5.0
    logits[2, 3] = 5.0  # after n1 the target wants 3: no child has it
    v = verify_tree_greedy(logits, tree)
    assert v.path == [1] and v.tokens == [1, 3] and v.kind == "recovered"


def test_chain_tree_agrees_with_chain_verifiers():
    gen = torch.Generator().manual_seed(0)
    for _ in range(50):
        draft = torch.randint(0, V, (4,), generator=gen).tolist()
        logits = torch.randn(5, V, generator=gen) * 3
        logits[torch.arange(4), torch.tensor(draft)] += torch.rand(4, generator=gen) * 4  # often accepted
        chain = TokenTree(draft, [-1, 0, 1, 2])
        assert verify_tree_greedy(logits, chain).tokens == verify_greedy(logits, draft).tokens
        # Greedy params make p one-hot: the sampling rule must then agree with the greedy walk.
        p = process_logits(logits, SamplingParams())
        assert verify_tree_sampling(p, None, chain, make_generator(1, "cpu")).tokens == \
            verify_greedy(logits, draft).tokens


def test_mask_and_depths():
    tree = TokenTree([3, 1, 4, 2, 0], [-1, -1, 0, 1, 1])
    m = tree.mask()
    assert m.shape == (6, 6)
    assert m[5].tolist() == [True, False, True, False, False, True]  # n4 sees root, n1, itself
    assert m[3].tolist() == [True, True, False, True, False, False]  # n2 sees root, n0, itself
    assert tree.depths() == [1, 1, 2, 2, 2]
    with pytest.raises(ValueError):
        TokenTree([1, 2], [1, -1])  # a parent after its child
