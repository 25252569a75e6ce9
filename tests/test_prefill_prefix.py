"""Chunked prefill and prefix caching in the scheduler: same greedy output as plain decoding, and
a long prompt that arrives shares steps with the running rows."""

import pytest
import torch

from specdec import Engine, SamplingParams
from specdec.drafters.draft_model import DraftModelDrafter, DraftPool
from specdec.models import loader
from specdec.models.quant import cpu_int8_available
from specdec.prefix_cache import PrefixCache, common_prefix
from specdec.scheduler import BatchScheduler, Request, serving_drafters

from helpers import TINY_VOCAB as V, drive, make_tiny_hf
from test_eagle import random_head

# Greedy output is compared with plain decoding, so nothing here may depend on the machine's timing:
# the schedulers draft a fixed k (adaptive=False; the goodput rule picks k from measured step
# times), and one torch thread computes a row the same whatever the shape of the block it is in
# (on two threads the rounding of a row can follow the block's shape and flip a near-tie of these
# random models: test_chunked_prefill_same_output_and_shares_steps failed half the time that way).
pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """The tiny Gemma 3 (sliding window 8, so every shared prefix below spans several windows) and
    a draft model with the same vocabulary."""
    target, _ = loader.load(make_tiny_hf(tmp_path_factory.mktemp("t"), "gemma3")[0], torch.float32, "cpu")
    draft, _ = loader.load(make_tiny_hf(tmp_path_factory.mktemp("d"), "gemma3", seed=1)[0], torch.float32, "cpu")
    return target, draft


def ids(n, seed):
    return torch.randint(3, V, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def drive_ids(sched, handles):
    """`helpers.drive`: the token ids of each handle's completion."""
    return [c.token_ids for c in drive(sched, handles)]


def test_common_prefix():
    assert common_prefix([1, 2, 3, 4], [1, 2, 5]) == 2
    assert common_prefix([], [1]) == 0
    assert common_prefix([1, 2, 3], [1, 2, 3, 4]) == 3
    assert common_prefix([7], [8]) == 0


@pytest.mark.parametrize("with_draft", [False, True])
def test_prefix_cache_same_greedy_output_including_after_eviction(tiny, with_draft):
    target, draft = tiny
    system, other = ids(40, 1), ids(30, 2)
    # Requests sharing a system prompt, a conversation that grows turn by turn (each turn's prompt
    # extends the previous request's prompt and output), and a second family of prefixes that
    # pushes the first out of a small budget.
    prompts = [system + ids(5 + i, 10 + i) for i in range(3)] + [other + ids(6, 20), other + ids(4, 21)]
    prompts += [system + ids(7, 30)]  # back to the first prefix, after the evictions
    plain = Engine(target, None)
    drafters = dict(serving_drafters()[0])
    name = "none"
    if with_draft:
        drafters["draft_model"] = DraftModelDrafter(draft, V)
        name = "draft_model"
    refs, outs = [], []
    for budget in (0, 120):
        sched = BatchScheduler(target, None, adaptive=False, drafters=drafters, drafter=name, num_speculative_tokens=3,
                               max_batch=2, max_model_len=160, prefix_cache_tokens=budget)
        got = []
        turn = list(system)
        for step in range(3):  # a conversation: each prompt is the last prompt + its answer + a new turn
            turn = turn + ids(4, 40 + step)
            [answer] = drive_ids(sched, [sched.submit(Request(list(turn), 6))])
            got.append(answer)
            turn = turn + answer
        got += [drive_ids(sched, [sched.submit(Request(p, 8))])[0] for p in prompts]
        (refs if budget == 0 else outs).append(got)
        if budget:
            stats = sched.prefix_cache.stats
            assert stats.hits >= 5 and stats.evicted >= 1  # later turns and the shared prefix hit
            assert sched.counters.prompt_tokens_cached == stats.hit_tokens > 5 * 30
            assert sched.prefix_cache.held <= 120
    expected = []
    turn = list(system)
    for step in range(3):
        turn = turn + ids(4, 40 + step)
        answer = plain.generate(prompt_ids=turn, max_new_tokens=6).token_ids
        expected.append(answer)
        turn = turn + answer
    expected += [plain.generate(prompt_ids=p, max_new_tokens=8).token_ids for p in prompts]
    assert refs[0] == expected
    assert outs[0] == expected


def test_requests_arriving_together_share_their_system_prompt(tiny):
    """The prompt is stored right after its prefill, not when its request finishes: of four
    requests submitted together with one system prompt, the three prefilled after the first copy
    its prefix; greedy output is that of plain decoding."""
    target, _ = tiny
    system = ids(40, 3)
    prompts = [system + ids(5 + i, 50 + i) for i in range(4)]
    sched = BatchScheduler(target, None, adaptive=False, drafter="none", max_batch=4, max_model_len=160, prefix_cache_tokens=400)
    outs = drive_ids(sched, [sched.submit(Request(p, 6)) for p in prompts])
    plain = Engine(target, None)
    assert outs == [plain.generate(prompt_ids=p, max_new_tokens=6).token_ids for p in prompts]
    stats = sched.prefix_cache.stats
    assert stats.hits == 3 and stats.hit_tokens == 3 * 40
    assert sched.counters.prompt_tokens_cached == 3 * 40


def test_prefix_cache_lookup_and_eviction(tiny):
    target, _ = tiny
    cache = target.new_cache(1, 64)
    a = ids(40, 5)
    tokens = torch.tensor([a])
    target(tokens, torch.arange(40)[None], cache)
    store = PrefixCache(budget_tokens=60)
    store.insert(a[:20], cache, 0)
    store.insert(a, cache, 0)  # covers the first entry, which goes
    assert len(store) == 1 and store.held == 40
    kv, n = store.lookup(a[:30] + [1, 2])
    assert n == 30 and kv.length == 40
    assert store.lookup(a[:20]) [1] == 19  # one token is always left to score
    assert store.lookup(ids(40, 6)) is None
    store.insert(ids(30, 7), cache, 0)  # 70 > 60: the least recently used (a) goes
    assert store.stats.evicted == 1 and store.lookup(a) is None
    # The copied slots are those of a fresh prefill: scoring the rest gives the same logits.
    row = target.new_cache(1, 64)
    full, _ = target(tokens, torch.arange(40)[None], target.new_cache(1, 64))
    row.import_row(cache.export_row(0, 25), 0)
    rest, _ = target(tokens[:, 25:], torch.arange(25, 40)[None], row)
    torch.testing.assert_close(rest, full[:, 25:], rtol=1e-5, atol=1e-5)


def test_chunked_prefill_same_output_and_shares_steps(tiny):
    target, _ = tiny
    plain = Engine(target, None)
    chunk, long_prompt = 8, ids(100, 3)
    short = [ids(6 + i, 50 + i) for i in range(3)]
    sched = BatchScheduler(target, None, adaptive=False, drafter="ngram", num_speculative_tokens=3, max_batch=4,
                           max_model_len=200, prefill_chunk=chunk)
    running = [sched.submit(Request(p, 40)) for p in short]
    sched.run_once(wait=False)  # nothing was running: the short prompts are prefilled whole, one step
    assert sched.num_running == 3 and sched.counters.steps == 1
    late = sched.submit(Request(long_prompt, 10))
    steps_before = sched.counters.steps
    forwards_before = sched.counters.prefill_forwards
    iterations = 0
    while late._sync.empty():  # no delta yet: its prefill is not over
        sched.run_once(wait=False)
        iterations += 1
    # Its prompt went in chunks of `chunk` tokens, one per iteration, and every iteration also
    # stepped the running rows.
    assert iterations == -(-len(long_prompt) // chunk)
    assert sched.counters.prefill_forwards - forwards_before == iterations
    assert sched.counters.steps - steps_before == iterations
    outs = drive_ids(sched, running + [late])
    refs = [plain.generate(prompt_ids=p, max_new_tokens=40).token_ids for p in short]
    refs.append(plain.generate(prompt_ids=long_prompt, max_new_tokens=10).token_ids)
    assert outs == refs


def test_chunked_prefill_with_prefix_cache_and_departures(tiny):
    """Rows leave while a prompt is half prefilled (its row moves down); cached prefixes and
    chunks together; the background thread as the server runs it."""
    target, _ = tiny
    plain = Engine(target, None)
    system = ids(50, 8)
    prompts = [system + ids(3 + i % 4, 60 + i) for i in range(9)]
    lengths = [3 + (5 * i) % 11 for i in range(9)]
    sched = BatchScheduler(target, None, adaptive=False, drafter="suffix", num_speculative_tokens=2, max_batch=3,
                           max_model_len=128, prefill_chunk=5, prefix_cache_tokens=200).start()
    handles = [sched.submit(Request(p, n)) for p, n in zip(prompts, lengths)]
    outs = [h.result().token_ids for h in handles]
    sched.shutdown()
    assert outs == [plain.generate(prompt_ids=p, max_new_tokens=n).token_ids for p, n in zip(prompts, lengths)]
    assert sched.counters.prompt_tokens_cached > 0
    assert sched.num_running == 0 and int(sched.cache.lengths.sum()) == 0


def test_settings_are_checked(tiny):
    target, _ = tiny
    from specdec.errors import InvalidRequestError

    for bad in (dict(prefill_chunk=-1), dict(prefix_cache_tokens=-5), dict(prefill_chunk=2.5)):
        with pytest.raises(InvalidRequestError):
            BatchScheduler(target, None, max_model_len=64, **bad)


def test_serve_flags():
    import argparse

    from specdec.errors import InvalidRequestError
    from specdec.server.cli import add_arguments, settings_from_args

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    settings = settings_from_args(parser.parse_args(["--prefill-chunk", "64", "--prefix-cache-tokens", "0"]))
    assert settings.prefill_chunk == 64 and settings.prefix_cache_tokens == 0
    for flag in ("--prefill-chunk", "--prefix-cache-tokens"):
        with pytest.raises(InvalidRequestError, match=flag):
            settings_from_args(parser.parse_args([flag, "-1"]))


def test_eagle_rows_chunked_and_next_to_the_prefix_cache(tiny):
    """An EAGLE head reads every prompt token's hidden state: chunks hand them over in order, and
    its rows skip the prefix cache (a copy has no hidden states) while other rows use it."""
    from specdec.drafters.eagle import EagleDrafter

    target, _ = tiny
    head = random_head(target, 60)
    drafters = dict(serving_drafters()[0], eagle=EagleDrafter(head))
    system = ids(30, 9)
    prompts = [system + ids(4 + i, 70 + i) for i in range(6)]
    sched = BatchScheduler(target, None, adaptive=False, drafters=drafters, drafter="eagle", num_speculative_tokens=3, max_batch=2,
                           max_model_len=96, prefill_chunk=7, prefix_cache_tokens=300).start()
    handles = [sched.submit(Request(p, 12, drafter="eagle" if i % 2 else "none")) for i, p in enumerate(prompts)]
    outs = [h.result() for h in handles]
    sched.shutdown()
    plain = Engine(target, None)
    assert [o.token_ids for o in outs] == [plain.generate(prompt_ids=p, max_new_tokens=12).token_ids
                                           for p in prompts]
    assert sum(o.stats.draft_tokens for o in outs[1::2]) > 0
    assert 0 < sched.counters.prompt_tokens_cached <= 2 * len(system)  # only the "none" rows after the first


@pytest.mark.parametrize("drafter", ["none", "ngram"])
def test_prompts_cached_but_their_last_token_share_one_prefill(tiny, drafter):
    """Repeated prompts (each all in the prefix cache but its last token) arriving together are
    prefilled in one forward (`Engine.prefill_last`), with nothing running and next to running
    rows; a prompt that misses the cache in their midst takes the one-row prefill. Greedy output
    is plain decoding's."""
    target, _ = tiny
    plain = Engine(target, None)
    prompts = [ids(20 + 3 * i, 70 + i) for i in range(6)]
    lengths = [5, 9, 4, 7, 6, 8]
    sched = BatchScheduler(target, None, adaptive=False, drafter=drafter, num_speculative_tokens=2, max_batch=4,
                           max_model_len=96, prefill_chunk=64, prefix_cache_tokens=1000)
    first = drive_ids(sched, [sched.submit(Request(p, n)) for p, n in zip(prompts, lengths)])
    forwards = sched.counters.prefill_forwards
    assert forwards >= len(prompts)  # nothing was cached yet: a prefill (or chunks) each
    again = prompts[:3] + [ids(25, 90)] + prompts[3:]  # a miss in the middle
    again_lengths = lengths[:3] + [6] + lengths[3:]
    second = drive_ids(sched, [sched.submit(Request(p, n)) for p, n in zip(again, again_lengths)])
    refs = [plain.generate(prompt_ids=p, max_new_tokens=n).token_ids for p, n in zip(again, again_lengths)]
    assert first == refs[:3] + refs[4:]
    assert second == refs
    # 7 prompts in fewer forwards: the first three hits share one, the miss has its own, and the
    # later hits are admitted together as rows leave.
    assert sched.counters.prefill_forwards - forwards < len(again) - 1
    assert sched.counters.prompt_tokens_cached == sum(len(p) - 1 for p in prompts)
    assert sched.num_running == 0 and int(sched.cache.lengths.sum()) == 0


@pytest.mark.parametrize("quantize", ["none", "int8"])
def test_cached_prompts_join_the_running_rows_without_a_forward_of_their_own(tmp_path, quantize):
    """Prompts the prefix cache holds all of but the last token, arriving while rows run (which
    draft, so the step's blocks are padded), join those rows at once: the next step scores their
    last token and emits their first, with no prefill forward. Greedy rows (argmax of the int8
    head, or full logits), a row with log-probs and a seeded sampled row each give what the same
    request gives alone."""
    from specdec.models.quant import quantize_model
    from specdec.sampling import SamplingParams

    target, _ = loader.load(make_tiny_hf(tmp_path, "gemma3")[0], torch.float32, "cpu")
    if quantize != "none":
        quantize_model(target, quantize)
    prompts = [ids(20 + i, 200 + i) for i in range(3)]
    requests = [Request(prompts[0], 8), Request(prompts[1], 8, drafter="none"), Request(prompts[2], 8, logprobs=2),
                Request(prompts[0], 8, sampling=SamplingParams(temperature=0.8, seed=5))]
    alone = BatchScheduler(target, None, adaptive=False, drafter="ngram", num_speculative_tokens=3, max_batch=1, max_model_len=128)
    refs = []
    for r in requests:
        handle = alone.submit(r)
        while not handle.finished:
            alone.run_once(wait=False)
        refs.append(handle.result())

    sched = BatchScheduler(target, None, adaptive=False, drafter="ngram", num_speculative_tokens=3, max_batch=6, max_model_len=128,
                           prefill_chunk=64, prefix_cache_tokens=2000)
    drive(sched, [sched.submit(Request(p, 4)) for p in prompts])  # now cached
    runners = [sched.submit(Request(ids(8, 300 + i) * 3, 40)) for i in range(2)]  # repetitive: they draft
    for _ in range(3):
        sched.run_once(wait=False)
    assert sched.num_running == 2
    forwards, drafted = sched.counters.prefill_forwards, sched.counters.spec.draft_tokens
    handles = [sched.submit(r) for r in requests]
    sched.run_once(wait=False)
    assert sched.num_running == 6 and sched.counters.prefill_forwards == forwards
    assert all(not h._sync.empty() for h in handles)  # each has its first token from that step
    while not all(h.finished for h in handles + runners):
        sched.run_once(wait=False)
    done = [h.result() for h in handles]
    assert sched.counters.prefill_forwards == forwards and sched.counters.spec.draft_tokens > drafted
    assert [d.token_ids for d in done] == [r.token_ids for r in refs]
    # (float32 matrix products round a row by the shape of their block: the log-probs agree closely)
    assert [lp.token for lp in done[2].logprobs] == [lp.token for lp in refs[2].logprobs] == refs[2].token_ids
    assert [lp.logprob for lp in done[2].logprobs] == pytest.approx([lp.logprob for lp in refs[2].logprobs], abs=1e-5)
    assert sched.num_running == 0 and int(sched.cache.lengths.sum()) == 0


@pytest.mark.parametrize("quantize", ["int8", "int4"])
def test_a_quantised_prompt_prefilled_in_pieces_is_bit_identical_to_one_prefill(tmp_path, quantize):
    """A quantised model's layers run row by row in every block (`Block.forward`), so a prompt
    prefilled in pieces (chunked prefill, a prefix-cache hit and the rest, one token more) holds the
    same cache bits and scores its last token with the same logits as one prefill of it. Before,
    blocks over 32 tokens took SDPA and rounded by block shape: the Qwen pair's greedy answer
    changed after a prefix-cache hit. Longer than 32 tokens on purpose, in pieces on both sides."""
    from specdec.models.quant import quantize_model

    if not cpu_int8_available():
        pytest.skip("needs the compiled CPU kernels")
    target, _ = loader.load(make_tiny_hf(tmp_path, "gemma3")[0], torch.float32, "cpu")
    quantize_model(target, quantize)
    prompt = ids(90, 7)

    def prefill(cuts: list[int]):
        cache = target.new_cache(1, 96)
        bounds = [0, *cuts, len(prompt)]
        with torch.inference_mode():
            for a, b in zip(bounds, bounds[1:]):
                logits, _ = target(torch.tensor([prompt[a:b]]), torch.arange(a, b)[None], cache, last_n=1,
                                   need_hidden=False)
        return logits[0, -1], cache

    whole, cache = prefill([])
    for cuts in ([89], [50], [33], [40, 80], list(range(16, 90, 16))):
        part, pieces = prefill(cuts)
        assert torch.equal(part, whole), cuts
        for layer in range(len(cache.keys)):
            assert torch.equal(pieces.keys[layer][:, :, :90], cache.keys[layer][:, :, :90]), (cuts, layer)
            assert torch.equal(pieces.values[layer][:, :, :90], cache.values[layer][:, :, :90]), (cuts, layer)


def test_a_draft_model_reads_a_resent_conversation_once_per_partition(tiny, monkeypatch):
    """The draft model's row is kept between requests of one prefix-cache partition: a
    conversation's next turn reads only what the last one did not leave read (the new turn), as the
    target copies the rest from its prefix cache; a request of another partition, or a seeded
    sampled one (whose read decision must not depend on earlier requests), reads its whole prompt.
    Greedy output stays plain decoding's."""
    target, draft = tiny
    reads = []
    real = DraftModelDrafter._run

    def counting(self, new, start, last_n, need_hidden=True):
        if last_n == 0:  # a read: the context's tokens, no head
            reads.append((start, len(new)))
        return real(self, new, start, last_n, need_hidden)

    monkeypatch.setattr(DraftModelDrafter, "_run", counting)
    plain = Engine(target, None)
    drafters = dict(serving_drafters()[0], draft_model=DraftModelDrafter(draft, V))
    sched = BatchScheduler(target, None, adaptive=False, drafters=drafters, drafter="draft_model",
                           num_speculative_tokens=3, max_batch=2, max_model_len=200, prefix_cache_tokens=400,
                           draft_length="fixed")
    turn, read_per_turn = ids(40, 3), []
    for step in range(3):
        turn = turn + ids(12, 60 + step)
        reads.clear()
        [answer] = drive_ids(sched, [sched.submit(Request(list(turn), 6, cache_partition=("alice", "")))])
        assert answer == plain.generate(prompt_ids=turn, max_new_tokens=6).token_ids
        read_per_turn.append(sum(n for _, n in reads))
        turn = turn + answer
    # The first proposal comes after the prefill's token: it reads the prompt (that token is forwarded
    # with the first draft). Later turns start from the row the last turn left (its prompt and the
    # answer it drafted along), so they read the new turn's 12 ids and a token or two of the answer.
    assert read_per_turn[0] == 40 + 12
    assert all(n <= 12 + 3 for n in read_per_turn[1:]) and all(start >= 40 + 12 for start, _ in reads)
    for partition, sampling in ((("bob", ""), SamplingParams()), (("alice", ""), SamplingParams(temperature=1.0, seed=5))):
        reads.clear()
        drive_ids(sched, [sched.submit(Request(list(turn), 4, sampling=sampling, cache_partition=partition))])
        assert reads[0] == (0, len(turn))  # nothing kept for it: the whole prompt


def test_the_draft_pool_matches_kept_rows_within_their_partition(tiny):
    _, draft = tiny
    pool = DraftPool(draft.new_cache(3, 64))
    a, b = ids(30, 8), ids(30, 9)
    for slot, held in ((0, a), (1, b)):
        got, _ = pool.acquire(held, None)
        assert got == slot
        pool.cache.lengths[slot] = len(held)
        pool.release(slot, held, ("t", "s") if slot == 0 else ("u", ""))
    # Its own partition's row, cut to the common prefix (never the last id of the view).
    assert pool.acquire(a[:20] + [1, 2], ("t", "s")) == (0, a[:20]) and int(pool.cache.lengths[0]) == 20
    pool.release(0, a[:20], ("t", "s"))
    assert pool.acquire(a[:15] + [1], ("t", "s")) == (2, [])  # under MIN_KEPT_TOKENS: an empty row
    # Another partition's row holding the very ids is not matched: the row released longest ago
    # is taken, emptied.
    assert pool.acquire(b, ("t", "s")) == (1, [])
    assert int(pool.cache.lengths[1]) == 0 and pool.kept == {0: (("t", "s"), a[:20])}
    assert pool.acquire(a, None) == (0, []) and int(pool.cache.lengths[0]) == 0  # no partition: nothing kept
