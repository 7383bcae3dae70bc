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
- `n` choices (1..`AsyncEngine.max_choices`, else a 400 naming `n`): each is its own sequence in the engine
  (`AsyncEngine.add_choices`; seeded: choice i's seed is `engine.choice_seed(seed, i)`), with the request's
  sampling, penalties, logprobs, grammar and tool parsing. Whole: `choices[i]` with `index` i, each with its
  finish_reason; streamed: each chunk names its choice's `index`, the choices' chunks interleaved as they come,
  each choice ending with its own finish chunk. `usage` sums the choices' tokens and `spec_decode` (the prompt
  counted once, `cached_tokens` the first choice's).
- Fields that change nothing in the reply are accepted and ignored (protocol), each name logged once per
  process; unknown fields are a 400 naming them.
- Tool calls: the chat template's tool format is detected once (`app.state.tool_format`,
  server.tool_calls). A chat request's `tools` are rendered by the template (its `tools` variable, as
  transformers passes them); with tool_choice "auto" the reply is parsed: `message.tool_calls` and
  finish_reason "tool_calls" (when it stopped on its own), content the text outside the calls (null if
  none); streamed: content deltas, and each call as `delta.tool_calls` entries: a call opens with index,
  id, type and name once the name is read, then its arguments follow in pieces as they arrive (the closing
  brace once the call is known to be well formed; tool_calls' streamed arguments); a call the parser cannot
  stream arrives whole once complete. A call that started streaming and turns out malformed (or is cut
  off) keeps its index with arguments that never parse, its text comes as content, and finish_reason is
  the whole reply's.
  tools with a template of no known format: 400 naming `tools`, unless tool_choice is "none" (rendered,
  not parsed). tool_choice "required" or a named function holds the reply to one call of those tools in the
  template's format (tool_calls.call_grammar: hermes and llama3_json with arguments valid against the
  tool's schema, qwen3_xml with the tool's parameters as that grammar holds them), parsed as above.
- Penalties, logit bias and logprobs (protocol's ranges; logit_bias keys checked against the vocabulary) go
  to the engine with the request. Logprobs come in OpenAI's shapes (protocol.chat_logprobs /
  completion_logprobs), one entry per generated token (EOS and the token that completed a stop string
  included, as `usage.completion_tokens` counts them); a token's text is its own decoding (special tokens
  kept; `bytes` are that text's UTF-8). Streamed, each chunk carries the entries of the tokens generated
  since the previous one (a chunk with empty content when the text is held back).
- Structured outputs: `response_format` (json_object, json_schema) or `structured_outputs` (protocol) are
  compiled before the request is queued (ovdflash.grammar; a schema, regex or grammar llguidance refuses,
  or a server without llguidance, is a 400 naming the field, code invalid_grammar); the output is then held
  to the grammar inside DFlash, lossless (decode.structured). /metrics counts them by kind.
- A client that disconnects (streamed or not) aborts its request: the engine stops it within a
  round and serves the next one.
- `run_server(app, host, port, shutdown_timeout)` serves until SIGTERM or SIGINT, then refuses new
  requests, lets open ones finish for `shutdown_timeout` seconds, ends the rest with
  finish_reason "abort" (streams still get their final chunk and [DONE]) and returns normally,
  so the process exits 0. A second SIGINT quits at once.

Layout: `_Api` checks requests and hands them to the engine, `_ChatReply` / `_CompletionReply` shape the
engine's outputs into an answer, `_respond` answers (whole or as events), `build_app` installs the error
handlers and `_bearer_auth`, then the route groups (`_add_health_routes`, `_add_model_routes`,
`_add_completion_routes`).
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

from ..decode.stats import GenerationStats
from ..grammar import check_structured, special_tokens_among
from . import protocol, tool_calls
from .engine import AsyncEngine, EngineStoppedError, QueueFullError, RequestParams
from .protocol import ApiError, bad_request

logger = logging.getLogger("ovdflash.server")
DEFAULT_MAX_REQUEST_BYTES = 4 << 20
RETRY_AFTER_S = 1
_DONE = format_sse_event(data_str="[DONE]")
_logged_ignored_fields: set[str] = set()  # names logged already: once per process, as vLLM warns


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
        tokenizer = self.pipeline.tokenizer
        self._token_texts: dict[int, str] = {}  # token id -> its text, for logprobs
        self.tool_format = tool_calls.detect_tool_format(tokenizer.chat_template if tokenizer is not None else None)

    # -- request checks ----------------------------------------------------------------------
    async def parse(self, request: Request, request_type):
        """The request body as `request_type`: 413 past max_request_bytes, 400 when it does not fit."""
        return protocol.parse_request(request_type, await read_body(request, self.max_request_bytes))

    @staticmethod
    def log_ignored_fields(req) -> None:
        for name in req.ignored_fields():
            if name not in _logged_ignored_fields:
                _logged_ignored_fields.add(name)
                logger.warning("ignoring the request field %r: it changes nothing in the reply (logged once)", name)

    def tool_parser(self, req: protocol.ChatCompletionRequest):
        """A new parser for each reply when the request's tool calls are to be parsed, else None."""
        if req.tool_call_mode() != "parse":
            return None
        if self.tool_format is None:
            raise bad_request("tools: this model's chat template teaches no tool-call format this server can read "
                              "(hermes <tool_call> JSON, Qwen3.5 <function=...> XML, Llama 3 JSON), so no reply "
                              "could carry tool_calls; send tool_choice \"none\" to show the model the tools anyway",
                              param="tools", code="unsupported_value")
        return functools.partial(tool_calls.new_parser, self.tool_format, req.tool_parameters(),
                                 req.parallel_tool_calls is not False)

    def model_name(self, requested: str | None) -> str:
        if requested is None:
            return self.names[0]
        if requested not in self.names:
            raise ApiError(404, f"the model {requested!r} does not exist; this server serves "
                                f"{', '.join(map(repr, self.names))}", param="model", code="model_not_found")
        return requested

    @property
    def vocab_size(self) -> int | None:
        return getattr(self.pipeline, "vocab_size", None) or (
            self.pipeline.tokenizer.vocab_size if self.pipeline.tokenizer is not None else None)

    def token_text(self, token_id: int) -> str:
        """One token's own text, as logprobs name it (special tokens kept)."""
        text = self._token_texts.get(token_id)
        if text is None:
            tokenizer = self.pipeline.tokenizer
            # vLLM's name for a token it cannot decode
            text = tokenizer.decode([token_id], skip_special_tokens=False) if tokenizer is not None \
                else f"token_id:{token_id}"
            self._token_texts[token_id] = text
        return text

    def logprob_entries(self, logprobs: list) -> list:
        """decode.sampling.TokenLogprobs as protocol's (token text, logprob, [(text, logprob), ...]) entries."""
        return [(self.token_text(lp.token), lp.logprob, [(self.token_text(t), v) for t, v in lp.top])
                for lp in logprobs]

    def logprob_replies(self, req: protocol._SamplingRequest):
        """`logprob_entries` for a reply when the request asked for logprobs, else None."""
        return self.logprob_entries if req.requested_logprobs() is not None else None

    def check_token_ids(self, ids: list[int], param: str) -> list[int]:
        vocab = self.vocab_size
        for i, t in enumerate(ids):
            if t < 0 or (vocab is not None and t >= vocab):
                raise bad_request(f"token id {t} is out of range 0..{vocab - 1}", param=f"{param}[{i}]")
        return ids

    def encode_messages(self, messages: list[protocol.ChatMessage], add_generation_prompt: bool = True,
                        tools: list[protocol.Tool] | None = None) -> list[int]:
        if self.pipeline.tokenizer is None:
            raise bad_request("this model has no tokenizer: send token ids to /v1/completions", param="messages")
        rendered = protocol.template_messages(messages)
        extra = {"tools": protocol.template_tools(tools)} if tools else {}
        try:
            return self.pipeline.tokenizer.encode_chat(rendered, add_generation_prompt=add_generation_prompt, **extra)
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
                             structured=self.structured(req),
                             temperature=req.temperature, top_p=req.top_p, top_k=max(req.top_k, 0), seed=req.seed,
                             stop=tuple(req.stop_strings()), presence_penalty=req.presence_penalty,
                             frequency_penalty=req.frequency_penalty, repetition_penalty=req.repetition_penalty,
                             logit_bias=req.logit_bias_ids(self.vocab_size), logprobs=req.requested_logprobs())

    def structured(self, req: protocol._SamplingRequest):
        """The request's structured-output spec, compiled once here so a bad one is a 400 naming its field."""
        requested = req.structured_request()
        forced_tools = req.forced_tools() if isinstance(req, protocol.ChatCompletionRequest) else None
        if forced_tools is not None:
            requested = self.tool_call_constraint(forced_tools, requested)
        if requested is None:
            return None
        spec, param = requested
        if self.pipeline.tokenizer is None:
            raise bad_request("structured outputs need the model's tokenizer; this model has none", param=param)
        try:
            return check_structured(self.pipeline.tokenizer, spec, self.vocab_size, self.pipeline.eos_token_ids)
        except ValueError as exc:
            raise bad_request(f"{param}: {exc}", param=param, code="invalid_grammar") from None

    def tool_call_constraint(self, forced_tools: dict[str, dict], requested) -> tuple[dict, str]:
        """The grammar of one call of `forced_tools` in the template's format (tool_choice "required" or named)."""
        if requested is not None:
            raise bad_request(f"tool_choice holds the reply to a tool call: it cannot be combined with "
                              f"{requested[1].split('.')[0]}", param="tool_choice")
        grammar = None
        if self.tool_format:
            special = special_tokens_among(self.pipeline.tokenizer, (tool_calls.OPEN_TAG, tool_calls.CLOSE_TAG),
                                           self.vocab_size, self.pipeline.eos_token_ids)
            grammar = tool_calls.call_grammar(self.tool_format, forced_tools, special)
        if grammar is None:
            raise bad_request(f"tool_choice \"required\" or naming a function is held to a grammar only for the "
                              f"hermes, qwen3_xml and llama3_json tool-call formats; this model's is "
                              f"{self.tool_format or 'none'}: send \"auto\" (the model chooses) or \"none\"",
                              param="tool_choice", code="unsupported_value")
        return {"grammar": grammar}, "tool_choice"

    def check_choices(self, req: protocol._SamplingRequest) -> None:
        limit = self.engine.max_choices
        if not 1 <= req.n <= limit:
            raise bad_request(f"n must be in 1..{limit} on this server (each choice is a sequence of its own; "
                              f"--max-num-seqs bounds it), got {req.n}", param="n")

    def start(self, req: protocol._SamplingRequest, prompt_ids: list[int], prompt_param: str, id_prefix: str):
        """(request id, created, a RequestStream per choice) of a request the engine took; 400 or 503 otherwise."""
        self.check_choices(req)
        params = self.sampling(req, len(prompt_ids), prompt_param)
        request_id = f"{id_prefix}-{uuid.uuid4().hex}"
        try:
            streams = self.engine.add_choices(request_id, prompt_ids, params, req.n)
            if params.structured is not None and self.engine.metrics is not None:
                self.engine.metrics.record_structured(params.structured.kind)
            return request_id, int(time.time()), streams
        except QueueFullError as exc:
            raise ApiError(503, f"the server is busy: {exc}; retry later", type="server_error", code="queue_full",
                           headers={"Retry-After": str(RETRY_AFTER_S)}) from None
        except EngineStoppedError as exc:
            raise ApiError(503, str(exc), type="server_error", code="unavailable",
                           headers={"Retry-After": str(RETRY_AFTER_S)}) from None

# -- answering: the engine's outputs as one response or as server-sent events ------------------------
class _CompletionReply:
    """How one choice's outputs become its part of the answer: `choice` (whole; `whole` wraps the choices),
    `opening` / `chunks` / `usage_chunk` (events). With `logprob_entries` (the request asked for logprobs) each
    answer carries its tokens' logprobs."""

    def __init__(self, request_id: str, created: int, model: str, include_usage: bool, logprob_entries=None,
                 index: int = 0):
        self.request_id, self.created, self.model, self.include_usage = request_id, created, model, include_usage
        self.logprob_entries = logprob_entries
        self.index = index
        self.text_offset = 0  # where the next streamed token's text starts in the reply

    def opening(self) -> dict | None:
        return None

    def chunks(self, output) -> list[dict]:
        return self._with_logprobs(self._text_chunks(output), output)

    def _text_chunks(self, output) -> list[dict]:
        if output.finished:
            return [self._chunk(output.text or "", output.finish_reason)]
        return [self._chunk(output.text)] if output.text else []

    def _with_logprobs(self, chunks: list[dict], output) -> list[dict]:
        """The output's logprobs on its first chunk (on an empty one when its text is held back)."""
        if self.logprob_entries is None or not output.logprobs:
            return chunks
        if not chunks:
            chunks = [self._empty_chunk()]
        chunks[0]["choices"][0]["logprobs"] = self._logprobs(self.logprob_entries(output.logprobs))
        return chunks

    def _empty_chunk(self) -> dict:
        return self._chunk("")

    def _logprobs(self, entries: list) -> dict:
        body = protocol.completion_logprobs(entries, self.text_offset)
        self.text_offset += sum(len(text) for text, _, _ in entries)
        return body

    def usage_chunk(self, usage_body: dict) -> dict:
        return self._chunk(None, usage_body=usage_body)

    def choice(self, text: str, finish_reason: str, logprobs: list | None = None) -> dict:
        return protocol.completion_choice(self.index, text, finish_reason, self._whole_logprobs(logprobs))

    def whole(self, choices: list[dict], usage_body: dict) -> dict:
        return protocol.completion(self.request_id, self.created, self.model, choices, usage_body)

    def _whole_logprobs(self, logprobs: list | None) -> dict | None:
        if self.logprob_entries is None:
            return None
        return self._logprobs(self.logprob_entries(logprobs or []))

    def _chunk(self, text, finish_reason=None, usage_body=None) -> dict:
        return protocol.completion_chunk(self.request_id, self.created, self.model, text, finish_reason, usage_body,
                                         self.include_usage, index=self.index)


class _ChatReply(_CompletionReply):
    """A chat completion's answer; with `new_parser` (tools to parse) the text is read for tool calls, whole or
    as it streams, and a reply with calls that stopped on its own ends with finish_reason "tool_calls"."""

    def __init__(self, request_id: str, created: int, model: str, include_usage: bool, new_parser=None,
                 logprob_entries=None, index: int = 0):
        super().__init__(request_id, created, model, include_usage, logprob_entries, index)
        self.new_parser = new_parser
        self.parser = new_parser() if new_parser is not None else None  # the stream's; `body` makes its own
        self.num_calls = 0     # calls completed (finish_reason)
        self.num_entries = 0   # delta.tool_calls indices used, calls started but never completed included
        self.started: dict[int, list[int]] = {}  # the parser's key of a started call -> [index, characters sent]

    def opening(self) -> dict | None:
        return self._chunk({"role": "assistant", "content": ""})

    def _text_chunks(self, output) -> list[dict]:
        if self.parser is None:
            if output.finished:
                return [self._chunk({"content": output.text} if output.text else {}, output.finish_reason)]
            return [self._chunk({"content": output.text})] if output.text else []
        events = self.parser.feed(output.text) + (self.parser.finish() if output.finished else [])
        chunks = [self._chunk(delta) for delta in self._deltas(events)]
        if output.finished:
            chunks.append(self._chunk({}, self._finish_reason(output.finish_reason, self.num_calls)))
        return chunks

    def _deltas(self, events: list) -> list[dict]:
        """The parser's events as deltas: content, a call whole, or a call started then its arguments in pieces."""
        deltas = []
        for event in events:
            if isinstance(event, str):
                deltas.append({"content": event})
            elif isinstance(event, tool_calls.CallStart):
                self.started[event.key] = [self.num_entries, 0]
                deltas.append(protocol.tool_call_start_delta(self.num_entries, event.name))
                self.num_entries += 1
            elif isinstance(event, tool_calls.ArgumentsDelta):
                entry = self.started[event.key]
                entry[1] += len(event.text)
                deltas.append(protocol.tool_call_arguments_delta(entry[0], event.text))
            else:
                entry = self.started.pop(event.started, None) if event.started is not None else None
                if entry is None:
                    deltas.append(protocol.tool_call_delta(self.num_entries, event))
                    self.num_entries += 1
                elif event.arguments[entry[1]:]:
                    deltas.append(protocol.tool_call_arguments_delta(entry[0], event.arguments[entry[1]:]))
                self.num_calls += 1
        return deltas

    def _empty_chunk(self) -> dict:
        return self._chunk({"content": ""})

    def _logprobs(self, entries: list) -> dict:
        return protocol.chat_logprobs(entries)

    def usage_chunk(self, usage_body: dict) -> dict:
        return self._chunk(None, usage_body=usage_body)

    def choice(self, text: str, finish_reason: str, logprobs: list | None = None) -> dict:
        whole = self._whole_logprobs(logprobs)
        if self.new_parser is None:
            return protocol.chat_choice(self.index, text, finish_reason, logprobs=whole)
        parsed = tool_calls.parse_reply(self.new_parser(), text)
        return protocol.chat_choice(self.index, parsed.content, self._finish_reason(finish_reason, len(parsed.tool_calls)),
                                    parsed.tool_calls, whole)

    def whole(self, choices: list[dict], usage_body: dict) -> dict:
        return protocol.chat_completion(self.request_id, self.created, self.model, choices, usage_body)

    @staticmethod
    def _finish_reason(finish_reason: str, num_calls: int) -> str:
        return "tool_calls" if num_calls and finish_reason == "stop" else finish_reason

    def _chunk(self, delta, finish_reason=None, usage_body=None) -> dict:
        return protocol.chat_chunk(self.request_id, self.created, self.model, delta, finish_reason, usage_body,
                                   self.include_usage, index=self.index)


async def _respond(engine: AsyncEngine, request: Request, req, streams: list, num_prompt: int,
                   replies: list[_CompletionReply]):
    """A stream of events, or the whole answer (`replies`, one per choice, shape both)."""
    if req.stream:
        return EventSourceResponse(_events(engine, streams, num_prompt, replies, req.include_usage),
                                   headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
    answers = await _collect(engine, request, streams)
    if answers is None:
        return Response(status_code=499)  # the client left: nobody reads this
    choices = [reply.choice(text, final.finish_reason, logprobs) for reply, (text, final, logprobs) in zip(replies, answers)]
    return replies[0].whole(choices, _usage(num_prompt, [final for _, final, _ in answers]))


def _usage(num_prompt: int, finals: list) -> dict:
    """The reply's usage: its choices' tokens and DFlash stats summed, the prompt counted once (as OpenAI)."""
    stats = GenerationStats()
    for final in finals:
        stats.merge(final.stats or GenerationStats())
    # the prompt is counted once, so its cached part is the first choice's
    stats.num_cached_prompt_tokens = (finals[0].stats or GenerationStats()).num_cached_prompt_tokens
    return protocol.usage(num_prompt, sum(final.num_output_tokens for final in finals), stats)


async def _collect(engine: AsyncEngine, request: Request, streams: list):
    """[(text, final output, logprobs)] of each choice of a non-streamed request; None when the client went away first."""
    async def gather(stream):
        pieces, final, logprobs = [], None, []
        async for output in stream:
            pieces.append(output.text)
            logprobs += output.logprobs or []
            final = output
        return "".join(pieces), final, logprobs

    answer = asyncio.ensure_future(asyncio.gather(*(gather(stream) for stream in streams)))
    gone = asyncio.ensure_future(_wait_for_disconnect(request))
    try:
        await asyncio.wait({answer, gone}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        gone.cancel()
        if not answer.done():  # the client left (or this handler was cancelled): stop generating
            answer.cancel()
            for stream in streams:
                engine.abort(stream.request_id)
    if not answer.done() or answer.cancelled():
        return None
    answers = answer.result()
    failed = next((final for _, final, _ in answers if final.error), None)
    if failed is not None:
        raise ApiError(500, f"generation failed: {failed.error}", type="server_error", code="generation_failed")
    return answers


async def _merged(streams: list):
    """(choice index, output) of every choice's stream, in the order the outputs arrive."""
    pending = {asyncio.ensure_future(stream.__anext__()): index for index, stream in enumerate(streams)}
    try:
        while pending:
            done, _ = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
            for task in sorted(done, key=pending.get):
                index = pending.pop(task)
                output = task.result()
                yield index, output
                if not output.finished:
                    pending[asyncio.ensure_future(streams[index].__anext__())] = index
    finally:
        for task in pending:
            task.cancel()


async def _events(engine: AsyncEngine, streams: list, num_prompt: int, replies: list[_CompletionReply],
                  include_usage: bool):
    """The SSE body of a streamed request: `replies[i].chunks(output)` builds choice i's events."""
    finals: dict[int, object] = {}
    try:
        for reply in replies:
            opening = reply.opening()
            if opening is not None:
                yield _sse(opening)
        async with contextlib.aclosing(_merged(streams)) as outputs:
            async for index, output in outputs:
                if output.error:
                    yield _sse(ApiError(500, f"generation failed: {output.error}", type="server_error",
                                        code="generation_failed").body())
                    break
                for chunk in replies[index].chunks(output):
                    yield _sse(chunk)
                if output.finished:
                    finals[index] = output
        if include_usage and len(finals) == len(streams):
            yield _sse(replies[0].usage_chunk(_usage(num_prompt, [finals[i] for i in range(len(streams))])))
        yield _DONE
    finally:
        for index, stream in enumerate(streams):
            if index not in finals:  # the client went away mid-stream, or another choice failed
                engine.abort(stream.request_id)


# -- the app: lifespan, errors, auth, then the route groups ---------------------------------------
def build_app(engine: AsyncEngine, served_model_names: list[str], api_key: str | None = None,
              max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES) -> FastAPI:
    api = _Api(engine, served_model_names, max_request_bytes)
    app = FastAPI(title="ovdflash", lifespan=_engine_lifespan(engine), docs_url=None, redoc_url=None,
                  openapi_url=None)
    app.state.engine = engine
    app.state.tool_format = api.tool_format
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
        if req.tools and req.messages is None:
            raise bad_request("tools are rendered with messages: give messages", param="tools")
        if req.messages is not None:
            ids = api.encode_messages(req.messages, req.add_generation_prompt, req.tools)
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
        api.log_ignored_fields(req)
        new_parser = api.tool_parser(req)
        prompt_ids = api.encode_messages(req.messages, tools=req.tools)
        request_id, created, streams = api.start(req, prompt_ids, "messages", "chatcmpl")
        replies = [_ChatReply(request_id, created, model, req.include_usage, new_parser, api.logprob_replies(req), index)
                   for index in range(len(streams))]
        return await _respond(api.engine, request, req, streams, len(prompt_ids), replies)

    @app.post("/v1/completions", dependencies=auth)
    @_guarded
    async def completions(request: Request):
        req = await api.parse(request, protocol.CompletionRequest)
        model = api.model_name(req.model)
        req.check_supported()
        api.log_ignored_fields(req)
        prompt = req.single_prompt()
        prompt_ids = api.encode_text(prompt) if isinstance(prompt, str) else api.check_token_ids(prompt, "prompt")
        request_id, created, streams = api.start(req, prompt_ids, "prompt", "cmpl")
        replies = [_CompletionReply(request_id, created, model, req.include_usage, api.logprob_replies(req), index)
                   for index in range(len(streams))]
        return await _respond(api.engine, request, req, streams, len(prompt_ids), replies)


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
