"""`ovdflash chat [MODEL_DIR]`: multi-turn chat with streamed DFlash output.

Contract: the reply streams to stdout block by block; one stats line per turn goes to stderr.
Each turn re-encodes the whole conversation; with the prefix cache (the default) it prefills only
the tokens the previous turn did not leave in the KV cache (the stats line counts the cached ones).
Commands: /reset (forget the conversation), /stats (cumulative stats), /quit (or Ctrl-D).
Ctrl-C while a reply streams stops that reply (the partial reply stays in the history) and
keeps the session. `--prompt TEXT` answers one message non-interactively and exits: 0 when
the reply is complete, 130 when Ctrl-C cut it (after printing what it had), 1 or 2 on an error.
"""
from __future__ import annotations

from pathlib import Path

import click

from .. import TARGET_RUNNERS
from ..options import parse_block_size, parse_config_options, sigint_to_main_thread_only
from ..ov.precision import PRECISIONS
from .options import CONFIDENCE_THRESHOLD_OPTION, WIDE_TARGET_OPTION, compile_options

HELP = "commands: /reset  /stats  /quit   (Ctrl-C stops a reply, Ctrl-D quits)"


@click.command()
@click.argument("model_dir", required=False, type=click.Path(exists=True, file_okay=False, path_type=Path))
@click.option("--prompt", "-p", help="Answer this one message and exit (non-interactive).")
@click.option("--system", help="System message for the conversation.")
@click.option("--temperature", "-t", type=float, default=0.0, show_default=True, help="0 = greedy.")
@click.option("--top-p", type=float, default=1.0, show_default=True)
@click.option("--top-k", type=int, default=0, show_default=True, help="0 = off.")
@click.option("--max-new-tokens", "-n", type=int, default=512, show_default=True)
@click.option("--block-size", default=None, metavar="N|auto",
              help="Tokens per draft block, or 'auto' (picked per round from measured costs and acceptance); "
                   "default: the model directory's default_block_size (the embedded default: 4).")
@click.option("--no-draft", is_flag=True, help="Plain autoregressive decoding on the same target.")
@click.option("--prompt-lookup/--no-prompt-lookup", default=True, show_default=True,
              help="Let rounds whose text so far ends with an n-gram seen earlier verify what followed it "
                   "instead of the drafter's block (output unchanged).")
@click.option("--prefix-cache/--no-prefix-cache", default=True, show_default=True,
              help="Keep the KV of the conversation so far between turns, so a turn prefills only its new "
                   "tokens (output unchanged).")
@click.option("--seed", type=int, default=None, help="Sampling seed (reproducible replies).")
@compile_options
@click.option("--target-runner", type=click.Choice(TARGET_RUNNERS), default=None,
              help="How the target's attention runs: paged (openvino's paged attention; the default) or stateful "
                   "(the exported IR's KV states). Default: the model directory's choice.")
@click.option("--precision", type=click.Choice(PRECISIONS), default=None,
              help="Target numerics: f32 (the default; greedy DFlash equals AR) or bf16 (faster verifies on CPUs "
                   "with BF16/AMX; greedy replies can part from AR at near-ties: docs/BENCHMARKS.md).")
@WIDE_TARGET_OPTION
@CONFIDENCE_THRESHOLD_OPTION
def chat(model_dir, prompt, system, temperature, top_p, top_k, max_new_tokens, block_size, no_draft, prompt_lookup,
         prefix_cache, seed, device, cache_dir, config, target_runner, precision, wide_target, confidence_threshold):
    """Chat with MODEL_DIR (default: SmolLM2-135M + shipped drafter)."""
    from ..decode.sampling import SamplingParams
    from ..pipeline import DFlashPipeline

    try:
        SamplingParams(temperature, top_p, top_k, seed)  # reject bad values before the slow load
        block_size = parse_block_size(block_size)
        with sigint_to_main_thread_only():
            pipe = DFlashPipeline.from_pretrained(model_dir, device=device, draft=not no_draft,
                                                  cache_dir=cache_dir, target_runner=target_runner,
                                                  prompt_lookup=prompt_lookup, precision=precision,
                                                  prefix_cache=prefix_cache, wide_target=wide_target,
                                                  **parse_config_options(config))
            if confidence_threshold is not None:
                pipe.confidence_threshold = confidence_threshold
            pipe.warm_up(block_size=block_size)  # with "auto" this measures its costs
    except (ValueError, FileNotFoundError, RuntimeError) as exc:
        raise click.ClickException(str(exc)) from exc
    options = dict(max_new_tokens=max_new_tokens, temperature=temperature, top_p=top_p, top_k=top_k,
                   seed=seed, block_size=block_size, draft=not no_draft)
    base = [{"role": "system", "content": system}] if system else []

    interrupted = False

    def reply(messages) -> str | None:
        nonlocal interrupted
        text = ""
        try:
            for chunk in pipe.stream(messages, **options):
                click.echo(chunk, nl=False)
                text += chunk
        except KeyboardInterrupt:
            interrupted = True
            click.echo(" [stopped]", nl=False)
        except ValueError as exc:  # e.g. the conversation no longer fits the context
            click.echo(f"error: {exc}" + ("" if prompt is not None else " (/reset starts over)"), err=True)
            return None
        click.echo()
        click.echo(f"[{pipe.last_stats.summary_line()}]", err=True)
        return text

    if prompt is not None:
        if reply(base + [{"role": "user", "content": prompt}]) is None:
            raise SystemExit(1)
        if interrupted:  # a cut reply is not a complete one: exit as shells do after Ctrl-C
            raise SystemExit(130)
        return

    click.echo(HELP, err=True)
    messages = list(base)
    while True:
        try:
            line = input(">>> ")
        except EOFError:
            click.echo()
            break
        except KeyboardInterrupt:
            click.echo()
            continue
        command = line.strip()
        if not command:
            continue
        if command in ("/quit", "/exit"):
            break
        if command == "/reset":
            messages = list(base)
            click.echo("[conversation reset]", err=True)
            continue
        if command == "/stats":
            click.echo(pipe.stats.report(), err=True)
            continue
        if command.startswith("/"):
            click.echo(f"unknown command {command!r}; {HELP}", err=True)
            continue
        answer = reply(messages + [{"role": "user", "content": line}])
        if answer is not None:
            messages += [{"role": "user", "content": line}, {"role": "assistant", "content": answer}]

