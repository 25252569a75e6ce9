"""The engine drives token trees: greedy identity with plain decoding for every tree drafter and
shape, stops and token limits inside an accepted path, statistics by depth, seeded sampling.

Most tests use an oracle drafter that knows the plain greedy continuation and hides it at a random
sibling of a random tree with decoy subtrees: deep accepted paths through non-first siblings, so
the tree mask, the positions and `compact` of the path are all exercised (a wrong one changes the
target's logits on the path, and with them the output).
"""

import random
import subprocess
import sys

import pytest
import torch

from specdec import Engine, SamplingParams
from specdec.drafters import DrafterNeeds, NgramDrafter, SuffixDrafter, TreeShape
from specdec.drafters.eagle import EagleDrafter
from specdec.errors import InvalidRequestError
from specdec.models import loader
from specdec.verify import TokenTree

from helpers import TINY_VOCAB as V, make_tiny_hf, random_prompts as prompts

from test_eagle import random_head

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def targets(tmp_path_factory):
    out = {}
    for family in ("gemma3", "llama"):  # gemma3: sliding-window layers (window 8) under `compact`
        folder, _ = make_tiny_hf(tmp_path_factory.mktemp(family), family, seed=1)
        out[family], _ = loader.load(folder, torch.float32, "cpu")
    return out


class OracleTree:
    """Proposes random trees that contain the plain greedy continuation (`truth`, the full output
    for `prompt`) along one branch, at a random sibling index per level, cut at a random depth;
    the other nodes are decoys (never the true token under the same parent)."""

    name = "oracle"
    needs = DrafterNeeds(trees=True)

    def __init__(self, prompt, truth, seed=0):
        self.prompt, self.truth, self.rng = list(prompt), list(truth), random.Random(seed)

    def begin(self, prompt_ids, sampling=None, generator=None):
        assert prompt_ids == self.prompt

    def propose(self, context, k):  # the protocol's chain method; never called with a tree shape
        raise AssertionError("the engine asked a tree drafter for a chain")

    def propose_tree(self, context, depth, top_k, budget):
        done = len(context) - len(self.prompt)  # tokens emitted so far
        true = self.truth[done : done + self.rng.randint(0, depth)]  # the right path, maybe short
        # Build nodes level by level as (parent, token, is_true), then shuffle into a random order
        # that still has parents before children.
        nodes, frontier = [], [(-1, True)]
        for level in range(depth):
            nxt = []
            for parent, on_path in frontier:
                width = self.rng.randint(1, top_k)
                slot = self.rng.randrange(width) if on_path and level < len(true) else -1
                used = {true[level]} if on_path and level < len(true) else set()
                for j in range(width):
                    if j == slot:
                        token = true[level]
                    else:
                        token = self.rng.choice([t for t in range(V) if t not in used])
                    used.add(token)
                    nodes.append((parent, token, j == slot))
                    nxt.append((len(nodes) - 1, j == slot))
            frontier = [f for f in nxt if f[1] or self.rng.random() < 0.3]
        order = self._topological_shuffle([p for p, _, _ in nodes])[:budget]  # ancestors come first
        index = {old: new for new, old in enumerate(order)}
        return TokenTree([nodes[o][1] for o in order], [index[nodes[o][0]] if nodes[o][0] >= 0 else -1 for o in order])

    def _topological_shuffle(self, parents):
        ready, order = [i for i, p in enumerate(parents) if p < 0], []
        while ready:
            node = ready.pop(self.rng.randrange(len(ready)))
            order.append(node)
            ready += [i for i, p in enumerate(parents) if p == node]
        return order

    def feedback(self, num_accepted):
        pass

    def end(self, output_ids):
        pass


class LetterTokenizer:
    """Just enough of a tokenizer for stop strings: token i decodes to `<i>`."""

    @staticmethod
    def decode(ids):
        return "".join(f"<{i}>" for i in ids)


def check_stats(out):
    s, steps = out.stats, [st for st in out.steps if st.kind != "prefill"]
    assert s.draft_tokens == sum(st.drafted for st in steps)
    assert s.accepted_tokens == sum(len(st.accepted) for st in steps)
    assert s.drafts == sum(1 for st in steps if st.drafted)
    for i, n in enumerate(s.accepted_per_position):
        assert n == sum(1 for st in steps if len(st.accepted) > i)
        assert s.drafted_per_position[i] >= n
    assert s.mean_accepted_length == pytest.approx(1 + s.accepted_tokens / s.drafts if s.drafts else 1.0)


# -- greedy identity ------------------------------------------------------------------------------


@pytest.mark.fast
@pytest.mark.parametrize("family", ["gemma3", "llama"])
@pytest.mark.parametrize("shape", ["4x3x12", "1x1x1", "8x1x8", "6x2x5", "3x4x30"])
def test_oracle_tree_greedy_identity(targets, family, shape):
    target = targets[family]
    plain = Engine(target, None)
    for seed, ids in enumerate(prompts(2)):
        truth = plain.generate(prompt_ids=ids, max_new_tokens=40).token_ids
        oracle = OracleTree(ids, truth, seed)
        out = Engine(target, None, drafter=oracle, draft_tree=shape).generate(prompt_ids=ids, max_new_tokens=40)
        assert out.token_ids == truth
        check_stats(out)
        assert out.stats.accepted_tokens > 0


@pytest.mark.fast
@pytest.mark.parametrize("family", ["gemma3", "llama"])
@pytest.mark.parametrize("shape", [TreeShape(3, 3, 10), TreeShape(1, 1, 1), TreeShape(6, 1, 6), TreeShape(4, 4, 24)])
def test_eagle_tree_greedy_identity(targets, family, shape):
    target = targets[family]
    drafter = EagleDrafter(random_head(target, V, seed=2))
    plain, tree = Engine(target, None), Engine(target, None, drafter=drafter, draft_tree=shape)
    for ids in prompts(2, seed=5):
        out = tree.generate(prompt_ids=ids, max_new_tokens=30)
        assert out.token_ids == plain.generate(prompt_ids=ids, max_new_tokens=30).token_ids
        assert out.stats.draft_tokens > 0 and max(st.drafted for st in out.steps) <= shape.budget
        check_stats(out)
        assert drafter.cache_length == 0


def repetitive(seed, n=60):
    """Phrases from a small set, repeated in random order: a tail recurs with different followers."""
    rng = random.Random(seed)
    phrases = [[rng.randrange(3, V) for _ in range(rng.randint(2, 4))] for _ in range(4)]
    out = []
    while len(out) < n:
        out += rng.choice(phrases)
    return out


@pytest.mark.fast
@pytest.mark.parametrize("shape", ["4x3x12", "1x1x1", "6x1x6", "3x2x4"])
def test_ngram_tree_greedy_identity(targets, shape):
    target = targets["gemma3"]
    plain, tree = Engine(target, None), Engine(target, None, drafter=NgramDrafter(), draft_tree=shape)
    for seed in range(3):
        ids = repetitive(seed)
        out = tree.generate(prompt_ids=ids, max_new_tokens=40)
        assert out.token_ids == plain.generate(prompt_ids=ids, max_new_tokens=40).token_ids
        check_stats(out)


# -- stops and limits inside an accepted path -----------------------------------------------------


def test_stop_string_and_limit_inside_an_accepted_path(targets):
    target = targets["gemma3"]
    plain = Engine(target, LetterTokenizer())
    cut_inside = 0
    for seed, ids in enumerate(prompts(3, seed=11)):
        truth = plain.generate(prompt_ids=ids, max_new_tokens=40)
        stop = LetterTokenizer.decode(truth.token_ids[13:15])
        want = plain.generate(prompt_ids=ids, max_new_tokens=40, stop=stop)
        spec = Engine(target, LetterTokenizer(), drafter=OracleTree(ids, truth.token_ids, seed), draft_tree="6x2x10")
        got = spec.generate(prompt_ids=ids, max_new_tokens=40, stop=stop)
        assert (got.token_ids, got.text, got.finish_reason) == (want.token_ids, want.text, "stop")
        cut_inside += sum(len(st.accepted) + 1 for st in got.steps) > len(got.token_ids)
        for limit in (1, 7, 17):
            spec = Engine(target, LetterTokenizer(), drafter=OracleTree(ids, truth.token_ids, seed),
                          draft_tree="6x3x12")
            got = spec.generate(prompt_ids=ids, max_new_tokens=limit)
            assert got.token_ids == truth.token_ids[:limit] and got.finish_reason == "length"
            assert all(len(st.accepted) < limit for st in got.steps)  # no drafting past the allowance
    assert cut_inside > 0


# -- sampling ----------------------------------------------------------------------------------------


def test_seeded_sampling_is_reproducible(targets):
    target = targets["llama"]
    ids = repetitive(2, 30)
    for drafter in (EagleDrafter(random_head(target, V, seed=3)), NgramDrafter()):
        engine = Engine(target, None, drafter=drafter, draft_tree="3x3x9")
        sp = SamplingParams(temperature=0.9, top_p=0.95, seed=7)
        a = engine.generate(prompt_ids=ids, max_new_tokens=30, sampling=sp)
        b = engine.generate(prompt_ids=ids, max_new_tokens=30, sampling=sp)
        c = engine.generate(prompt_ids=ids, max_new_tokens=30, sampling=SamplingParams(temperature=0.9, seed=8))
        assert a.token_ids == b.token_ids and [s.accepted for s in a.steps] == [s.accepted for s in b.steps]
        assert a.token_ids != c.token_ids
        assert a.stats.draft_tokens > 0


def test_sampling_tree_gets_no_q(targets, monkeypatch):
    """Tree candidates are deterministic: the engine verifies them with q = None (one-hot), not
    with some drafter distribution, and a chain keeps its drafter's q."""
    import specdec.engine as engine_module

    seen = []
    real_tree, real_chain = engine_module.verify_tree_sampling, engine_module.verify_sampling
    monkeypatch.setattr(engine_module, "verify_tree_sampling", lambda p, q, tree, g: seen.append(("tree", q)) or
                        real_tree(p, q, tree, g))
    monkeypatch.setattr(engine_module, "verify_sampling", lambda p, q, draft, g: seen.append(("chain", q)) or
                        real_chain(p, q, draft, g))
    target = targets["llama"]
    drafter = EagleDrafter(random_head(target, V, seed=3))
    sp = SamplingParams(temperature=0.8, seed=1)
    Engine(target, None, drafter=drafter, draft_tree="3x3x9").generate(prompt_ids=prompts(1)[0], max_new_tokens=8,
                                                                       sampling=sp)
    assert seen and all(kind == "tree" and q is None for kind, q in seen)
    seen.clear()
    chain = Engine(target, None, drafter=drafter, num_speculative_tokens=3, draft_length="fixed")
    chain.generate(prompt_ids=prompts(1)[0], max_new_tokens=8, sampling=sp)
    assert seen and all(kind == "chain" and q is not None and q.shape[1] == V for kind, q in seen)


# -- API and CLI ---------------------------------------------------------------------------------------


def test_tree_shape_and_engine_errors(targets):
    assert TreeShape.parse("5x4x24") == TreeShape(5, 4, 24) and str(TreeShape(2, 3, 4)) == "2x3x4"
    for bad in ("5x4", "ax4x2", "0x4x24", "5x4x0", ""):
        with pytest.raises(InvalidRequestError, match="draft tree"):
            TreeShape.parse(bad)
    assert NgramDrafter().needs.trees and not SuffixDrafter().needs.trees
    target = targets["llama"]
    with pytest.raises(InvalidRequestError, match="cannot propose draft trees"):
        Engine(target, None, drafter=SuffixDrafter(), draft_tree="3x2x4")
    with pytest.raises(InvalidRequestError, match="cannot propose draft trees"):
        Engine(target, None, drafter=None, draft_tree="3x2x4")
    with pytest.raises(InvalidRequestError, match="fixed shape"):
        Engine(target, None, drafter=NgramDrafter(), draft_length="adaptive", draft_tree="3x2x4")


@pytest.mark.parametrize("args,needle", [
    (["--tree", "4x3"], "DEPTHxTOPKxBUDGET"),
    (["--tree", "4x3x8", "--drafter", "suffix"], "cannot propose draft trees"),
])
def test_cli_tree_errors_are_one_line(args, needle):
    res = subprocess.run([sys.executable, "-m", "specdec.cli", "generate", "--prompt", "hi", *args],
                         capture_output=True, text=True, timeout=120)
    assert res.returncode != 0 and "Traceback" not in res.stderr
    assert needle in res.stderr.strip().splitlines()[-1]
