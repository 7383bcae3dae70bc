"""A loaded pipeline made into the server's app: what `ovdflash serve` and each Ray replica build.

Contract:
- `load_pipeline(model_dir, ..., config, block_size, ...)` loads and warms up the pipeline as
  `ovdflash chat` does (`config`: KEY=VALUE items, as `-c` gives them).
- `build_server_app(pipe, served_model_names, block_size, draft, max_num_seqs, max_queue,
  max_model_len, api_key, max_request_bytes, kv_cache_memory_bytes, max_num_batched_tokens,
  prefill_batch_tokens, prefix_cache_memory_bytes)` wires backend, engine, metrics and endpoints (max_num_batched_tokens: the
  batch's per-round token budget; prefill_batch_tokens: how many whole prompts' tokens a round
  prefills together, None: all waiting; decode.scheduler.DEFAULT_PREFILL_BATCH_TOKENS by default).
  max_num_seqs None: batch where the runner can (`DEFAULT_MAX_NUM_SEQS` on the paged runner, else 1);
  1: one request at a time. The batch's KV pool is `kv_cache_memory_bytes`
  (`parse_bytes`: "4G", "512M", bytes) or `ov.paged_batch.default_pool_blocks` (one full context
  shared by the batch, at most a quarter of the available memory); a pool smaller than one
  full-context sequence lowers the context limit to what it holds (an explicit max_model_len beyond
  it is a ValueError). Cached prefix blocks nobody holds keep at most `prefix_cache_memory_bytes` of
  memory beyond what running requests hold (None: a quarter of the pool; `block_pool` contract).
  `app.state.kv_pool` describes the pool (tokens, MiB, KV precision) for the
  start-up line; `/metrics` reads the pool's used / cached / free blocks.
- `is_loopback(host)`: whether an address only this machine reaches.
"""
from __future__ import annotations

import ipaddress

from ..decode.scheduler import DEFAULT_PREFILL_BATCH_TOKENS
from ..options import parse_config_options, sigint_to_main_thread_only

DEFAULT_MAX_NUM_SEQS = 8


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def load_pipeline(model_dir, device, no_draft, cache_dir, target_runner, prompt_lookup, precision, config,
                  block_size, prefix_caching=True, wide_target=None, confidence_threshold=None):
    """The pipeline `serve` runs, loaded and warmed up as `ovdflash chat` does."""
    from ..decode.block_policy import ConfidenceCut
    from ..pipeline import DFlashPipeline

    if confidence_threshold is not None:
        ConfidenceCut(confidence_threshold)  # a bad value fails before the slow load
    with sigint_to_main_thread_only():
        pipe = DFlashPipeline.from_pretrained(model_dir, device=device, draft=not no_draft, cache_dir=cache_dir,
                                              target_runner=target_runner, prompt_lookup=prompt_lookup,
                                              precision=precision, prefix_cache=prefix_caching,
                                              wide_target=wide_target, **parse_config_options(config))
        if confidence_threshold is not None:
            pipe.confidence_threshold = float(confidence_threshold)
        pipe.warm_up(block_size=block_size)
    return pipe


def parse_bytes(text, flag: str = "--kv-cache-memory-bytes", allow_zero: bool = False) -> int:
    """'1073741824', '512M', '4G' or '4GiB' as bytes (K, M, G, T: powers of 1024, as vLLM reads them)."""
    import re

    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]?)(?:i?B)?\s*", str(text), re.IGNORECASE)
    if m is None or float(m.group(1)) < 0 or (float(m.group(1)) == 0 and not allow_zero):
        raise ValueError(f"{flag} must be a size such as 4G or 536870912{' (or 0)' if allow_zero else ''}, got {text!r}")
    return int(float(m.group(1)) * 1024 ** " KMGT".index(m.group(2).upper() or " "))


def build_server_app(pipe, served_model_names, block_size=None, draft=None, max_num_seqs=1, max_queue=128,
                     max_model_len=None, api_key=None, max_request_bytes=None, kv_cache_memory_bytes=None,
                     max_num_batched_tokens=None, prefill_batch_tokens=DEFAULT_PREFILL_BATCH_TOKENS,
                     prefix_cache_memory_bytes=None):
    """The FastAPI app over `pipe`: scheduler, engine, metrics and endpoints wired together.
    max_num_seqs 1: one request at a time (SequentialBackend); more: continuous batching
    (BatchedBackend over the paged runner's block pool, with prefix caching as `pipe.prefix_cache`).
    A pool smaller than one full-context sequence lowers the context limit to what it holds (an
    explicit max_model_len beyond it is an error), so every request the server takes fits the pool."""
    from .app import DEFAULT_MAX_REQUEST_BYTES, build_app
    from .backends import BatchedBackend, SequentialBackend
    from .engine import AsyncEngine
    from .metrics import ServerMetrics

    if max_num_seqs is None:  # batch where the runner can
        from ..ov.paged import OVPagedTarget

        max_num_seqs = DEFAULT_MAX_NUM_SEQS if isinstance(pipe.target, OVPagedTarget) else 1
    if isinstance(max_num_seqs, bool) or not isinstance(max_num_seqs, int) or max_num_seqs < 1:
        raise ValueError(f"--max-num-seqs must be an integer >= 1, got {max_num_seqs!r}")
    if max_queue < 0:
        raise ValueError(f"--max-queue must be >= 0, got {max_queue}")
    context = pipe.target.max_length
    if max_model_len is not None and not 2 <= max_model_len <= context:
        raise ValueError(f"--max-model-len must be in 2..{context} (the model's context), got {max_model_len}")
    pool_text = None
    if max_num_seqs == 1:
        scheduler = SequentialBackend(pipe, block_size, draft)
    else:
        from ..ov.block_pool import default_idle_cached
        from ..ov.paged_batch import (
            block_tokens_of,
            blocks_for_bytes,
            cache_inputs_of,
            default_pool_blocks,
            describe_pool,
            paged_compiled,
            pool_bytes_per_block,
        )

        compiled = paged_compiled(pipe.target)  # another runner: a clear error
        caching = bool(pipe.prefix_cache)
        pool_blocks = (blocks_for_bytes(compiled, parse_bytes(kv_cache_memory_bytes), caching)
                       if kv_cache_memory_bytes is not None else default_pool_blocks(compiled, context, caching))
        pool_text = describe_pool(compiled, pool_blocks, caching)
        pool_tokens = pool_blocks * block_tokens_of(cache_inputs_of(compiled))
        if max_model_len is not None and max_model_len > pool_tokens:
            raise ValueError(f"--kv-cache-memory-bytes {kv_cache_memory_bytes or '(default)'} holds {pool_tokens} tokens of KV cache, "
                             f"fewer than --max-model-len {max_model_len}: raise the one or lower the other")
        if pool_tokens < context:
            max_model_len = max_model_len or pool_tokens
        scheduler = BatchedBackend(pipe, block_size, draft, max_num_seqs, pool_blocks, max_num_batched_tokens,
                                   prefill_batch_tokens)
        pool = scheduler.batch.scheduler.target.pool
        pool.max_idle_cached = (default_idle_cached(pool_blocks) if prefix_cache_memory_bytes is None else
                                parse_bytes(prefix_cache_memory_bytes, "--prefix-cache-memory-bytes", allow_zero=True)
                                // pool_bytes_per_block(compiled, caching))
        if caching:
            pool_text += f"; finished requests' prefixes keep at most {pool.max_idle_cached} more blocks"
    metrics = ServerMetrics(served_model_names[0], bool(pipe.prefix_cache))
    if max_num_seqs > 1:
        metrics.watch_pool(scheduler.batch.pool_usage)
    engine = AsyncEngine(scheduler, max_num_seqs, max_queue, metrics, max_model_len or context)
    app = build_app(engine, served_model_names, api_key,
                    max_request_bytes if max_request_bytes is not None else DEFAULT_MAX_REQUEST_BYTES)
    app.state.kv_pool = pool_text  # for the start-up line: tokens, bytes and precision of the pool
    return app

