"""Prefix caching: the KV entries of finished requests, kept for later requests that share a prefix.

A system prompt, the earlier turns of a conversation or a few-shot header is the same token prefix
in many requests; its keys and values depend on those tokens only, so a later request may copy
them instead of computing them again. The scheduler stores a sequence's committed tokens with a
copy of their cache slots (`KVPrefix`) when it leaves the batch, and on admission copies the
longest stored prefix of the new prompt into the new row; the prefill then scores only the rest.

Shape of the store. Entries are whole token sequences (not blocks), kept least-recently-used first
under a budget counted in cached tokens (`budget_tokens`; the memory is that times the model's
bytes per cached token, `cache_bytes_per_token`). Lookup compares the prompt with every entry
(each comparison a binary search over slice equality, i.e. C-speed list compares), which suits
tens to hundreds of entries; an entry that is a prefix of a newly stored one is dropped (the new
one covers it), and a sequence that is a prefix of an entry already stored is not stored again.
vLLM's automatic prefix caching (hashes per block) and SGLang's radix tree share memory between
branches; this store trades that for copies that are simple to get right.

At least one prompt token is always left to score: the first output token comes from its logits.
Positions travel with the slots and every layer keeps every slot (no ring buffer), so a copied
prefix is position-exact for the sliding-window layers too.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

from .models.kv_cache import KVCache, KVPrefix

MIN_PREFIX_TOKENS = 16  # shorter shared prefixes are not worth a copy (and a lookup's bookkeeping)


def common_prefix(a: list[int], b: list[int]) -> int:
    """Length of the longest common prefix of two token lists (binary search on slice equality)."""
    lo, hi = 0, min(len(a), len(b))
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if a[:mid] == b[:mid]:
            lo = mid
        else:
            hi = mid - 1
    return lo


@dataclass
class _Entry:
    tokens: list[int]
    kv: KVPrefix


@dataclass
class PrefixStats:
    lookups: int = 0
    hits: int = 0
    hit_tokens: int = 0  # prompt tokens whose keys and values were copied rather than computed
    stored: int = 0
    evicted: int = 0


class PrefixCache:
    """Finished sequences' tokens and KV slots, least recently used evicted first past
    `budget_tokens` cached tokens (see the module docstring)."""

    def __init__(self, budget_tokens: int, min_tokens: int = MIN_PREFIX_TOKENS):
        if budget_tokens < 0:
            raise ValueError("budget_tokens must be >= 0")
        self.budget = budget_tokens
        self.min_tokens = min_tokens
        self._entries: OrderedDict[int, _Entry] = OrderedDict()  # least recently used first
        self._next = 0
        self.held = 0  # cached tokens over all entries
        self.stats = PrefixStats()

    def __len__(self) -> int:
        return len(self._entries)

    def lookup(self, prompt: list[int]) -> tuple[KVPrefix, int] | None:
        """The stored slots sharing the longest prefix with `prompt`, and how many of them to use
        (at most len(prompt) - 1), or None when no entry shares `min_tokens` tokens."""
        self.stats.lookups += 1
        best, best_n = None, 0
        for key, entry in self._entries.items():
            n = min(common_prefix(entry.tokens, prompt), len(prompt) - 1)
            if n > best_n:
                best, best_n = key, n
        if best is None or best_n < self.min_tokens:
            return None
        self._entries.move_to_end(best)
        self.stats.hits += 1
        self.stats.hit_tokens += best_n
        return self._entries[best].kv, best_n

    def insert(self, tokens: list[int], cache: KVCache, row: int) -> None:
        """Store `tokens`, whose keys and values are cache row `row`'s first len(tokens) slots."""
        n = len(tokens)
        if n < self.min_tokens or n > self.budget:
            return
        for key, entry in list(self._entries.items()):
            if len(entry.tokens) >= n and entry.tokens[:n] == tokens:
                self._entries.move_to_end(key)  # already held, as (a prefix of) this entry
                return
            if entry.tokens == tokens[: len(entry.tokens)]:
                self._drop(key)  # the new entry covers it
        self._entries[self._next] = _Entry(list(tokens), cache.export_row(row, n))
        self._next += 1
        self.held += n
        self.stats.stored += 1
        while self.held > self.budget:
            self._drop(next(iter(self._entries)))
            self.stats.evicted += 1

    def _drop(self, key: int) -> None:
        self.held -= len(self._entries.pop(key).tokens)


def cache_bytes_per_token(cache: KVCache) -> int:
    """Bytes one cached token takes (keys and values of every layer)."""
    return sum(k.shape[1] * k.shape[3] * k.element_size() for k in cache.keys) * 2
