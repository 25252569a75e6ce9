"""Pure functions from what the scheduler hands back (`request.Delta`, `Completion`, `Usage`,
`TokenLogprob`, `errors.Fault`) to OpenAI's objects: completions and chat completions, whole and as
stream chunks, their `usage` and `logprobs`, the model list, and the SSE framing. No HTTP and no
state: the routes (`routes.py`) call them with the request's header fields (`base`: id, object,
created, model) and the tokenizer that spells the tokens.
"""

from __future__ import annotations

import json

from ..errors import Fault
from ..request import Completion, Delta, Usage
from ..step import TokenLogprob
from ..tokenizer import Tokenizer
from .wire import error_body


def sse(payload: dict) -> str:
    return f"data: {json.dumps(payload, ensure_ascii=False)}\n\n"


SSE_DONE = "data: [DONE]\n\n"


def usage_dict(usage: Usage) -> dict:
    return {"prompt_tokens": usage.prompt_tokens, "completion_tokens": usage.completion_tokens,
            "total_tokens": usage.prompt_tokens + usage.completion_tokens,
            "prompt_tokens_details": {"cached_tokens": usage.cached_tokens},
            **({} if usage.prediction is None else {"completion_tokens_details": {
                "accepted_prediction_tokens": usage.prediction.accepted,
                "rejected_prediction_tokens": usage.prediction.rejected}})}


def fault_body(fault: Fault) -> dict:
    """The SSE error event of a stream whose request failed after its first byte."""
    return error_body(fault.message, fault.type, fault.param)


def model_list(name: str, created: int, max_model_len: int) -> dict:
    return {"object": "list", "data": [{"id": name, "object": "model", "created": created, "owned_by": "specdec",
                                        "max_model_len": max_model_len}]}


def token_text(tokenizer: Tokenizer | None, token: int) -> str:
    return tokenizer.decode([token]) if tokenizer is not None else ""


def usage_chunk(base: dict, usage: dict) -> dict:
    """A stream's last chunk under `stream_options.include_usage`: no choices, the usage."""
    return {**base, "choices": [], "usage": usage}


# -- /v1/completions ---------------------------------------------------------------------------------

def completion_logprobs(items: list[TokenLogprob] | None, tokenizer: Tokenizer | None, offset: int) -> dict | None:
    """The legacy completions' `logprobs`; `offset` is where the text of `items` starts."""
    if items is None:
        return None
    tokens = [token_text(tokenizer, i.token) for i in items]
    offsets, at = [], offset
    for t in tokens:
        offsets.append(at)
        at += len(t)
    return {"tokens": tokens, "token_logprobs": [i.logprob for i in items],
            "top_logprobs": [{token_text(tokenizer, t): lp for t, lp in i.top} for i in items],
            "text_offset": offsets}


def completion(base: dict, result: Completion, tokenizer: Tokenizer | None, usage: dict) -> dict:
    return {**base, "choices": [{"index": 0, "text": result.text,
                                 "logprobs": completion_logprobs(result.logprobs, tokenizer, 0),
                                 "finish_reason": result.finish_reason}],
            "usage": usage}


def completion_chunk(base: dict, delta: Delta, tokenizer: Tokenizer | None, offset: int,
                     include_usage: bool) -> dict:
    chunk = {**base, "choices": [{"index": 0, "text": delta.text,
                                  "logprobs": completion_logprobs(delta.logprobs, tokenizer, offset),
                                  "finish_reason": delta.finish_reason}]}
    if include_usage:
        chunk["usage"] = None
    return chunk


# -- /v1/chat/completions ----------------------------------------------------------------------------

def chat_logprobs(items: list[TokenLogprob] | None, tokenizer: Tokenizer | None) -> dict | None:
    if items is None:
        return None

    def entry(token: int, lp: float) -> dict:
        text = token_text(tokenizer, token)
        return {"token": text, "logprob": lp, "bytes": list(text.encode("utf-8"))}

    return {"content": [{**entry(i.token, i.logprob), "top_logprobs": [entry(t, lp) for t, lp in i.top]}
                        for i in items]}


def chat_completion(base: dict, message: dict, finish_reason: str, logprobs: dict | None, usage: dict) -> dict:
    return {**base, "object": "chat.completion",
            "choices": [{"index": 0, "message": message, "logprobs": logprobs, "finish_reason": finish_reason}],
            "usage": usage}


def chat_chunk(head: dict, delta: dict, logprobs: dict | None = None, finish_reason: str | None = None,
               include_usage: bool = False) -> dict:
    """One `chat.completion.chunk` (`head` carries its object name); `usage: null` on every chunk but
    the last under `include_usage`."""
    return {**head, "choices": [{"index": 0, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}],
            **({"usage": None} if include_usage else {})}
