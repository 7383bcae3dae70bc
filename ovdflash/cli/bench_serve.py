"""`ovdflash bench-serve --base-url URL ...`: load-test any OpenAI-compatible endpoint (ovdflash.bench.load) and print the report as a table, or write it as JSON."""
from __future__ import annotations

import json
from pathlib import Path

import click

from ..bench.load import RequestResult, eval_prompts, format_report, run_load


@click.command("bench-serve")
@click.option("--base-url", default="http://127.0.0.1:8000/v1", show_default=True,
              help="The endpoint's OpenAI base URL (with /v1).")
@click.option("--model", default=None, help="Model name to send (default: the first of GET /models).")
@click.option("--api-key", envvar="OVDFLASH_API_KEY", default=None, help="Bearer key (also OVDFLASH_API_KEY).")
@click.option("--endpoint", type=click.Choice(["chat", "completions"]), default="chat", show_default=True)
@click.option("--prompt-set", default="code,math,chat", show_default=True,
              help="Eval prompt sets to interleave (comma-separated).")
@click.option("--num-prompts", type=click.IntRange(1), default=30, show_default=True)
@click.option("--concurrency", type=click.IntRange(1), default=1, show_default=True,
              help="Requests in flight at once (each client sends its next when one ends).")
@click.option("--max-tokens", type=click.IntRange(1), default=128, show_default=True)
@click.option("--temperature", type=float, default=0.0, show_default=True)
@click.option("--seed", type=int, default=None)
@click.option("--min-rounds", type=click.IntRange(1), default=None,
              help="Cycle the prompts until the responses' spec_decode drafts add up to this many rounds.")
@click.option("--timeout", "timeout_s", type=float, default=600.0, show_default=True, help="Seconds per request.")
@click.option("--output-json", type=click.Path(dir_okay=False, path_type=Path), default=None)
def bench_serve(base_url, model, api_key, endpoint, prompt_set, num_prompts, concurrency, max_tokens, temperature,
                seed, min_rounds, timeout_s, output_json):
    """Drive an OpenAI-compatible endpoint with the eval prompts; report throughput, TTFT and TPOT."""
    try:
        import openai  # noqa: F401
    except ImportError as exc:
        raise click.ClickException(f"bench-serve needs the openai client: pip install 'ovdflash[serve]' ({exc})")
    prompts = eval_prompts([s.strip() for s in prompt_set.split(",") if s.strip()], num_prompts)

    def progress(result: RequestResult, count: int) -> None:
        click.echo(f"[{count}] {'ok' if result.ok else 'FAILED ' + result.error}", err=True)

    try:
        report = run_load(base_url, prompts, concurrency, max_tokens, model, api_key, endpoint, temperature, seed,
                          min_rounds, timeout_s, progress)
    except Exception as exc:  # unreachable server, bad key on /models: one line
        raise click.ClickException(f"{type(exc).__name__}: {exc}") from exc
    click.echo(format_report(report))
    if output_json is not None:
        output_json.write_text(json.dumps(report, indent=1))
    if report["failed"]:
        raise SystemExit(1)

