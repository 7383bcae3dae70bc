"""Between HTTP and the pipeline: a scheduler driven by ONE worker thread, and per-request event queues.

Contract:
- A scheduler offers `add(request_id, prompt_ids, params)`, `abort(request_id) -> [RequestOutput]`,
  `step() -> [RequestOutput]`, `has_unfinished()`, `num_running`, `num_waiting`. It is called
  from the worker thread only, so it needs no locks. Each `RequestOutput` carries the text since
  the request's previous output; the last one has `finished`, `finish_reason` ("stop",
  "length", "abort", "error") and the request's `GenerationStats`. A batched scheduler with this
  interface replaces `SequentialScheduler` without other changes here.
- `SequentialScheduler` runs one request at a time, first come first served, one DFlash round
  per `step()` (`DFlashPipeline.stream_rounds`), so an abort stops a request within a round. The
  pipeline has one target KV cache, so a second sequence cannot start before the first ends: a
  request waits for the ones before it (docs/SERVING.md). The text equals `DFlashPipeline.generate`
  for the same prompt and settings, because it is the same code.
- `BatchedScheduler(pipeline, block_size, draft, max_num_seqs, pool_blocks)` runs up to
  max_num_seqs requests at once, joining and leaving between rounds, every round ONE target call
  for all of them (ovdflash.batch_generation over the scheduler and the paged runner's block
  pool). block_size None or "auto": the load-aware policy chooses each round's drafts for the
  whole batch; an integer fixes them. A request whose KV cache cannot be booked yet waits, FIFO.
  Each request's text equals `DFlashPipeline.generate` alone (greedy; sampled with a seed, the
  same draws).
- `AsyncEngine(scheduler, max_num_seqs, max_queue, metrics)`: `add` (on the event loop) returns
  a `RequestStream`, an async iterator of that request's outputs, or raises `QueueFullError`
  when max_num_seqs + max_queue requests are already open, `EngineStoppedError` once shutdown
  has begun. `abort(request_id)` (a client went away) drops the stream at once and tells the
  worker. `begin_shutdown(drain_s)`: no new requests; open ones may finish for `drain_s`
  seconds, then end with finish_reason "abort" at their next round. `close()` stops the worker.
- The worker owns the pipeline: no other thread touches it while the engine runs. Every
  `TRIM_EVERY` finished requests, and when it runs out of work, it hands the C heap's free pages
  back to the kernel (ovdflash.memory.release_free_heap), so resident memory follows use. It records
  metrics (ServerMetrics) for every request it finishes, answered or not, and a failure inside
  a request ends that request with "error" and one log line, not the server.
"""
from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections import deque
from dataclasses import dataclass, field

from ..pipeline import GenerationResult
from ..stats import GenerationStats

logger = logging.getLogger("ovdflash.server")

# finished requests between two trims of the C heap (one trim costs about a millisecond)
TRIM_EVERY = 32


@dataclass(frozen=True)
class RequestParams:
    max_tokens: int
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop: tuple[str, ...] = ()


@dataclass
class RequestOutput:
    request_id: str
    text: str                          # new text since this request's previous output
    num_output_tokens: int             # tokens generated so far
    finished: bool = False
    finish_reason: str | None = None   # on the last output: stop, length, abort, error
    stats: GenerationStats | None = None
    error: str | None = None


class QueueFullError(Exception):
    pass


class EngineStoppedError(Exception):
    pass


# -- the one-at-a-time scheduler --------------------------------------------------------------
_END = object()


@dataclass
class _Sequence:
    request_id: str
    prompt_ids: list[int]
    params: RequestParams
    result: GenerationResult = field(default_factory=lambda: GenerationResult("", [], "", GenerationStats()))
    rounds: object = None  # the pipeline's stream_rounds generator, once running


class SequentialScheduler:
    """One sequence at a time, FIFO, one round per step (see the module contract)."""

    def __init__(self, pipeline, block_size: int | str | None = None, draft: bool | None = None):
        self.pipeline = pipeline
        self.block_size = block_size
        self.draft = draft
        self.waiting: deque[_Sequence] = deque()
        self.running: _Sequence | None = None

    @property
    def num_running(self) -> int:
        return int(self.running is not None)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    def has_unfinished(self) -> bool:
        return self.running is not None or bool(self.waiting)

    def add(self, request_id: str, prompt_ids: list[int], params: RequestParams) -> None:
        self.waiting.append(_Sequence(request_id, list(prompt_ids), params))

    def abort(self, request_id: str) -> list[RequestOutput]:
        seq = self.running
        if seq is not None and seq.request_id == request_id:
            self.running = None
            seq.rounds.close()  # the pipeline records the stats of the rounds it ran
            return [self._final(seq, "abort")]
        for seq in self.waiting:
            if seq.request_id == request_id:
                self.waiting.remove(seq)
                return [self._final(seq, "abort")]
        return []

    def step(self) -> list[RequestOutput]:
        if self.running is None:
            if not self.waiting:
                return []
            self.running = self._start(self.waiting.popleft())
        seq = self.running
        try:
            text = next(seq.rounds, _END)
            ended = text is _END
            text = "" if ended else text
            if seq.result.finish_reason and not ended:  # the last round ran: only text remains, no rounds
                text += "".join(seq.rounds)
        except Exception as exc:  # a failure inside one request ends that request only
            logger.error("request %s failed: %s: %s", seq.request_id, type(exc).__name__, exc)
            self.running = None
            seq.rounds.close()
            return [self._final(seq, "error", error=f"{type(exc).__name__}: {exc}")]
        if not (seq.result.finish_reason or ended):
            return [RequestOutput(seq.request_id, text, len(seq.result.token_ids))]
        self.running = None
        reason = _FINISH_REASONS.get(seq.result.finish_reason, seq.result.finish_reason)
        return [self._final(seq, reason, text)]

    def _start(self, seq: _Sequence) -> _Sequence:
        p = seq.params
        seq.rounds = self.pipeline.stream_rounds(
            seq.prompt_ids, seq.result, stop=list(p.stop), max_new_tokens=p.max_tokens, temperature=p.temperature,
            top_p=p.top_p, top_k=p.top_k, seed=p.seed, block_size=self.block_size, draft=self.draft)
        return seq

    @staticmethod
    def _final(seq: _Sequence, reason: str, text: str = "", error: str | None = None) -> RequestOutput:
        return RequestOutput(seq.request_id, text, len(seq.result.token_ids), True, reason,
                             seq.result.stats, error)


# -- many sequences per round ------------------------------------------------------------------
class BatchedScheduler:
    """Continuous batching behind the server (see the module contract)."""

    def __init__(self, pipeline, block_size: int | str | None = None, draft: bool | None = None,
                 max_num_seqs: int = 8, pool_blocks: int | None = None):
        from ..batch_generation import BatchGeneration

        self.pipeline = pipeline
        self.block_size = "auto" if block_size is None and pipeline.drafter is not None else block_size
        self.draft = draft
        self.batch = BatchGeneration(pipeline, max_num_seqs, pool_blocks)
        if self.block_size == "auto" and draft is not False:  # measure the cost curve now, not at a request
            pipeline.batch_draft_policy(max_num_seqs)
        self.failed: list[RequestOutput] = []  # requests refused at add, answered at the next step

    @property
    def num_running(self) -> int:
        return self.batch.num_running

    @property
    def num_waiting(self) -> int:
        return self.batch.num_waiting

    def has_unfinished(self) -> bool:
        return self.batch.has_work() or bool(self.failed)

    def add(self, request_id: str, prompt_ids: list[int], params: RequestParams) -> None:
        from ..sampling import SamplingParams

        try:
            self.batch.add(request_id, prompt_ids, params.max_tokens,
                           SamplingParams(params.temperature, params.top_p, params.top_k, params.seed),
                           list(params.stop), self.block_size, self.draft)
        except Exception as exc:  # a request the engine cannot take ends alone, with its reason
            logger.error("request %s refused: %s: %s", request_id, type(exc).__name__, exc)
            self.failed.append(RequestOutput(request_id, "", 0, True, "error", GenerationStats(),
                                             f"{type(exc).__name__}: {exc}"))

    def abort(self, request_id: str) -> list[RequestOutput]:
        result = self.batch.abort(request_id)
        if result is None:
            return []
        return [RequestOutput(request_id, "", len(result.token_ids), True, "abort", result.stats)]

    def step(self) -> list[RequestOutput]:
        outputs, self.failed = self.failed, []
        try:
            step = self.batch.step()
        except Exception as exc:  # the shared call failed: its requests end with the error, the server goes on
            error = f"{type(exc).__name__}: {exc}"
            logger.error("a batched round failed: %s", error)
            for request_id in list(self.batch.requests):
                result = self.batch.abort(request_id)
                outputs.append(RequestOutput(request_id, "", len(result.token_ids), True, "error", result.stats, error))
            return outputs
        for request_id, text, finished, result in step:
            reason = _FINISH_REASONS.get(result.finish_reason, result.finish_reason) if finished else None
            outputs.append(RequestOutput(request_id, text, len(result.token_ids), finished, reason,
                                         result.stats if finished else None))
        return outputs


# a sequence that filled the context ends as OpenAI's "length"; "" (nothing ran) as "stop"
_FINISH_REASONS = {"context": "length", "": "stop", None: "stop"}


# -- the thread and the event loop ------------------------------------------------------------
class RequestStream:
    """A request's outputs, in order, as an async iterator that ends after the finished one."""

    def __init__(self, request_id: str):
        self.request_id = request_id
        self.queue: asyncio.Queue[RequestOutput] = asyncio.Queue()
        self.finished = False

    def __aiter__(self):
        return self

    async def __anext__(self) -> RequestOutput:
        if self.finished:
            raise StopAsyncIteration
        output = await self.queue.get()
        self.finished = output.finished
        return output


class AsyncEngine:
    def __init__(self, scheduler, max_num_seqs: int = 1, max_queue: int = 128, metrics=None,
                 max_model_len: int | None = None):
        self.scheduler = scheduler
        self.pipeline = getattr(scheduler, "pipeline", None)
        self.max_num_seqs = max_num_seqs
        self.max_queue = max_queue
        self.metrics = metrics
        self.max_model_len = max_model_len
        self._streams: dict[str, RequestStream] = {}   # open requests; event-loop thread only
        self._accepting = True
        self._loop: asyncio.AbstractEventLoop | None = None
        self._cond = threading.Condition()
        self._commands: list[tuple] = []               # ("add", id, ids, params, t) / ("abort", id)
        self._stop = False
        self._abort_at: float | None = None            # monotonic time at which open requests are ended
        self._thread: threading.Thread | None = None
        self._failure: str | None = None
        if metrics is not None:  # waiting = open requests the scheduler is not running (queued, or not yet taken)
            metrics.watch_load(lambda: scheduler.num_running,
                               lambda: max(0, len(self._streams) - scheduler.num_running))

    # -- event-loop side ---------------------------------------------------------------------
    def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._thread = threading.Thread(target=self._run, name="ovdflash-engine", daemon=True)
        self._thread.start()

    @property
    def healthy(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and self._failure is None

    @property
    def accepting(self) -> bool:
        return self._accepting

    @property
    def num_open_requests(self) -> int:
        return len(self._streams)

    def add(self, request_id: str, prompt_ids: list[int], params: RequestParams) -> RequestStream:
        if not self._accepting or not self.healthy:
            self._reject("shutting_down")
            raise EngineStoppedError("the server is shutting down" if not self._accepting
                                     else f"the engine has stopped: {self._failure}")
        if len(self._streams) >= self.max_num_seqs + self.max_queue:
            self._reject("queue_full")
            raise QueueFullError(f"{len(self._streams)} requests are open ({self.max_num_seqs} running, "
                                 f"at most {self.max_queue} waiting)")
        stream = RequestStream(request_id)
        self._streams[request_id] = stream
        self._send(("add", request_id, list(prompt_ids), params, time.perf_counter()))
        return stream

    def abort(self, request_id: str) -> None:
        if self._streams.pop(request_id, None) is not None:
            self._send(("abort", request_id))

    def begin_shutdown(self, drain_s: float = 0.0) -> None:
        self._accepting = False
        with self._cond:
            self._abort_at = time.monotonic() + max(0.0, drain_s)
            self._cond.notify()

    def close(self, timeout: float = 30.0) -> None:
        with self._cond:
            self._stop = True
            self._cond.notify()
        if self._thread is not None:
            self._thread.join(timeout)

    def _reject(self, reason: str) -> None:
        if self.metrics is not None:
            self.metrics.record_rejected(reason)

    def _send(self, command: tuple) -> None:
        with self._cond:
            self._commands.append(command)
            self._cond.notify()

    def _deliver(self, outputs: list[RequestOutput]) -> None:
        for output in outputs:
            stream = self._streams.get(output.request_id)
            if stream is None:  # aborted: nobody listens
                continue
            if output.finished:
                del self._streams[output.request_id]
            stream.queue.put_nowait(output)

    # -- worker side -------------------------------------------------------------------------
    def _run(self) -> None:
        from ..memory import release_free_heap

        timing: dict[str, list] = {}  # request id -> [arrival, first output time or None]
        finished_since_trim = 0
        try:
            while True:
                with self._cond:
                    if finished_since_trim and not (self._commands or self.scheduler.has_unfinished()):
                        release_free_heap()  # out of work: what the last requests left goes back
                        finished_since_trim = 0
                    while not (self._commands or self._stop or self.scheduler.has_unfinished()):
                        self._cond.wait()
                    commands, self._commands = self._commands, []
                    stop, abort_at = self._stop, self._abort_at
                outputs = []
                for command in commands:
                    if command[0] == "add":
                        _, request_id, prompt_ids, params, arrival = command
                        timing[request_id] = [arrival, None]
                        self.scheduler.add(request_id, prompt_ids, params)
                    else:
                        outputs += self.scheduler.abort(command[1])
                if stop or (abort_at is not None and time.monotonic() >= abort_at):
                    for request_id in list(timing):
                        outputs += self.scheduler.abort(request_id)
                else:
                    outputs += self.scheduler.step()
                self._publish(outputs, timing)
                finished_since_trim += sum(o.finished for o in outputs)
                if finished_since_trim >= TRIM_EVERY:
                    release_free_heap()
                    finished_since_trim = 0
                if stop and not self.scheduler.has_unfinished():
                    return
        except BaseException as exc:  # the engine itself broke: fail every open request, keep serving errors
            self._failure = f"{type(exc).__name__}: {exc}"
            logger.error("the engine stopped: %s", self._failure)
            self._publish([RequestOutput(r, "", 0, True, "error", GenerationStats(), self._failure)
                           for r in timing], timing)

    def _publish(self, outputs: list[RequestOutput], timing: dict[str, list]) -> None:
        now = time.perf_counter()
        for output in outputs:
            arrival_first = timing.get(output.request_id)
            if arrival_first is None:
                continue
            if arrival_first[1] is None and output.num_output_tokens:
                arrival_first[1] = now
                if self.metrics is not None:
                    self.metrics.record_first_token(now - arrival_first[0])
            if output.finished:
                del timing[output.request_id]
                if self.metrics is not None:
                    ttft = arrival_first[1] - arrival_first[0] if arrival_first[1] is not None else None
                    self.metrics.record_finished(output.stats or GenerationStats(), output.num_output_tokens,
                                                 output.finish_reason, now - arrival_first[0], ttft)
        if outputs and self._loop is not None and not self._loop.is_closed():
            try:
                self._loop.call_soon_threadsafe(self._deliver, outputs)
            except RuntimeError:  # the loop closed in between: nobody is left to tell
                pass
