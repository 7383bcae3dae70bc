"""Text-level continuous batching: requests in, text out, one batched round per `step()`.

Contract:
- `BatchGeneration(pipeline, max_batch_size=8, pool_blocks=None, max_num_batched_tokens=None,
  prefill_batch_tokens=None)` runs
  `scheduler.Scheduler` on the pipeline's batched paged runner (`DFlashPipeline.batch_target`) and
  drafter pool; `max_num_batched_tokens` is the scheduler's per-round token budget (chunked prefill;
  None: whole prompts; output unchanged either way). It is the one
  engine behind `DFlashPipeline.generate_batch` and the server's batched scheduler. It does not
  take the pipeline's lock: its owner calls it from one thread (generate_batch holds the lock; the
  server's worker thread owns the pipeline).
- `add(request_id, prompt_ids, max_new_tokens, params, stop=(), block_size=None, draft=None,
  prompt_lookup=None, prefix_cache=None, structured=None) -> GenerationResult`: queues a request (block_size/draft/
  prompt_lookup/prefix_cache as `DFlashPipeline.generate`; "auto" lets the scheduler's load-aware
  policy choose each round's drafts, up to the trained block; prefix_cache shares the pool's cached
  KV blocks that begin the prompt). The result fills as the request runs. Bad arguments raise
  ValueError at once, nothing queued. A drafter that reports confidences has its proposals cut at
  the pipeline's `confidence_threshold` (block_policy.ConfidenceCut), fixed block or "auto".
- `structured` (token_generation's spelling) holds the request's output to a grammar, a fresh one per
  request (token_generation.call_grammar); a bad spec is a ValueError at `add`.
- Penalties, logit bias and logprobs come in `params` (decode.sampling.SamplingParams); a logit_bias
  token id beyond the vocabulary is a ValueError at `add`; `result.logprobs` fills as tokens do.
- `step() -> [BatchOutput(request_id, text, finished, result)]`: one round for every running request. text is
  text that can no longer change: while a request runs, text that could be the start of a stop
  string is held back; its last item carries the rest. On finish the result's finish_reason is
  "stop" (EOS or a stop string, cut from the text), "length" or "context", and its stats are
  merged into the pipeline's cumulative stats.
- `abort(request_id) -> GenerationResult | None` drops a waiting or running request (its blocks
  and drafter go back at once); the result keeps what was generated, finish_reason "abort".
- Text and token ids equal `DFlashPipeline.generate` for the same prompt and arguments (greedy
  exactly; sampled with the same seed, the same draws): the scheduler's events are decode.sequence.generate's.
- The pipeline's batch side, each function the `DFlashPipeline` method of its name (the pipeline's
  contract): `batch_target(pipe, pool_blocks=None)`, the batched paged runner on the pipeline's
  compiled target (ov.paged_batch.batch_target_for), made again when pool_blocks or the pipeline's
  `prefix_cache` changes; `drafter_pool(pipe)`, drafters on its compiled drafter (None without
  one); `batch_draft_policy(pipe, max_batch_size=8)`, the load-aware "auto" policy, its costs
  measured on first use (block_policy.measure_batch_costs); `generate_batch(pipe, prompts, ...)`,
  one BatchGeneration run to the end under the pipeline's lock. The runner, the pool and the
  policy live in the pipeline's BatchRunners, each made once.

Imports: decode/, ov/ (lazily: openvino loads only when a batched runner is made), text, tokenizer,
token_generation; never the pipeline (it comes in as an argument), server/, bench/ or cli/.
"""
from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass
from typing import NamedTuple

from .decode.block_policy import BatchDraftPolicy, ConfidenceCut, measure_batch_costs
from .decode.sampling import SamplingParams
from .decode.scheduler import Scheduler
from .decode.stats import GenerationStats
from .text import (
    GenerationResult,
    check_positive_int,
    check_stops,
    check_token_ids,
    extend_text,
    held_back,
    record_token,
)
from .token_generation import call_grammar, check_block_size, sampling_params
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
    def __init__(self, pipeline, max_batch_size: int = 8, pool_blocks: int | None = None,
                 max_num_batched_tokens: int | None = None, prefill_batch_tokens: int | None = None):
        self.pipeline = pipeline
        self.scheduler = Scheduler(pipeline.batch_target(pool_blocks), pipeline.drafter_pool(), max_batch_size,
                                   max_num_batched_tokens=max_num_batched_tokens,
                                   prefill_batch_tokens=prefill_batch_tokens)
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
            draft: bool | None = None, prompt_lookup: bool | None = None, prefix_cache: bool | None = None,
            structured=None):
        pipe = self.pipeline
        prompt_ids = check_token_ids(prompt_ids, pipe.vocab_size)
        if params is not None and params.logit_bias:  # the vocabulary bound, as generate_tokens checks it
            sampling_params(pipe, logit_bias=params.logit_bias)
        check_positive_int("max_new_tokens", max_new_tokens)
        block_size = check_block_size(pipe, block_size, draft)
        use_drafter = draft is not False and pipe.drafter is not None and (block_size == "auto" or block_size > 1)
        use_lookup = bool((pipe.prompt_lookup if prompt_lookup is None else prompt_lookup) and use_drafter)
        stops = check_stops(stop)
        if request_id in self.requests:
            raise ValueError(f"request {request_id!r} is already queued")
        grammar = call_grammar(pipe, structured)
        block = (pipe.block_size if block_size == "auto" else block_size) if use_drafter else 1
        load_aware = use_drafter and block_size == "auto" and block > 1
        if load_aware and self.scheduler.draft_policy is None:
            self.scheduler.draft_policy = pipe.batch_draft_policy(self.scheduler.max_batch_size)
        stats = self.scheduler.add(request_id, prompt_ids, max_new_tokens, params or SamplingParams(), block,
                                   use_lookup, tuple(pipe.eos_token_ids), load_aware=load_aware,
                                   reuse_prefix=pipe.prefix_cache if prefix_cache is None else bool(prefix_cache),
                                   grammar=grammar, draft_cut=ConfidenceCut(pipe.confidence_threshold))
        result = GenerationResult("", [], "", stats)
        detok = IncrementalDetokenizer(pipe.tokenizer) if pipe.tokenizer is not None else None
        self.requests[request_id] = _Request(result, detok, stops, set(pipe.eos_token_ids))
        return result

    def step(self) -> list[BatchOutput]:
        out = []
        for request_id, events in self.scheduler.step():
            req = self.requests[request_id]
            result, finished = req.result, False
            for event in events:
                record_token(result, event)
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


# -- the pipeline's batch side: DFlashPipeline's methods of these names ---------------------------
@dataclass
class BatchRunners:
    """What the batch side keeps beside one pipeline's models, each made on first use."""
    target: object = None        # ov.paged_batch.OVPagedBatchTarget
    drafter_pool: object = None  # ov.drafter_rows.DrafterRows or ov.paged_batch.DrafterPool
    draft_policy: BatchDraftPolicy | None = None


def batch_target(pipe, pool_blocks: int | None = None):
    """The batched paged runner beside this pipeline's target (made once; same compiled model). It
    keeps a prefix cache of KV blocks across requests and calls while `prefix_cache` is on."""
    current = pipe._batch.target
    if current is None or (pool_blocks is not None and pool_blocks != current.pool_blocks) \
            or current.caches_prefixes != bool(pipe.prefix_cache):
        from .ov.paged_batch import batch_target_for

        pipe._batch.target = batch_target_for(pipe.target, pool_blocks, prefix_caching=bool(pipe.prefix_cache))
    return pipe._batch.target


def drafter_pool(pipe):
    """Drafters for batched sequences, on this pipeline's compiled drafter (made once; None without one):
    rows of one request, a round's drafter calls in one inference (ov.drafter_rows.DrafterRows), where
    the drafter is a DFlash one; else a request per sequence (ov.paged_batch.DrafterPool)."""
    if pipe._batch.drafter_pool is None and pipe.drafter is not None:
        from .ov.drafter_rows import DrafterRows, batches_rows
        from .ov.paged_batch import DrafterPool

        pipe._batch.drafter_pool = (DrafterRows if batches_rows(pipe.drafter) else DrafterPool)(pipe.drafter)
    return pipe._batch.drafter_pool


def batch_draft_policy(pipe, max_batch_size: int = 8):
    """The load-aware policy behind generate_batch's block_size="auto" (block_policy.BatchDraftPolicy):
    on first use, measures batched target calls up to max_batch_size full blocks and the
    drafter's cost; it keeps learning costs across calls (acceptance is per sequence)."""
    if pipe._batch.draft_policy is None:
        if pipe.drafter is None:
            raise ValueError("block_size='auto' needs a drafter")
        pool = pipe.drafter_pool()
        drafter = pool.take()
        try:
            tokens, call_cost_s, draft_cost_s = measure_batch_costs(
                pipe.batch_target(), drafter, max_batch_size * pipe.block_size, pipe.block_size - 1,
                max_sequences=max_batch_size)
        finally:
            pool.give(drafter)
        pipe._batch.draft_policy = BatchDraftPolicy(tokens, call_cost_s, draft_cost_s,
                                                    shared_draft_call=hasattr(pool, "propose_many"))
    return pipe._batch.draft_policy


def generate_batch(pipe, prompts, max_new_tokens: int = 256, temperature: float = 0.0,
                   top_p: float = 1.0, top_k: int = 0, seed: int | None = None, stop=None,
                   block_size: int | str | None = None, draft: bool | None = None,
                   apply_chat_template: bool = False, prompt_lookup: bool | None = None,
                   max_batch_size: int = 8, pool_blocks: int | None = None,
                   prefix_cache: bool | None = None, presence_penalty: float = 0.0,
                   frequency_penalty: float = 0.0, repetition_penalty: float = 1.0, logit_bias=None,
                   logprobs: int | None = None, structured=None,
                   max_num_batched_tokens: int | None = None) -> list[GenerationResult]:
    """`generate` for every prompt, verified together: one target inference per round for all
    running sequences (continuous batching, at most max_batch_size at once; batch_generation).
    Each result equals that prompt's `generate` alone with the same arguments (greedy exactly;
    sampled with the same seed, the same draws). block_size="auto": each round's drafts are
    chosen for the whole batch from its cost curve (`batch_draft_policy`). With prefix caching
    (None: the pipeline's `prefix_cache`), a prompt starting with full KV blocks that an earlier
    or concurrent sequence computed (a shared system prompt) prefills only the rest.
    max_num_batched_tokens: each round's token budget; a longer prompt prefills over several rounds
    beside the others' verifies (chunked prefill; None: whole prompts)."""
    if isinstance(prompts, (str, dict)) or not hasattr(prompts, "__iter__"):
        raise TypeError("prompts must be a list of prompts (strings, message lists or token-id lists)")
    prompts = list(prompts)
    params = sampling_params(pipe, temperature, top_p, top_k, seed, presence_penalty, frequency_penalty,
                             repetition_penalty, logit_bias, logprobs)
    encoded = [pipe.encode_prompt(p, apply_chat_template) for p in prompts]
    with pipe._lock.hold():
        batch = BatchGeneration(pipe, max_batch_size, pool_blocks, max_num_batched_tokens)
        try:
            results = [batch.add(i, ids, max_new_tokens, params, stop, block_size, draft, prompt_lookup,
                                 prefix_cache, structured) for i, ids in enumerate(encoded)]
            while batch.has_work():
                batch.step()
        finally:
            for i in list(batch.requests):  # an interrupted batch gives its blocks and drafters back
                batch.abort(i)
    return results
