"""One decoding step over a batch of rows, in named phases; a row's fault stays in its row.

`Engine.step(rows, cache, cap)` runs, for rows r = 0 .. n - 1 sitting in cache rows 0 .. n - 1:

    propose   each row: its draft length (its rule, the batch's load cap) and its drafter's
              proposal; rows whose drafters share a batch key in one call    -> a `Block` per row
    forward   ONE target forward over the ragged blocks [lead token] + drafts, padded at the end
              to the widest                                                   -> hidden [n, T, h]
    heads     the head strategy of each row: the raw head's argmax of the rows a screened greedy
              chain may need (all such rows in one call), or full logits (the rest, in one call)
    verify    each row with its own sampling and generator (`verify.py`)     -> `TreeVerdict`
    commit    each row's cache back to its accepted path; its drafter and rule hear back
    emit      the verdict's tokens through the row's `Output`, one at a time; log-probs

    join      a row joining from the prefix cache (its prompt all in but its last token, which was
              its block): its first token, what `Engine.prefill_last` would give

Fault isolation. An exception raised for one row (its drafter, its sampling or penalties, its
grammar, its log-probs) is caught where that row's work happens: that row's `Emitted` carries the
error and no tokens, and the other rows go on exactly as if it were not there (its block is its
lead token alone, which no other row can see). A failure in a shared call is narrowed down before
anyone is failed: a batched draft that raises is retried row by row; a target forward that raises
is retried on each half of the rows (contiguous cache rows, so each half is a view), down to the
single row that fails alone; a joined output head that raises is retried row by row. A row's
error is the exception of its own work only, so it never carries another request's data; what
the caller is told about it is the caller's business (`errors.Fault`).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable

import torch

from .drafters.base import Drafter, Proposal
from .drafters.combined import LEARNED
from .forced import FORCED, forced_tokens
from .verify import TokenTree, TreeVerdict, verify_greedy_best


@dataclass(frozen=True)
class TokenLogprob:
    """The target's own log-probability (log-softmax of its raw logits) of one emitted token."""

    token: int
    logprob: float
    top: list[tuple[int, float]]  # the `logprobs` most likely tokens at that position, best first


@dataclass
class Step:
    """What one target pass produced, for --show-drafts."""

    accepted: list[int]
    next_token: int
    kind: str  # "recovered" | "bonus" | "prefill"
    drafted: int  # draft tokens the target scored (tree nodes for a tree)


@dataclass
class Emitted:
    """What one prefill or step pushed through one row's `Output`, or the row's error."""

    tokens: list[int]  # pushed tokens (cut at EOS, a stop string or the limit)
    text: str  # the text they added (cut before a stop string)
    logprobs: list[TokenLogprob] | None = None  # per token, when the row asked for them
    drafted: int = 0  # draft tokens the target scored for this row (tree nodes for a tree)
    accepted: int = 0
    depth: int = 0  # the draft's deepest position (a chain's length)
    error: Exception | None = None  # the row failed this step: no tokens; it must leave the batch
    # Per pushed token: the text it added (`Output.push`; "" inside a multi-byte character) and
    # where it came from (`token_sources`), for the server's coloured stream.
    pieces: list[str] | None = None
    sources: list[str] | None = None


# Where an emitted token came from: an accepted draft token, the target's own (after a rejection,
# from a step that drafted nothing, or from the prefill), or the bonus token after a fully
# accepted draft.
DRAFT, TARGET, BONUS = "draft", "target", "bonus"


def token_sources(accepted: int, kind: str, drafted: int) -> list[str]:
    """The sources of a verdict's tokens, in order: its accepted drafts, then its next token."""
    return [DRAFT] * accepted + [BONUS if kind == "bonus" and drafted else TARGET]


@dataclass
class StepReport:
    """One step over a batch: per row what it emitted, and what the load rules learn from."""

    emitted: list[Emitted]
    width: int  # T: tokens per row in the forward, padding included
    drafted: int  # draft tokens scored, over all rows
    accepted: int
    forward_s: float  # the target forward and its output head


@dataclass
class Block:
    """One row's drafts in this step's forward: a tree (a chain is a path), their q
    ([len(tree), vocab] or None for one-hot) and the proposal's `source`."""

    tree: TokenTree
    q: torch.Tensor | None = None
    source: object = None


def _empty() -> Block:
    return Block(TokenTree([], []))


class Faults(dict):
    """Row index -> the exception that failed it this step."""

    def run(self, r: int, work: Callable, *args):
        """`work(*args)` for row r, or None with r failed (or already failed)."""
        if r in self:
            return None
        try:
            return work(*args)
        except Exception as exc:  # noqa: BLE001 (any fault of the row's own work is the row's)
            self[r] = exc
            return None


def log_probs(logits: torch.Tensor, tokens: list[int], top: int) -> list[TokenLogprob]:
    """Each emitted token's log-prob and the `top` best alternatives. logits: [len(tokens), vocab]"""
    logp = torch.log_softmax(logits.float(), dim=-1)  # [len(tokens), vocab]
    chosen = logp[torch.arange(len(tokens)), torch.tensor(tokens, dtype=torch.long)].tolist()
    best = logp.topk(top, dim=-1) if top else None
    return [TokenLogprob(t, lp, list(zip(best.indices[i].tolist(), best.values[i].tolist())) if best else [])
            for i, (t, lp) in enumerate(zip(tokens, chosen))]


def run(engine, rows: list, cache, cap: int | list[int] | None) -> StepReport:
    """`Engine.step`: the phases above, each row's faults kept to its row."""
    faults = Faults()
    blocks = propose(engine, rows, cap, faults)
    base = cache.lengths.tolist()  # [n] each row's committed length = its lead token's position
    for r, row in enumerate(rows):
        if not row.out.ids:
            faults.run(r, _check_join, row, base[r])
    started = time.perf_counter()
    hidden, width = forward(engine, rows, blocks, cache, base, faults)  # [n, T, h]
    scores = heads(engine, rows, blocks, hidden, faults)
    if engine.device.type == "cuda":
        torch.cuda.synchronize()
    forward_s = time.perf_counter() - started
    emitted, drafted, accepted = [], 0, 0
    for r, (row, block) in enumerate(zip(rows, blocks)):
        if not row.out.ids:
            out = faults.run(r, join, engine, row, r, scores.get(r), cache, base[r])
        else:
            out = faults.run(r, _finish_row, engine, row, r, block, scores.get(r), hidden, cache, base[r],
                             len(rows), forward_s)
        if r in faults:
            cache.truncate(base[r], row=r)  # nothing of a failed step stays (the row leaves)
            out = Emitted([], "", error=faults[r])
        drafted += out.drafted
        accepted += out.accepted
        emitted.append(out)
    return StepReport(emitted, width, drafted, accepted, forward_s)


# -- propose ---------------------------------------------------------------------------------------


def propose(engine, rows: list, cap: int | list[int] | None, faults: Faults) -> list[Block]:
    """Each row's drafts: its plan (`Engine._plan`), then its proposal, rows whose drafters share a
    batch key (a draft model's or an EAGLE head's rows) in one call, one model forward per draft
    position. A lookup-first row looks up first; where it finds nothing, its learned part joins
    that batched call. A batched call that raises is retried row by row."""
    caps = cap if isinstance(cap, list) else [cap] * len(rows)
    forced = [faults.run(r, forced_tokens, row, caps[r]) for r, row in enumerate(rows)]  # forced.py
    plans = [0 if forced[r] else faults.run(r, _plan, row, caps[r]) for r, row in enumerate(rows)]
    batched = _propose_batched(rows, plans, faults)
    blocks = []
    for r, (row, plan) in enumerate(zip(rows, plans)):
        if forced[r] and r not in faults:
            blocks.append(Block(TokenTree.chain(forced[r]), None, FORCED))
            continue
        if not plan:  # 0, an empty tree, or the row failed
            blocks.append(_empty())
            continue
        made = faults.run(r, row.control.draft, row.context, plan, batched.get(r))
        blocks.append(_empty() if made is None else Block(*made))
    return blocks


def _plan(row, cap: int | None) -> int | TokenTree:
    """The row's ask of its drafter (`DraftController.plan`); 0 without a drafter, and for a row
    joining this step (its drafter begins when its first token is out)."""
    if row.control is None or not row.out.ids:
        return 0
    return row.control.plan(row.context, row.out.remaining, cap)


def _propose_batched(rows: list, plans: list, faults: Faults) -> dict[int, tuple[Proposal, float]]:
    """The proposals made in batched calls (row -> proposal, its share of the call's time); rows
    left out propose alone in `Engine._draft`."""
    batched: dict[int, tuple[Proposal, float]] = {}
    groups: dict[int, list[tuple[int, Drafter, int]]] = {}  # key -> (row, drafter, k) of each member
    for r, (row, plan) in enumerate(zip(rows, plans)):
        if r in faults or not isinstance(plan, int) or plan == 0 or not row.drafter.needs.batches \
                or (key := row.drafter.batch_key()) is None:
            continue
        member = faults.run(r, _batch_member, row, plan, batched, r)
        if member is not None:
            groups.setdefault(id(key), []).append((r, member[0], member[1]))
    for members in groups.values():
        if len(members) == 1 and not rows[members[0][0]].drafter.needs.fallback:
            continue  # alone: `_draft` proposes it
        started = time.perf_counter()
        try:
            made = members[0][1].propose_batch([d for _, d, _ in members], [rows[r].context for r, _, _ in members],
                                               [k for _, _, k in members])
        except Exception:  # noqa: BLE001 (narrowed down: each member proposes alone, its fault its own)
            continue
        share = (time.perf_counter() - started) / len(members)
        for (r, _, _), p in zip(members, made):
            if rows[r].drafter.needs.fallback:
                p = Proposal(p.tokens, p.q, source=LEARNED)
            batched[r] = (p, share)
    return batched


def _batch_member(row, plan: int, batched: dict, r: int) -> tuple[Drafter, int] | None:
    """(the row's member of a batched draft, its k), or None where the row needs no batched call
    (a lookup-first row whose lookup found a guess, or whose model is not asked this step: its
    proposal goes into `batched` at once)."""
    k, control = plan, row.control
    if row.drafter.needs.fallback:
        started = time.perf_counter()
        free = row.drafter.propose_free(row.context, plan, control.learned_first())
        if free is not None:
            batched[r] = (free, time.perf_counter() - started)
            return None
        if not control.asked:  # its model is not asked this step
            batched[r] = (Proposal([], source=LEARNED), 0.0)
            return None
        control.catch_up(row.context)  # the read its plan put off, now that its model drafts
        k = control.learned_k(plan)
    return row.drafter.batch_member(), k


def _check_join(row, base: int) -> None:
    if base != len(row.prompt) - 1 or (row.drafter is not None and row.drafter.needs.observes is not None):
        raise ValueError("a row joins a step holding its prompt but the last token, without a "
                         "drafter that observes the prompt")
    row.started = row.started or time.perf_counter()


# -- forward ---------------------------------------------------------------------------------------


def forward(engine, rows: list, blocks: list[Block], cache, base: list[int], faults: Faults):
    """ONE target forward over the blocks [lead token] + drafts, each at its positions (the lead
    token is the last emitted one, not yet in the cache; tree node i is block position i + 1 at
    its depth's position), padded at the end to the widest. A failed row's block is its lead
    token alone. Returns (hidden [n, T, h], T)."""
    tokens_of, places = [], []
    for r, (row, block, b) in enumerate(zip(rows, blocks, base)):
        tree = _empty().tree if r in faults else block.tree
        tokens_of.append([row.out.ids[-1] if row.out.ids else row.prompt[-1]] + tree.tokens)
        places.append([b] + [b + d for d in tree.depths()])
    width = max(len(block) for block in tokens_of)
    tokens = torch.tensor([blk + [blk[-1]] * (width - len(blk)) for blk in tokens_of],
                          device=engine.device)  # [n, T]
    positions = torch.tensor([p + list(range(p[-1] + 1, p[-1] + 1 + width - len(p))) for p in places],
                             device=engine.device)  # [n, T]
    mask = None  # chains need only the causal mask; a tree row lets each node see its ancestors
    trees = [b.tree for r, b in enumerate(blocks) if r not in faults]
    if not all(tree.is_chain for tree in trees):
        mask = torch.ones(width, width, dtype=torch.bool).tril().repeat(len(rows), 1, 1)  # [n, T, T]
        for r, block in enumerate(blocks):
            if r not in faults and not block.tree.is_chain:
                mask[r, : len(block.tree) + 1, : len(block.tree) + 1] = block.tree.mask()
        mask = mask.to(engine.device)
    return _forward_rows(engine, tokens, positions, mask, cache, base, 0, len(rows), faults), width


def _forward_rows(engine, tokens, positions, mask, cache, base, lo: int, hi: int, faults: Faults):
    """The forward of rows [lo, hi) (a view of those cache rows); where it raises, each half again,
    down to the row that fails alone (its hidden states zeros, its fault recorded)."""
    view = cache if (lo, hi) == (0, len(base)) else cache.rows(hi, lo)
    try:
        _, hidden = engine.model(tokens[lo:hi], positions[lo:hi], view,
                                 mask=None if mask is None else mask[lo:hi], last_n=0)  # [hi - lo, T, h]
        return hidden
    except Exception as exc:  # noqa: BLE001 (narrowed down below)
        for r in range(lo, hi):
            cache.truncate(base[r], row=r)
        if hi - lo == 1:
            faults[lo] = exc
            config = engine.model.config
            return torch.zeros(1, tokens.shape[1], config.hidden_size, dtype=engine.model.embed_tokens.weight.dtype,
                               device=engine.device)
        mid = (lo + hi) // 2
        return torch.cat([_forward_rows(engine, tokens, positions, mask, cache, base, lo, mid, faults),
                          _forward_rows(engine, tokens, positions, mask, cache, base, mid, hi, faults)])


# -- heads -----------------------------------------------------------------------------------------


@dataclass
class Scores:
    """What the head gave one row: the argmax of its first block rows (a screened greedy chain's),
    or the logits of its whole block ([len(block), vocab])."""

    picked: list[int] | None = None
    logits: torch.Tensor | None = None


def heads(engine, rows: list, blocks: list[Block], hidden: torch.Tensor, faults: Faults) -> dict[int, Scores]:
    """The output head (a large share of a step with a big vocabulary) runs on the real rows of
    blocks only, not on padding, and not at all on the rows a screened verify never needs. Rows
    verified greedily on the raw head (`row.screen`) need only its argmax, which an int8 head
    finds exactly at about half the work of its full product (`head_argmax`); their rows go
    through one call together, as the other rows' logits do."""
    live = [r for r in range(len(rows)) if r not in faults]
    best_of = {}  # row -> how many block rows need the argmax
    for r in live:
        tree = blocks[r].tree
        if rows[r].screen and tree.is_chain:
            need = 1 if len(tree) == 0 else faults.run(r, _screened, engine, hidden[r, : len(tree)], tree.tokens,
                                                       rows[r].context)
            if need is not None:
                best_of[r] = need
    full = [r for r in live if r not in best_of and r not in faults]
    sizes = {r: 1 + len(blocks[r].tree) for r in full}
    scores = {r: Scores(logits=out) for r, out in _joined(engine.model.head, hidden, sizes, faults).items()}
    for r, best in _joined(engine._head_argmax, hidden, best_of, faults).items():
        scores[r] = Scores(picked=best)
    return scores


def _screened(engine, hidden: torch.Tensor, draft: list[int], context: list[int]) -> int:
    return 1 + engine._screen(hidden, draft, context)


def _joined(head, hidden: torch.Tensor, sizes: dict[int, int], faults: Faults) -> dict[int, object]:
    """`head` over the first sizes[r] block rows of every row r in one call, split back per row;
    where the joined call raises, row by row."""
    if not sizes:
        return {}
    try:
        out = head(torch.cat([hidden[r, :m] for r, m in sizes.items()]))  # [sum of sizes, ...]
    except Exception:  # noqa: BLE001 (narrowed down: row by row)
        each = {r: faults.run(r, head, hidden[r, :m]) for r, m in sizes.items()}
        return {r: v for r, v in each.items() if r not in faults}
    parts, offset = {}, 0
    for r, m in sizes.items():
        parts[r] = out[offset : offset + m]
        offset += m
    return parts


# -- verify, commit, emit (one row) ----------------------------------------------------------------


def join(engine, row, r: int, scores: Scores, cache, base: int) -> Emitted:
    """A row joining from the prefix cache: its first token, as `prefill_last` would give it."""
    row.stats.target_forwards += 1
    cache.truncate(base + 1, row=r)  # its prompt; not the padding of a wider block
    return engine._first_token(row, scores.logits, scores.picked[0] if scores.picked is not None else None)


def _finish_row(engine, row, r: int, block: Block, scores: Scores, hidden: torch.Tensor, cache,
                base: int, batch: int, forward_s: float) -> Emitted:
    row.stats.target_forwards += 1
    verdict = verify(engine, row, block, scores)
    keep = commit(engine, row, r, block, verdict, hidden, cache, base, batch, forward_s)
    return emit(row, block, verdict, scores, keep)


def verify(engine, row, block: Block, scores: Scores) -> TreeVerdict:
    """The row's verdict: from the head's argmax (screened greedy chains) or its logits, with the
    row's own sampling and generator (`verify.py`)."""
    if scores.picked is not None:
        v = verify_greedy_best(scores.picked, block.tree.tokens)
        return TreeVerdict(v.accepted, v.next_token, v.kind, path=list(range(v.num_accepted)))
    return engine._verify_tree(scores.logits, block.tree, block.q, row)


def commit(engine, row, r: int, block: Block, verdict: TreeVerdict, hidden: torch.Tensor, cache, base: int,
           batch: int, forward_s: float) -> list[int]:
    """Roll the row's cache back to the lead token and the accepted path (the verdict's next token
    leads the following block): a chain's path is a prefix of the block, so moving the length is
    enough; a tree's path is packed into consecutive slots first. Then the drafter and the
    draft-length rule hear how it went. Returns the kept block positions."""
    tree = block.tree
    keep = [0] + [i + 1 for i in verdict.path]  # block positions, increasing
    if verdict.path == list(range(verdict.num_accepted)):
        cache.truncate(base + len(keep), row=r)
    else:
        cache.compact(keep, base, row=r)
    row.stats.count(len(tree), verdict.num_accepted, max(tree.depths(), default=0))
    if row.drafter is None:
        return keep
    if row.drafter.needs.observes is not None:
        row.drafter.observe(hidden[r, keep])  # lead token + accepted path, in order
    if block.source == FORCED:  # not the drafter's guess: neither it nor its rule hears back
        return keep
    row.drafter.feedback(verdict.num_accepted)
    row.control.hear(len(tree), verdict.num_accepted, block.source, forward_s, batch)
    return keep


def emit(row, block: Block, verdict: TreeVerdict, scores: Scores, keep: list[int]) -> Emitted:
    """Every token of the verdict through the row's `Output`, one at a time (a stop inside an
    accepted run ends the text exactly where plain decoding would), and the grammar advanced."""
    tree = block.tree
    if row.steps is not None:
        row.steps.append(Step(list(verdict.accepted), verdict.next_token, verdict.kind, len(tree)))
    kept, pieces = [], []
    for token in verdict.tokens:
        pieces.append(row.out.push(token))
        kept.append(token)
        if row.out.finished:
            break
    if row.grammar is not None:
        row.grammar.advance(kept)
    logprobs = None
    if row.logprobs is not None:
        logprobs = log_probs(scores.logits[keep][: len(kept)], kept, row.logprobs)
    sources = token_sources(verdict.num_accepted, verdict.kind, len(tree))[: len(kept)]
    return Emitted(kept, "".join(pieces), logprobs, len(tree), verdict.num_accepted, max(tree.depths(), default=0),
                   pieces=pieces, sources=sources)
