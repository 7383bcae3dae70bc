"""What the server's worker steps: one request at a time, or continuous batching (ovdflash.server.engine's backend interface).

Contract:
- `SequentialBackend(pipeline, block_size, draft)` runs one request at a time, first come first
  served, one DFlash round per `step()` (`DFlashPipeline.stream_rounds`), so an abort stops a
  request within a round. The pipeline has one target KV cache, so a second sequence cannot start
  before the first ends: a request waits for the ones before it (docs/SERVING.md). The text equals
  `DFlashPipeline.generate` for the same prompt and settings, because it is the same code.
- `BatchedBackend(pipeline, block_size, draft, max_num_seqs, pool_blocks, max_num_batched_tokens,
  prefill_batch_tokens=DEFAULT_PREFILL_BATCH_TOKENS)` runs up to
  max_num_seqs requests at once, joining and leaving between rounds, every round ONE target call
  for all of them (ovdflash.batch_generation over the batch scheduler and the paged runner's block
  pool). Whole prompts that arrive together prefill a few at a time (the scheduler's
  `prefill_batch_tokens`), so the first of a burst answers after one prefill, not all of them.
  block_size None or "auto": the load-aware policy chooses each round's drafts for the whole
  batch; an integer fixes them. A request whose KV cache cannot be booked yet waits, FIFO.
  Each request's text equals `DFlashPipeline.generate` alone (greedy; sampled with a seed, the
  same draws). A request the batch refuses at `add` ends alone with "error" at the next step.
- Both hold a request's output to its grammar (`RequestParams.structured`, decode.structured) and
  honour its penalties, logit bias and logprobs (RequestParams.sampling_kwargs); each
  output carries the logprobs of the tokens generated since the previous one (`new_logprobs`).
"""
from __future__ import annotations

import logging
from collections import deque
from dataclasses import dataclass, field

from ..decode.scheduler import DEFAULT_PREFILL_BATCH_TOKENS
from ..decode.stats import GenerationStats
from ..text import GenerationResult
from .engine import RequestOutput, RequestParams

logger = logging.getLogger("ovdflash.server")

def new_logprobs(result: GenerationResult, num_sent: int) -> list | None:
    """The result's logprobs from num_sent on; None when the request asked for none."""
    return None if result.logprobs is None else result.logprobs[num_sent:]


# -- the one-at-a-time scheduler --------------------------------------------------------------
_END = object()


@dataclass
class _Sequence:
    request_id: str
    prompt_ids: list[int]
    params: RequestParams
    result: GenerationResult = field(default_factory=lambda: GenerationResult("", [], "", GenerationStats()))
    rounds: object = None  # the pipeline's stream_rounds generator, once running
    num_logprobs_sent: int = 0


class SequentialBackend:
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
            return [RequestOutput(seq.request_id, text, len(seq.result.token_ids), logprobs=self._logprobs(seq))]
        self.running = None
        reason = _FINISH_REASONS.get(seq.result.finish_reason, seq.result.finish_reason)
        return [self._final(seq, reason, text)]

    def _start(self, seq: _Sequence) -> _Sequence:
        p = seq.params
        seq.rounds = self.pipeline.stream_rounds(
            seq.prompt_ids, seq.result, stop=list(p.stop), max_new_tokens=p.max_tokens, block_size=self.block_size,
            draft=self.draft, structured=p.structured, **p.sampling_kwargs())
        return seq

    @staticmethod
    def _logprobs(seq: _Sequence) -> list | None:
        sent = new_logprobs(seq.result, seq.num_logprobs_sent)
        seq.num_logprobs_sent += len(sent or ())
        return sent

    @classmethod
    def _final(cls, seq: _Sequence, reason: str, text: str = "", error: str | None = None) -> RequestOutput:
        return RequestOutput(seq.request_id, text, len(seq.result.token_ids), True, reason,
                             seq.result.stats, error, cls._logprobs(seq))


# -- many sequences per round ------------------------------------------------------------------
class BatchedBackend:
    """Continuous batching behind the server (see the module contract)."""

    def __init__(self, pipeline, block_size: int | str | None = None, draft: bool | None = None,
                 max_num_seqs: int = 8, pool_blocks: int | None = None, max_num_batched_tokens: int | None = None,
                 prefill_batch_tokens: int | None = DEFAULT_PREFILL_BATCH_TOKENS):
        from ..batch_generation import BatchGeneration

        self.pipeline = pipeline
        self.block_size = "auto" if block_size is None and pipeline.drafter is not None else block_size
        self.draft = draft
        self.batch = BatchGeneration(pipeline, max_num_seqs, pool_blocks, max_num_batched_tokens, prefill_batch_tokens)
        if self.block_size == "auto" and draft is not False:  # measure the cost curve now, not at a request
            pipeline.batch_draft_policy(max_num_seqs)
        self.failed: list[RequestOutput] = []  # requests refused at add, answered at the next step
        self.num_logprobs_sent: dict[str, int] = {}  # request id -> logprobs already in its outputs

    @property
    def num_running(self) -> int:
        return self.batch.num_running

    @property
    def num_waiting(self) -> int:
        return self.batch.num_waiting

    def has_unfinished(self) -> bool:
        return self.batch.has_work() or bool(self.failed)

    def add(self, request_id: str, prompt_ids: list[int], params: RequestParams) -> None:
        from ..token_generation import sampling_params

        try:
            self.batch.add(request_id, prompt_ids, params.max_tokens,
                           sampling_params(self.pipeline, **params.sampling_kwargs()),
                           list(params.stop), self.block_size, self.draft, structured=params.structured)
        except Exception as exc:  # a request the engine cannot take ends alone, with its reason
            logger.error("request %s refused: %s: %s", request_id, type(exc).__name__, exc)
            self.failed.append(RequestOutput(request_id, "", 0, True, "error", GenerationStats(),
                                             f"{type(exc).__name__}: {exc}"))

    def abort(self, request_id: str) -> list[RequestOutput]:
        result = self.batch.abort(request_id)
        if result is None:
            return []
        self.num_logprobs_sent.pop(request_id, None)
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
                self.num_logprobs_sent.pop(request_id, None)
                outputs.append(RequestOutput(request_id, "", len(result.token_ids), True, "error", result.stats, error))
            return outputs
        for request_id, text, finished, result in step:
            reason = _FINISH_REASONS.get(result.finish_reason, result.finish_reason) if finished else None
            sent = self.num_logprobs_sent.pop(request_id, 0)
            logprobs = new_logprobs(result, sent)
            if not finished:
                self.num_logprobs_sent[request_id] = sent + len(logprobs or ())
            outputs.append(RequestOutput(request_id, text, len(result.token_ids), finished, reason,
                                         result.stats if finished else None, logprobs=logprobs))
        return outputs


# a sequence that filled the context ends as OpenAI's "length"; "" (nothing ran) as "stop"
_FINISH_REASONS = {"context": "length", "": "stop", None: "stop"}

