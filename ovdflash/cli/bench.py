"""`ovdflash bench [MODEL_DIR]`: the click command, its progress display and its outputs.

Contract: runs `measure.run_benchmark` with the options below, then writes `OUT/bench.json`
(the summary, `settings` with the drafter's kind, `host` = `ovdflash.ov.host.collect()`, `memory`
with `--memory`) and `OUT/bench.png`, and prints the tables to stdout. Progress goes to stderr: a
bar on a terminal, else one line per finished run (`run_progress`), so a long bench is never silent.
With `--concurrency`, `concurrency.concurrency_command` runs instead (`OUT/bench_concurrency.*`;
default modes and block size its own unless --modes / --block-sizes are given).
"""
from __future__ import annotations

import contextlib
import json
import os
import sys
import time
from pathlib import Path

import click

from .. import TARGET_RUNNERS
from ..bench.measure import Run, measure_memory, run_benchmark
from ..bench.prompts import PROMPT_SETS
from ..bench.report import plot, render_tables
from ..pipeline import default_model_dir


def parse_block_sizes(text: str) -> list[int | str]:
    """'4,8,auto' -> [4, 8, 'auto']."""
    try:
        return [x.strip() if x.strip() == "auto" else int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise click.BadParameter(f"expected comma-separated integers or 'auto', got {text!r}")


def describe_run(run: Run) -> str:
    """One finished run: set, prompt, mode, tokens, tok/s, CPU cores other processes used."""
    return (f"{run.prompt_set} #{run.prompt_index} {run.mode}: {run.num_tokens} tokens, "
            f"{run.tokens_per_s:.1f} tok/s, busy {run.foreign_cores:.1f}")


@contextlib.contextmanager
def run_progress(console):
    """Yields `progress(done, total, run)` for run_benchmark: a rich bar when `console` is a
    terminal, else one line per finished run (logs, pipes, CI)."""
    if not console.is_terminal:
        yield lambda done, total, run: console.print(f"run {done}/{total}: {describe_run(run)}", markup=False,
                                                     highlight=False, soft_wrap=True)
        return
    from rich.progress import (
        BarColumn,
        MofNCompleteColumn,
        Progress,
        TextColumn,
        TimeElapsedColumn,
        TimeRemainingColumn,
    )

    with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                  TimeRemainingColumn(), console=console, transient=True) as bar:
        task = bar.add_task("bench: compiling and warming up", total=None)
        yield lambda done, total, run: bar.update(task, completed=done, total=total,
                                                  description=describe_run(run))


@click.command()
@click.argument("model_dir", required=False, type=click.Path(path_type=Path))
@click.option("--prompt-sets", default="code,math,chat", show_default=True, help="comma-separated: code, math, chat")
@click.option("-n", "--num-prompts", default=8, show_default=True, help="prompts per set")
@click.option("--max-new-tokens", default=128, show_default=True)
@click.option("--modes", default="dflash,ar,genai-ar,genai-dflash", show_default=True,
              help="comma-separated from dflash (with n-gram lookup, the pipeline's default), dflash-nopl "
                   "(the drafter alone), ar, genai-ar, genai-dflash, genai-pl, oracle (a perfect "
                   "drafter at the real drafter's cost: the runtime's ceiling)")
@click.option("--block-sizes", default="8", show_default=True,
              help="comma-separated block sizes to sweep; 'auto' = the automatic block size")
@click.option("--repetitions", default=3, show_default=True)
@click.option("--warmup", default=1, show_default=True)
@click.option("--out", "out_dir", default="bench_out", show_default=True, type=click.Path(path_type=Path))
@click.option("--memory/--no-memory", default=True, show_default=True, help="measure drafter memory overhead")
@click.option("--config", "config_json", default="{}", help="extra OpenVINO compile properties as JSON")
@click.option("--target-runner", type=click.Choice(TARGET_RUNNERS), default=None,
              help="how our modes run the target's attention: paged (openvino's paged attention, the default) "
                   "or stateful (the exported IR's KV states); default: the model directory's choice")
@click.option("--concurrency", default=None,
              help="comma-separated numbers of concurrent requests, e.g. 1,2,4,8: benchmark batched DFlash "
                   "(modes batch-dflash, batch-ar, genai-cb, seq-dflash, and batch-oracle when named; block size default: "
                   "the manifest's) "
                   "and write bench_concurrency.json instead")
@click.option("--wide-target/--no-wide-target", default=None,
              help="our modes: the f32-weight copy of an fp16 target for wide calls (default: where memory allows)")
def bench(model_dir, prompt_sets, num_prompts, max_new_tokens, modes, block_sizes, repetitions, warmup,
          out_dir, memory, config_json, target_runner, concurrency, wide_target):
    """Benchmark DFlash against autoregressive baselines (greedy, interleaved runs, medians)."""
    from rich.console import Console

    from ..ov.host import collect

    console = Console(width=None if sys.stdout.isatty() else 160)  # no wrapped columns in logs
    status = Console(stderr=True)
    model_dir = model_dir or default_model_dir()
    sets = [s for s in prompt_sets.split(",") if s]
    for s in sets:
        if s not in PROMPT_SETS:
            raise click.BadParameter(f"unknown prompt set {s!r}; choose from {', '.join(PROMPT_SETS)}")
    if "math" in sets:
        console.print("note: GSM8K is not on PyPI; `math` is a GSM8K-style set written for this project")
    try:
        config = json.loads(config_json)
    except json.JSONDecodeError as exc:
        raise click.BadParameter(f"--config is not JSON: {exc}")
    if not status.is_terminal:
        status.print(f"bench: compiling the modes of {model_dir} and warming up", markup=False, highlight=False,
                     soft_wrap=True)
    if concurrency is not None:
        from ..bench.concurrency import DEFAULT_CONCURRENCY_MODES, concurrency_command, parse_concurrency

        given = click.get_current_context().get_parameter_source
        with run_progress(status) as progress:
            concurrency_command(model_dir, parse_concurrency(concurrency), sets, num_prompts, max_new_tokens,
                                list(DEFAULT_CONCURRENCY_MODES) if given("modes").name == "DEFAULT"
                                else [m for m in modes.split(",") if m],
                                None if given("block_sizes").name == "DEFAULT" else parse_block_sizes(block_sizes),
                                repetitions, warmup, out_dir, config, target_runner, console, progress, wide_target)
        return
    with run_progress(status) as progress:
        result = run_benchmark(model_dir, sets, num_prompts, max_new_tokens, [m for m in modes.split(",") if m],
                               parse_block_sizes(block_sizes), repetitions, warmup, config,
                               progress=progress, target_runner=target_runner, wide_target=wide_target)
    result["settings"] = dict(model_dir=str(model_dir), prompt_sets=sets, num_prompts=num_prompts,
                              max_new_tokens=max_new_tokens, block_sizes=parse_block_sizes(block_sizes),
                              repetitions=repetitions, warmup=warmup, config=config,
                              target_runner=result.pop("target_runner"), drafter_kind=result.pop("drafter_kind"),
                              wide_target=wide_target,
                              machine=f"{os.cpu_count()} CPUs", date=time.strftime("%Y-%m-%d %H:%M:%S"))
    result["host"] = collect()
    if memory:
        status.print("bench: measuring resident memory in fresh processes", markup=False, highlight=False)
        result["memory"] = measure_memory(model_dir, config, target_runner, wide_target)
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "bench.json").write_text(json.dumps(result, indent=1))
    plot(result, out_dir / "bench.png")
    render_tables(result, console)
    if memory and result["memory"].get("drafter_overhead") is not None:
        m = result["memory"]
        console.print(f"resident memory: target only {m['target_only_mb']:.0f} MB, with drafter "
                      f"{m['with_drafter_mb']:.0f} MB (+{m['drafter_overhead']:.0%})")
    console.print(f"wrote {out_dir / 'bench.json'} and {out_dir / 'bench.png'}")
