"""`ovdflash env`: print this host's CPU, ISA, versions and a model's compile precisions (ov.host), or JSON with --json."""
from __future__ import annotations

import json
from pathlib import Path

import click

from ..manifest import TARGET_RUNNERS
from ..ov.host import built_default_model_dir, collect, render
from ..ov.precision import PRECISIONS


@click.command()
@click.option("--model", "model_dir", type=click.Path(exists=True, file_okay=False, path_type=Path), default=None,
              help="Model directory to report compile precisions for (default: the embedded model if built).")
@click.option("--precision", type=click.Choice(PRECISIONS), default=None,
              help="The precision a run would ask for (default: the manifest's, else f32).")
@click.option("--target-runner", type=click.Choice(TARGET_RUNNERS), default=None,
              help="The target runner a run would use (default: the model directory's choice).")
@click.option("--json", "as_json", is_flag=True, help="Print JSON.")
def env(model_dir, precision, target_runner, as_json):
    """Print the host's CPU, ISA, cores, memory and versions, and a model's compile precisions."""
    model_dir = model_dir or built_default_model_dir()
    try:
        facts = collect(model_dir, precision, target_runner)
    except (OSError, ValueError) as exc:  # a bad model directory or manifest: one line
        raise click.ClickException(str(exc)) from None
    if model_dir is None:
        facts["model"] = None if as_json else "none (the embedded model is not exported yet; give --model DIR)"
    click.echo(json.dumps(facts, indent=1) if as_json else render(facts))

