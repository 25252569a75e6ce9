"""Penalties, logit bias, min_tokens and ignore_eos under speculation.

Each verified position must see the tokens before it as if the accepted drafts had already been
emitted (`adjust_logits` with the draft prefix as extra output): greedy output with every drafter
is then token for token plain decoding's, and sampled output follows the adjusted target exactly
(chi-square against the enumerated distribution, with a broken variant that fails).
"""

import itertools

import pytest
import torch

from specdec import Engine, SamplingParams
from specdec.drafters import DraftModelDrafter, NgramDrafter, SuffixDrafter
from specdec.drafters.base import DrafterBase, DrafterNeeds, Proposal
from specdec.errors import InvalidRequestError
from specdec.models import loader
from specdec.sampling import adjust_logits, make_generator, process_logits, sample
from specdec.verify import TokenTree, verify_sampling, verify_tree_sampling

from helpers import TINY_VOCAB as V, make_tiny_hf, pooled_chisquare_p


pytestmark = pytest.mark.usefixtures("one_thread")

PENALISED = [
    SamplingParams(repetition_penalty=1.6),
    SamplingParams(frequency_penalty=0.9, presence_penalty=0.4),
    SamplingParams(logit_bias={5: 4.0, 6: -100.0, 7: 2.5}, min_tokens=6),
    SamplingParams(frequency_penalty=-0.7, repetition_penalty=0.8, logit_bias={9: 3.0}),
]


def reference_adjust(logits, params, prompt, output, eos_ids):
    """One position, written out token by token as the definitions read (no tensors shared with
    `adjust_logits`)."""
    out = [float(x) for x in logits]
    for token, bias in params.logit_bias:
        out[token] += bias
    if len(output) < params.min_tokens:
        for e in eos_ids:
            out[e] = float("-inf")
    for t in set(prompt) | set(output):
        if params.repetition_penalty != 1:
            out[t] = out[t] / params.repetition_penalty if out[t] > 0 else out[t] * params.repetition_penalty
    for t in set(output):
        out[t] -= params.frequency_penalty * output.count(t) + params.presence_penalty
    return torch.tensor(out)


@pytest.mark.parametrize("params", PENALISED)
def test_adjust_logits_rows_see_their_own_prefix(params):
    g = torch.Generator().manual_seed(0)
    vocab = 12
    prompt, output = [3, 4, 3, 9], [4, 5, 5, 1]
    tree = TokenTree([5, 7, 5, 5, 9], [-1, -1, 0, 2, 1])
    logits = torch.randn(len(tree) + 1, vocab, generator=g) * 3
    got = adjust_logits(logits, params, prompt, output, tree.paths(), eos_ids=[1])
    for j, path in enumerate(tree.paths()):
        want = reference_adjust(logits[j], params, prompt, output + path, [1])
        torch.testing.assert_close(got[j], want)


def test_sampling_params_are_checked():
    for kwargs, name in [({"frequency_penalty": 2.5}, "frequency_penalty"),
                         ({"presence_penalty": -3}, "presence_penalty"),
                         ({"repetition_penalty": 0}, "repetition_penalty"), ({"min_tokens": -1}, "min_tokens"),
                         ({"logit_bias": {1: 200}}, "logit_bias"), ({"logit_bias": {-1: 1}}, "logit_bias"),
                         ({"ignore_eos": 1}, "ignore_eos"),
                         ({"repetition_penalty": float("nan")}, "repetition_penalty")]:
        with pytest.raises(InvalidRequestError) as info:
            SamplingParams(**kwargs)
        assert info.value.param == name
    assert SamplingParams(logit_bias={3: 1, 2: -1}).logit_bias == ((2, -1.0), (3, 1.0))
    assert not SamplingParams(logit_bias={}).adjusts_logits


# -- greedy: every drafter gives plain decoding's tokens ----------------------------------------


class Oracle(DrafterBase):
    """Drafts the plain output itself (what plain decoding with the same params emits next), up to
    k tokens, with one wrong token now and then: accepted runs are long, so every verified row's
    adjustment is put to the test (a row adjusted for the wrong prefix changes the argmax)."""

    name = "oracle"
    needs = DrafterNeeds()

    def __init__(self, prompt, truth):
        self.prompt, self.truth, self.calls = list(prompt), list(truth), 0

    def propose(self, context, k):
        done = len(context) - len(self.prompt)
        self.calls += 1
        tokens = self.truth[done : done + k]
        if self.calls % 3 == 0 and len(tokens) > 1:
            tokens[-1] = (tokens[-1] + 1) % V
        return Proposal(tokens)


class OracleTree(Oracle):
    """The truth along the second sibling of a small tree with decoy first siblings."""

    needs = DrafterNeeds(trees=True)

    def propose_tree(self, context, depth, top_k, budget):
        done = len(context) - len(self.prompt)
        truth = self.truth[done : done + min(depth, budget // 2)]
        tokens, parents, last = [], [], -1
        for t in truth:
            tokens += [(t + 1) % V, t]
            parents += [last, last]
            last = len(tokens) - 1
        return TokenTree(tokens, parents)


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("pen")
    target, _ = loader.load(make_tiny_hf(root / "t", "gemma3", seed=0)[0], torch.float32, "cpu")
    draft, _ = loader.load(make_tiny_hf(root / "d", "gemma3", seed=0)[0], torch.float32, "cpu")
    return target, draft


PROMPTS = [(list(range(10, 22)) * 3)[:30], [40, 41, 42, 43, 40, 41, 42, 43, 40, 41]]


@pytest.mark.parametrize("params", PENALISED + [SamplingParams(min_tokens=30, ignore_eos=True)])
def test_greedy_identity_with_every_drafter(models, params):
    target, draft = models
    plain = Engine(target, None)
    accepted = 0
    for prompt in PROMPTS:
        want = plain.generate(prompt_ids=prompt, max_new_tokens=24, sampling=params).token_ids
        spec_engines = [
            Engine(target, None, drafter=NgramDrafter(), num_speculative_tokens=4, draft_length="fixed"),
            Engine(target, None, drafter=SuffixDrafter(), num_speculative_tokens=4, draft_length="fixed"),
            Engine(target, None, drafter=NgramDrafter(), draft_tree="3x2x6"),
            Engine(target, None, drafter=DraftModelDrafter(draft, V, draft_p_min=0.0), num_speculative_tokens=3,
                   draft_length="fixed"),
            Engine(target, None, drafter=Oracle(prompt, want), num_speculative_tokens=5, draft_length="fixed"),
            Engine(target, None, drafter=OracleTree(prompt, want), draft_tree="4x2x8"),
        ]
        for spec in spec_engines:
            got = spec.generate(prompt_ids=prompt, max_new_tokens=24, sampling=params)
            assert got.token_ids == want, spec.drafter.name
            accepted += got.stats.accepted_tokens
    assert accepted > 50  # the drafts were really verified, mostly accepted by the oracles


def test_penalties_change_the_output(models):
    target, _ = models
    plain = Engine(target, None)
    base = plain.generate(prompt_ids=PROMPTS[0], max_new_tokens=24).token_ids
    for params in PENALISED:
        assert plain.generate(prompt_ids=PROMPTS[0], max_new_tokens=24, sampling=params).token_ids != base


def test_min_tokens_and_ignore_eos(models):
    target, _ = models
    eos = target.config.eos_token_ids[0]
    # A huge bias on EOS makes it the argmax everywhere: min_tokens holds it back, ignore_eos
    # keeps going past it.
    engine = Engine(target, None, drafter=NgramDrafter(), num_speculative_tokens=3)
    out = engine.generate(prompt_ids=PROMPTS[1], max_new_tokens=20,
                          sampling=SamplingParams(logit_bias={eos: 100.0}, min_tokens=4))
    assert out.token_ids[4] == eos and eos not in out.token_ids[:4] and len(out.token_ids) == 5
    out = engine.generate(prompt_ids=PROMPTS[1], max_new_tokens=7,
                          sampling=SamplingParams(logit_bias={eos: 100.0}, ignore_eos=True))
    assert out.token_ids == [eos] * 7 and out.finish_reason == "length"


def test_logit_bias_outside_the_vocabulary(models):
    target, _ = models
    with pytest.raises(InvalidRequestError) as info:
        Engine(target, None).generate(prompt_ids=[5, 6], sampling=SamplingParams(logit_bias={V: 1.0}))
    assert info.value.param == "logit_bias"


# -- sampled: exact distribution ----------------------------------------------------------------

VT, N, SAMPLES = 5, 3, 6000
g = torch.Generator().manual_seed(77)
TARGET = torch.randn(VT, VT, generator=g) * 1.5  # [last token, vocab]
DRAFT = torch.randn(VT, VT, generator=g) * 1.5  # unrelated, unadjusted: mass on biased-away tokens
PARAMS = SamplingParams(temperature=0.9, frequency_penalty=1.2, presence_penalty=0.3, repetition_penalty=1.3,
                        logit_bias={2: -100.0, 3: 1.5})
PROMPT = [0]


def adjusted_p(ctx, out, draft, params, broken=False):
    paths = [[] for _ in range(len(draft) + 1)] if broken else [draft[:i] for i in range(len(draft) + 1)]
    logits = adjust_logits(TARGET[[ctx[-1]] + draft], params, PROMPT, out, paths, eos_ids=[])
    return process_logits(logits, params)


def spec_sample(params, k, tree, broken, generator):
    out = []
    while len(out) < N:
        ctx = PROMPT + out
        if tree:  # two i.i.d. root candidates from q, then a chain under the first
            q0 = process_logits(DRAFT[ctx[-1]], params)
            a, b = int(sample(q0, generator)), int(sample(q0, generator))
            q1 = process_logits(DRAFT[a], params)
            c = int(sample(q1, generator))
            t = TokenTree([a, b, c], [-1, -1, 0])
            paths = [[] for _ in range(4)] if broken else t.paths()
            rows = [ctx[-1], a, b, c]
            p = process_logits(adjust_logits(TARGET[rows], params, PROMPT, out, paths, eos_ids=[]), params)
            v = verify_tree_sampling(p, torch.stack([q0, q0, q1]), t, generator)
        else:
            draft, qs, last = [], [], ctx[-1]
            for _ in range(k):
                q = process_logits(DRAFT[last], params)
                last = int(sample(q, generator))
                draft.append(last)
                qs.append(q)
            v = verify_sampling(adjusted_p(ctx, out, draft, params, broken), torch.stack(qs), draft, generator)
        out += v.tokens
    return tuple(out[:N])


def exact(params):
    cells = list(itertools.product(range(VT), repeat=N))
    probs = []
    for cell in cells:
        prob = 1.0
        for i, t in enumerate(cell):
            out = list(cell[:i])
            ctx = PROMPT + out
            prob *= float(adjusted_p(ctx, out, [], params)[0, t])
        probs.append(prob)
    return cells, probs


def p_value(params, k, tree, broken, seed):
    generator = make_generator(seed, "cpu")
    counts = {}
    for _ in range(SAMPLES):
        key = spec_sample(params, k, tree, broken, generator)
        counts[key] = counts.get(key, 0) + 1
    cells, probs = exact(params)
    if not broken:
        assert all(counts.get(c, 0) == 0 for c, pr in zip(cells, probs) if pr == 0)
    return pooled_chisquare_p(counts, cells, probs, SAMPLES)


@pytest.mark.parametrize("k,tree", [(2, False), (3, False), (0, True)])
def test_penalised_speculative_sampling_is_exact(k, tree):
    assert p_value(PARAMS, k, tree, broken=False, seed=11) > 1e-3


def test_adjusting_every_row_for_the_context_only_fails():
    # The broken variant: the draft tokens before a row are not counted (the penalties of the
    # step's context applied to every row), which plain decoding would never do.
    assert p_value(PARAMS, 3, False, broken=True, seed=11) < 1e-6
