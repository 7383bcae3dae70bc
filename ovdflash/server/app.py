"""The OpenAI-compatible HTTP API on FastAPI, and the uvicorn server that runs it.

Contract:
- `build_app(engine, served_model_names, api_key=None, max_request_bytes=...)` -> a FastAPI app over
  an `AsyncEngine` (started and stopped by the app's lifespan). Endpoints: `POST
  /v1/chat/completions`, `POST /v1/completions` (both with `stream: true` as server-sent events
  ending in `data: [DONE]`, `stream_options.include_usage` for a final usage chunk), `GET
  /v1/models`, `POST /tokenize`, `POST /detokenize`, `GET /health`, `GET /metrics` (Prometheus).
- With an `api_key`, every endpoint but /health and /metrics needs `Authorization: Bearer KEY`
  (401 otherwise). A body over `max_request_bytes` is refused with 413 before it is parsed.
- Every error is OpenAI's error JSON (protocol.ApiError) with one log line; a failure inside the
  server is a 500 that names the exception, never a traceback. Queue full or shutting down:
  503 with Retry-After. A prompt that leaves no room for one new token, or max_tokens beyond the
  context: 400 naming both token counts (code context_length_exceeded).
- `usage` carries the token counts and `spec_decode` (protocol.spec_decode_usage), in
  non-streamed responses and in a stream's usage chunk.
- A client that disconnects (streamed or not) aborts its request: the engine stops it within a
  round and serves the next one.
- `run_server(app, host, port, shutdown_timeout)` serves until SIGTERM or SIGINT, then refuses new
  requests, lets open ones finish for `shutdown_timeout` seconds, ends the rest with
  finish_reason "abort" (streams still get their final chunk and [DONE]) and returns normally,
  so the process exits 0. A second SIGINT quits at once.

Layout: `_Api` checks requests and hands them to the engine, `_respond` answers (whole or as
events), `build_app` installs the error handlers and `_bearer_auth`, then the route groups
(`_add_health_routes`, `_add_model_routes`, `_add_completion_routes`).
"""
from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import logging
import secrets
import time
import uuid

import uvicorn
from fastapi import Depends, FastAPI, Request
from fastapi.responses import JSONResponse, Response
from fastapi.sse import EventSourceResponse, format_sse_event
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.exceptions import HTTPException as StarletteHTTPException

from . import protocol
from .engine import AsyncEngine, EngineStoppedError, QueueFullError, RequestParams
from .protocol import ApiError, bad_request

logger = logging.getLogger("ovdflash.server")
DEFAULT_MAX_REQUEST_BYTES = 4 << 20
RETRY_AFTER_S = 1
_DONE = format_sse_event(data_str="[DONE]")


def _sse(payload: dict) -> bytes:
    return format_sse_event(data_str=json.dumps(payload, ensure_ascii=False, separators=(",", ":")))


def _guarded(endpoint):
    """An unexpected exception becomes a 500 in OpenAI's error JSON (logged once by the handler)."""
    @functools.wraps(endpoint)
    async def wrapper(*args, **kwargs):
        try:
            return await endpoint(*args, **kwargs)
        except ApiError:
            raise
        except Exception as exc:
            raise ApiError(500, f"internal error: {type(exc).__name__}: {exc}", type="server_error",
                           code="internal_error") from exc
    return wrapper


async def read_body(request: Request, limit: int) -> bytes:
    """The request body, or 413 once it passes `limit` bytes (the rest is read and dropped, so the
    client sees the answer instead of a broken connection)."""
    declared = request.headers.get("content-length", "")
    too_large = declared.isdigit() and int(declared) > limit
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            too_large = True
        if too_large:
            if size > 16 * limit:  # do not drain forever: let the connection drop
                break
            continue
        chunks.append(chunk)
    if too_large:
        raise ApiError(413, f"the request body is {max(size, int(declared or 0))} bytes; this server takes at most "
                            f"{limit} (--max-request-bytes)", code="request_too_large")
    return b"".join(chunks)


async def _wait_for_disconnect(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


class _Api:
    """The endpoints' shared state: the engine, the tokenizer's owner, the names and limits."""

    def __init__(self, engine: AsyncEngine, served_model_names: list[str], max_request_bytes: int):
        self.engine = engine
        self.pipeline = engine.pipeline
        self.names = list(served_model_names)
        self.max_request_bytes = max_request_bytes
        self.max_model_len = engine.max_model_len or self.pipeline.target.max_length

    # -- request checks ----------------------------------------------------------------------
    async def parse(self, request: Request, request_type):
        """The request body as `request_type`: 413 past max_request_bytes, 400 when it does not fit."""
        return protocol.parse_request(request_type, await read_body(request, self.max_request_bytes))

    def model_name(self, requested: str | None) -> str:
        if requested is None:
            return self.names[0]
        if requested not in self.names:
            raise ApiError(404, f"the model {requested!r} does not exist; this server serves "
                                f"{', '.join(map(repr, self.names))}", param="model", code="model_not_found")
        return requested

    def check_token_ids(self, ids: list[int], param: str) -> list[int]:
        vocab = getattr(self.pipeline, "vocab_size", None) or (
            self.pipeline.tokenizer.vocab_size if self.pipeline.tokenizer is not None else None)
        for i, t in enumerate(ids):
            if t < 0 or (vocab is not None and t >= vocab):
                raise bad_request(f"token id {t} is out of range 0..{vocab - 1}", param=f"{param}[{i}]")
        return ids

    def encode_messages(self, messages: list[protocol.ChatMessage], add_generation_prompt: bool = True) -> list[int]:
        if self.pipeline.tokenizer is None:
            raise bad_request("this model has no tokenizer: send token ids to /v1/completions", param="messages")
        try:
            return self.pipeline.tokenizer.encode_chat([m.as_template_message() for m in messages],
                                                       add_generation_prompt=add_generation_prompt)
        except Exception as exc:  # the template's own raise_exception, or no template at all
            raise bad_request(f"the messages do not fit the model's chat template: {exc}", param="messages") from None

    def encode_text(self, text: str) -> list[int]:
        if self.pipeline.tokenizer is None:
            raise bad_request("this model has no tokenizer: send token ids", param="prompt")
        return self.pipeline.encode_prompt(text)

    def sampling(self, req: protocol._SamplingRequest, num_prompt: int, prompt_param: str) -> RequestParams:
        limit = self.max_model_len
        if num_prompt == 0:
            raise bad_request("the prompt is empty", param=prompt_param)
        if num_prompt >= limit:
            raise bad_request(f"the prompt has {num_prompt} tokens; this model's context is {limit} tokens, and the "
                              f"prompt plus at least 1 new token must fit", param=prompt_param,
                              code="context_length_exceeded")
        param, requested = req.requested_max_tokens()
        if requested is not None and num_prompt + requested > limit:
            raise bad_request(f"{param} is {requested} and the prompt has {num_prompt} tokens: {num_prompt + requested} "
                              f"tokens, more than this model's context of {limit}; at most {limit - num_prompt} new "
                              f"tokens fit", param=param, code="context_length_exceeded")
        return RequestParams(max_tokens=requested if requested is not None else limit - num_prompt,
                             temperature=req.temperature, top_p=req.top_p, top_k=max(req.top_k, 0), seed=req.seed,
                             stop=tuple(req.stop_strings()))

    def start(self, req: protocol._SamplingRequest, prompt_ids: list[int], prompt_param: str, id_prefix: str):
        """(request id, created, RequestStream) of a request the engine took; 400 or 503 otherwise."""
        params = self.sampling(req, len(prompt_ids), prompt_param)
        request_id = f"{id_prefix}-{uuid.uuid4().hex}"
        try:
            return request_id, int(time.time()), self.engine.add(request_id, prompt_ids, params)
        except QueueFullError as exc:
            raise ApiError(503, f"the server is busy: {exc}; retry later", type="server_error", code="queue_full",
                           headers={"Retry-After": str(RETRY_AFTER_S)}) from None
        except EngineStoppedError as exc:
            raise ApiError(503, str(exc), type="server_error", code="unavailable",
                           headers={"Retry-After": str(RETRY_AFTER_S)}) from None

# -- answering: the engine's outputs as one response or as server-sent events ------------------------
async def _respond(engine: AsyncEngine, request: Request, req, stream, num_prompt: int, chunk, opening, body):
    """A stream of events (`chunk` builds each), or the whole answer as `body(text, finish_reason, usage)`."""
    if req.stream:
        return EventSourceResponse(_events(engine, stream, num_prompt, chunk, req.include_usage, opening),
                                   headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
    answer = await _collect(engine, request, stream)
    if answer is None:
        return Response(status_code=499)  # the client left: nobody reads this
    text, final = answer
    return body(text, final.finish_reason, protocol.usage(num_prompt, final.num_output_tokens, final.stats))


async def _collect(engine: AsyncEngine, request: Request, stream):
    """(text, final output) of a non-streamed request; None when the client went away first."""
    async def gather():
        pieces, final = [], None
        async for output in stream:
            pieces.append(output.text)
            final = output
        return "".join(pieces), final

    answer = asyncio.ensure_future(gather())
    gone = asyncio.ensure_future(_wait_for_disconnect(request))
    try:
        await asyncio.wait({answer, gone}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        gone.cancel()
        if not answer.done():  # the client left (or this handler was cancelled): stop generating
            answer.cancel()
            engine.abort(stream.request_id)
    if not answer.done() or answer.cancelled():
        return None
    text, final = answer.result()
    if final.error:
        raise ApiError(500, f"generation failed: {final.error}", type="server_error", code="generation_failed")
    return text, final


async def _events(engine: AsyncEngine, stream, num_prompt: int, chunk, include_usage: bool,
                  opening: dict | None = None):
    """The SSE body of a streamed request: `chunk(text, finish_reason=None)` builds each event."""
    finished = False
    try:
        if opening is not None:
            yield _sse(opening)
        async for output in stream:
            if output.finished:
                finished = True
                if output.error:
                    yield _sse(ApiError(500, f"generation failed: {output.error}", type="server_error",
                                        code="generation_failed").body())
                    break
                yield _sse(chunk(output.text, output.finish_reason))
                if include_usage:
                    yield _sse(chunk(None, usage_body=protocol.usage(num_prompt, output.num_output_tokens,
                                                                     output.stats)))
            elif output.text:
                yield _sse(chunk(output.text))
        yield _DONE
    finally:
        if not finished:  # the client went away mid-stream
            engine.abort(stream.request_id)


# -- the app: lifespan, errors, auth, then the route groups ---------------------------------------
def build_app(engine: AsyncEngine, served_model_names: list[str], api_key: str | None = None,
              max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES) -> FastAPI:
    api = _Api(engine, served_model_names, max_request_bytes)
    app = FastAPI(title="ovdflash", lifespan=_engine_lifespan(engine), docs_url=None, redoc_url=None,
                  openapi_url=None)
    app.state.engine = engine
    app.add_exception_handler(ApiError, _api_error)
    app.add_exception_handler(StarletteHTTPException, _http_error)
    auth = [Depends(_bearer_auth(api_key))]
    _add_health_routes(app, engine)
    _add_model_routes(app, api, auth)
    _add_completion_routes(app, api, auth)
    return app


def _engine_lifespan(engine: AsyncEngine):
    """The app's lifespan: the engine runs while the app serves."""
    @contextlib.asynccontextmanager
    async def lifespan(app):
        engine.start()
        try:
            yield
        finally:
            engine.close()
    return lifespan


async def _api_error(request: Request, exc: ApiError):
    log = logger.error if exc.status >= 500 else logger.warning
    log("%s %s -> %d %s", request.method, request.url.path, exc.status, exc.message)
    return JSONResponse(exc.body(), status_code=exc.status, headers=exc.headers)


async def _http_error(request: Request, exc: StarletteHTTPException):
    error = ApiError(exc.status_code, f"{request.method} {request.url.path}: {exc.detail}",
                     code="not_found" if exc.status_code == 404 else None)
    return await _api_error(request, error)


def _bearer_auth(api_key: str | None):
    """The dependency of every route but /health and /metrics: 401 unless `Authorization: Bearer KEY`."""
    async def authorized(request: Request) -> None:
        if api_key is None:
            return
        scheme, _, token = request.headers.get("authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not secrets.compare_digest(token.strip().encode(), api_key.encode()):
            raise ApiError(401, "missing or wrong API key: send 'Authorization: Bearer KEY'",
                           type="authentication_error", code="invalid_api_key",
                           headers={"WWW-Authenticate": "Bearer"})
    return authorized


def _add_health_routes(app: FastAPI, engine: AsyncEngine) -> None:
    """/health and /metrics: open to all, for load balancers and Prometheus."""
    @app.get("/health")
    async def health():
        if not engine.healthy or not engine.accepting:
            raise ApiError(503, "shutting down" if not engine.accepting else "the engine has stopped",
                           type="server_error", code="unavailable")
        return {"status": "ok"}

    @app.get("/metrics")
    async def metrics():
        return Response(generate_latest(engine.metrics.registry), media_type=CONTENT_TYPE_LATEST)


def _add_model_routes(app: FastAPI, api: _Api, auth: list) -> None:
    """/v1/models, /tokenize and /detokenize: what is served and its tokenizer."""
    @app.get("/v1/models", dependencies=auth)
    async def models():
        return {"object": "list", "data": [
            {"id": name, "object": "model", "created": 0, "owned_by": "ovdflash", "max_model_len": api.max_model_len}
            for name in api.names]}

    @app.post("/tokenize", dependencies=auth)
    @_guarded
    async def tokenize(request: Request):
        req = await api.parse(request, protocol.TokenizeRequest)
        api.model_name(req.model)
        if (req.prompt is None) == (req.messages is None):
            raise bad_request("give exactly one of prompt and messages", param="prompt")
        if req.messages is not None:
            ids = api.encode_messages(req.messages, req.add_generation_prompt)
        elif req.add_special_tokens:
            ids = api.encode_text(req.prompt)
        else:
            ids = api.pipeline.tokenizer.encode(req.prompt, add_special_tokens=False)
        return {"count": len(ids), "max_model_len": api.max_model_len, "tokens": ids}

    @app.post("/detokenize", dependencies=auth)
    @_guarded
    async def detokenize(request: Request):
        req = await api.parse(request, protocol.DetokenizeRequest)
        api.model_name(req.model)
        if api.pipeline.tokenizer is None:
            raise bad_request("this model has no tokenizer", param="tokens")
        return {"prompt": api.pipeline.tokenizer.decode(api.check_token_ids(req.tokens, "tokens"))}


def _add_completion_routes(app: FastAPI, api: _Api, auth: list) -> None:
    """/v1/chat/completions and /v1/completions, streamed or whole."""
    @app.post("/v1/chat/completions", dependencies=auth)
    @_guarded
    async def chat_completions(request: Request):
        req = await api.parse(request, protocol.ChatCompletionRequest)
        model = api.model_name(req.model)
        req.check_supported()
        prompt_ids = api.encode_messages(req.messages)
        request_id, created, stream = api.start(req, prompt_ids, "messages", "chatcmpl")

        def chunk(text, finish_reason=None, usage_body=None):
            delta = None if text is None and finish_reason is None else ({"content": text} if text else {})
            return protocol.chat_chunk(request_id, created, model, delta, finish_reason, usage_body, req.include_usage)

        opening = protocol.chat_chunk(request_id, created, model, {"role": "assistant", "content": ""},
                                      include_usage=req.include_usage)
        return await _respond(api.engine, request, req, stream, len(prompt_ids), chunk, opening,
                              functools.partial(protocol.chat_completion, request_id, created, model))

    @app.post("/v1/completions", dependencies=auth)
    @_guarded
    async def completions(request: Request):
        req = await api.parse(request, protocol.CompletionRequest)
        model = api.model_name(req.model)
        req.check_supported()
        prompt = req.single_prompt()
        prompt_ids = api.encode_text(prompt) if isinstance(prompt, str) else api.check_token_ids(prompt, "prompt")
        request_id, created, stream = api.start(req, prompt_ids, "prompt", "cmpl")

        def chunk(text, finish_reason=None, usage_body=None):
            piece = None if text is None and finish_reason is None else (text or "")
            return protocol.completion_chunk(request_id, created, model, piece, finish_reason, usage_body,
                                             req.include_usage)

        return await _respond(api.engine, request, req, stream, len(prompt_ids), chunk, None,
                              functools.partial(protocol.completion, request_id, created, model))


def run_server(app: FastAPI, host: str = "127.0.0.1", port: int = 8000, shutdown_timeout: float = 5.0,
               log_level: str = "info") -> None:
    """Serve `app` until SIGTERM/SIGINT; see the module contract for how it drains."""
    config = uvicorn.Config(app, host=host, port=port, log_level=log_level, timeout_graceful_shutdown=None)
    DrainingServer(config, shutdown_timeout).run()


class DrainingServer(uvicorn.Server):
    """uvicorn's server, which first tells the engine to wind down, and treats a signal as a normal end."""

    def __init__(self, config: uvicorn.Config, shutdown_timeout: float = 5.0):
        super().__init__(config)
        self.shutdown_timeout = shutdown_timeout

    async def shutdown(self, sockets=None):
        engine = getattr(getattr(self.config.app, "state", None), "engine", None)
        if engine is not None:
            engine.begin_shutdown(self.shutdown_timeout)
        await super().shutdown(sockets)

    @contextlib.contextmanager
    def capture_signals(self):
        with super().capture_signals():
            try:
                yield
            finally:  # uvicorn re-raises the signal after shutting down; here it is the normal way to stop
                self._captured_signals.clear()
