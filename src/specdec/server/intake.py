"""From an HTTP request to a queued scheduler request (`request.Request`): the JSON body read and
checked (media type, UTF-8, depth), the prompt tokenised, OpenAI's sampling fields turned into
`SamplingParams`, the request's drafter, grammar and prediction, its tenant's place and its prefix
cache partition. Tokenising, compiling a grammar and tokenising a prediction run in a worker thread
(`submit`), so a large request never holds up the event loop.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
from typing import Callable

from starlette.requests import Request

from ..drafters.prediction import Prediction
from ..errors import InvalidRequestError
from ..request import Request as GenRequest
from ..request import RequestHandle
from ..sampling import SamplingParams
from ..scheduler import BatchScheduler
from ..tokenizer import Tokenizer
from .http_errors import APIError
from .protocol import _Sampling
from .state import ServerState
from .tenants import Tenant, cache_partition

MAX_JSON_DEPTH = 64  # request bodies nest 4 deep; anything near Python's recursion limit is an attack


async def read_body(request: Request) -> object:
    """The request's JSON body: application/json in UTF-8 (RFC 8259), at most MAX_JSON_DEPTH deep."""
    content_type = request.headers.get("content-type")
    if content_type is not None:  # no header at all: taken as JSON, as most servers do
        media, *params = [part.strip().lower() for part in content_type.split(";")]
        if media != "application/json" and not (media.startswith("application/") and media.endswith("+json")):
            raise APIError(415, f"unsupported content type {media!r}: send the body as application/json",
                           "invalid_request_error", None, "unsupported_media_type")
        charset = next((p.split("=", 1)[1].strip('" ') for p in params if p.startswith("charset=")), "utf-8")
        if charset not in ("utf-8", "utf8"):
            raise APIError(415, f"unsupported charset {charset!r}: JSON bodies are UTF-8",
                           "invalid_request_error", None, "unsupported_media_type")
    raw = await request.body()
    try:
        # Decoded as UTF-8 first: json.loads(bytes) would also guess UTF-16 and UTF-32.
        body = json.loads(raw.decode("utf-8"), parse_constant=_no_constant)
    except UnicodeDecodeError as exc:
        raise InvalidRequestError(f"the request body is not UTF-8: {exc.reason} at byte {exc.start}") from None
    except RecursionError:
        raise InvalidRequestError(f"the request body nests deeper than {MAX_JSON_DEPTH} levels") from None
    except ValueError as exc:  # JSONDecodeError, NaN / Infinity, integers of more than 4300 digits
        raise InvalidRequestError(f"the request body is not valid JSON: {exc}") from None
    if _depth(body) > MAX_JSON_DEPTH:
        raise InvalidRequestError(f"the request body nests deeper than {MAX_JSON_DEPTH} levels")
    return body


def _no_constant(name: str):
    raise ValueError(f"{name} is not a JSON number")


def _depth(value: object) -> int:
    """How deep JSON containers nest in `value` (a scalar is 0), without recursion."""
    deepest, stack = 0, [(value, 1)]
    while stack:
        item, depth = stack.pop()
        children = item.values() if isinstance(item, dict) else item if isinstance(item, list) else None
        if children is not None:
            deepest = max(deepest, depth)
            if depth <= MAX_JSON_DEPTH:
                stack.extend((child, depth + 1) for child in children)
    return deepest


def text_ids(tokenizer: Tokenizer | None, text: str, param: str) -> list[int]:
    if not text:
        raise InvalidRequestError("the prompt is empty", param)
    if tokenizer is None:
        raise InvalidRequestError("this model has no tokenizer: send the prompt as a list of token ids", param)
    return tokenizer.encode(text)


def prediction_of(body: _Sampling, tokenizer: Tokenizer | None) -> Prediction | None:
    """The request's prediction tokenised on its own (off the event loop), or None."""
    text = body.prediction_text
    return None if text is None else Prediction.of(text, tokenizer)


def gen_request(body: _Sampling, prompt_ids: list[int], max_tokens: int | None, logprobs: int | None,
                scheduler: BatchScheduler, prediction: Prediction | None = None, constraint=None) -> GenRequest:
    """The scheduler's request for an OpenAI body (`max_tokens` None: the context left)."""
    if max_tokens is None:
        max_tokens = max(1, scheduler.max_model_len - len(prompt_ids))
    sampling = SamplingParams(body.temperature, max(0, body.top_k), body.top_p, body.min_p, body.seed,
                              frequency_penalty=body.frequency_penalty, presence_penalty=body.presence_penalty,
                              repetition_penalty=body.repetition_penalty, logit_bias=body.logit_bias_pairs,
                              min_tokens=body.min_tokens, ignore_eos=body.ignore_eos)
    scheduler.engine.check_sampling(sampling)
    drafter, k = None, None
    if body.speculative is False:
        k = 0
    elif body.speculative is not None and body.speculative is not True:
        drafter, k = body.speculative.drafter, body.speculative.num_tokens
    spec = body.structured if constraint is None else constraint  # a tool turn's (toolapi.tool_turn)
    grammar = scheduler.engine.compile_structured(spec) if spec is not None else None
    return GenRequest(prompt_ids, max_tokens, sampling, body.stop_list, drafter, k, logprobs, grammar,
                      prediction=prediction, token_sources=bool(body.specdec and body.specdec.tokens))


async def submit(state: ServerState, request: Request, tenant: Tenant, body: _Sampling, scheduler: BatchScheduler,
                 tokenize: Callable[[], list[int]], max_tokens: int | None, logprobs: int | None,
                 constraint=None) -> RequestHandle:
    """Wait for one of the tenant's places (429 when its queue is full), tokenise and compile its
    grammar off the event loop, and queue the request; its place is given back when the scheduler finishes it."""
    await state.gate.acquire(tenant)
    try:
        ids = await asyncio.to_thread(tokenize)
        # Off the loop too: compiling a grammar may take its whole work budget (seconds), and
        # tokenising a prediction is as long as its text.
        gen = await asyncio.to_thread(lambda: gen_request(body, ids, max_tokens, logprobs, scheduler,
                                                          prediction_of(body, state.tokenizer), constraint))
        gen = dataclasses.replace(gen, tenant=tenant.name, request_id=request.scope["specdec.access"].id,
                                  cache_partition=cache_partition(state.settings.cache_salt, tenant, body.cache_salt))
        handle = scheduler.submit(gen, asyncio.get_running_loop())
    except BaseException:
        state.gate.release(tenant.name)
        raise
    request.scope["specdec.access"].prompt_tokens = len(ids)
    return handle
