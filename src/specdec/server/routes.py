"""The app's routes: /health, /metrics, the docs and the schema, /v1/models, /v1/completions and
/v1/chat/completions. Each route reads the app's one `ServerState` (`request.app.state.specdec`),
makes its checks in the order the app's docstring gives, queues the request (`intake.py`) and turns
what comes back into OpenAI's objects (`responses.py`), whole or as server-sent events.

A streamed request is cancelled when its client goes away (`guarded`); a whole one too, the moment
the client disconnects (`collect`), so an abandoned request frees its batch row at once.
"""

from __future__ import annotations

import asyncio
import time

from fastapi import FastAPI, Request
from fastapi.openapi.docs import get_redoc_html, get_swagger_ui_html
from fastapi.openapi.utils import get_openapi
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse

from ..errors import InvalidRequestError
from ..request import Delta, RequestHandle, Usage
from . import responses as R
from .http_errors import error_response, raise_fault
from .intake import read_body, submit, text_ids
from .protocol import ChatCompletionRequest, CompletionRequest, parse
from .state import ServerState
from .toolapi import ToolStream, ToolTurn, message_of, template_messages, tool_turn
from .web import model_extension, stream_extension

DEFAULT_COMPLETION_MAX_TOKENS = 16  # the OpenAI completions default; chat defaults to the context left


def add_routes(app: FastAPI) -> None:
    """The routes, on `app` itself rather than through an included router: `ray_app` replaces
    /metrics by its path."""
    app.add_api_route("/health", health, methods=["GET"])
    app.add_api_route("/metrics", metrics, methods=["GET"], response_class=PlainTextResponse)
    app.add_api_route("/openapi.json", openapi_json, methods=["GET"], include_in_schema=False)
    app.add_api_route("/docs", docs, methods=["GET"], include_in_schema=False)
    app.add_api_route("/redoc", redoc, methods=["GET"], include_in_schema=False)
    app.add_api_route("/v1/models", models, methods=["GET"])
    app.add_api_route("/v1/completions", completions, methods=["POST"])
    app.add_api_route("/v1/chat/completions", chat_completions, methods=["POST"])


def state_of(request: Request) -> ServerState:
    return request.app.state.specdec


async def health(request: Request):
    state = state_of(request)
    if state.load_error is not None:
        return JSONResponse({"status": "error", "error": state.load_error}, status_code=503)
    if state.scheduler is None:
        return JSONResponse({"status": "loading"}, status_code=503)
    return {"status": "ok"}


async def metrics(request: Request):
    state = state_of(request)
    scope = state.metrics_scope(request)
    return PlainTextResponse(state.metrics.render(state.scheduler, state.settings.served_model_name, scope),
                             media_type="text/plain; version=0.0.4")


async def openapi_json(request: Request):
    state_of(request).metrics_scope(request)
    return JSONResponse(request.app.openapi())


async def docs(request: Request):
    state_of(request).metrics_scope(request)
    return get_swagger_ui_html(openapi_url="/openapi.json", title="specdec")


async def redoc(request: Request):
    state_of(request).metrics_scope(request)
    return get_redoc_html(openapi_url="/openapi.json", title="specdec")


async def models(request: Request):
    state = state_of(request)
    state.check_key(request)
    scheduler, settings = state.scheduler, state.settings
    listing = R.model_list(settings.served_model_name, state.created, state.context)
    listing["data"][0].update(model_extension(scheduler, state.tokenizer))
    return listing


async def completions(request: Request):
    state = state_of(request)
    tenant = state.check_key(request)
    scheduler = state.ready()
    body = parse(CompletionRequest, await read_body(request))
    state.check_model(body.model)
    prompt, tokenizer = body.single_prompt, state.tokenizer
    handle = await submit(state, request, tenant, body, scheduler,
                          lambda: text_ids(tokenizer, prompt, "prompt") if isinstance(prompt, str) else list(prompt),
                          body.max_tokens or DEFAULT_COMPLETION_MAX_TOKENS, body.logprobs)
    access = request.scope["specdec.access"]
    base = {"id": f"cmpl-{access.id}", "object": "text_completion", "created": int(time.time()),
            "model": state.settings.served_model_name}
    if body.stream:
        return StreamingResponse(_completion_events(handle, access, base, tokenizer, body),
                                 media_type="text/event-stream")
    result = await _collected(handle, request, access)
    if result is None:  # nobody reads this
        return error_response(499, "client disconnected", "cancelled")
    return R.completion(base, result, tokenizer, await usage_of(result.usage))


async def _collected(handle: RequestHandle, request: Request, access):
    """A non-streamed request's whole answer, or None when its client went away; a fault is raised
    as its error response."""
    done = await collect(handle, request)
    if done is None:
        return None
    note(access, done[-1])
    raise_fault(done[-1])
    return RequestHandle.collect(done)


async def _completion_events(handle: RequestHandle, access, base: dict, tokenizer, body: CompletionRequest):
    offset, include_usage = 0, body.include_usage
    async for delta in guarded(handle):
        note(access, delta)
        if delta.finish_reason == "error":
            yield R.sse(R.fault_body(delta.error))
            break
        if delta.text or delta.finish_reason or delta.logprobs:
            yield R.sse({**R.completion_chunk(base, delta, tokenizer, offset, include_usage),
                         **stream_extension(body, delta)})
            offset += len(delta.text)
        if delta.finish_reason and include_usage:
            yield R.sse(R.usage_chunk(base, await usage_of(delta.usage)))
    yield R.SSE_DONE


async def chat_completions(request: Request):
    state = state_of(request)
    tenant = state.check_key(request)
    scheduler = state.ready()
    body = parse(ChatCompletionRequest, await read_body(request))
    state.check_model(body.model)
    tokenizer = state.tokenizer
    if tokenizer is None:
        raise InvalidRequestError("this model has no tokenizer, so no chat template: use /v1/completions "
                                  "with token ids", "messages")
    top = body.top_logprobs or 0
    turn = tool_turn(body, tokenizer)
    handle = await submit(state, request, tenant, body, scheduler, lambda: tokenizer.encode_chat(
        template_messages(body), body.add_generation_prompt, body.continue_final_message,
        turn and turn.template_tools), body.max_completion_tokens or body.max_tokens,
                          top if body.logprobs else None, turn and turn.constraint)
    access = request.scope["specdec.access"]
    base = {"id": f"chatcmpl-{access.id}", "created": int(time.time()), "model": state.settings.served_model_name}
    if body.stream:
        return StreamingResponse(_chat_events(handle, access, base, tokenizer, turn, body),
                                 media_type="text/event-stream")
    result = await _collected(handle, request, access)
    if result is None:  # nobody reads this
        return error_response(499, "client disconnected", "cancelled")
    message, finish = {"role": "assistant", "content": result.text}, result.finish_reason
    if turn is not None:
        message, finish = message_of(turn, result.token_ids, tokenizer, finish)
    return R.chat_completion(base, message, finish, R.chat_logprobs(result.logprobs, tokenizer),
                             await usage_of(result.usage))


async def _chat_events(handle: RequestHandle, access, base: dict, tokenizer, turn: ToolTurn | None,
                       body: ChatCompletionRequest):
    """The chunks of a streamed chat completion: the role first, the content as it comes (held back
    where it may be a tool call of `turn`), the calls and the finish reason at the end."""
    head, include_usage = {**base, "object": "chat.completion.chunk"}, body.include_usage
    yield R.sse(R.chat_chunk(head, {"role": "assistant", "content": ""}, include_usage=include_usage))
    calls = ToolStream(turn, tokenizer) if turn is not None else None
    async for delta in guarded(handle):
        note(access, delta)
        if delta.finish_reason == "error":
            yield R.sse(R.fault_body(delta.error))
            break
        # A tool turn's deltas: content, a call's head, its argument fragments (toolapi.ToolStream).
        parts = calls.push(delta.text, delta.token_ids) if calls is not None else \
            [{"content": delta.text}] if delta.text else []
        if delta.logprobs and not parts:
            parts = [{"content": ""}]
        for n, part in enumerate(parts):
            yield R.sse({**R.chat_chunk(head, part, R.chat_logprobs(delta.logprobs, tokenizer) if n == 0 else None,
                                        include_usage=include_usage),
                         **(stream_extension(body, delta, stats=False) if calls is None else {})})
        if delta.finish_reason:
            finish = delta.finish_reason
            if calls is not None:
                parts, finish = calls.finish(finish)
                for part in parts:
                    yield R.sse(R.chat_chunk(head, part, include_usage=include_usage))
            yield R.sse({**R.chat_chunk(head, {}, None, finish, include_usage),
                         **stream_extension(body, delta, tokens=False)})
            if include_usage:
                yield R.sse(R.usage_chunk(head, await usage_of(delta.usage)))
    yield R.SSE_DONE


def openapi_schema(app: FastAPI) -> dict:
    """`app.openapi`: FastAPI's schema with the request models of the two generating routes.

    The endpoints read their bodies themselves (so the checks run in the order of the app's
    docstring); the request models are declared here so that /openapi.json describes them."""
    if app.openapi_schema is None:
        schema = get_openapi(title=app.title, version=app.version, routes=app.routes)
        components = schema.setdefault("components", {}).setdefault("schemas", {})
        for path, model in (("/v1/completions", CompletionRequest),
                            ("/v1/chat/completions", ChatCompletionRequest)):
            model_schema = model.model_json_schema(ref_template="#/components/schemas/{model}")
            components.update(model_schema.pop("$defs", {}))
            components[model.__name__] = model_schema
            schema["paths"][path]["post"]["requestBody"] = {"required": True, "content": {"application/json": {
                "schema": {"$ref": f"#/components/schemas/{model.__name__}"}}}}
        app.openapi_schema = schema
    return app.openapi_schema


async def usage_of(usage: Usage) -> dict:
    """`responses.usage_dict` worked out off the event loop (its prediction counts run difflib)."""
    return await asyncio.to_thread(R.usage_dict, usage)


def note(access, delta: Delta) -> None:
    """What the access line says of a finished request (its last delta carries the totals)."""
    if delta.usage is not None:
        access.completion_tokens, access.cached_tokens = delta.usage.completion_tokens, delta.usage.cached_tokens
    if delta.stats is not None:
        access.forwards = delta.stats.target_forwards


async def guarded(handle: RequestHandle):
    """The handle's deltas; if the consumer goes away (client disconnect), cancel the request.

    Starlette cancels the streaming task when the client disconnects (or the next write fails);
    either way this generator is closed, and `finally` frees the batch row.
    """
    try:
        async for delta in handle:
            yield delta
    finally:
        if not handle.consumed:
            handle.cancel()


async def collect(handle: RequestHandle, request: Request) -> list[Delta] | None:
    """All deltas of a non-streaming request; None (and the request cancelled) if the client left.

    Waits for the result and, at the same time, for the client's `http.disconnect`, which the
    server sends the moment the connection closes: an abandoned request frees its batch row at
    once rather than generating to its end.
    """

    async def everything() -> list[Delta]:
        return [delta async for delta in handle]

    async def disconnect() -> None:
        # The body has been read, so the next ASGI message is the disconnect (the server sends it
        # when the client goes away, or once the response is complete).
        while (await request.receive())["type"] != "http.disconnect":
            pass

    result, gone = asyncio.ensure_future(everything()), asyncio.ensure_future(disconnect())
    try:
        await asyncio.wait({result, gone}, return_when=asyncio.FIRST_COMPLETED)
        return result.result() if result.done() else None
    finally:
        result.cancel()
        gone.cancel()
        if not handle.consumed:
            handle.cancel()
