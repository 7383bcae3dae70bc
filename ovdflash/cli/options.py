"""Click options that several commands share.

Contract: `WIDE_TARGET_OPTION`, the `--wide-target/--no-wide-target` flag of chat and serve
(ov.paged.OVPagedTarget's f32-weight copy; None: where memory allows); `CONFIDENCE_THRESHOLD_OPTION`,
their `--confidence-threshold` (the pipeline's `confidence_threshold`); `compile_options`, the
`--device`, `--cache-dir` and `--config` options of chat and serve (what OpenVINO compiles with).
"""
from __future__ import annotations

from pathlib import Path

import click

# `--wide-target` of chat and serve (ov.paged.OVPagedTarget's f32-weight copy)
WIDE_TARGET_OPTION = click.option(
    "--wide-target/--no-wide-target", default=None,
    help="A second copy of an fp16-weight target with f32 weights for calls of many tokens (wide verifies, "
         "batches, prefills): faster, at twice the target's weight size in memory. Default: when that fits a "
         "quarter of the available memory.")

# `--confidence-threshold` of chat and serve (DFlashPipeline.confidence_threshold)
CONFIDENCE_THRESHOLD_OPTION = click.option(
    "--confidence-threshold", type=click.FloatRange(0.0, 1.0), default=None,
    help="Drafters with a confidence head (DSpark): verify only the drafts whose predicted chance of being "
         "reached stays at or above this, with a fixed block size or batching ('auto' weighs the confidences "
         "itself). Default: 0.2.")


def compile_options(command):
    """`--device`, `--cache-dir` and `-c/--config KEY=VALUE` on a command (chat, serve)."""
    for option in reversed((
            click.option("--device", "-d", default="CPU", show_default=True, help="OpenVINO device."),
            click.option("--cache-dir", type=click.Path(path_type=Path), default=None,
                         help="OpenVINO CACHE_DIR (default ~/.cache/ovdflash/ov_cache)."),
            click.option("--config", "-c", multiple=True, metavar="KEY=VALUE",
                         help="OpenVINO compile property, e.g. -c INFERENCE_PRECISION_HINT=f32 (repeatable)."))):
        command = option(command)
    return command
