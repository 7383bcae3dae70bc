"""Text-level continuous batching: requests in, text out, one batched round per `step()`.

Contract:
- `BatchGeneration(pipeline, max_batch_size=8, pool_blocks=None)` runs `scheduler.Scheduler` on the
  pipeline's batched paged runner (`DFlashPipeline.batch_target`) and drafter pool. It is the one
  engine behind `DFlashPipeline.generate_batch` and the server's batched scheduler. It does not
  take the pipeline's lock: its owner calls it from one thread (generate_batch holds the lock; the
  server's worker thread owns the pipeline).
- `add(request_id, prompt_ids, max_new_tokens, params, stop=(), block_size=None, draft=None,
  prompt_lookup=None, prefix_cache=None) -> GenerationResult`: queues a request (block_size/draft/
  prompt_lookup/prefix_cache as `DFlashPipeline.generate`; "auto" lets the scheduler's load-aware
  policy choose each round's drafts, up to the trained block; prefix_cache shares the pool's cached
  KV blocks that begin the prompt). The result fills as the request runs. Bad arguments raise
  ValueError at once, nothing queued.
- `step() -> [BatchOutput(request_id, text, finished, result)]`: one round for every running request. text is
  text that can no longer change: while a request runs, text that could be the start of a stop
  string is held back; its last item carries the rest. On finish the result's finish_reason is
  "stop" (EOS or a stop string, cut from the text), "length" or "context", and its stats are
  merged into the pipeline's cumulative stats.
- `abort(request_id) -> GenerationResult | None` drops a waiting or running request (its blocks
  and drafter go back at once); the result keeps what was generated, finish_reason "abort".
- Text and token ids equal `DFlashPipeline.generate` for the same prompt and arguments (greedy
  exactly; sampled with the same seed, the same draws): the scheduler's events are engine.generate's.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Hashable, NamedTuple, Sequence

from .decode.sampling import SamplingParams
from .decode.scheduler import Scheduler
from .decode.stats import GenerationStats
from .tokenizer import IncrementalDetokenizer


class BatchOutput(NamedTuple):
    request_id: Hashable
    text: str        # new text since this request's previous output
    finished: bool
    result: object   # the request's text.GenerationResult, as it stands


@dataclass
class _Request:
    result: object  # text.GenerationResult
    detok: IncrementalDetokenizer | None
    stops: list[str]
    eos: set
    emitted: int = 0


class BatchGeneration:
    def __init__(self, pipeline, max_batch_size: int = 8, pool_blocks: int | None = None):
        self.pipeline = pipeline
        self.scheduler = Scheduler(pipeline.batch_target(pool_blocks), pipeline.drafter_pool(), max_batch_size)
        self.requests: dict[Hashable, _Request] = {}

    @property
    def num_running(self) -> int:
        return len(self.scheduler.running)

    @property
    def num_waiting(self) -> int:
        return len(self.scheduler.waiting)

    def pool_usage(self) -> dict[str, int]:
        """The KV block pool's used / cached / free blocks (paged_batch.OVPagedBatchTarget.pool_usage)."""
        return self.scheduler.target.pool_usage()

    def has_work(self) -> bool:
        return self.scheduler.has_work()

    def add(self, request_id: Hashable, prompt_ids: Sequence[int], max_new_tokens: int,
            params: SamplingParams | None = None, stop=(), block_size: int | str | None = None,
            draft: bool | None = None, prompt_lookup: bool | None = None, prefix_cache: bool | None = None):
        from .text import GenerationResult, check_positive_int, check_stops, check_token_ids

        pipe = self.pipeline
        prompt_ids = check_token_ids(prompt_ids, pipe.vocab_size)
        check_positive_int("max_new_tokens", max_new_tokens)
        block_size = pipe._check_block_size(block_size, draft)
        use_drafter = draft is not False and pipe.drafter is not None and (block_size == "auto" or block_size > 1)
        use_lookup = bool((pipe.prompt_lookup if prompt_lookup is None else prompt_lookup) and use_drafter)
        stops = check_stops(stop)
        if request_id in self.requests:
            raise ValueError(f"request {request_id!r} is already queued")
        block = (pipe.block_size if block_size == "auto" else block_size) if use_drafter else 1
        load_aware = use_drafter and block_size == "auto" and block > 1
        if load_aware and self.scheduler.draft_policy is None:
            self.scheduler.draft_policy = pipe.batch_draft_policy(self.scheduler.max_batch_size)
        stats = self.scheduler.add(request_id, prompt_ids, max_new_tokens, params or SamplingParams(), block,
                                   use_lookup, tuple(pipe.eos_token_ids), load_aware=load_aware,
                                   reuse_prefix=pipe.prefix_cache if prefix_cache is None else bool(prefix_cache))
        result = GenerationResult("", [], "", stats)
        detok = IncrementalDetokenizer(pipe.tokenizer) if pipe.tokenizer is not None else None
        self.requests[request_id] = _Request(result, detok, stops, set(pipe.eos_token_ids))
        return result

    def step(self) -> list[BatchOutput]:
        from .text import extend_text, held_back

        out = []
        for request_id, events in self.scheduler.step():
            req = self.requests[request_id]
            result, finished = req.result, False
            for event in events:
                result.token_ids.append(event.token)
                result.finish_reason = event.finish_reason or result.finish_reason
                finished = bool(event.finish_reason)
                if req.detok is None:
                    continue
                result.text, stopped = extend_text(result.text, event, req.detok, req.eos, req.stops)
                if stopped:  # a stop string: this request ends here, mid-round or not
                    result.finish_reason, finished = "stop", True
                    self.scheduler.abort(request_id)
                    break
            safe = len(result.text) if finished else len(result.text) - held_back(result.text, req.stops)
            out.append(BatchOutput(request_id, result.text[req.emitted:safe], finished, result))
            req.emitted = max(req.emitted, safe)
            if finished:
                self._close(request_id)
        return out

    def abort(self, request_id: Hashable):
        req = self.requests.get(request_id)
        if req is None:
            return None
        self.scheduler.abort(request_id)
        req.result.finish_reason = "abort"
        self._close(request_id)
        return req.result

    def _close(self, request_id: Hashable) -> None:
        stats: GenerationStats = self.requests.pop(request_id).result.stats
        self.pipeline.stats.merge(stats)
