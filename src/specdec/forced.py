"""Forced-token drafts: where a row's grammar admits only one continuation for its next tokens
(a tool call's JSON skeleton `{"name": "`, a named function's name, `", "arguments": {"`, a
schema's required keys; any constraint's fixed text), those tokens are drafted as an ordinary
deterministic draft (q one-hot), so the target verifies them all in one pass instead of emitting
them one step each.

The tokens are the grammar engine's fast-forward tokens at the row's committed tokens (llguidance's
`compute_ff_tokens`: the forced bytes, tokenised as the tokenizer would). They are drafts like any
other: verified by the ordinary rules against the masked target (`verify.py`, "Adjusted and masked
targets"), so greedy output is the plain constrained output and sampled output keeps its
distribution whatever is drafted; a forced token the target (or its mask) does not take is just a
rejection.

A row with a drafter (speculation on), drafting a chain, whose grammar forces at least one token,
drafts those this step instead of asking its drafter (so the drafter's state and the draft-length
rule's estimates are not touched: its proposal is neither made nor heard back, `Block.source` is
`FORCED`); the drafter is asked again at the next step. They do count in the row's `Stats`
(drafted and accepted tokens), like any draft the target verified. The length is capped by the row's token
allowance, the batch's load cap, and the cache room every step may write into: the larger of the
row's own (`DraftController.room`) and `PREDICTION_K_MAX`, which the server's cache holds past
every row for prediction rows (a lone row's cache, `Engine.generate`, holds its whole allowance).

Hooks: `step.propose` asks `forced_tokens(row, cap)` before planning a row; `step.commit` skips the
drafter's feedback and the rule's `hear` for a `FORCED` block.
"""

from __future__ import annotations

from .policy import PREDICTION_K_MAX

FORCED = "forced"  # Block.source of a forced draft


def forced_tokens(row, cap: int | None) -> list[int]:
    """This step's forced draft for the row, or [] (its drafter is asked as usual)."""
    control = row.control
    if row.grammar is None or control is None or control.tree is not None or not row.out.ids:
        return []
    limit = min(max(control.room, PREDICTION_K_MAX), row.out.remaining)
    if cap is not None and not control.fixed_k:
        limit = min(limit, cap)
    return row.grammar.forced()[:limit] if limit > 0 else []
