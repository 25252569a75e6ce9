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

Reduced vocabulary (FR-Spec, Zhao et al. 2025). With `vocab=N` the draft scores only N ids: the
first N of its vocabulary (a byte-level BPE numbers its tokens in merge order, which follows their
frequency in the tokenizer's corpus) and its special tokens (EOS, end of turn). Its output head is
then a copy of those N rows: Qwen2.5-0.5B's full head is 151,936 x 896, a quarter of the bytes a
draft token reads. The other ids get -inf, so the draft never proposes them; q (under sampling) is
the distribution over the kept ids that the token was really drawn from. Verification is unchanged
(the target scores its full vocabulary), so the output stays exact; only acceptance can drop, where
the target's token is one the draft cannot name.

Price. Each draft token costs a forward of the draft model, which a lookup drafter's does not.
`measure_cost(target)` times one-token steps of both models and keeps the ratio in `draft_cost`;
the engine's cost-aware draft length then charges it per drafted token (`PricedDraftLength`), so
the draft model drafts only where its measured acceptance pays for both its own forwards and the
wider verify pass, and not at all where it does not.

Vocabularies. The target's vocabulary is the one that counts: draft logits for ids the target does
not have are dropped, ids the draft does not have get -inf (probability 0), so q always has the
target's vocabulary size. Models of one family are often padded to a round size, so sizes within
`VOCAB_SIZE_TOLERANCE` are accepted; a larger difference, or tokenizers that spell a sample of ids
differently, is an `InvalidRequestError`.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import Tensor

from specdec.drafters.base import CostAwareDraftLength, Proposal, check_k, common_prefix_length, draft_chain
from specdec.errors import InvalidRequestError
from specdec.models.kv_cache import KVCache
from specdec.models.transformer import Transformer, soft_cap
from specdec.sampling import SamplingParams, greedy_tokens, make_generator, process_logits, sample

# Padding differences seen in practice are up to 128 ids (e.g. Qwen2.5 sizes); llama.cpp uses the
# same bound for its draft-model check.
VOCAB_SIZE_TOLERANCE = 128
# Confidence cut-off used when none is given; 0 turns it off. Measured on the default model (Gemma 3
# 270M, fp32, 32 tokens, k=5): its only same-vocabulary draft is itself, which is always right, so a
# cut-off only shortens drafts (0: 9.9 tok/s; 0.5: 7.0; 0.8: 6.1). With a poor draft (the same model
# minus 6 of 18 layers, 3% accepted) it limits the damage (0: 2.3 tok/s; 0.5: 5.4) but plain decoding
# (11.6) is better still. So off by default; worth setting for a draft of uneven quality.
DEFAULT_DRAFT_P_MIN = 0.0
_INITIAL_ROOM = 256  # cache slots beyond the prompt at `begin`; the cache doubles when full
_SAMPLE_IDS = 512  # ids whose spelling is compared between the two tokenizers


class DraftModelDrafter:
    """Drafts with a small model on its own KV cache; see the module docstring for the design.

    model: any `Transformer` specdec loads, on the device (and usually the dtype) of the target.
    target_vocab_size: the target's vocabulary size; q rows have this length.
    draft_p_min: confidence cut-off in [0, 1]; 0 = off.
    tokenizer, target_tokenizer: the two models' tokenizers where both have one: a sample of ids
        must decode alike, else `InvalidRequestError`.
    """

    name = "draft_model"

    def __init__(
        self,
        model: Transformer,
        target_vocab_size: int,
        draft_p_min: float = DEFAULT_DRAFT_P_MIN,
        tokenizer=None,
        target_tokenizer=None,
        vocab: int | None = None,
    ):
        check_draft_p_min(draft_p_min)
        check_same_vocabulary(target_vocab_size, model.config.vocab_size, target_tokenizer, tokenizer)
        self.model = model
        self.target_vocab_size = target_vocab_size
        self.draft_p_min = float(draft_p_min)
        self.draft_cost: float | None = None  # one draft token in target steps (`measure_cost`)
        # Reduced vocabulary: the kept ids [m] (sorted) and the head over their rows; None = all.
        self.vocab_ids: Tensor | None = None
        self._sub_head = None
        if vocab:
            self.vocab_ids = frequent_ids(model.config.vocab_size, vocab, special_ids(model, tokenizer))
            self._sub_head = _rows_of(model.lm_head, self.vocab_ids)
        self._sampling = SamplingParams()
        self._generator: torch.Generator | None = None
        self._cache: KVCache | None = None
        self._tokens: list[int] = []  # ids whose keys/values the cache holds, in order

    @classmethod
    def load(
        cls,
        source: str | Path,
        target_vocab_size: int,
        dtype: torch.dtype,
        device,
        draft_p_min: float = DEFAULT_DRAFT_P_MIN,
        target_tokenizer=None,
        progress=None,
        quantize: str = "none",
        vocab: int | None = None,
    ) -> "DraftModelDrafter":
        """Load a draft model from an HF folder or a .gguf file (converted once, as for targets).

        `quantize="int8"` puts its linears and output head on int8 (`quant.quantize_model`), the
        target's fast path; a draft token then costs a fraction of a target token rather than more.
        """
        from specdec.models import loader
        from specdec.tokenizer import Tokenizer

        check_draft_p_min(draft_p_min)  # before the slow part
        check_vocab(vocab)
        model, folder = loader.load(source, dtype, device, progress, quantize=quantize)
        return cls(model, target_vocab_size, draft_p_min, Tokenizer.from_folder(folder), target_tokenizer, vocab)

    def measure_cost(self, target: Transformer, context: int = 64, repeats: int = 5) -> float:
        """Time one-token steps of the draft and of `target` after a `context`-token prompt, in turns
        (median of `repeats` each), and keep their ratio in `draft_cost`."""
        import statistics
        import time

        ids = [[(101 + 7 * i) % min(target.config.vocab_size, self.model.config.vocab_size) for i in range(context)]]
        times: dict[int, list[float]] = {0: [], 1: []}
        caches = []
        for model in (target, self.model):
            cache = model.new_cache(1, context + 2)
            model(torch.tensor(ids, device=self.device), torch.arange(context, device=self.device)[None], cache,
                  last_n=1, need_hidden=False)
            caches.append(cache)
        step, position = torch.tensor([[ids[0][-1]]], device=self.device), torch.tensor([[context]], device=self.device)
        for _ in range(repeats + 1):  # the first round warms up
            for i, model in enumerate((target, self.model)):
                start = time.perf_counter()
                model(step, position, caches[i], last_n=1, need_hidden=False)
                times[i].append(time.perf_counter() - start)
                caches[i].truncate(context)
        self.draft_cost = statistics.median(times[1][1:]) / statistics.median(times[0][1:])
        return self.draft_cost

    # -- protocol -------------------------------------------------------------------------------

    def begin(
        self,
        prompt_ids: list[int],
        sampling: SamplingParams | None = None,
        generator: torch.Generator | None = None,
    ) -> None:
        self._sampling = sampling or SamplingParams()
        if generator is None and not self._sampling.greedy:
            generator = make_generator(self._sampling.seed, self.device)
        self._generator = generator
        self._cache = self.model.new_cache(1, len(prompt_ids) + _INITIAL_ROOM)
        self._tokens = []

    def propose(self, context: list[int], k: int) -> Proposal:
        check_k(k)
        k = min(k, self.model.config.max_position - len(context))  # the draft's own context limit
        if k <= 0 or not context:
            return Proposal([])
        if self._cache is None:  # propose without begin: start a greedy request
            self.begin(list(context))
        logits = self._sync(context)  # [vocab_target] for the token after context
        # Draft i sits at position len(context) + i; the last one is forwarded next time, if accepted.
        return draft_chain(self._choose, lambda token, i: self._forward([token], len(context) + i), logits, k)

    def _choose(self, logits: Tensor) -> tuple[int | None, Tensor | None]:
        """One draft position: (token, q row) from logits [target_vocab]; token None = stop here.

        Greedy: the argmax, q None (one-hot); the cut-off reads the raw softmax. Sampling: q is the
        processed distribution, the token is drawn from it; the cut-off reads q.
        """
        if self._sampling.greedy:
            if self.draft_p_min > 0 and float(logits.softmax(-1).max()) < self.draft_p_min:
                return None, None
            return greedy_tokens(logits[None])[0], None
        q = process_logits(logits, self._sampling)  # [target_vocab]
        if self.draft_p_min > 0 and float(q.max()) < self.draft_p_min:
            return None, None
        return int(sample(q, self._generator)), q

    def feedback(self, num_accepted: int) -> None:
        # Nothing to do: the next propose truncates the rejected drafts by the prefix rule.
        pass

    def end(self, output_ids: list[int]) -> None:
        self._cache = None  # free the cache between requests
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
        """Make the cache hold context[:-1] + the last token's keys; return the next-token logits."""
        keep = min(common_prefix_length(self._tokens, context), len(context) - 1)
        self._cache.truncate(keep)
        del self._tokens[keep:]
        return self._forward(list(context[keep:]), keep)

    def _forward(self, new: list[int], start: int) -> Tensor:
        """Forward `new` at positions start.. (start == cache length); logits after the last one.

        Returns logits [target_vocab] float32, already mapped to the target's vocabulary.
        """
        assert start == len(self._tokens) == self._cache.length()
        self._ensure_room(len(new))
        vocab = self.model.config.vocab_size
        # Ids only the target has (padding region) cannot be embedded: feed 0 instead. This can
        # only make the draft worse, never the output wrong (verification decides).
        ids = torch.tensor([[t if t < vocab else 0 for t in new]], device=self.device)  # [1, T]
        positions = torch.arange(start, start + len(new), device=self.device)[None]  # [1, T]
        if self._sub_head is None:
            logits, _ = self.model(ids, positions, self._cache, last_n=1, need_hidden=False)
            self._tokens.extend(new)
            return self._to_target_vocab(logits[0, -1])
        _, hidden = self.model(ids, positions, self._cache, last_n=0)  # no full head
        self._tokens.extend(new)
        with torch.inference_mode():
            sub = soft_cap(self._sub_head(hidden[0, -1:]).float(), self.model.config.final_logit_softcap)[0]
            full = sub.new_full((self.model.config.vocab_size,), -math.inf)
            full[self.vocab_ids] = sub
        return self._to_target_vocab(full)

    def _to_target_vocab(self, logits: Tensor) -> Tensor:
        """logits [draft_vocab] -> [target_vocab]: drop ids the target lacks, -inf for ids the draft lacks."""
        extra = self.target_vocab_size - logits.shape[-1]
        if extra < 0:
            return logits[: self.target_vocab_size]
        if extra > 0:
            return torch.cat([logits, logits.new_full((extra,), -math.inf)])
        return logits

    def _ensure_room(self, new_tokens: int) -> None:
        """Grow the cache (double, copying the filled slots) when `new_tokens` would not fit."""
        cache = self._cache
        need = cache.length() + new_tokens
        if need <= cache.capacity:
            return
        grown = self.model.new_cache(1, max(need, 2 * cache.capacity))
        n = cache.length()
        for src, dst in ((cache.keys, grown.keys), (cache.values, grown.values)):
            for layer_src, layer_dst in zip(src, dst):
                layer_dst[:, :, :n] = layer_src[:, :, :n]
        grown.positions[:, :n] = cache.positions[:, :n]
        grown.truncate(n)
        self._cache = grown


@dataclass
class PricedDraftLength(CostAwareDraftLength):
    """`CostAwareDraftLength` where the kinds of proposal in `draft_costs` (`Proposal.source` ->
    the cost of drafting one token, in plain steps) also pay that per drafted token:

        (1 - a^(k+1)) / ((1 - a) (1 + c0 + c k' + d k))      (k': the screened count, as there)

    so a draft model is asked for k = 0 (a plain step, nothing drafted) where its acceptance does
    not pay for its own forwards."""

    draft_costs: dict = field(default_factory=dict)

    def next_k(self, source: object = None) -> int:
        d = self.draft_costs.get(source)
        if not d:
            return super().next_k(source)
        a, c, f = self.acceptance(source), self.verify_cost, self.screened_share
        best_k, best, expected = 0, 1.0, 1.0
        for k in range(1, self.k_max + 1):
            expected += a**k
            value = expected / (1 + self.verify_overhead + c * ((1 - f) * k + f * (expected - 1)) + d * k)
            if value > best:
                best_k, best = k, value
        return best_k


def check_vocab(vocab) -> None:
    if vocab is not None and (isinstance(vocab, bool) or not isinstance(vocab, int) or vocab < 0):
        raise InvalidRequestError(f"the draft vocabulary must be a number of ids >= 0 (0 = all), got {vocab!r}",
                                  param="draft_vocab")


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


def _rows_of(head, ids: Tensor):
    """A head that scores rows `ids` of `head` only, with the same numbers for them."""
    from specdec.models.quant import Int8Linear

    bias = None if head.bias is None else head.bias.data[ids]
    if isinstance(head, Int8Linear):
        return Int8Linear.from_int8(head.int8_rows(ids).contiguous(), head.weight_scale[ids].contiguous(), bias)
    sub = torch.nn.Linear(head.in_features, len(ids), bias=bias is not None, device=head.weight.device,
                          dtype=head.weight.dtype)
    with torch.no_grad():
        sub.weight.copy_(head.weight[ids])
        if bias is not None:
            sub.bias.copy_(bias)
    return sub.requires_grad_(False)


def check_draft_p_min(draft_p_min: float) -> None:
    if isinstance(draft_p_min, bool) or not isinstance(draft_p_min, (int, float)) or not 0 <= draft_p_min <= 1:
        raise InvalidRequestError(f"draft_p_min must be a number in [0, 1] (0 = off), got {draft_p_min!r}",
                                  param="draft_p_min")


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
