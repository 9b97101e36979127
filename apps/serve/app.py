"""The HTTP side of `specbeam serve` (Starlette): OpenAI's /v1/chat/completions, /v1/completions and /v1/models,
LibreTranslate's /translate and /languages, and /health. Every refusal is OpenAI's error object with a 4xx; the
server goes on after each. Nothing logged holds a key or a body."""
from __future__ import annotations

import asyncio
import hmac
import json
import sys
import time

from starlette.applications import Starlette
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, StreamingResponse
from starlette.routing import Route

from specbeam_edge.text.tokenizer import ChatTemplateError

from . import shapes
from .complete import Run, follow, prepare
from .params import ApiError, Call, parse
from .translate import languages, translate

MAX_BODY = 8 * 2**20           # a request body larger than this is refused (413)


class Server:
    """What the routes share: the models, the key, and the limits."""

    def __init__(self, registry, *, api_key: str | None = None, max_body: int = MAX_BODY):
        self.registry, self.api_key, self.max_body = registry, api_key, max_body

    def authorize(self, request: Request, body_key: str | None = None) -> None:
        if self.api_key is None:
            return
        auth = request.headers.get("authorization", "")
        token = auth[7:].strip() if auth[:7].lower() == "bearer " else body_key
        if not isinstance(token, str) or not hmac.compare_digest(token.encode(), self.api_key.encode()):
            raise ApiError(401, "a missing or wrong API key: send it as 'Authorization: Bearer KEY'",
                           code="invalid_api_key")

    async def body(self, request: Request) -> dict:
        size = request.headers.get("content-length")
        if size is not None and size.isdigit() and int(size) > self.max_body:
            raise ApiError(413, f"the body has {int(size)} bytes; this server takes at most {self.max_body}")
        raw = bytearray()
        async for part in request.stream():
            raw += part
            if len(raw) > self.max_body:
                raise ApiError(413, f"the body is over {self.max_body} bytes, the most this server takes")
        try:
            body = json.loads(bytes(raw).decode("utf-8"))
        except (UnicodeDecodeError, ValueError) as e:
            raise ApiError(400, f"the body is not JSON ({e})", code="invalid_json") from None
        if not isinstance(body, dict):
            raise ApiError(400, "the body must be a JSON object", code="invalid_json")
        return body


def error_response(e: ApiError) -> JSONResponse:
    return JSONResponse(e.body(), status_code=e.status, headers=e.headers)


async def health(request: Request):
    reg = request.app.state.server.registry
    if reg.error:
        return JSONResponse({"status": "error", "error": reg.error}, status_code=503)
    if not reg.ready:
        return JSONResponse({"status": "loading"}, status_code=503, headers={"Retry-After": "5"})
    return JSONResponse({"status": "ok"})


async def models(request: Request):
    server = request.app.state.server
    server.authorize(request)
    server.registry.get(None)          # 503 while loading
    data = [{"id": m.name, "object": "model", "created": m.created, "owned_by": "specbeam-edge",
             "meta": {"context_length": m.engine.target.cfg.context_length, "draft": m.engine.draft is not None,
                      "chat": m.chat}} for m in server.registry.models.values()]
    return JSONResponse({"object": "list", "data": data})


def message_text(m, i: int) -> dict:
    """A message as the chat template takes it: content a string (OpenAI's text parts joined)."""
    if not isinstance(m, dict) or not isinstance(m.get("role"), str):
        raise ApiError(400, f"messages[{i}] must be an object with a 'role' and 'content'", param="messages")
    content = m.get("content")
    if isinstance(content, list):
        if not all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)
                   for p in content):
            raise ApiError(400, f"messages[{i}].content: only text parts are supported", param="messages")
        content = "".join(p["text"] for p in content)
    elif content is None:
        content = ""
    elif not isinstance(content, str):
        raise ApiError(400, f"messages[{i}].content must be a string or a list of text parts", param="messages")
    role = "system" if m["role"] == "developer" else m["role"]
    return {"role": role, "content": content}


def chat_ids(served, body: dict) -> list[list[int]]:
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise ApiError(400, "'messages' must be a non-empty list of messages", param="messages")
    msgs = [message_text(m, i) for i, m in enumerate(messages)]
    engine = served.engine
    try:
        prompt = engine.tokenizer.apply_chat_template(msgs) if served.chat else \
            engine.tokenizer.format_prompt(msgs[-1]["content"])
        return [engine.encode(prompt)]
    except (ChatTemplateError, ValueError, TypeError) as e:
        raise ApiError(400, f"messages: {e}", param="messages") from None


def completion_ids(served, body: dict) -> list[list[int]]:
    """OpenAI's prompt: a text, a list of texts, token ids, or a list of those; texts as written (no template)."""
    prompt = body.get("prompt")
    one = isinstance(prompt, str) or isinstance(prompt, list) and prompt and all(
        isinstance(t, int) and not isinstance(t, bool) for t in prompt)
    prompts = [prompt] if one else prompt
    if not isinstance(prompts, list) or not prompts or len(prompts) > 64:
        raise ApiError(400, "'prompt' must be a text, token ids, or a list of at most 64 of those", param="prompt")
    try:
        return [served.engine.encode(p, raw=True) for p in prompts]
    except (ValueError, TypeError) as e:
        raise ApiError(400, f"prompt: {e}", param="prompt") from None


async def chat_completions(request: Request):
    return await _complete(request, chat=True)


async def completions(request: Request):
    return await _complete(request, chat=False)


async def _complete(request: Request, chat: bool):
    server: Server = request.app.state.server
    server.authorize(request)
    body = await server.body(request)
    call = parse(body, chat)
    served = server.registry.get(call.model)
    ids = await run_in_threadpool(chat_ids if chat else completion_ids, served, body)
    groups = await run_in_threadpool(prepare, served, call, ids)
    run = Run(served, call, groups, sum(g.count for g in groups))
    run.submit()
    if call.stream:
        return StreamingResponse(_stream(run, chat), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
    return await _whole(run, chat, request)


async def _whole(run: Run, chat: bool, request: Request):
    """The answer whole; a client that left has its requests cancelled (checked twice a second)."""
    try:
        if not await follow(request, run.next, lambda: run.finished):
            run.cancel()
            return JSONResponse({}, status_code=499)
    except asyncio.CancelledError:
        run.cancel()
        raise
    if run.failed is not None:
        return error_response(_failure(run.failed))
    choices = []
    tok = run.served.engine.tokenizer
    for g in run.groups:
        for j in range(g.count):
            rows = await run.logprobs(g, j)
            lp = (shapes.chat_logprobs if chat else shapes.completion_logprobs)(tok, g.tokens[j], rows)
            choices.append(shapes.choice(chat, g.first + j, g.texts[j], g.reasons[j], lp))
    use = shapes.usage(run)
    body = dict(shapes.head(run, chat), choices=choices, usage=use,
                timings=shapes.timings(run.stats(), use["completion_tokens"], time.perf_counter() - run.t0))
    return JSONResponse(body)


def _failure(error: BaseException) -> ApiError:
    """A request the engine failed on: one line on stderr, a 500 for the client (no traceback)."""
    print(f"specbeam serve: a request failed: {type(error).__name__}: {error}", file=sys.stderr, flush=True)
    return ApiError(500, f"the engine failed on this request ({type(error).__name__}); the server goes on")


async def _stream(run: Run, chat: bool):
    """OpenAI's chunks: the role first (chat), text as it becomes final, each choice's finish_reason, a usage
    chunk with no choices when asked (stream_options.include_usage), then [DONE]."""
    top = shapes.head(run, chat, chunk=True)
    extra = {"usage": None} if run.call.include_usage else {}
    tok = run.served.engine.tokenizer
    try:
        if chat:
            yield shapes.sse(dict(top, choices=[shapes.delta(chat, i, role=True) for i in range(run.n_choices)],
                                  **extra))
        while not run.finished:
            g, text = await run.next()
            if run.failed is not None:
                yield shapes.sse(_failure(run.failed).body())
                return
            if text:
                yield shapes.sse(dict(top, choices=[shapes.delta(chat, g.first + j, text) for j in range(g.count)],
                                      **extra))
            elif text is None:
                shown = g.scan.text[:g.scan.sent]          # what this group's chunks gave so far
                for j in range(g.count):
                    rest = g.texts[j][len(shown):] if g.texts[j].startswith(shown) else ""
                    rows = await run.logprobs(g, j)
                    lp = (shapes.chat_logprobs if chat else shapes.completion_logprobs)(tok, g.tokens[j], rows)
                    figures = shapes.timings(g.stats, len(g.tokens[j]), time.perf_counter() - run.t0) \
                        if g.stats is not None else None
                    yield shapes.sse(dict(top, choices=[shapes.delta(chat, g.first + j, rest, g.reasons[j], lp)],
                                          timings=figures, **extra))
        if run.call.include_usage:
            use = shapes.usage(run)
            yield shapes.sse(dict(top, choices=[], usage=use, timings=shapes.timings(
                run.stats(), use["completion_tokens"], time.perf_counter() - run.t0)))
        yield shapes.DONE
    finally:
        if not run.finished:        # the client went away (or the stream failed): stop before the next pass
            run.cancel()


def build(server: Server) -> Starlette:
    async def api_error(request, e: ApiError):
        return error_response(e)

    async def http_error(request, e: HTTPException):
        return error_response(ApiError(e.status_code, f"{request.method} {request.url.path}: {e.detail}"))

    async def crash(request, e: Exception):
        return error_response(_failure(e))

    app = Starlette(routes=[
        Route("/health", health, methods=["GET"]),
        Route("/v1/models", models, methods=["GET"]),
        Route("/v1/chat/completions", chat_completions, methods=["POST"]),
        Route("/v1/completions", completions, methods=["POST"]),
        Route("/translate", translate, methods=["POST"]),
        Route("/languages", languages, methods=["GET"]),
    ], exception_handlers={ApiError: api_error, HTTPException: http_error, Exception: crash})
    app.state.server = server
    return app


__all__ = ["Call", "Server", "build"]
