"""Draft model: a smaller Transformer with the target's vocabulary guesses the next k tokens.

The draft runs autoregressively, one token per forward pass, on its own KV cache. Its guesses are
verified by the target like any other drafter's; what makes it different is that it has a real
distribution q, so under sampling it proposes tokens *drawn from* q and hands q to the verifier
(speculative sampling is exact for any q, and the closer q is to p the more gets accepted).

Cache sync. The drafter never hears which tokens the engine emitted, only the next `context`
(prompt + everything emitted). It remembers `_tokens`, the ids whose keys and values its cache
holds (cache length == len(_tokens) always), and on each `propose(context, k)`:

1. keeps the common prefix of `_tokens` and `context` (`cache.truncate`), but at most
   len(context) - 1 tokens, because the logits for the first draft come from forwarding the last
   context token;
2. forwards the missing tail of `context` in one pass (it is short in steady state);
3. drafts: pick a token from the logits, forward it, repeat; the last draft is not forwarded
   (nothing reads its logits yet).

After a step the context grows by the accepted drafts plus one recovered / bonus token. The
accepted drafts are already in the cache (step 3 forwarded them), so step 2 forwards one token;
when all k were accepted the last draft was never forwarded, and step 2 forwards two (the last
draft and the bonus token). A rejection simply truncates the stale drafts away. No bookkeeping in
`feedback` is needed, and a context that does not extend the previous one (a new request without
`begin`, a caller rolling back) is handled by the same prefix rule.

Sampling. q is the draft's logits run through `sampling.process_logits` with the *request's*
`SamplingParams` (the same temperature, top-k, top-p and min-p as the target's p), and draft tokens
are drawn from q with the request's generator, both handed over in `begin`. Greedy requests take
the argmax and return q = None (one-hot), which is what greedy verification compares against.

Confidence cut-off (llama.cpp's --draft-p-min). Drafting stops before position i when the top
probability there is below `draft_p_min`: of q under sampling, of the raw softmax under greedy
(where q is one-hot and says nothing). A low top probability predicts a rejection, and a draft
token that will be rejected costs a draft forward and a wider verify pass for nothing. Stopping is
a decision taken from the draft's own state before its token is drawn, so it leaves verification
exact; an empty draft makes the engine do a plain step.

Chain stop. Under the cost rule the engine hands each row a `policy.ChainStop` (`stop_by`) and
asks for the most tokens the rule allows: `_choose` reports each position's confidence (the same
top probability) to it, and the chain ends where the product of the confidences so far no longer
pays for scoring another token, or for reading another position, at the rate the request earns.
The confidences are the draft's own (q under sampling), read before its token is drawn, so the
stop leaves verification exact and a seeded request's draws independent of timings (its price is
the prior). The cut-off above stays a floor under it.

Prompt window (`window=W`, off by default). The draft reads only the prompt's first PROMPT_SINK
tokens and its last W, at consecutive positions (`_view`): a long prompt's read (`read`) costs
the draft W + PROMPT_SINK tokens instead of all of them. Only acceptance can change (the target
verifies); on the tuning prompts it fell on the long summarization and QA prompts and the saving
did not make up for it, hence off.

Reading the prompt. `begin` only makes room: the prompt stays `pending` until the core first
means to ask for drafts, and `read` then forwards it (without a head) apart from the proposals.
The core reads it only where the answer's remaining tokens can pay the read back
(`policy.AskGate.reads`): for a prompt of several hundred tokens the read costs the draft as many
target steps as a 128-token answer's drafts save, and it is paid before any draft is proposed.

Reduced vocabulary (FR-Spec, Zhao et al. 2025). With `vocab=N` the draft scores only N ids: the
first N of its vocabulary (a byte-level BPE numbers its tokens in merge order, which follows their
frequency in the tokenizer's corpus) and its special tokens (EOS, end of turn). Its output head is
then a copy of those N rows: Qwen2.5-0.5B's full head is 151,936 x 896, a quarter of the bytes a
draft token reads. The other ids have probability 0, so the draft never proposes them; q (under
sampling) is the distribution over the kept ids that the token was really drawn from. The draft
chooses from the N scores themselves (argmax, top probability, q) and names a target id only for the
token it chose, and under sampling widens q to the target's vocabulary (0 elsewhere) for the
verifier: nothing of the full vocabulary's size is scored or normalised. Verification is unchanged
(the target scores its full vocabulary), so the output stays exact; only acceptance can drop, where
the target's token is one the draft cannot name.

A 4-bit draft (`quantize="int4"`: its decoder layers on 4 bits) also scores with a 4-bit copy of
its output head (`int4_head`; the model's own head stays int8, as `quant.quantize_model` leaves
it): Qwen2.5-0.5B's 151,936 x 896 head is then 85 MB a token instead of 136. A draft's numbers only
move its acceptance, never the output, so the head may be coarser than the target's would be.

Cache elements (`draft_kv_dtype`). A quantised draft keeps its keys and values in float16 under
the engine's default `kv_dtype`, as the target does: at a long context the draft's attention over
its cache is most of what a position costs beyond its weights, and float16 halves the bytes it
reads. A float draft keeps its own dtype (see `draft_kv_dtype` for why).

Price. Each draft token costs a forward of the draft model, which a lookup drafter's does not.
`measure_cost(target)` times a draft position as a chain pays it (a one-token forward through the
drafting head, the confidence and the choice) against a one-token step of the target, and keeps the
ratio in `draft_cost`;
the cost-aware draft length (`policy.CostAwareDraftLength`) starts its online price of a draft
token (`policy.DraftCost`) from it and charges it per drafted token, so the draft model drafts only
where its measured acceptance pays for both its own forwards and the wider verify pass.

Vocabularies. The target's vocabulary is the one that counts: draft logits for ids the target does
not have are dropped, ids the draft does not have get probability 0, so q always has the target's
vocabulary size. Models of one family are often padded to a round size, so sizes within
`VOCAB_SIZE_TOLERANCE` are accepted; a larger difference, or tokenizers that spell a sample of ids
differently, is an `InvalidRequestError`.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path

import torch
from torch import Tensor

from specdec.drafters import draft_cache
from specdec.drafters.base import (DrafterBase, DrafterNeeds, Proposal, check_k, common_prefix_length, draft_chain,
                                   draft_rows)
from specdec.errors import InvalidRequestError
from specdec.models.kv_cache import KVCache, resolve_kv_dtype
from specdec.models.quant import quantize_of
from specdec.models.transformer import Transformer, soft_cap
from specdec.sampling import SamplingParams, greedy_tokens, make_generator, process_logits, sample

# Padding differences seen in practice are up to 128 ids (e.g. Qwen2.5 sizes); llama.cpp uses the
# same bound for its draft-model check.
VOCAB_SIZE_TOLERANCE = 128
# Confidence cut-off used when none is given; 0 turns it off. A draft that is always right only
# loses drafts to a cut-off; with a poor draft it limits the damage, but plain decoding was better
# still (a check on the default model and a cut copy of it). So off by default; worth setting for a draft of uneven
# quality (a named pair sets its own).
DEFAULT_DRAFT_P_MIN = 0.0
_INITIAL_ROOM = 256  # cache slots beyond the prompt at `begin`; the cache doubles when full
_SAMPLE_IDS = 512  # ids whose spelling is compared between the two tokenizers
_BATCHED_CATCH_UP = 4  # context tokens a row catches up with inside a batched forward, at most
# With a prompt window, the prompt's first tokens the draft always reads: a chat template's system
# turn and the start of the user's, which also serve as the attention sink a model expects at the
# start of its context (StreamingLLM, Xiao et al. 2023).
PROMPT_SINK = 32
# The cut-off `measure_cost`'s twin drafts with: above 0, so every position's confidence is read (as
# under a chain stop), and below any probability, so no token is dropped.
_KEEP_ANY = math.ulp(0.0)


class DraftModelDrafter(DrafterBase):
    """Drafts with a small model on its own KV cache; see the module docstring for the design.

    model: any `Transformer` specdec loads, on the device (and usually the dtype) of the target.
    target_vocab_size: the target's vocabulary size; q rows have this length.
    draft_p_min: confidence cut-off in [0, 1]; 0 = off.
    tokenizer, target_tokenizer: the two models' tokenizers where both have one: a sample of ids
        must decode alike, else `InvalidRequestError`.
    """

    name = "draft_model"
    needs = DrafterNeeds(batches=True, reads=True, stops=True, model=True)

    def __init__(
        self,
        model: Transformer,
        target_vocab_size: int,
        draft_p_min: float = DEFAULT_DRAFT_P_MIN,
        tokenizer=None,
        target_tokenizer=None,
        vocab: int | None = None,
        int4_head: bool | None = None,
        window: int | None = None,
        kv_dtype: str = "auto",
        cache_folder: Path | None = None,
    ):
        check_same_vocabulary(target_vocab_size, model.config.vocab_size, target_tokenizer, tokenizer)
        self.model = model
        self.target_vocab_size = target_vocab_size
        self.draft_p_min = float(draft_p_min)
        self.draft_cost: float | None = None  # one draft token in target steps (`measure_cost`)
        # Reduced vocabulary: the kept ids [m] (sorted); None = all. `_sub_head`: the head the draft
        # scores with when it is not the model's own (the kept rows, and/or on 4 bits).
        self.vocab_ids: Tensor | None = None
        self._sub_head = None
        if vocab:
            kept = frequent_ids(model.config.vocab_size, vocab, special_ids(model, tokenizer))
            self.vocab_ids = kept[kept < target_vocab_size]  # an id the target lacks is never drafted
        if int4_head is None:
            int4_head = quantize_of(model) == "int4"
        # `cache_folder`: the kernel-layout entry `model` was loaded from, where its 4-bit drafting head
        # and measured price are kept between loads (`draft_cache`); None keeps nothing.
        self.cache_folder = cache_folder
        if vocab or int4_head:
            make = lambda: _rows_of(model.lm_head, self.vocab_ids, int4_head)  # noqa: E731
            self._sub_head = draft_cache.sub_head(cache_folder, self.vocab_ids, make) if int4_head else make()
        self.kv_dtype = draft_kv_dtype(model, kv_dtype)  # the element type of every cache it makes
        self._sampling = SamplingParams()
        self._generator: torch.Generator | None = None
        self._cache: KVCache | None = None
        self._tokens: list[int] = []  # ids whose keys/values the cache holds, in order
        self._pool: DraftPool | None = None  # shared by the spawned rows of a server (`reserve`)
        self._slot: int | None = None  # this request's row of the pool's cache
        # Kept between requests (`keep_within`): the partition whose requests may start from what
        # this one leaves in the draft's cache (None: start empty, leave nothing), and, without a
        # pool, what the last request left: (partition, cache, ids its slots hold).
        self._partition: object = None
        self._kept: tuple[object, KVCache, list[int]] | None = None
        self._stop = None  # the row's `policy.ChainStop` (`stop_by`); None: draft the k asked for
        # Prompt window: the draft reads the prompt's first PROMPT_SINK tokens and its last `window`
        # (None: all of it); `_cut` is where this request's skipped middle ends (0: nothing skipped).
        self.window = window
        self._cut = 0

    @classmethod
    def load(
        cls,
        source: str | Path,
        target_vocab_size: int,
        dtype: torch.dtype,
        device,
        *,
        draft_p_min: float = DEFAULT_DRAFT_P_MIN,
        target_tokenizer=None,
        progress=None,
        quantize: str = "none",
        vocab: int | None = None,
        kv_dtype: str = "auto",
    ) -> "DraftModelDrafter":
        """Load a draft model from an HF folder or a .gguf file (converted once, as for targets).

        `quantize="int8"` puts its linears and output head on int8 (`quant.quantize_model`), the
        target's fast path; a draft token then costs a fraction of a target token rather than more.
        `kv_dtype` is the engine's cache setting, which the draft's cache follows (`draft_kv_dtype`).
        """
        from specdec.models import loader
        from specdec.tokenizer import Tokenizer

        model, folder = loader.load(source, dtype, device, progress, quantize=quantize)
        tokenizer = Tokenizer.for_encoding(folder, target_tokenizer)  # the target's where the files are the same
        cache_folder = folder if draft_cache.entry_of(model) is not None else None
        return cls(model, target_vocab_size, draft_p_min, tokenizer, target_tokenizer, vocab,
                   kv_dtype=kv_dtype, cache_folder=cache_folder)

    def measure_cost(self, target: Transformer, context: int = 64, repeats: int = 5) -> float:
        """Time one draft token and one one-token step of `target` after a `context`-token prompt,
        in turns (median of `repeats` each), and keep their ratio in `draft_cost`. The process's
        CPU time, not the wall's: another process taking the core for a moment must not set the price.

        The draft token is what a chain pays per position (`draft_step_seconds`): the draft
        model's forward of one token with the head it drafts with (`_sub_head` where it has one),
        its confidence and its choice; not the model's own full head, which drafting never reads.

        Where both models come from kernel-layout entries, the price measured on this machine with
        these threads is kept in the draft's entry and read back at the next load (`draft_cache`:
        it prices drafts only, so it never changes an output).
        """
        import statistics
        import time

        key = draft_cache.cost_key(target, self, context, repeats)
        kept = draft_cache.kept_cost(self.cache_folder, key)
        if kept is not None:
            self.draft_cost = kept
            return kept

        ids = [(101 + 7 * i) % min(target.config.vocab_size, self.model.config.vocab_size) for i in range(context)]
        cache = target.new_cache(1, context + 2)
        target(torch.tensor([ids], device=self.device), torch.arange(context, device=self.device)[None], cache,
               last_n=1, need_hidden=False)
        step, position = torch.tensor([[ids[-1]]], device=self.device), torch.tensor([[context]], device=self.device)
        twin = self._twin_for_timing(ids)
        times: dict[int, list[float]] = {0: [], 1: []}
        for _ in range(repeats + 1):  # the first round warms up
            start = time.process_time()
            target(step, position, cache, last_n=1, need_hidden=False)
            times[0].append(time.process_time() - start)
            cache.truncate(context)
            times[1].append(twin.draft_step_seconds(ids))
        twin.end([])
        self.draft_cost = draft_cache.keep_cost(self.cache_folder, key,
                                                statistics.median(times[1][1:]) / statistics.median(times[0][1:]))
        return self.draft_cost

    def _twin_for_timing(self, prompt: list[int]) -> "DraftModelDrafter":
        """A drafter on these weights, with a cache of its own holding `prompt` but its last token,
        greedy, reading its confidence at every position (as under a chain stop) and keeping every
        token: what `draft_step_seconds` times."""
        twin = self.spawn()
        twin._pool = None
        twin.draft_p_min = _KEEP_ANY  # the confidence is read; no token falls below it
        twin.begin(prompt[:-1])
        twin.read(prompt)  # begin leaves the prompt unread (`pending`); the cache holds prompt[:-1]
        return twin

    def draft_step_seconds(self, context: list[int]) -> float:
        """CPU seconds of one draft position, as a chain pays it: forward `context`'s last token
        (the cache holds the rest) through the draft and its drafting head, read the confidence and
        choose the token; the cache is then rolled back to hold context[:-1] again."""
        import time

        start = time.process_time()
        self._choose(self._forward(list(context[-1:]), len(context) - 1))
        seconds = time.process_time() - start
        self._rewind(context)
        return seconds

    # -- protocol -------------------------------------------------------------------------------

    def spawn(self) -> "DraftModelDrafter":
        """Another request's drafter on the same weights (its own state; its own cache, or a row
        of the shared pool's once `reserve` made one)."""
        twin = type(self).__new__(type(self))
        twin.__dict__.update(self.__dict__)
        twin._slot = None
        twin._stop = None
        twin._partition, twin._kept = None, None
        twin.end([])
        twin._sampling = SamplingParams()
        return twin

    def reserve(self, rows: int, length: int) -> KVCache:
        """Rows spawned from here from now on share one KV cache of `rows` rows x `length` slots,
        so that the rows of a batch draft in one forward per draft position (`propose_batch`)."""
        pool = self._pool
        if pool is None or pool.cache.batch < rows or pool.cache.capacity < length:
            self._pool = pool = DraftPool(self.model.new_cache(rows, length, dtype=self.kv_dtype))
        return pool.cache

    def batch_member(self) -> "DraftModelDrafter":
        return self

    def batch_key(self) -> object | None:
        """Rows whose drafters return the same key propose together (`propose_batch`)."""
        return self._pool if self._slot is not None else None

    def propose_batch(self, drafters: list["DraftModelDrafter"], contexts: list[list[int]],
                      ks: list[int]) -> list[Proposal]:
        return propose_batch(drafters, contexts, ks)

    def begin(self, prompt_ids: list[int], sampling: SamplingParams | None = None,
              generator: torch.Generator | None = None, *, window: int | None = None) -> None:
        """`window`: this request's prompt window (`PromptReader.begin`); the drafter's own wins if narrower."""
        self._sampling = sampling or SamplingParams()
        if generator is None and not self._sampling.greedy:
            generator = make_generator(self._sampling.seed, self.device)
        self._generator = generator
        self._cut = 0
        if window is None or (self.window is not None and self.window < window):
            window = self.window
        if window is not None and len(prompt_ids) > PROMPT_SINK + window:
            self._cut = len(prompt_ids) - window
        # A seeded sampled row starts empty: whether its prompt read pays (`policy.AskGate.reads`)
        # must not depend on what earlier requests left, or its seed would not fix its text.
        reuse = self._partition if self._sampling.greedy or self._sampling.seed is None else None
        view = self._view(prompt_ids)
        if self._pool is not None:
            if self._slot is None:
                self._slot, held = self._pool.acquire(view, reuse)
            else:
                self._pool.cache.truncate(0, row=self._slot)
                held = []
            self._cache = self._pool.cache.rows(self._slot + 1, self._slot)
        else:
            kept, self._kept = self._kept, None
            held = kept_prefix(kept[2], view) if kept is not None and reuse is not None and kept[0] == reuse else []
            if held:
                self._cache = kept[1]
                self._cache.truncate(len(held))
            else:
                self._cache = self.model.new_cache(1, len(prompt_ids) + _INITIAL_ROOM, dtype=self.kv_dtype)
        self._tokens = held
        # The prompt is not read here: reading it is the draft's largest single cost (a prompt of a
        # few hundred tokens costs as many plain target steps as a short answer saves), paid before
        # any draft is proposed. It is `pending` until the core first means to ask, which `read`s
        # it apart from the drafts (their price per token stays that of drafting) where the
        # answer's remaining tokens can pay it back (`policy.AskGate.reads`), or never.

    def propose(self, context: list[int], k: int) -> Proposal:
        check_k(k)
        k = min(k, self.model.config.max_position - len(context))  # the draft's own context limit
        if k <= 0 or not context:
            return Proposal([])
        if self._cache is None:  # propose without begin: start a greedy request
            self.begin(list(context))
        context = self._view(context)
        scores = self._sync(context)  # [columns] (`_scores`) for the token after context
        # Draft i sits at position len(context) + i; the last one is forwarded next time, if accepted.
        if self._stop is not None:
            self._stop.start()
        return draft_chain(self._choose, lambda token, i: self._forward([token], len(context) + i), scores, k,
                           None if self._stop is None else self._stop.more)

    def stop_by(self, stop) -> None:
        self._stop = stop

    def pending(self, context: list[int]) -> int:
        """Tokens of `context` (as the draft reads it, `_view`) that are not in the cache, the last
        one excepted (a proposal forwards it for its first logits); 0 when no more than
        _BATCHED_CATCH_UP are missing, which a proposal reads along in its first forward."""
        if self._cache is None or not context:
            return 0
        view = self._view(context)
        missing = len(view) - 1 - reusable_prefix(self._tokens, view)
        return missing if missing > _BATCHED_CATCH_UP else 0

    @torch.inference_mode()
    def read(self, context: list[int]) -> None:
        """Forward the missing part of `context` but its last token into the cache (no head: no
        logits are needed until a proposal)."""
        if self._cache is None:
            self.begin(list(context))
        view = self._view(context)
        keep = self._rewind(view)
        if keep < len(view) - 1:
            self._run(view[keep:-1], keep, last_n=0)

    def _view(self, context: Sequence[int]) -> list[int]:
        """What the draft reads of `context`: all of it, or with a prompt window the prompt's first
        PROMPT_SINK tokens and everything from `_cut` on, at consecutive positions."""
        if not self._cut:
            return list(context)
        return list(context[:PROMPT_SINK]) + list(context[self._cut:])

    def _choose(self, scores: Tensor) -> tuple[int | None, Tensor | None]:
        """One draft position: (token, q row) from the draft's scores [columns] (`_scores`: its
        scored ids only, in increasing id order); token None = stop here.

        Greedy: the argmax, q None (one-hot); the cut-off and the chain stop read the softmax of
        the scores. Sampling: q is the processed distribution over the scored ids, the token is
        drawn from it; they read q, handed over widened to the target's vocabulary (0 for ids the
        draft does not score, which it never draws). Ids outside the scores have logit -inf, so
        probability 0: reading only the scored columns gives the same argmax (the kept ids are in
        increasing order, so a tie still goes to the lowest id), the same top probability and the
        same processed q as over the full vocabulary (every sampling filter keeps or drops the
        scored ids alike), without a softmax over the full vocabulary.
        """
        if self._sampling.greedy:
            if (self.draft_p_min > 0 or self._stop is not None) and not self._keeps(float(scores.softmax(-1).max())):
                return None, None
            return self._target_id(greedy_tokens(scores[None])[0]), None
        q = process_logits(scores, self._sampling)  # [columns]
        if (self.draft_p_min > 0 or self._stop is not None) and not self._keeps(float(q.max())):
            return None, None
        return self._target_id(int(sample(q, self._generator))), self._target_q(q)

    def _target_id(self, column: int) -> int:
        """The target id of a column of the scores."""
        return column if self.vocab_ids is None else int(self.vocab_ids[column])

    def _target_q(self, q: Tensor) -> Tensor:
        """q over the scored columns [columns] -> over the target's vocabulary [target_vocab], 0 elsewhere."""
        if self.vocab_ids is None and q.shape[-1] == self.target_vocab_size:
            return q
        return self._widen(q, 0.0)

    def _target_logits(self, scores: Tensor) -> Tensor:
        """The scores [columns] as logits over the target's vocabulary [target_vocab], -inf for ids
        the draft does not score: what the draft's distribution is over the target's ids (tests
        and introspection; drafting reads the scores themselves)."""
        return self._widen(scores, -math.inf)

    def _widen(self, values: Tensor, fill: float) -> Tensor:
        """values over the scored columns [columns] at their target ids in [target_vocab], `fill` elsewhere."""
        full = values.new_full((self.target_vocab_size,), fill)
        if self.vocab_ids is None:
            full[: values.shape[-1]] = values
        else:
            full[self.vocab_ids] = values
        return full

    def _keeps(self, p: float) -> bool:
        """Whether a draft token of confidence p is proposed: the chain stop (told of every position
        read, so it counts the forwards) and the cut-off both agree."""
        keep = self._stop is None or self._stop.take(p)
        return keep and p >= self.draft_p_min

    def feedback(self, num_accepted: int) -> None:
        # Nothing to do: the next propose truncates the rejected drafts by the prefix rule.
        pass

    def keep_within(self, partition: object) -> None:
        """Let this drafter's requests start from what an earlier request of `partition` left in
        the draft's cache (the longest common prefix of their ids), and leave theirs for a later
        one; None (the default): start empty, leave nothing. See `DraftPool`."""
        self._partition = partition

    def end(self, output_ids: list[int]) -> None:
        # Slots are kept only while the cache holds exactly the ids `_tokens` names (a fault in a
        # forward may have left them apart).
        exact = self._cache is not None and self._cache.length() == len(self._tokens)
        keep = self._tokens if exact and self._partition is not None else None
        if self._slot is not None:
            self._pool.release(self._slot, keep, self._partition)
            self._slot = None
        elif keep:
            self._kept = (self._partition, self._cache, keep)
        self._cache = None  # free the cache between requests (a kept one lives on in `_kept`)
        self._tokens = []
        self._generator = None

    # -- introspection (tests, stats) -----------------------------------------------------------

    @property
    def device(self) -> torch.device:
        return self.model.embed_tokens.weight.device

    @property
    def cached_tokens(self) -> list[int]:
        """The ids whose keys and values the draft cache holds (a copy)."""
        return list(self._tokens)

    @property
    def cache_length(self) -> int:
        return 0 if self._cache is None else self._cache.length()

    # -- cache sync -----------------------------------------------------------------------------

    def _sync(self, context: Sequence[int]) -> Tensor:
        """Make the cache hold context[:-1] + the last token's keys; return the draft's scores for
        the next token (`_scores`)."""
        keep = self._rewind(context)
        return self._forward(list(context[keep:]), keep)

    def _rewind(self, context: Sequence[int]) -> int:
        """Keep what the cache holds of `context` (`reusable_prefix`); return how many tokens."""
        keep = reusable_prefix(self._tokens, context)
        self._cache.truncate(keep)
        del self._tokens[keep:]
        return keep

    def _forward(self, new: list[int], start: int) -> Tensor:
        """Forward `new` at positions start.. (start == cache length); the scores after the last one.

        Returns the draft's scores [columns] float32 (`_scores`): what `_choose` reads.
        """
        if self._sub_head is None:
            logits, _ = self._run(new, start, last_n=1, need_hidden=False)
            return logits[0, -1, : self.target_vocab_size]
        _, hidden = self._run(new, start, last_n=0)  # no full head
        return self._scores(hidden[0, -1:])[0]

    def _run(self, new: list[int], start: int, last_n: int, need_hidden: bool = True):
        """The draft model's forward of `new` at positions start.. (start == cache length) into the
        cache: its (logits, hidden) for `last_n` (0: no head)."""
        assert start == len(self._tokens) == self._cache.length()
        self._ensure_room(len(new))
        vocab = self.model.config.vocab_size
        # Ids only the target has (padding region) cannot be embedded: feed 0 instead. This can
        # only make the draft worse, never the output wrong (verification decides).
        ids = torch.tensor([[t if t < vocab else 0 for t in new]], device=self.device)  # [1, T]
        positions = torch.arange(start, start + len(new), device=self.device)[None]  # [1, T]
        out = self.model(ids, positions, self._cache, last_n=last_n, need_hidden=need_hidden)
        self._tokens.extend(new)
        return out

    @torch.inference_mode()
    def _scores(self, hidden: Tensor) -> Tensor:
        """hidden [rows, h] -> the draft's scores [rows, columns] float32: the logits of the ids it
        drafts from, in increasing id order, and no others. With a reduced vocabulary those are the
        kept ids (`vocab_ids`, column j is id vocab_ids[j]), scored by the kept rows only;
        otherwise the ids both vocabularies have (column j is id j). Nothing of the size of the
        full vocabulary is made: the other ids have probability 0 and are never drafted."""
        if self._sub_head is None:
            return self.model.head(hidden)[:, : self.target_vocab_size]
        sub = soft_cap(self._sub_head(hidden).float(), self.model.config.final_logit_softcap)  # [rows, m]
        return sub if self.vocab_ids is not None else sub[:, : self.target_vocab_size]

    def _ensure_room(self, new_tokens: int) -> None:
        """Grow the cache (double, copying the filled slots) when `new_tokens` would not fit."""
        cache = self._cache
        need = cache.length() + new_tokens
        if need <= cache.capacity or self._slot is not None:  # a pool row is sized for any request
            return
        grown = self.model.new_cache(1, max(need, 2 * cache.capacity), dtype=cache.keys[0].dtype)
        n = cache.length()
        for src, dst in ((cache.keys, grown.keys), (cache.values, grown.values)):
            for layer_src, layer_dst in zip(src, dst):
                layer_dst[:, :, :n] = layer_src[:, :, :n]
        grown.positions[:, :n] = cache.positions[:, :n]
        grown.truncate(n)
        self._cache = grown


MIN_KEPT_TOKENS = 16  # a shorter common prefix with a kept row is not worth taking it for


def reusable_prefix(held: Sequence[int], context: Sequence[int]) -> int:
    """How many of the ids a draft cache holds (`held`) a read of `context` keeps: their common
    prefix, but never `context`'s last id, which is forwarded again for the scores after it."""
    return min(common_prefix_length(held, context), len(context) - 1)


def kept_prefix(held: list[int], view: list[int]) -> list[int]:
    """The ids of `held` that a request reading `view` can keep (`reusable_prefix`); [] below
    MIN_KEPT_TOKENS."""
    n = reusable_prefix(held, view)
    return list(held[:n]) if n >= MIN_KEPT_TOKENS else []


class DraftPool:
    """One KV cache whose rows the drafters of a server's requests take, one each, while they run.

    Rows are handed out lowest first, so the rows in use stay near the start and a batched forward
    over rows [lo, hi) wastes little on rows of requests that are not drafting this step.

    Kept rows. A request that ends in a partition (`keep_within`: the server's tenant and cache
    salt, as the target's prefix cache) leaves its row's slots in place, with the ids they hold.
    A request of the same partition whose prompt shares at least MIN_KEPT_TOKENS leading ids with
    such a row takes that row and reads only the rest: an agent's or a chat's next turn re-sends
    the conversation, which the draft would otherwise read whole each time while the target copies
    it from its prefix cache. A row is matched only within its partition, so no request starts
    from, or times, another partition's text; any other request takes the lowest row holding
    nothing, or else the one released longest ago, and empties it (so whether a kept row is still
    there tells a partition only that other requests came, never what they held). A slot's keys
    and values depend only on the ids up to it: a kept row is what a fresh read of them gives, up
    to the rounding of the forwards that wrote them, as a request's own prefix rule already keeps;
    only acceptance can move, never the output.
    """

    def __init__(self, cache: KVCache):
        self.cache = cache
        self.free = list(range(cache.batch))
        self.kept: dict[int, tuple[object, list[int]]] = {}  # free row -> (partition, the ids its slots hold)

    def acquire(self, view: list[int] | None = None, partition: object = None) -> tuple[int, list[int]]:
        """A free row for a request reading `view`, and the ids its slots already hold (a prefix
        of `view`, or [] when the row starts empty)."""
        if not self.free:
            raise RuntimeError("the draft model's cache has no free row: reserve as many rows as the batch has")
        best, held = None, []
        if partition is not None and view:
            for slot in sorted(self.free):
                owner, ids = self.kept.get(slot, (None, []))
                if owner == partition and len(shared := kept_prefix(ids, view)) > len(held):
                    best, held = slot, shared
        if best is None:
            empty = [s for s in self.free if s not in self.kept]
            # `free` holds the rows in the order they were released (a kept row was released once).
            best = min(empty) if empty else self.free[0]
        self.free.remove(best)
        self.kept.pop(best, None)
        self.cache.truncate(len(held), row=best)
        return best, held

    def release(self, slot: int, held: list[int] | None = None, partition: object = None) -> None:
        """Hand `slot` back; with `held` (the ids its slots hold) and a partition, its slots stay
        for a later request of that partition."""
        if held and partition is not None:
            self.kept[slot] = (partition, list(held))
        else:
            self.cache.truncate(0, row=slot)
        self.free.append(slot)


@torch.inference_mode()
def propose_batch(drafters: list[DraftModelDrafter], contexts: list[list[int]], ks: list[int]) -> list[Proposal]:
    """Each drafter's `propose(context, k)`, for rows of one pool, in one forward of the draft model
    per draft position (plus one to catch up with each context's new tokens).

    Every row keeps its own state, sampling and generator, and the same cache rule as `propose`
    (see the module docstring). A forward runs over the pool rows [lo, hi) that hold the batch;
    rows in that range that are not drafting get padding, and their lengths are put back after.
    """
    pool = drafters[0]._pool
    cache = pool.cache
    device = drafters[0].device
    for k in ks:
        check_k(k)
    ks = [min(k, d.model.config.max_position - len(c)) for d, c, k in zip(drafters, contexts, ks)]
    contexts = [d._view(c) for d, c in zip(drafters, contexts)]
    slots = [d._slot for d in drafters]
    lo, hi = min(slots), max(slots) + 1
    view = cache.rows(hi, lo)
    vocab = drafters[0].model.config.vocab_size

    def forward(news: dict[int, list[int]]) -> dict[int, Tensor]:
        """Forward `news[i]` (drafter index -> new ids) at each row's length; the draft's scores
        (`_scores`) after each row's last new token."""
        lengths = view.lengths.clone()
        width = max(len(t) for t in news.values())
        tokens = torch.zeros(hi - lo, width, dtype=torch.long, device=device)
        positions = lengths[:, None] + torch.arange(width, device=device)[None]  # [rows, T]
        for i, new in news.items():
            ids = [t if t < vocab else 0 for t in new]  # ids only the target has: see `_forward`
            tokens[slots[i] - lo, : len(ids)] = torch.tensor(ids, device=device)
            if len(ids) < width:
                tokens[slots[i] - lo, len(ids):] = ids[-1]
        _, hidden = drafters[0].model(tokens, positions, view, last_n=0)  # [rows, T, h]
        view.lengths.copy_(lengths)  # rows not drafting keep their length; drafting rows move below
        rows = torch.tensor([slots[i] - lo for i in news], device=device)
        last = torch.tensor([len(news[i]) - 1 for i in news], device=device)
        scores = drafters[0]._scores(hidden[rows, last])  # [drafting rows, columns]
        out = {}
        for j, (i, new) in enumerate(news.items()):
            view.lengths[slots[i] - lo] += len(new)
            drafters[i]._tokens.extend(new)
            out[i] = scores[j]
        return out

    # Catch up: keep each row's common prefix with its context (never its last token), forward the
    # rest: in steady state one or two tokens a row, together; a long tail (the first proposal of a
    # request reads its whole prompt) on the row's own, so no forward is wider than a draft step's
    # room past the other rows' lengths.
    news, logits = {}, {}
    for i, (d, context) in enumerate(zip(drafters, contexts)):
        if ks[i] <= 0 or not context:
            continue
        if len(context) - reusable_prefix(d._tokens, context) > _BATCHED_CATCH_UP:
            logits[i] = d._sync(context)
            continue
        news[i] = list(context[d._rewind(context):])
    if news:
        logits.update(forward(news))
    for i in logits:
        if drafters[i]._stop is not None:
            drafters[i]._stop.start()
    return draft_rows(drafters, logits, ks, lambda feed: forward({i: [t] for i, t in feed.items()}),
                      lambda i: drafters[i]._stop is None or drafters[i]._stop.more())


def draft_kv_dtype(model: Transformer, kv_dtype: str = "auto") -> torch.dtype:
    """The draft cache's element type under the engine's `kv_dtype` setting (`resolve_kv_dtype`):
    as set, where it is set; under "auto", the target's rule (float16 under a float32 model on the
    CPU) for a quantised draft only. Its products put each row on its own 8-bit grid, so a row's
    keys are the same bits whether it is forwarded alone (a draft step) or with a few others (a
    catch-up): its cache stays what a fresh read of the context makes. A float draft's keys differ
    in their last bits between the two, which float16 rounding can widen into a whole float16 step,
    enough to flip a near-tie: it keeps its own dtype unless told otherwise."""
    p = model.embed_tokens.weight
    if kv_dtype == "auto" and quantize_of(model) == "none":
        return p.dtype
    return resolve_kv_dtype(kv_dtype, p.dtype, p.device)


def special_ids(model: Transformer, tokenizer=None) -> list[int]:
    """Ids a reduced draft vocabulary always keeps: the EOS ids and the tokenizer's added tokens
    (end of turn, chat markers), which a chat answer needs to end."""
    ids = set(model.config.eos_token_ids)
    hf = getattr(tokenizer, "_tok", None)
    ids.update(getattr(hf, "added_tokens_decoder", None) or {})
    rust = getattr(tokenizer, "_rust", None)
    if rust is not None:
        ids.update(rust.get_added_tokens_decoder())
    return sorted(i for i in ids if 0 <= i < model.config.vocab_size)


def frequent_ids(vocab_size: int, n: int, keep: Sequence[int] = ()) -> Tensor:
    """The first `n` ids and `keep`, sorted (int64)."""
    return torch.tensor(sorted(set(range(min(n, vocab_size))) | set(keep)), dtype=torch.long)


def _rows_of(head, ids: Tensor | None, int4: bool = False):
    """A head that scores rows `ids` (None = all) of `head` only: with the same numbers for them, or
    with `int4` on 4-bit groups (`quant.quantize_int4` of the rows as `head` holds them), which reads
    5/8 of an int8 head's bytes per draft token. Only acceptance depends on the draft's numbers."""
    from specdec.models.quant import Int4Linear, Int8Linear, quantize_int4

    if ids is None:
        ids = torch.arange(head.out_features)
    bias = None if head.bias is None else head.bias.data[ids]
    if int4:
        rows = _HeadRows(head, ids)
        return Int4Linear.from_parts(*quantize_int4(rows), tuple(rows.shape), bias)
    if isinstance(head, Int8Linear):
        return Int8Linear.from_int8(head.int8_rows(ids).contiguous(), head.weight_scale[ids].contiguous(), bias)
    sub = torch.nn.Linear(head.in_features, len(ids), bias=bias is not None, device=head.weight.device,
                          dtype=head.weight.dtype)
    with torch.no_grad():
        sub.weight.copy_(head.weight[ids])
        if bias is not None:
            sub.bias.copy_(bias)
    return sub.requires_grad_(False)


class _HeadRows:
    """Rows `ids` of a head's weight as float32, read a block at a time (what `quantize_int4` reads
    from a `loader.StoredTensor`), so no float copy of a 151,936-row head is made."""

    def __init__(self, head, ids: Tensor):
        self.head, self.ids = head, ids
        self.shape = (len(ids), head.in_features)

    def read_into(self, start: int, out: Tensor) -> None:  # out: [rows, in] float32
        from specdec.models.quant import linear_rows

        out.copy_(linear_rows(self.head, self.ids[start : start + out.shape[0]]))


def check_same_vocabulary(target_vocab: int, draft_vocab: int, target_tokenizer=None, draft_tokenizer=None) -> None:
    """Raise `InvalidRequestError` unless the draft speaks the target's vocabulary.

    Sizes may differ by padding (up to `VOCAB_SIZE_TOLERANCE` ids). Where both models have a
    tokenizer, a fixed sample of ids (the first 32, then evenly spread over the shared range) must
    decode to the same text: two different tokenizers of similar size disagree on almost every id.
    """
    if abs(target_vocab - draft_vocab) > VOCAB_SIZE_TOLERANCE:
        raise InvalidRequestError(
            f"the draft model's vocabulary ({draft_vocab} ids) is not the target's ({target_vocab} ids); "
            f"a draft model must share the target's tokenizer",
            param="drafter",
        )
    if target_tokenizer is None or draft_tokenizer is None:
        return
    shared = min(target_vocab, draft_vocab)
    step = max(1, shared // _SAMPLE_IDS)
    ids = sorted(set(range(min(32, shared))) | set(range(0, shared, step)))
    for i in ids:
        a, b = target_tokenizer.decode([i]), draft_tokenizer.decode([i])
        if a != b:
            raise InvalidRequestError(
                f"the draft model's tokenizer differs from the target's (id {i} is {b!r} for the draft, "
                f"{a!r} for the target); a draft model must share the target's tokenizer",
                param="drafter",
            )
