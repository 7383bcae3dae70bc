"""`ovdflash serve [MODEL_DIR]`: the click command of the OpenAI-compatible server (ovdflash.server).

Contract: loads MODEL_DIR (default: the embedded model, as `ovdflash chat`) with the same load
options as chat (`-c KEY=VALUE`, `--target-runner`, `--precision`, `--block-size`, `--no-draft`,
`--prompt-lookup`), warms it up, and serves it on `--host` (default 127.0.0.1) and `--port`
until SIGTERM or SIGINT, then exits 0 after open requests end (docs/SERVING.md). Options spelled
as vLLM's: `--api-key` (or OVDFLASH_API_KEY; without it the server is open, so a non-loopback
`--host` without a key is refused unless `--allow-open` says so), `--served-model-name`
(repeatable; default: the directory's name), `--max-num-seqs` (sequences generating at once,
default 8 with the paged target runner, 1 with the others), `--kv-cache-memory-bytes` (the batch's
KV block pool limit, cached prefix features included; default: one full-context sequence shared by
the batch, at most a quarter of the memory available; the start-up lines say how many tokens the
pool holds and in which precision), `--enable-prefix-caching/--no-enable-prefix-caching`,
`--max-queue`, `--max-model-len`, `--max-request-bytes`, `--max-num-batched-tokens` (each
batched round's token budget: chunked prefill, scheduler contract; default: whole prompts),
`--prefill-batch-tokens` (whole prompts a round prefills together; 0: all). With batching, `--block-size` defaults to
"auto". `--replicas N` serves the same app on N Ray Serve replicas (ovdflash.server.ray_app; the
`ray` extra). The wiring is `ovdflash.server.wiring`; bad options are one-line errors before the
model loads where they can be. A start-up line names the tool-call format the chat template teaches
(server.tool_calls), or says that none is known.
"""
from __future__ import annotations

import logging
from pathlib import Path

import click

from .. import TARGET_RUNNERS
from ..decode.scheduler import DEFAULT_PREFILL_BATCH_TOKENS
from ..options import parse_block_size
from ..ov.precision import PRECISIONS
from ..server.tool_calls import describe_tool_format
from ..server.wiring import build_server_app, is_loopback, load_pipeline, parse_bytes
from .options import CONFIDENCE_THRESHOLD_OPTION, WIDE_TARGET_OPTION, compile_options


@click.command()
@click.argument("model_dir", required=False, type=click.Path(exists=True, file_okay=False, path_type=Path))
@click.option("--host", default="127.0.0.1", show_default=True, help="Address to bind.")
@click.option("--port", type=click.IntRange(0, 65535), default=8000, show_default=True)
@click.option("--api-key", envvar="OVDFLASH_API_KEY", default=None,
              help="Require 'Authorization: Bearer KEY' (also OVDFLASH_API_KEY). Without it the server is open.")
@click.option("--allow-open", is_flag=True, help="Serve a non-loopback --host without an API key.")
@click.option("--served-model-name", multiple=True,
              help="Model name(s) clients send (repeatable; the first is reported). Default: MODEL_DIR's name.")
@click.option("--block-size", default=None, metavar="N|auto",
              help="Tokens per draft block, or 'auto' (batched: drafts chosen per round from the batch's cost); "
                   "default: 'auto' when batching, else the model directory's default_block_size.")
@click.option("--no-draft", is_flag=True, help="Plain autoregressive decoding on the same target.")
@click.option("--prompt-lookup/--no-prompt-lookup", default=True, show_default=True,
              help="n-gram lookup drafts beside the drafter's (output unchanged).")
@click.option("--max-num-seqs", type=click.IntRange(1), default=None,
              help="Sequences generating at once, verified in one target call per round (paged runner; "
                   "default 8, or 1 with another runner); 1: one request at a time.")
@click.option("--max-num-batched-tokens", type=click.IntRange(1), default=None,
              help="Tokens per batched round (chunked prefill): verifies first, prompts in chunks with the rest, "
                   "so a long prompt holds up neither new requests nor running ones. Default: whole prompts.")
@click.option("--prefill-batch-tokens", type=click.IntRange(0), default=DEFAULT_PREFILL_BATCH_TOKENS,
              show_default=True,
              help="Whole prompts a batched round prefills together, in tokens (the first always goes): a burst of "
                   "requests gets first tokens one round apart instead of all after every prefill. 0: all at once.")
@click.option("--kv-cache-memory-bytes", default=None, metavar="SIZE",
              help="KV block pool limit for batching, e.g. 4G (default: one full context shared by the batch, "
                   "at most a quarter of the available memory).")
@click.option("--prefix-cache-memory-bytes", default=None, metavar="SIZE",
              help="Memory the prefix cache may keep of finished requests' KV blocks beyond what running requests "
                   "hold, e.g. 256M (default: a quarter of the pool; 0: only blocks running requests needed).")
@click.option("--enable-prefix-caching/--no-enable-prefix-caching", default=True, show_default=True,
              help="Reuse the KV blocks of prompt prefixes computed before (a shared system prompt, earlier chat "
                   "turns); output unchanged.")
@click.option("--max-queue", type=int, default=128, show_default=True,
              help="Requests that may wait for the engine; beyond it: 503 with Retry-After.")
@click.option("--max-model-len", type=int, default=None,
              help="Context limit for prompt + reply (default and maximum: the model's).")
@click.option("--max-request-bytes", type=click.IntRange(1), default=4 << 20, show_default=True,
              help="Largest request body; beyond it: 413.")
@click.option("--shutdown-timeout", type=click.FloatRange(0), default=5.0, show_default=True,
              help="Seconds open requests may run on after SIGTERM/SIGINT before they end with finish_reason 'abort'.")
@compile_options
@click.option("--target-runner", type=click.Choice(TARGET_RUNNERS), default=None,
              help="How the target's attention runs (paged or stateful). Default: the model directory's choice.")
@click.option("--precision", type=click.Choice(PRECISIONS), default=None,
              help="Target numerics: f32 (the default) or bf16 (on CPUs with BF16/AMX).")
@WIDE_TARGET_OPTION
@CONFIDENCE_THRESHOLD_OPTION
@click.option("--log-level", type=click.Choice(["debug", "info", "warning", "error"]), default="info",
              show_default=True)
@click.option("--replicas", type=click.IntRange(1), default=None,
              help="Serve N replicas behind one endpoint on Ray Serve (the ray extra); default: no Ray.")
@click.option("--num-cpus-per-replica", type=click.FloatRange(0, min_open=True), default=None,
              help="Ray CPUs per replica, also its OpenVINO thread count (default: this host's CPUs / --replicas).")
@click.option("--ray-address", default=None,
              help="With --replicas: an existing Ray cluster ('auto' or HEAD:6379); "
                   "default: a local instance on loopback.")
def serve(model_dir, host, port, api_key, allow_open, served_model_name, block_size, no_draft, prompt_lookup,
          max_num_seqs, max_num_batched_tokens, prefill_batch_tokens, kv_cache_memory_bytes, prefix_cache_memory_bytes,
          enable_prefix_caching, max_queue, max_model_len, max_request_bytes,
          shutdown_timeout, device, cache_dir, config, target_runner, precision, wide_target, confidence_threshold,
          log_level, replicas, num_cpus_per_replica, ray_address):
    """Serve MODEL_DIR (default: SmolLM2-135M + shipped drafter) as an OpenAI-compatible API."""
    if not api_key and not is_loopback(host) and not allow_open:
        raise click.ClickException(f"--host {host} is reachable from other machines and there is no --api-key: "
                                   "give a key, or --allow-open to serve without one")
    if replicas is not None:  # Ray Serve: every replica loads its own pipeline (server/ray_app.py)
        from ..server.ray_app import serve_on_ray

        try:
            return serve_on_ray(model_dir, replicas, num_cpus_per_replica, ray_address, host, port, shutdown_timeout,
                                log_level, lambda line: click.echo(line, err=True),
                                served_model_names=served_model_name, block_size=parse_block_size(block_size),
                                no_draft=no_draft, prompt_lookup=prompt_lookup, device=device, cache_dir=cache_dir,
                                config=config, target_runner=target_runner, precision=precision,
                                max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
                                prefill_batch_tokens=prefill_batch_tokens or None,
                                kv_cache_memory_bytes=kv_cache_memory_bytes,
                                prefix_cache_memory_bytes=prefix_cache_memory_bytes,
                                enable_prefix_caching=enable_prefix_caching, wide_target=wide_target,
                                confidence_threshold=confidence_threshold,
                                max_queue=max_queue, max_model_len=max_model_len, api_key=api_key,
                                max_request_bytes=max_request_bytes)
        except (ImportError, ValueError, FileNotFoundError, RuntimeError) as exc:
            raise click.ClickException(str(exc)) from exc
    try:
        if kv_cache_memory_bytes is not None:
            parse_bytes(kv_cache_memory_bytes)
        if prefix_cache_memory_bytes is not None:
            parse_bytes(prefix_cache_memory_bytes, "--prefix-cache-memory-bytes", allow_zero=True)
        block_size = parse_block_size(block_size)
        from ..server.app import run_server  # fastapi/uvicorn missing: a clear error before the slow load
        pipe = load_pipeline(model_dir, device, no_draft, cache_dir, target_runner, prompt_lookup, precision,
                             config, block_size, enable_prefix_caching, wide_target, confidence_threshold)
        names = list(served_model_name) or [Path(pipe.model_dir).name]
        app = build_server_app(pipe, names, block_size, False if no_draft else None, max_num_seqs, max_queue,
                               max_model_len, api_key, max_request_bytes, kv_cache_memory_bytes,
                               max_num_batched_tokens, prefill_batch_tokens or None, prefix_cache_memory_bytes)
    except ImportError as exc:
        raise click.ClickException(f"the server needs its extra: pip install 'ovdflash[serve]' ({exc})") from exc
    except (ValueError, FileNotFoundError, RuntimeError) as exc:
        raise click.ClickException(str(exc)) from exc
    logging.basicConfig(level=log_level.upper(), format="%(levelname)s %(name)s: %(message)s")
    batched = app.state.engine.max_num_seqs > 1
    batching = f"up to {app.state.engine.max_num_seqs} sequences per round" if batched else "one request at a time"
    limit = app.state.engine.max_model_len
    pool_bound = max_model_len is None and limit < pipe.target.max_length
    click.echo(f"serving {names[0]} ({pipe.model_dir}) on http://{host}:{port}/v1, {batching}, block size "
               f"{block_size or ('auto' if batched else pipe.default_block_size)}, context {limit} tokens"
               f"{' (all the KV cache pool holds)' if pool_bound else ''}, "
               f"prefix caching {'on' if enable_prefix_caching else 'off'}, "
               f"{'API key required' if api_key else 'no API key'}", err=True)
    if app.state.kv_pool:
        click.echo(app.state.kv_pool, err=True)
    click.echo(describe_tool_format(app.state.tool_format), err=True)
    run_server(app, host, port, shutdown_timeout, log_level)

