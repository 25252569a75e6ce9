"""The chat page at `/` and specdec's extension fields of the OpenAI wire format.

The page is three static files in `server/static/` (HTML, plain JavaScript, CSS: no build step,
nothing fetched from elsewhere), read once at start and served from memory under a strict
Content-Security-Policy (no inline script or style, every fetch to this origin only). The page
itself needs no API key: it talks to this server's own `/v1/*` endpoints, which keep their key
rules, and asks its user for a key when they answer 401.

Extension fields, all under the key `specdec`, which standard clients ignore:

- a request's `"specdec": {"tokens": true, "stats": true}` (`protocol.SpecdecOptions`);
- with `tokens`, each streamed chunk that carries text also carries
  `"specdec": {"tokens": [{"text": ..., "source": "draft" | "target" | "bonus"}, ...]}`: the
  chunk's text (`choices[0].text`, or `delta.content` for chat) cut into pieces by where each
  token came from (an accepted draft token, the target's own token, the bonus token after a fully
  accepted draft); the pieces join to exactly that text (`sources.py`). A chat answer with tools
  carries none (its text is rewritten into calls);
- with `stats`, the chunk with the `finish_reason` carries `"specdec": {"stats": {...}}`
  (`stats_of`);
- `GET /v1/models`: each model has `"specdec": {"drafters": [...], "default_drafter": ...,
  "chat_template": bool}`: the drafter names a request's `speculative.drafter` may take, and
  whether `/v1/chat/completions` works (else the page uses `/v1/completions`).
"""

from __future__ import annotations

from importlib import resources

from fastapi import FastAPI
from fastapi.responses import Response

# The page's only origin is this server; nothing inline, no plugins, no framing.
CSP = ("default-src 'self'; script-src 'self'; style-src 'self'; img-src 'self'; connect-src 'self'; "
       "object-src 'none'; base-uri 'none'; form-action 'none'; frame-ancestors 'none'")
PAGE_HEADERS = {"Content-Security-Policy": CSP, "X-Content-Type-Options": "nosniff",
                "Referrer-Policy": "no-referrer", "X-Frame-Options": "DENY", "Cache-Control": "no-cache"}
# URL path -> (file in static/, media type)
PAGE_FILES = {"/": ("index.html", "text/html; charset=utf-8"),
              "/static/app.js": ("app.js", "text/javascript; charset=utf-8"),
              "/static/markdown.js": ("markdown.js", "text/javascript; charset=utf-8"),
              "/static/app.css": ("app.css", "text/css; charset=utf-8"),
              "/static/icon.svg": ("icon.svg", "image/svg+xml")}


def page_files() -> dict[str, tuple[bytes, str]]:
    """Each page path's bytes and media type, read from the package."""
    static = resources.files("specdec.server") / "static"
    return {path: ((static / name).read_bytes(), media) for path, (name, media) in PAGE_FILES.items()}


def add_web_routes(app: FastAPI) -> None:
    """Serve the page's files (GET, no key) from memory."""
    files = page_files()

    def serve(path: str):
        body, media = files[path]

        async def route():
            return Response(body, media_type=media, headers=PAGE_HEADERS)

        return route

    for path in files:
        app.add_api_route(path, serve(path), methods=["GET"], include_in_schema=False)


def model_extension(scheduler, tokenizer) -> dict:
    """`/v1/models`' extension field of the served model (empty while it loads)."""
    if scheduler is None:
        return {}
    return {"specdec": {"drafters": list(scheduler.drafters), "default_drafter": scheduler.drafter,
                        "chat_template": bool(tokenizer is not None and tokenizer.chat_template)}}


def stream_extension(body, delta, tokens: bool = True, stats: bool = True) -> dict:
    """The `specdec` field of a chunk made from `delta`, as the request's `specdec` asks: its
    text's token sources (`tokens`), and on the last delta the request's statistics (`stats`)."""
    options = body.specdec
    if options is None:
        return {}
    out = {}
    if tokens and options.tokens and delta.sources:
        out["tokens"] = [{"text": text, "source": source} for text, source in delta.sources]
    if stats and options.stats and delta.finish_reason and delta.stats is not None:
        out["stats"] = stats_of(delta)
    return {"specdec": out} if out else {}


def stats_of(delta) -> dict:
    """A finished request's speculation statistics: tokens, target passes, draft tokens scored and
    accepted (overall and per draft position), decoding speed (after the first token) and latency."""
    s, t = delta.stats, delta.timing
    return {"completion_tokens": s.new_tokens, "target_passes": s.target_forwards,
            "tokens_per_pass": s.new_tokens / s.target_forwards if s.target_forwards else None,
            "draft_tokens": s.draft_tokens, "accepted_tokens": s.accepted_tokens,
            "acceptance_rate": s.acceptance_rate if s.draft_tokens else None,
            "drafted_per_position": list(s.drafted_per_position),
            "accepted_per_position": list(s.accepted_per_position),
            "tokens_per_s": s.tokens_per_s or None,
            "ttft_s": None if t is None else t.ttft_s, "e2e_s": None if t is None else t.e2e_s}
