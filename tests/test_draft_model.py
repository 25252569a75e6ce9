"""Draft-model drafter: greedy identity, cache sync, exact sampling, vocabularies, the p_min cut-off."""

import dataclasses
import itertools
import json
import random
import subprocess
import sys

import pytest
import torch

from specdec import Engine, SamplingParams
from specdec.drafters import DraftModelDrafter, Drafter
from specdec.drafters.draft_model import check_same_vocabulary
from specdec.builder import Made, make_drafter
from specdec.settings import DecodingSettings
from specdec.errors import InvalidRequestError
from specdec.models import loader
from specdec.models.kv_cache import resolve_kv_dtype
from specdec.models.transformer import ModelConfig, RopeSpec, Transformer
from specdec.sampling import make_generator, process_logits, sample

from helpers import TINY_VOCAB as V, make_tiny_hf, pooled_chisquare_p, random_prompts as prompts


pytestmark = pytest.mark.usefixtures("one_thread")


def noisy_copy(model: Transformer, scale: float, seed: int) -> Transformer:
    """The model with Gaussian noise on every weight: a draft that agrees with it only partly."""
    g = torch.Generator().manual_seed(seed)
    state = {k: v + torch.randn(v.shape, generator=g) * scale * v.std() for k, v in model.state_dict().items()}
    return loader.build_model(model.config, state, torch.float32, "cpu")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """family -> dict(target, folder, self, noisy, other) of fp32 tiny models sharing a vocabulary."""
    out = {}
    for family in ("llama", "gemma3"):
        root = tmp_path_factory.mktemp(family)
        folder, _ = make_tiny_hf(root / "t", family, seed=0)
        other_folder, _ = make_tiny_hf(root / "o", family, seed=1)
        target, _ = loader.load(folder, torch.float32, "cpu")
        other, _ = loader.load(other_folder, torch.float32, "cpu")
        out[family] = dict(target=target, folder=folder, self=target, noisy=noisy_copy(target, 0.5, 3), other=other)
    return out


_plain = {}


def plain_greedy(tiny, family, ids, n):
    key = (family, tuple(ids), n)
    if key not in _plain:
        _plain[key] = Engine(tiny[family]["target"], None).generate(prompt_ids=ids, max_new_tokens=n).token_ids
    return _plain[key]


# -- greedy identity ---------------------------------------------------------------------------------


@pytest.mark.fast
@pytest.mark.parametrize("family", ["llama", "gemma3"])
@pytest.mark.parametrize("draft", ["self", "noisy", "other"])
@pytest.mark.parametrize("k,length", [(1, "fixed"), (3, "fixed"), (8, "fixed"), (3, "adaptive")])
def test_greedy_identity(tiny, family, draft, k, length):
    m = tiny[family]
    engine = Engine(m["target"], None, drafter=DraftModelDrafter(m[draft], V), num_speculative_tokens=k,
                    draft_length=length)
    drafted = accepted = 0
    for ids in prompts(2):
        out = engine.generate(prompt_ids=ids, max_new_tokens=32)
        assert out.token_ids == plain_greedy(tiny, family, ids, 32)
        drafted += out.stats.draft_tokens
        accepted += out.stats.accepted_tokens
    assert drafted > 0
    if draft == "self":
        # The target as its own draft: every draft accepted, so every step takes the all-accepted
        # path where the last draft and the bonus token both enter the draft cache next time.
        assert accepted == drafted
    elif draft == "noisy":
        assert 0 < accepted < drafted  # mixed: rollbacks into the middle of a draft


def test_satisfies_protocol(tiny):
    assert isinstance(DraftModelDrafter(tiny["llama"]["target"], V), Drafter)


# -- the draft cache stays in step ---------------------------------------------------------------------


_quantised: dict = {}


def quantised_noisy(tiny, family, mode):
    """The family's noisy draft on `mode` products ("none": itself), made once per module."""
    if mode == "none":
        return tiny[family]["noisy"]
    from specdec.models.quant import cpu_int8_available, quantize_model

    if not cpu_int8_available():
        pytest.skip("no int8 backend")
    if (family, mode) not in _quantised:
        _quantised[family, mode] = quantize_model(noisy_copy(tiny[family]["target"], 0.5, 3), mode)
    return _quantised[family, mode]


@pytest.mark.parametrize("family", ["llama", "gemma3"])
@pytest.mark.parametrize("greedy", [True, False])
@pytest.mark.parametrize("quantize", ["none", "int8", "int4"])
def test_cache_in_step_and_equal_to_fresh(tiny, family, greedy, quantize):
    """Drive propose like the engine (accept a prefix, append one token) and check after each step
    that the cache holds exactly context + forwarded drafts, and that proposals equal those of a
    fresh drafter that prefills the whole context (the incremental cache changes nothing). A
    quantised draft does so on its float16 cache (`draft_kv_dtype`), a float one on float32."""
    draft = quantised_noisy(tiny, family, quantize)
    sampling = SamplingParams() if greedy else SamplingParams(temperature=0.8, top_k=20, seed=0)
    gen_a, gen_b = torch.Generator(), torch.Generator()
    d = DraftModelDrafter(draft, V)
    assert d.kv_dtype == (torch.float32 if quantize == "none" else torch.float16)
    rng = random.Random(5)
    context = prompts(1, 6)[0]
    d.begin(list(context), sampling, gen_a)
    for step in range(24):
        k = rng.randint(1, 6)
        gen_a.manual_seed(step)
        prop = d.propose(context, k)
        assert len(prop.tokens) == k
        assert d._cache.keys[0].dtype == d.kv_dtype
        # The last draft token is not forwarded (no one needs its logits yet).
        assert d.cached_tokens == context + prop.tokens[:-1]
        assert d.cache_length == len(context) + k - 1
        fresh = DraftModelDrafter(draft, V)
        fresh.begin(list(context), sampling, gen_b)
        gen_b.manual_seed(step)
        ref = fresh.propose(context, k)
        assert prop.tokens == ref.tokens
        if greedy:
            assert prop.q is None
        else:
            assert prop.q.shape == (k, V)
            torch.testing.assert_close(prop.q, ref.q, atol=1e-5, rtol=1e-4)
        d.feedback(accepted := rng.choice([0, k, rng.randint(0, k)]))  # all-accepted often
        context = context + prop.tokens[:accepted] + [rng.randrange(V)]
        if step == 12:  # a caller rolling back: a context that does not extend the last one
            context = context[:-5] + [rng.randrange(V)]
    d.end([])
    assert d.cache_length == 0


@pytest.mark.parametrize("quantize", ["none", "int4"])
def test_cache_grows_past_initial_room(tiny, quantize):
    draft = quantised_noisy(tiny, "llama", quantize)
    d = DraftModelDrafter(draft, V)
    context = prompts(1, 4)[0]
    d.begin(context)
    long = context + torch.randint(0, V, (300,), generator=torch.Generator().manual_seed(1)).tolist()
    got = d.propose(long[:100], 3).tokens
    assert got == DraftModelDrafter(draft, V).propose(long[:100], 3).tokens
    got = d.propose(long, 3).tokens  # 304 + 2 slots > 4 + 256: the cache doubles, keeping its content
    assert d.cache_length == len(long) + 2
    assert d._cache.keys[0].dtype == d.kv_dtype  # the grown cache keeps the element type
    assert got == DraftModelDrafter(draft, V).propose(long, 3).tokens


# -- vocabularies --------------------------------------------------------------------------------------


def resized_vocab(model: Transformer, vocab: int) -> Transformer:
    """`model` with its (untied) embedding and head cut or padded to `vocab` rows. Padded head rows
    get huge random weights, so some padding id would win every argmax if they were not dropped."""
    state = {k: v.clone() for k, v in model.state_dict().items()}
    old = model.config.vocab_size
    for name in ("embed_tokens.weight", "lm_head.weight"):
        w = state[name]
        if vocab <= old:
            state[name] = w[:vocab]
        else:
            extra = vocab - old
            big = torch.randn(extra, w.shape[1], generator=torch.Generator().manual_seed(0)) * 100 * w.std()
            pad = torch.zeros(extra, w.shape[1]) if name.startswith("embed") else big
            state[name] = torch.cat([w, pad])
    cfg = dataclasses.replace(model.config, vocab_size=vocab)
    return loader.build_model(cfg, state, torch.float32, "cpu")


@pytest.mark.parametrize("draft_vocab", [V + 7, V - 5])
def test_padded_vocabulary(tiny, draft_vocab):
    m = tiny["llama"]
    assert not m["target"].config.tie_embeddings
    draft = resized_vocab(m["target"], draft_vocab)
    engine = Engine(m["target"], None, drafter=DraftModelDrafter(draft, V), num_speculative_tokens=4,
                    draft_length="fixed")
    for ids in prompts(2):
        out = engine.generate(prompt_ids=ids, max_new_tokens=32)
        assert out.token_ids == plain_greedy(tiny, "llama", ids, 32)
        if draft_vocab > V:  # the target's own weights plus padding ids that must never be drafted
            assert out.stats.accepted_tokens == out.stats.draft_tokens > 0
    d = DraftModelDrafter(draft, V)
    d.begin(prompts(1)[0], SamplingParams(temperature=1.0, seed=0), make_generator(0, "cpu"))
    prop = d.propose(prompts(1)[0] + [V - 1], 5)  # V - 1 is beyond a smaller draft's vocabulary
    assert prop.q.shape == (5, V) and all(t < V for t in prop.tokens)
    torch.testing.assert_close(prop.q.sum(-1), torch.ones(5))


def test_vocab_size_mismatch_is_an_error(tiny):
    big = resized_vocab(tiny["llama"]["target"], V + 500)
    with pytest.raises(InvalidRequestError, match="vocabulary"):
        DraftModelDrafter(big, V)


class FakeTokenizer:
    def __init__(self, spelling):
        self.spelling = spelling

    def decode(self, ids):
        return "".join(self.spelling(i) for i in ids)


def test_tokenizer_mismatch_is_an_error():
    same = FakeTokenizer(lambda i: f"t{i}")
    check_same_vocabulary(1000, 1000, same, FakeTokenizer(lambda i: f"t{i}"))
    check_same_vocabulary(1000, 1064, same, None)  # a weights-only folder: sizes only
    with pytest.raises(InvalidRequestError, match="tokenizer"):
        check_same_vocabulary(1000, 1000, same, FakeTokenizer(lambda i: f"t{i}" if i < 500 else "x"))
    with pytest.raises(InvalidRequestError, match="tokenizer"):  # a shifted vocabulary of equal size
        check_same_vocabulary(1000, 1000, same, FakeTokenizer(lambda i: f"t{i + 1}"))


def test_engine_load_with_draft_model_path(tiny, tmp_path):
    import transformers as T

    m = tiny["llama"]
    # A fixed length: the target as its own draft costs as much as a target step, which the
    # (default) cost-aware length, charging the draft's measured price, would never draft.
    engine = Engine.load(str(m["folder"]), drafter=str(m["folder"]), num_speculative_tokens=3, dtype="float32",
                         draft_p_min=0.0, draft_length="fixed")
    assert isinstance(engine.drafter, DraftModelDrafter) and engine.drafter.draft_p_min == 0.0
    ids = prompts(1)[0]
    out = engine.generate(prompt_ids=ids, max_new_tokens=16)
    assert out.token_ids == plain_greedy(tiny, "llama", ids, 16)
    assert out.stats.accepted_tokens == out.stats.draft_tokens > 0

    cfg = T.LlamaConfig(vocab_size=V + 400, hidden_size=32, intermediate_size=48, num_hidden_layers=1,
                        num_attention_heads=2, num_key_value_heads=1)
    T.LlamaForCausalLM(cfg).save_pretrained(str(tmp_path / "big"))
    with pytest.raises(InvalidRequestError, match="vocabulary"):
        Engine.load(str(m["folder"]), drafter=str(tmp_path / "big"), dtype="float32")
    with pytest.raises(InvalidRequestError, match="drafter"):
        Engine.load(str(m["folder"]), drafter=str(tmp_path / "missing"), dtype="float32")
    with pytest.raises(InvalidRequestError, match="draft_p_min"):
        Engine.load(str(m["folder"]), drafter=str(m["folder"]), draft_p_min=1.5)
    with pytest.raises(InvalidRequestError, match="draft_p_min"):
        make_drafter("ngram", Made(settings=DecodingSettings(draft_p_min=0.5)))


# -- the confidence cut-off ----------------------------------------------------------------------------


def raw_top_probs(model, context, draft):
    """Top raw-softmax probability at each draft position (after context + draft[:i])."""
    cache = model.new_cache(1, len(context) + len(draft))
    seq = context + draft[:-1]
    logits, _ = model(torch.tensor([seq]), torch.arange(len(seq))[None], cache, last_n=len(draft))
    return logits[0].softmax(-1).amax(-1).tolist()


def cut_between(tops):
    """(m, p_min) such that drafting with p_min stops exactly before position m >= 1."""
    for m in range(1, len(tops)):
        if tops[m] < min(tops[:m]):
            return m, (tops[m] + min(tops[:m])) / 2
    return None


@pytest.mark.parametrize("greedy", [True, False])
def test_p_min_stops_exactly_at_the_first_unconfident_position(tiny, greedy):
    draft = tiny["gemma3"]["noisy"]
    sampling = SamplingParams() if greedy else SamplingParams(temperature=0.5, seed=0)
    checked = 0
    for context in prompts(6):
        gen = make_generator(1, "cpu")
        full = DraftModelDrafter(draft, V)
        full.begin(context, sampling, gen)
        ref = full.propose(context, 8)
        tops = raw_top_probs(draft, context, ref.tokens) if greedy else ref.q.amax(-1).tolist()
        found = cut_between(tops)
        if found is None:
            continue
        m, p_min = found
        cut = DraftModelDrafter(draft, V, draft_p_min=p_min)
        cut.begin(context, sampling, make_generator(1, "cpu"))
        got = cut.propose(context, 8)
        assert got.tokens == ref.tokens[:m]
        if not greedy:
            torch.testing.assert_close(got.q, ref.q[:m])
        # Cut-off at the first position: an empty proposal, the engine's plain step.
        none = DraftModelDrafter(draft, V, draft_p_min=min(1.0, tops[0] * 1.01 + 1e-6))
        none.begin(context, sampling, make_generator(1, "cpu"))
        assert none.propose(context, 8).tokens == []
        checked += 1
    assert checked >= 3


@pytest.mark.parametrize("draft", ["self", "noisy"])
def test_p_min_shortens_drafts_and_keeps_identity(tiny, draft):
    m = tiny["gemma3"]
    ids_list = prompts(3)
    # Threshold at the median confidence along the greedy trajectories, so some steps are cut.
    tops = []
    for ids in ids_list:
        out = plain_greedy(tiny, "gemma3", ids, 32)
        tops += raw_top_probs(m[draft], ids, out)
    p_min = sorted(tops)[len(tops) // 2]
    stats = {}
    for p in (0.0, p_min):
        engine = Engine(m["target"], None, drafter=DraftModelDrafter(m[draft], V, draft_p_min=p),
                        num_speculative_tokens=5, draft_length="adaptive")
        drafted = accepted = 0
        for ids in ids_list:
            out = engine.generate(prompt_ids=ids, max_new_tokens=32)
            assert out.token_ids == plain_greedy(tiny, "gemma3", ids, 32)
            drafted += out.stats.draft_tokens
            accepted += out.stats.accepted_tokens
        stats[p] = drafted, accepted
    assert 0 < stats[p_min][0] < stats[0.0][0]
    if draft == "self":
        assert stats[p_min][1] == stats[p_min][0]
    else:  # unconfident positions are where rejections are: the acceptance rate goes up
        assert stats[p_min][1] / stats[p_min][0] > stats[0.0][1] / stats[0.0][0]


# -- exact distribution under sampling -------------------------------------------------------------------

SMALL_V, N_NEW, SAMPLES = 6, 3, 2000
PROMPT = [1, 4]


def small_model(seed: int) -> Transformer:
    """A 1-layer Llama over 6 tokens: every 3-token continuation can be enumerated (216 cells)."""
    cfg = ModelConfig(family="llama", vocab_size=SMALL_V, hidden_size=32, intermediate_size=64, num_layers=1,
                      num_heads=2, num_kv_heads=1, head_dim=16, rms_eps=1e-6, max_position=64,
                      layer_rope=(RopeSpec(1e4),), layer_window=(None,))
    torch.manual_seed(seed)
    model = Transformer(cfg).eval()
    with torch.no_grad():
        model.lm_head.weight.mul_(4.0)  # peakier than the default init, so p and q differ clearly
    return model


def exact_joint(target, params):
    """P(first N_NEW generated tokens = cell) for every cell, by enumerating prefixes."""
    probs = {}
    for prefix_len in range(N_NEW):
        for prefix in itertools.product(range(SMALL_V), repeat=prefix_len):
            seq = PROMPT + list(prefix)
            # The engine's cache element type (`kv_dtype` "auto"): the target's p as the engine computes it.
            cache = target.new_cache(1, 16, dtype=resolve_kv_dtype("auto", torch.float32, "cpu"))
            logits, _ = target(torch.tensor([seq]), torch.arange(len(seq))[None], cache, last_n=1)
            probs[prefix] = process_logits(logits[0, -1], params)
    out = {}
    for cell in itertools.product(range(SMALL_V), repeat=N_NEW):
        pr = 1.0
        for i in range(N_NEW):
            pr *= float(probs[cell[:i]][cell[i]])
        out[cell] = pr
    return out


class BrokenDrafter(DraftModelDrafter):
    """Reports the processed q but draws its token from the raw softmax: the kind of mismatch
    between q and the sampling distribution that makes speculative sampling inexact."""

    def _choose(self, logits):
        q = process_logits(logits, self._sampling)
        return int(sample(logits.softmax(-1), self._generator)), q


def p_value(params, drafter, k):
    target = small_model(0)
    engine = Engine(target, None, drafter=drafter, num_speculative_tokens=k, draft_length="fixed")
    counts = {}
    for seed in range(SAMPLES):
        out = engine.generate(prompt_ids=PROMPT, max_new_tokens=N_NEW, sampling=SamplingParams(
            temperature=params.temperature, top_k=params.top_k, top_p=params.top_p, seed=seed))
        counts[tuple(out.token_ids)] = counts.get(tuple(out.token_ids), 0) + 1
    return chi_square_p(target, params, counts, strict=not isinstance(drafter, BrokenDrafter))


def chi_square_p(target, params, counts: dict, strict: bool = True) -> float:
    """The chi-square p-value of sampled continuations (`counts`: cell -> samples) against the
    exact joint distribution; with `strict`, no sample may fall in a cell of probability 0."""
    exact = exact_joint(target, params)
    assert set(counts) <= {c for c, p in exact.items() if p > 0} or not strict
    return pooled_chisquare_p(counts, list(exact), list(exact.values()), SAMPLES)


@pytest.mark.parametrize("params,p_min", [
    (SamplingParams(temperature=1.0), 0.0),
    # with the cut-off on (it drops ~half the draft positions here): still exact
    (SamplingParams(temperature=0.7, top_k=3), 0.6),
])
def test_sampling_follows_exact_target_distribution(params, p_min):
    # Target and draft disagree a lot (about 20% of drafts accepted), so the recovered-token path
    # from norm(max(0, p - q)) carries much of the mass.
    drafter = DraftModelDrafter(small_model(1), SMALL_V, draft_p_min=p_min)
    assert p_value(params, drafter, k=2) > 1e-3


def test_broken_q_is_caught():
    params = SamplingParams(temperature=0.7, top_k=3)
    assert p_value(params, BrokenDrafter(small_model(1), SMALL_V), k=2) < 1e-6


def test_seeded_sampling_reproducible():
    engine = Engine(small_model(0), None, drafter=DraftModelDrafter(small_model(1), SMALL_V, draft_p_min=0.3),
                    num_speculative_tokens=3, draft_length="fixed")
    runs = [engine.generate(prompt_ids=PROMPT, max_new_tokens=20, sampling=SamplingParams(temperature=1.0, seed=s))
            for s in (9, 9, 10)]
    assert runs[0].token_ids == runs[1].token_ids != runs[2].token_ids


# -- the default model and the CLI -----------------------------------------------------------------------


def test_default_model_as_its_own_draft(default_engine_fp32):
    e = default_engine_fp32
    drafter = DraftModelDrafter(e.model, e.model.config.vocab_size, tokenizer=e.tokenizer,
                                target_tokenizer=e.tokenizer)  # also checks the real tokenizer's ids
    spec = Engine(e.model, e.tokenizer, drafter=drafter, num_speculative_tokens=4, draft_length="fixed")
    prompt = "def fibonacci(n):\n    if n < 2:\n        return n\n"
    plain = e.generate(prompt=prompt, max_new_tokens=24)
    out = spec.generate(prompt=prompt, max_new_tokens=24)
    assert out.token_ids == plain.token_ids
    assert out.stats.accepted_tokens == out.stats.draft_tokens > 0


def test_cli_generate_with_draft_model(tiny):
    folder = str(tiny["gemma3"]["folder"])
    res = subprocess.run(
        [sys.executable, "-m", "specdec.cli", "generate", "--model", folder, "--drafter", folder, "--prompt-ids",
         "5,6,7,8,9", "--max-tokens", "12", "--dtype", "float32", "--draft-p-min", "0.01", "--compare", "--json"],
        capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr
    out = json.loads(res.stdout)
    assert out["identical"]
    assert out["speculative"]["stats"]["accepted_tokens"] == out["speculative"]["stats"]["draft_tokens"]

