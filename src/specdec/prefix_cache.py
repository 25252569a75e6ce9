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

Partitions. Every entry belongs to one partition (the server's: a tenant and a cache salt,
`Partition`); a lookup sees only its own partition's entries and a store drops or extends only
its own partition's, so one client can never reuse, or time, another's prefix (the prefix-cache
timing attack of arXiv 2411.18191). Each owner (a partition's first part, the tenant) may hold at
most its own share of the budget (`owner_budgets`); past it, its own least recently used entries
go first, so an owner whose share fits cannot evict another's. A lookup reads its own partition's
entries only, so its time says nothing about the others'. The statistics measure the isolation
rather than assume it: `cross_partition_hit_tokens` counts the tokens a lookup copied from an
entry of another partition (0 unless the code is wrong), and with `audit` on,
`partition_withheld_tokens` the tokens an unpartitioned store would have served from other
partitions' entries (the attack the partitions stopped).

At least one prompt token is always left to score: the first output token comes from its logits.
Positions travel with the slots and every layer keeps every slot (no ring buffer), so a copied
prefix is position-exact for the sliding-window layers too.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

from .models.kv_cache import KVCache, KVPrefix

MIN_PREFIX_TOKENS = 16  # shorter shared prefixes are not worth a copy (and a lookup's bookkeeping)
Partition = tuple[str, str]  # (owner, salt): entries are shared only inside one
SHARED: Partition = ("", "")  # the one partition of a store nobody partitions (the library, tests)


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
    partition: Partition = SHARED


@dataclass
class PrefixStats:
    lookups: int = 0
    hits: int = 0
    hit_tokens: int = 0  # prompt tokens whose keys and values were copied rather than computed
    stored: int = 0
    evicted: int = 0
    cross_partition_hit_tokens: int = 0  # tokens copied from another partition's entry (must stay 0)
    partition_withheld_tokens: int = 0  # more tokens an unpartitioned store would have copied


class PrefixCache:
    """Finished sequences' tokens and KV slots, least recently used evicted first past
    `budget_tokens` cached tokens (see the module docstring).

    `audit`: also compare each prompt with the other partitions' entries, to count
    `partition_withheld_tokens`. Off by default: that comparison takes time that grows with what
    the other partitions hold, which a client could time; a lookup otherwise reads its own
    partition's entries only."""

    def __init__(self, budget_tokens: int, min_tokens: int = MIN_PREFIX_TOKENS, audit: bool = False):
        if budget_tokens < 0:
            raise ValueError("budget_tokens must be >= 0")
        self.budget = budget_tokens
        self.min_tokens = min_tokens
        self.audit = audit
        self._entries: OrderedDict[int, _Entry] = OrderedDict()  # least recently used first
        # The same keys per partition and per owner, least recently used first.
        self._parts: dict[Partition, OrderedDict[int, None]] = {}
        self._owned: dict[str, OrderedDict[int, None]] = {}
        self._next = 0
        self.held = 0  # cached tokens over all entries
        self._held_by: dict[str, int] = {}  # owner -> cached tokens of its partitions
        # owner -> the most cached tokens its partitions may hold (absent: the whole budget); the
        # server sets it from the tenants' shares, and may replace it while the store is in use.
        self.owner_budgets: dict[str, int] = {}
        self.stats = PrefixStats()

    def __len__(self) -> int:
        return len(self._entries)

    def lookup(self, prompt: list[int], partition: Partition = SHARED) -> tuple[KVPrefix, int] | None:
        """The slots of `partition`'s entry sharing the longest prefix with `prompt`, and how many
        of them to use (at most len(prompt) - 1), or None when none shares `min_tokens` tokens."""
        self.stats.lookups += 1
        best, best_n = self._longest(prompt, self._parts.get(partition, ()))
        if self.audit:
            others = [key for key, entry in self._entries.items() if entry.partition != partition]
            elsewhere = self._longest(prompt, others)[1]
            served = best_n if best_n >= self.min_tokens else 0
            if elsewhere >= self.min_tokens and elsewhere > served:
                self.stats.partition_withheld_tokens += elsewhere - served
        if best is None or best_n < self.min_tokens:
            return None
        self._touch(best)
        entry = self._entries[best]
        self.stats.hits += 1
        self.stats.hit_tokens += best_n
        if entry.partition != partition:  # measured on the entry actually copied
            self.stats.cross_partition_hit_tokens += best_n
        return entry.kv, best_n

    def _longest(self, prompt: list[int], keys) -> tuple[int | None, int]:
        best, best_n = None, 0
        for key in keys:
            n = min(common_prefix(self._entries[key].tokens, prompt), len(prompt) - 1)
            if n > best_n:
                best, best_n = key, n
        return best, best_n

    def insert(self, tokens: list[int], cache: KVCache, row: int, partition: Partition = SHARED) -> None:
        """Store `tokens` for `partition`: their keys and values are cache row `row`'s first
        len(tokens) slots."""
        n = len(tokens)
        owner = partition[0]
        cap = min(self.budget, self.owner_budgets.get(owner, self.budget))
        if n < self.min_tokens or n > cap:
            return
        for key in list(self._parts.get(partition, ())):
            entry = self._entries[key]
            if len(entry.tokens) >= n and entry.tokens[:n] == tokens:
                self._touch(key)  # already held, as (a prefix of) this entry
                return
            if entry.tokens == tokens[: len(entry.tokens)]:
                self._drop(key)  # the new entry covers it
        while self._held_by.get(owner, 0) + n > cap:  # the owner's share: its own entries go first
            self._drop(next(iter(self._owned[owner])))
            self.stats.evicted += 1
        key, self._next = self._next, self._next + 1
        self._entries[key] = _Entry(list(tokens), cache.export_row(row, n), partition)
        self._parts.setdefault(partition, OrderedDict())[key] = None
        self._owned.setdefault(owner, OrderedDict())[key] = None
        self._held(owner, n)
        self.stats.stored += 1
        while self.held > self.budget:
            self._drop(next(iter(self._entries)))
            self.stats.evicted += 1

    def held_by(self, owner: str) -> int:
        """Cached tokens that `owner`'s partitions hold."""
        return self._held_by.get(owner, 0)

    def _touch(self, key: int) -> None:
        partition = self._entries[key].partition
        for order in (self._entries, self._parts[partition], self._owned[partition[0]]):
            order.move_to_end(key)

    def _held(self, owner: str, n: int) -> None:
        self.held += n
        self._held_by[owner] = self._held_by.get(owner, 0) + n

    def _drop(self, key: int) -> None:
        entry = self._entries.pop(key)
        owner = entry.partition[0]
        for index, name in ((self._parts, entry.partition), (self._owned, owner)):
            del index[name][key]
            if not index[name]:
                del index[name]
        self._held(owner, -len(entry.tokens))


def cache_bytes_per_token(cache: KVCache) -> int:
    """Bytes one cached token takes (keys and values of every layer)."""
    return sum(k.shape[1] * k.shape[3] * k.element_size() for k in cache.keys) * 2
