"""Where each streamed piece of text came from: the scheduler's split of a stream's text by token source.

The core reports, per emitted token, the text it added and its source (`step.token_sources`:
an accepted draft token, the target's own, or the bonus token). A stream does not send that text
token by token: `Output.take_text` holds back a tail that may begin a stop string and cuts the
text at a stop string. Both are slices of one append-only text, so the sent text is always a
prefix of the tokens' pieces joined; `SourceSplitter` keeps the pieces not yet sent and cuts each
sent text into (text, source) segments that join to exactly that text. A token whose text is
split by the hold-back appears as two segments with the same source.
"""

from __future__ import annotations

from collections import deque


class SourceSplitter:
    """One request's pieces not yet sent, in order: `split(pieces, sources, sent)` per delta."""

    def __init__(self) -> None:
        self._pending: deque[list[str]] = deque()  # [text, source]

    def split(self, pieces: list[str] | None, sources: list[str] | None, sent: str) -> list[tuple[str, str]]:
        """Add this step's tokens (their texts and sources), then take `sent` (the text the delta
        carries) off the front: its segments, in order, joined equal to `sent`."""
        for text, source in zip(pieces or [], sources or []):
            if text:
                self._pending.append([text, source])
        out, need = [], len(sent)
        while need and self._pending:
            head = self._pending[0]
            take = head[0][:need]
            out.append((take, head[1]))
            need -= len(take)
            if len(take) == len(head[0]):
                self._pending.popleft()
            else:
                head[0] = head[0][len(take):]
        if need:  # cannot happen while the sent text is a prefix of the pieces; never lose text
            out.append((sent[len(sent) - need:], "target"))
        return out
