"""Between HTTP and the pipeline: ONE worker thread steps a backend, and each request gets an event queue.

Contract:
- A backend (`ovdflash.server.backends`) offers `add(request_id, prompt_ids, params)`,
  `abort(request_id) -> [RequestOutput]`, `step() -> [RequestOutput]`, `has_unfinished()`,
  `num_running`, `num_waiting`. It is called from the worker thread only, so it needs no locks.
  Each `RequestOutput` carries the text since the request's previous output (and, when the request
  asked for logprobs, the TokenLogprobs of the tokens since then, every generated token once); the last one has
  `finished`, `finish_reason` ("stop", "length", "abort", "error") and the request's `GenerationStats`.
- `AsyncEngine(backend, max_num_seqs, max_queue, metrics)`: `add` (on the event loop) returns
  a `RequestStream`, an async iterator of that request's outputs, or raises `QueueFullError`
  when max_num_seqs + max_queue requests are already open, `EngineStoppedError` once shutdown
  has begun. `abort(request_id)` (a client went away) drops the stream at once and tells the
  worker.
- `add_choices(request_id, prompt_ids, params, n)`: n sequences of one prompt (a request's `n`), one
  stream each; choice 0 is `request_id` with `params`, choice i is `choice_request_id(request_id, i)` with
  `params.for_choice(i)` (a seeded request's choice i samples with `choice_seed(seed, i)`: the same request
  gives the same choices, and choice 0 equals the request with n=1). The later choices reach the backend
  once choice 0 has run its first round (its prefill), so a batch with prefix caching shares the prompt's KV
  blocks with them; the queue limit counts each choice. `max_choices`: the largest n the engine takes
  (max_num_seqs when it batches, else `MAX_CHOICES_ONE_AT_A_TIME`, within the queue). `begin_shutdown(drain_s)`: no new requests; open ones may finish for `drain_s`
  seconds, then end with finish_reason "abort" at their next round. `close()` stops the worker.
- The worker owns the pipeline: no other thread touches it while the engine runs. Every
  time a request finishes (at most every `TRIM_INTERVAL_S`), and when it runs out of work, it hands
  the C heap's free pages back to the kernel (ovdflash.ov.memory.release_free_heap), so resident memory follows use. It
  records metrics (ServerMetrics) for every request it finishes, answered or not, and a failure
  inside a request ends that request with "error" and one log line, not the server.
"""
from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import logging
import threading
import time
from dataclasses import dataclass

from ..decode.stats import GenerationStats

logger = logging.getLogger("ovdflash.server")


# shortest time between two trims of the C heap (a trim costs a few milliseconds on a loaded server)
TRIM_INTERVAL_S = 0.1
# the most choices one request may ask for when requests run one at a time: they run one after another
MAX_CHOICES_ONE_AT_A_TIME = 16


def choice_seed(seed: int | None, index: int) -> int | None:
    """The seed of choice `index` of a request seeded `seed`: the seed itself for choice 0, else a hash of both, so
    no choice of one seed repeats a choice of another; None (independent draws) stays None."""
    if seed is None or index == 0:
        return seed
    digest = hashlib.blake2b(f"{seed}/{index}".encode(), digest_size=8, person=b"ovdflash-n").digest()
    return int.from_bytes(digest, "big") >> 1  # a seed must be a non-negative int64


def choice_request_id(request_id: str, index: int) -> str:
    return request_id if index == 0 else f"{request_id}-{index}"


@dataclass(frozen=True)
class RequestParams:
    max_tokens: int
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: tuple[tuple[int, float], ...] = ()
    logprobs: int | None = None  # None = off; else the alternatives per token
    structured: object = None  # None, or the decode.structured spec the output is held to

    def for_choice(self, index: int) -> "RequestParams":
        return dataclasses.replace(self, seed=choice_seed(self.seed, index))

    def sampling_kwargs(self) -> dict:
        """The pipeline's sampling arguments (DFlashPipeline.generate's names)."""
        return {"temperature": self.temperature, "top_p": self.top_p, "top_k": self.top_k, "seed": self.seed,
                "presence_penalty": self.presence_penalty, "frequency_penalty": self.frequency_penalty,
                "repetition_penalty": self.repetition_penalty, "logit_bias": self.logit_bias,
                "logprobs": self.logprobs}


@dataclass
class RequestOutput:
    request_id: str
    text: str                          # new text since this request's previous output
    num_output_tokens: int             # tokens generated so far
    finished: bool = False
    finish_reason: str | None = None   # on the last output: stop, length, abort, error
    stats: GenerationStats | None = None
    error: str | None = None
    logprobs: list | None = None       # with params.logprobs: a decode.sampling.TokenLogprob per new token


class QueueFullError(Exception):
    pass


class EngineStoppedError(Exception):
    pass


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
        self._commands: list[tuple] = []               # ("add", id, ids, params, t, first choice) / ("abort", id)
        self._followers: dict[str, list[tuple]] = {}   # worker only: first choice's id -> its later choices' adds
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

    @property
    def max_choices(self) -> int:
        if self.max_num_seqs > 1:
            return self.max_num_seqs
        return min(MAX_CHOICES_ONE_AT_A_TIME, self.max_num_seqs + self.max_queue)

    def add(self, request_id: str, prompt_ids: list[int], params: RequestParams) -> RequestStream:
        return self.add_choices(request_id, prompt_ids, params, 1)[0]

    def add_choices(self, request_id: str, prompt_ids: list[int], params: RequestParams,
                    n: int) -> list[RequestStream]:
        if not self._accepting or not self.healthy:
            self._reject("shutting_down")
            raise EngineStoppedError("the server is shutting down" if not self._accepting
                                     else f"the engine has stopped: {self._failure}")
        if len(self._streams) + n > self.max_num_seqs + self.max_queue:
            self._reject("queue_full")
            raise QueueFullError(f"{len(self._streams)} requests are open ({self.max_num_seqs} running, "
                                 f"at most {self.max_queue} waiting)")
        streams, arrival = [], time.perf_counter()
        with self._cond:  # all choices in one batch of commands: choice 0 comes first, its followers after it
            for index in range(n):
                choice_id = choice_request_id(request_id, index)
                streams.append(RequestStream(choice_id))
                self._streams[choice_id] = streams[-1]
                self._commands.append(("add", choice_id, list(prompt_ids), params.for_choice(index), arrival,
                                       request_id if index else None))
            self._cond.notify()
        return streams

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
        from ..ov.memory import release_free_heap

        timing: dict[str, list] = {}  # request id -> [arrival, first output time or None]
        finished_since_trim, last_trim = 0, time.monotonic()
        try:
            while True:
                with self._cond:
                    while not (self._commands or self._stop or self.scheduler.has_unfinished()):
                        self._cond.wait()
                    commands, self._commands = self._commands, []
                    stop, abort_at = self._stop, self._abort_at
                outputs = []
                for command in commands:
                    if command[0] == "add":
                        _, request_id, prompt_ids, params, arrival, first_choice = command
                        timing[request_id] = [arrival, None]
                        if first_choice is None:
                            self.scheduler.add(request_id, prompt_ids, params)
                        else:  # a later choice waits for the first one's prefill, to share its prompt's KV blocks
                            self._followers.setdefault(first_choice, []).append(command)
                    else:
                        outputs += self._abort(command[1])
                if stop or (abort_at is not None and time.monotonic() >= abort_at):
                    for request_id in list(timing):
                        outputs += self._abort(request_id)
                else:
                    outputs += self.scheduler.step()
                self._release_followers(outputs)
                self._publish(outputs, timing)
                finished_since_trim += sum(o.finished for o in outputs)
                out_of_work = not self.scheduler.has_unfinished()
                if finished_since_trim and (out_of_work or time.monotonic() - last_trim >= TRIM_INTERVAL_S):
                    release_free_heap()  # what the finished requests left goes back to the kernel
                    finished_since_trim, last_trim = 0, time.monotonic()
                if stop and not self.scheduler.has_unfinished():
                    return
        except BaseException as exc:  # the engine itself broke: fail every open request, keep serving errors
            self._failure = f"{type(exc).__name__}: {exc}"
            logger.error("the engine stopped: %s", self._failure)
            self._publish([RequestOutput(r, "", 0, True, "error", GenerationStats(), self._failure)
                           for r in timing], timing)

    def _release_followers(self, outputs: list[RequestOutput]) -> None:
        """The later choices of every first choice that has run a round (or ended) go to the backend."""
        for output in outputs:
            for _, request_id, prompt_ids, params, _, _ in self._followers.pop(output.request_id, ()):
                self.scheduler.add(request_id, prompt_ids, params)

    def _abort(self, request_id: str) -> list[RequestOutput]:
        for commands in self._followers.values():
            for command in commands:
                if command[1] == request_id:  # not in the backend yet: it ends here
                    commands.remove(command)
                    return [RequestOutput(request_id, "", 0, True, "abort", GenerationStats())]
        return self.scheduler.abort(request_id)

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

