"""`ovdflash verify MODEL_DIR`: check a model directory's IR files against the checksums export recorded.

Exit codes: 0 all files match; 1 a file is missing or differs (each named on stderr); 2 the directory
is not a valid model directory or records no checksums (exported before they were recorded).
"""
from __future__ import annotations

import sys
import time
from pathlib import Path

import click


@click.command(name="verify")
@click.argument("model_dir", type=click.Path(exists=True, file_okay=False, path_type=Path))
def verify(model_dir: Path):
    """Check MODEL_DIR's IR files against the sha256 checksums in its manifest."""
    from ..manifest import load_manifest, verify_files

    try:
        manifest = load_manifest(model_dir)
    except (ValueError, FileNotFoundError) as exc:
        click.echo(f"Error: {exc}", err=True)
        sys.exit(2)
    start = time.perf_counter()
    bad = verify_files(model_dir, manifest)
    if bad is None:
        click.echo(f"Error: {model_dir / 'manifest.json'} records no checksums; re-export to record them", err=True)
        sys.exit(2)
    for name in bad:
        click.echo(f"{model_dir / name}: missing or damaged (sha256 differs from the manifest's)", err=True)
    if bad:
        sys.exit(1)
    click.echo(f"{model_dir}: {len(manifest['files'])} files match ({time.perf_counter() - start:.2f} s)")
