"""kimi-serve: an OpenAI-compatible HTTP server over one compiled module (iree.runtime + numpy, no torch).

    kimi-serve OUT/ [--host 127.0.0.1] [--port 8000] [--slots N] [--queue 64]

    POST /v1/completions, /v1/chat/completions (JSON or SSE streaming), GET /v1/models, /health

The HTTP side is Starlette on uvicorn (the `[serve]` extra): both small, widely used and kept up,
with streaming responses that notice a client going away, and a graceful shutdown on SIGTERM. No
HTTP is parsed here. Requests run on the `Engine` (runtime/engine.py), which owns the slots; this
module only checks fields, renders the chat template and turns engine events into OpenAI's JSON
and chunk formats. A bad request gets OpenAI's error object and never reaches the engine.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import signal
import sys
import time
import uuid
from pathlib import Path

from .chat_template import ChatTemplate, load_chat_template
from .engine import Engine, Event, QueueFull, SamplingParams
from .errors import RuntimeUsageError
from .session import Session
from .tokenizer import Tokenizer

ROLES = ("system", "developer", "user", "assistant", "tool")
DISCONNECT_POLL_S = 0.25             # how often a non-streaming request looks for its client having gone


class ApiError(Exception):
    """An OpenAI-style error: HTTP status, message, and the offending parameter."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 kind: str = "invalid_request_error"):
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.kind = status, message, param, code, kind

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}}


# ---------------------------------------------------------------------------------------------- fields
def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_number(v) -> bool:
    return (isinstance(v, (int, float)) and not isinstance(v, bool)) and math.isfinite(v)


def field(body: dict, name: str, check, expected: str, default=None):
    """body[name] if present and not null, checked; a wrong type or range is a 400 naming the field."""
    value = body.get(name)
    if value is None:
        return default
    if not check(value):
        raise ApiError(400, f"'{name}' must be {expected}, got {json.dumps(value)[:80]}", param=name)
    return value


def sampling_params(body: dict, default_max_tokens: int, max_tokens_names: tuple[str, ...]) -> SamplingParams:
    max_tokens = None
    for name in max_tokens_names:
        max_tokens = field(body, name, lambda v: _is_int(v) and v >= 1, "an integer >= 1", max_tokens)
    stop = field(body, "stop", lambda v: isinstance(v, str) or (isinstance(v, list) and len(v) <= 16 and all(
        isinstance(s, str) and s for s in v)), "a string or a list of up to 16 non-empty strings", [])
    n = field(body, "n", _is_int, "an integer", 1)
    if n != 1:
        raise ApiError(400, "'n' must be 1: one completion per request", param="n")
    for name in ("presence_penalty", "frequency_penalty"):
        if field(body, name, _is_number, "a number", 0) != 0:
            raise ApiError(400, f"'{name}' is not supported (give 0 or leave it out)", param=name)
    if field(body, "logprobs", lambda v: isinstance(v, (bool, int)), "a boolean or an integer", False):
        raise ApiError(400, "'logprobs' is not supported", param="logprobs")
    field(body, "stream", lambda v: isinstance(v, bool), "a boolean")
    field(body, "stream_options", lambda v: isinstance(v, dict) and isinstance(v.get("include_usage", False), bool),
          "an object {\"include_usage\": boolean}")
    top_k = field(body, "top_k", lambda v: _is_int(v) and v >= -1, "an integer >= -1 (-1 or 0: off)", 0)
    return SamplingParams(
        max_tokens=max_tokens if max_tokens is not None else default_max_tokens,
        temperature=float(field(body, "temperature", lambda v: _is_number(v) and 0 <= v <= 2, "a number in [0, 2]", 1.0)),
        top_p=float(field(body, "top_p", lambda v: _is_number(v) and 0 < v <= 1, "a number in (0, 1]", 1.0)),
        top_k=max(top_k, 0),
        seed=field(body, "seed", _is_int, "an integer"),
        stop=(stop,) if isinstance(stop, str) else tuple(stop))


def completion_prompt(body: dict, tokenizer: Tokenizer) -> list[int]:
    """`prompt`: a string or token ids, or a list holding exactly one of those."""
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]
    if isinstance(prompt, str):
        return tokenizer.encode(prompt)
    if isinstance(prompt, list) and prompt and all(_is_int(t) for t in prompt):
        return list(prompt)
    raise ApiError(400, "'prompt' must be a non-empty string or list of token ids (one prompt per request)",
                   param="prompt")


def chat_messages(body: dict) -> list[dict]:
    """`messages`, with each content given as text (a string, or a list of {"type": "text"} parts)."""
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise ApiError(400, "'messages' must be a non-empty list of {role, content} objects", param="messages")
    out = []
    for i, m in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(m, dict) or m.get("role") not in ROLES:
            raise ApiError(400, f"{where} must be an object with 'role' one of {', '.join(ROLES)}", param=where)
        content = m.get("content")
        if isinstance(content, list):
            if not all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)
                       for p in content):
                raise ApiError(400, f"{where}.content: only text parts are supported", param=f"{where}.content")
            content = "".join(p["text"] for p in content)
        if content is None and m["role"] == "assistant":
            content = ""
        if not isinstance(content, str):
            raise ApiError(400, f"{where}.content must be a string or a list of text parts", param=f"{where}.content")
        out.append({**{k: v for k, v in m.items() if k not in ("role", "content")}, "role": m["role"],
                    "content": content})
    return out


# ---------------------------------------------------------------------------------------------- app
class Server:
    """The state the handlers share: the engine, the tokenizer, the chat template, the model's name."""

    def __init__(self, engine: Engine, tokenizer: Tokenizer, template: ChatTemplate | None, model_name: str):
        self.engine, self.tokenizer, self.template, self.model_name = engine, tokenizer, template, model_name
        self.created = int(time.time())

    def check_model(self, body: dict) -> None:
        model = field(body, "model", lambda v: isinstance(v, str), "a string")
        if model is not None and model != self.model_name:
            raise ApiError(404, f"The model '{model}' does not exist (this server has '{self.model_name}')",
                           param="model", code="model_not_found")

    def submit(self, prompt_ids: list[int], params: SamplingParams) -> tuple[object, asyncio.Queue]:
        """Hand a request to the engine; its events arrive on the returned queue in this event loop."""
        loop = asyncio.get_running_loop()
        events: asyncio.Queue[Event] = asyncio.Queue()
        try:
            request = self.engine.submit(prompt_ids, params, lambda e: loop.call_soon_threadsafe(events.put_nowait, e))
        except QueueFull as e:
            raise ApiError(503, f"server busy: {e}; retry later", code="server_busy", kind="server_error") from None
        except RuntimeUsageError as e:
            raise ApiError(400, str(e), param="max_tokens" if "max_tokens" in str(e) else "prompt") from None
        return request, events


def _usage(event: Event) -> dict:
    return {"prompt_tokens": event.prompt_tokens, "completion_tokens": event.completion_tokens,
            "total_tokens": event.prompt_tokens + event.completion_tokens}


def _sse(obj) -> str:
    return f"data: {json.dumps(obj)}\n\n"


def create_app(server: Server):
    from starlette.applications import Starlette
    from starlette.exceptions import HTTPException
    from starlette.requests import Request
    from starlette.responses import JSONResponse, StreamingResponse
    from starlette.routing import Route

    async def read_body(request: Request) -> dict:
        try:
            body = json.loads(await request.body())
        except (ValueError, UnicodeDecodeError) as e:
            raise ApiError(400, f"the request body is not valid JSON ({e})") from None
        if not isinstance(body, dict):
            raise ApiError(400, "the request body must be a JSON object")
        return body

    async def collect(request: Request, handle, events: asyncio.Queue) -> tuple[str, Event]:
        """Wait for the whole completion; a client that went away cancels it."""
        text = []
        while True:
            try:
                event = await asyncio.wait_for(events.get(), DISCONNECT_POLL_S)
            except asyncio.TimeoutError:
                if await request.is_disconnected():
                    server.engine.cancel(handle)
                continue
            text.append(event.text)
            if event.finish_reason is not None:
                return "".join(text), event

    def failed(event: Event) -> None:
        if event.finish_reason == "error":
            raise ApiError(500, f"the model failed: {event.error}", kind="server_error")
        if event.finish_reason == "cancelled":
            raise ApiError(503, "cancelled: the server is shutting down", kind="server_error", code="cancelled")

    def stream(handle, events: asyncio.Queue, chunk, include_usage: bool) -> StreamingResponse:
        """SSE: a chunk per piece of final text, one with the finish reason, usage if asked, [DONE]."""
        async def chunks():
            try:
                first = chunk(None, None, first=True)
                if first is not None:
                    yield _sse(first)
                while True:
                    event = await events.get()
                    if event.finish_reason in ("error", "cancelled"):
                        yield _sse(ApiError(500 if event.finish_reason == "error" else 503,
                                            event.error or event.finish_reason, kind="server_error").body())
                        return
                    if event.text:
                        yield _sse(chunk(event.text, None))
                    if event.finish_reason is not None:
                        yield _sse(chunk("", event.finish_reason))
                        if include_usage:
                            yield _sse({**chunk("", None), "choices": [], "usage": _usage(event)})
                        yield "data: [DONE]\n\n"
                        return
            finally:                                    # a client that went away ends here too
                server.engine.cancel(handle)
        return StreamingResponse(chunks(), media_type="text/event-stream", headers={"Cache-Control": "no-cache"})

    async def completions(request: Request):
        body = await read_body(request)
        server.check_model(body)
        if field(body, "echo", lambda v: isinstance(v, bool), "a boolean", False):
            raise ApiError(400, "'echo' is not supported", param="echo")
        params = sampling_params(body, 16, ("max_tokens",))
        ids = completion_prompt(body, server.tokenizer)
        handle, events = server.submit(ids, params)
        cid, created = f"cmpl-{uuid.uuid4().hex}", int(time.time())

        def chunk(text, finish_reason, first=False):
            if first:
                return None
            return {"id": cid, "object": "text_completion", "created": created, "model": server.model_name,
                    "choices": [{"index": 0, "text": text or "", "logprobs": None, "finish_reason": finish_reason}]}
        if body.get("stream"):
            return stream(handle, events, chunk, bool((body.get("stream_options") or {}).get("include_usage")))
        text, last = await collect(request, handle, events)
        failed(last)
        return JSONResponse({**chunk(text, last.finish_reason), "usage": _usage(last)})

    async def chat_completions(request: Request):
        body = await read_body(request)
        server.check_model(body)
        messages = chat_messages(body)
        if server.template is None:
            raise ApiError(400, "this model has no chat template (no chat_template in its tokenizer_config.json "
                                "or chat_template.jinja): use /v1/completions", param="messages")
        try:
            prompt = server.template.render(messages, add_generation_prompt=True)
        except RuntimeUsageError as e:
            raise ApiError(400, str(e), param="messages") from None
        ids = server.tokenizer.encode(prompt, add_bos=False)
        room = server.engine.session.max_context - len(ids)
        params = sampling_params(body, max(room, 1), ("max_tokens", "max_completion_tokens"))
        handle, events = server.submit(ids, params)
        cid, created = f"chatcmpl-{uuid.uuid4().hex}", int(time.time())

        def chunk(text, finish_reason, first=False):
            delta = {"role": "assistant", "content": ""} if first else ({"content": text} if text else {})
            return {"id": cid, "object": "chat.completion.chunk", "created": created, "model": server.model_name,
                    "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}]}
        if body.get("stream"):
            return stream(handle, events, chunk, bool((body.get("stream_options") or {}).get("include_usage")))
        text, last = await collect(request, handle, events)
        failed(last)
        return JSONResponse({"id": cid, "object": "chat.completion", "created": created, "model": server.model_name,
                             "choices": [{"index": 0, "message": {"role": "assistant", "content": text},
                                          "logprobs": None, "finish_reason": last.finish_reason}],
                             "usage": _usage(last)})

    async def models(request: Request):
        return JSONResponse({"object": "list", "data": [{"id": server.model_name, "object": "model",
                                                          "created": server.created, "owned_by": "kimi-iree"}]})

    async def health(request: Request):
        return JSONResponse({"status": "ok", **server.engine.stats()})

    async def api_error(request: Request, exc: ApiError):
        return JSONResponse(exc.body(), status_code=exc.status)

    async def http_error(request: Request, exc: HTTPException):
        return JSONResponse(ApiError(exc.status_code, str(exc.detail)).body(), status_code=exc.status_code)

    async def internal_error(request: Request, exc: Exception):
        return JSONResponse(ApiError(500, f"internal error: {type(exc).__name__}: {exc}", kind="server_error").body(),
                            status_code=500)

    return Starlette(routes=[
        Route("/v1/completions", completions, methods=["POST"]),
        Route("/v1/chat/completions", chat_completions, methods=["POST"]),
        Route("/v1/models", models, methods=["GET"]),
        Route("/health", health, methods=["GET"]),
    ], exception_handlers={ApiError: api_error, HTTPException: http_error, Exception: internal_error})


# ---------------------------------------------------------------------------------------------- main
def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="kimi-serve", description=__doc__.split("\n")[0])
    ap.add_argument("module", help="the OUT directory of kimi-compile (or OUT/model.vmfb)")
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=8000)
    ap.add_argument("--slots", type=int, help="requests run at once, each in its own sequence slot (default: "
                    "the module's --max-batch for a batched module, else 4 taking turns on the batch-1 module)")
    ap.add_argument("--queue", type=int, default=64, help="requests that may wait for a slot before a 503")
    ap.add_argument("--device", help="driver or device URI overriding the manifest's")
    ap.add_argument("--model-name", help="the model id clients send (default: the checkpoint's directory name)")
    ap.add_argument("--shutdown-timeout", type=float, default=30.0,
                    help="seconds SIGTERM gives running requests to finish before they are cancelled")
    return ap


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        import uvicorn
    except ImportError:
        print("error: kimi-serve needs the serve extra: pip install 'kimi-iree[serve]'", file=sys.stderr)
        return 2
    try:
        session = Session(args.module, device=args.device)
        tokenizer = Tokenizer(session.directory, session.manifest.tokenizer.files)
        template = load_chat_template(session.directory)
        slots = args.slots or (session.max_batch if session.max_batch > 1 else 4)
        engine = Engine(session, slots=slots, queue_limit=args.queue, tokenizer=tokenizer)
    except RuntimeUsageError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    name = args.model_name or Path(session.manifest.source.get("checkpoint") or session.directory).name
    config = uvicorn.Config(create_app(Server(engine, tokenizer, template, name)), host=args.host, port=args.port,
                            log_level="warning", timeout_graceful_shutdown=args.shutdown_timeout, lifespan="off")
    # uvicorn re-raises the signal it caught once it has shut down; a no-op handler makes SIGTERM
    # (and Ctrl-C) end in a clean exit 0 after the graceful shutdown.
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: None)
    batched = f", batched over {session.max_batch} rows" if session.max_batch > 1 else ""
    print(f"kimi-serve: {name} ({slots} slots{batched}, max context {session.max_context}) on "
          f"http://{args.host}:{args.port}/v1", file=sys.stderr, flush=True)
    try:
        uvicorn.Server(config).run()
    finally:
        engine.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
