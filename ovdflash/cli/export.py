"""`ovdflash export`: target LLM + DFlash drafter -> one OpenVINO model directory.

The export stage (torch, transformers, optimum-intel, nncf) is imported inside the command
only, so loading the CLI never imports torch. `--target` / `--drafter` take a local path or a
Hugging Face id (resolved by `ovdflash_export.hub` into the HF cache, offline mode honoured; the
export proper then makes no hub request). Input problems (a pair that does not fit, a
missing file) print one line ``Error: ...`` and exit with code 2, writing nothing.
"""
from __future__ import annotations

import sys
import time

import click

WEIGHT_FORMATS = ("fp32", "fp16", "int8", "int4")


@click.command(name="export")
@click.option("--target", "target", required=True, metavar="PATH|ORG/NAME[@REV][:FILE.gguf]",
              help="HF model directory (or a .gguf file) of the target LLM (llama, qwen2, qwen3; qwen3_5 and "
                   "qwen3_5_text hybrids), or its Hugging Face id.")
@click.option("--drafter", "drafter", required=True, metavar="PATH|ORG/NAME[@REV]",
              help="z-lab format DFlash drafter checkpoint directory, or its Hugging Face id.")
@click.option("--cache-dir", type=click.Path(file_okay=False), default=None,
              help="Hugging Face cache for ids (default: HF_HUB_CACHE, else HF_HOME/hub); "
                   "HF_HUB_OFFLINE=1 reads it only.")
@click.option("--out", "out", required=True, type=click.Path(file_okay=False), help="Output model directory.")
@click.option("--target-weight-format", type=click.Choice(WEIGHT_FORMATS), default="fp32", show_default=True)
@click.option("--drafter-weight-format", type=click.Choice(WEIGHT_FORMATS), default="fp32", show_default=True)
@click.option("--block-size", type=click.IntRange(min=2), default=None,
              help="Block size (default: the drafter's block_size).")
@click.option("--default-block-size", default="auto", show_default=True, metavar="N|auto",
              help="Block size the runtime uses when none is asked for (written to the manifest): "
                   "'auto' picks per round from measured costs; 1..--block-size fixes it.")
@click.option("--compile-option", "-c", "compile_options", multiple=True, metavar="KEY=VALUE",
              help="OpenVINO compile property the runtime applies to this model (written to the manifest), "
                   "e.g. -c INFERENCE_PRECISION_HINT=f32 for a model whose answers bf16 degrades (repeatable).")
def export(target, drafter, out, cache_dir, target_weight_format, drafter_weight_format, block_size,
           default_block_size, compile_options):
    """Export a target LLM and its DFlash drafter to OpenVINO IR."""
    from ..options import parse_config_options

    compile_options = parse_config_options(compile_options, "--compile-option")
    from rich.console import Console

    console = Console(stderr=True)
    try:
        from ovdflash_export.exporter import ExportError, check_default_block_size, export_pair, validate_pair
    except ImportError as exc:
        raise click.ClickException(
            f"the export stage is not installed ({exc}); install with `pip install ovdflash[export]`") from exc

    start = time.perf_counter()
    try:
        from ovdflash_export.hub import resolve_source, stay_offline

        sources = resolve_source(target, "target", cache_dir), resolve_source(drafter, "drafter", cache_dir)
        for role, source in zip(("target", "drafter"), sources):
            if source.repo_id:
                console.log(f"{role}: {source} in {source.path}")
        target, drafter = (source.path for source in sources)
        stay_offline()  # the ids are resolved: the export proper never reaches for a hub
        info = validate_pair(target, drafter, block_size)  # before any output, so a mismatch is one line
        check_default_block_size(default_block_size, block_size or info.drafter_config.block_size)
        with console.status("starting") as status:
            def step(msg):
                console.log(msg)
                status.update(msg)

            path = export_pair(target, drafter, out, target_weight_format=target_weight_format,
                               drafter_weight_format=drafter_weight_format, block_size=block_size,
                               progress=step, default_block_size=default_block_size,
                               compile_options=compile_options)
    except ExportError as exc:
        click.echo(f"Error: {exc}", err=True)
        sys.exit(2)
    console.log(f"exported to {path} in {time.perf_counter() - start:.1f} s")
