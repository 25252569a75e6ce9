"""Lookup first, a learned drafter where lookup finds nothing (`ngram+eagle`): who drafts when,
greedy identity (chains and trees), exact sampling with its power check, names and options."""

import pytest
import torch

from specdec import Engine, SamplingParams
from specdec.bench.configs import eagle_name, parse_config
from specdec.drafters import DrafterNeeds, NgramDrafter, Proposal, SuffixDrafter
from specdec.drafters.combined import LEARNED, LookupFirstDrafter, lookup_first
from specdec.drafters.eagle import EagleDrafter
from specdec.builder import parse
from specdec.errors import InvalidRequestError

from helpers import random_prompts as prompts

import test_eagle as te
import test_draft_model as tdm

pytestmark = pytest.mark.usefixtures("one_thread")


class Recorder:
    """A drafter stand-in that proposes fixed tokens and records every call."""

    name = "rec"
    needs = DrafterNeeds(observes=(-1,), labels_proposals=True)

    def __init__(self, tokens):
        self.tokens, self.calls = tokens, []

    def begin(self, prompt_ids, sampling=None, generator=None):
        self.calls.append(("begin",))

    def propose(self, context, k):
        self.calls.append(("propose", k))
        return Proposal(self.tokens[:k], source=3)

    def feedback(self, n):
        self.calls.append(("feedback", n))

    def end(self, output_ids):
        self.calls.append(("end",))

    def observe(self, hidden):
        self.calls.append(("observe", tuple(hidden.shape)))


def test_who_drafts_and_who_hears_back():
    found, learned = Recorder([7, 8, 9]), Recorder([1, 2, 3, 4, 5])
    d = LookupFirstDrafter(found, learned, fallback_k=2)
    d.begin([1, 2])
    p = d.propose([1, 2], 3)
    assert (p.tokens, p.source) == ([7, 8, 9], 3) and ("propose", 3) not in learned.calls  # lookup's own label
    d.feedback(2)
    assert found.calls[-1] == ("feedback", 2) and learned.calls == [("begin",)]
    d.observe(torch.zeros(4, 8))  # features always reach the learned drafter
    assert learned.calls[-1] == ("observe", (4, 8))

    nothing = Recorder([])
    d = LookupFirstDrafter(nothing, learned, fallback_k=2)
    p = d.propose([1, 2], 5)
    assert (p.tokens, p.source) == ([1, 2], LEARNED) and learned.calls[-1] == ("propose", 2)
    assert d.propose([1, 2], 5, fallback_k=4).tokens == [1, 2, 3, 4]
    assert d.propose([1, 2], 3, fallback_k=9).tokens == [1, 2, 3]  # never more than k
    assert d.propose([1, 2], 5, fallback_k=0).tokens == [] and learned.calls[-1] == ("propose", 3)
    d.feedback(1)
    assert learned.calls[-1] == ("feedback", 1) and not any(c[0] == "feedback" for c in nothing.calls)
    assert d.name == "rec+rec"


def test_trees_only_when_both_parts_draft_them(tiny_models):
    head = EagleDrafter(te.random_head(tiny_models["llama"]["target"], 50))
    assert lookup_first(NgramDrafter(), head).needs.trees
    assert not lookup_first(SuffixDrafter(), head).needs.trees


@pytest.mark.fast
@pytest.mark.parametrize("family", ["llama", "gemma3"])
@pytest.mark.parametrize("length,tree", [("fixed", None), ("cost", None), ("fixed", "3x2x6")])
def test_greedy_identity_with_both_kinds_drafting(tiny_models, family, length, tree):
    target = tiny_models[family]["target"]
    lookup = NgramDrafter()
    drafter = lookup_first(lookup, EagleDrafter(te.random_head(target, 60, seed=1)))
    engine, plain = Engine(target, None, drafter=drafter, num_speculative_tokens=4, draft_length=length,
                           draft_tree=tree), Engine(target, None)
    kinds = []
    real_propose = lookup.propose_tree if tree else lookup.propose
    def counting(*args, **kwargs):
        out = real_propose(*args, **kwargs)
        kinds.append("lookup" if len(out.tokens if isinstance(out, Proposal) else out) else "learned")
        return out
    setattr(lookup, "propose_tree" if tree else "propose", counting)
    # Prompts that repeat themselves give lookup matches; the rest falls to the head.
    for ids in [p * 3 for p in prompts(3, 5)]:
        out = engine.generate(prompt_ids=ids, max_new_tokens=40)
        assert out.token_ids == plain.generate(prompt_ids=ids, max_new_tokens=40).token_ids
    assert "lookup" in kinds and "learned" in kinds, kinds


def test_sampling_follows_exact_target_distribution():
    drafter = lookup_first(NgramDrafter(), te.small_head())
    assert tdm.p_value(SamplingParams(temperature=0.7, top_k=3), drafter, k=2) > 1e-3


def test_broken_learned_part_is_caught():
    drafter = lookup_first(NgramDrafter(), te.small_head(te.BrokenEagle))
    assert tdm.p_value(SamplingParams(temperature=0.7, top_k=3), drafter, k=2) < 1e-6


def test_names_and_options(tmp_path):
    both = parse("ngram+eagle")
    assert (both.lookup, both.kind, both.path) == ("ngram", "eagle", te.DEFAULT_HEAD_DIR)
    assert parse("eagle").lookup is None and parse("none").kind == "none"
    path = tmp_path / "a+b"  # a path with a `+` in it stays a path
    path.mkdir()
    assert (parse(str(path)).kind, parse(str(path)).lookup) == ("draft_model", None)
    for bad in ("ngram+none", "ngram+suffix", "ngram+", "ngram+ngram+eagle"):
        with pytest.raises(InvalidRequestError, match="learned drafter"):
            parse(bad)
    with pytest.raises(InvalidRequestError, match="unknown drafter"):
        parse("ngram+/no/such/model")
    with pytest.raises(InvalidRequestError, match="cannot propose draft trees"):
        Engine.load("default", drafter="suffix+eagle", draft_tree="3x2x6")  # fails before loading anything
    c = parse_config("eagle:k=8:lookup=ngram")
    assert eagle_name(c.options) == "ngram+eagle" and c.k == 8
    assert eagle_name(parse_config(f"eagle:lookup=suffix:head={te.DEFAULT_HEAD_DIR}").options) == \
        f"suffix+eagle:{te.DEFAULT_HEAD_DIR}"
    with pytest.raises(InvalidRequestError, match="lookup must be ngram or suffix"):
        parse_config("eagle:lookup=eagle")
    with pytest.raises(InvalidRequestError, match="no trees"):
        parse_config("eagle:lookup=suffix:tree=3x2x6")
