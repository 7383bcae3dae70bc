"""The default model of `ovdflash chat` / `bench`: SmolLM2-135M-Instruct + the shipped drafter.

Contract: `ensure_default_model(cache_dir=None, progress=True) -> Path` returns an exported model
directory (docs/DESIGN.md layout, with manifest.json) at `<root>/smollm2-135m-dflash-ov`, where
`<root>` is as in `ovdflash_models.fetch.cache_root`. On first use it fetches SmolLM2
(`fetch_smollm2`), then exports target + `SHIPPED_DRAFTER` with
`ovdflash_export.exporter.export_pair`. Idempotent: it re-exports only when the export is missing
or was made from a different drafter checkpoint or export recipe (sha256 of the checkpoint's files
and `EXPORT_RECIPE`, kept in `STAMP_NAME`), or when its IR files no longer match the checksums its
manifest recorded (a damaged default model rebuilds itself).
Needs the export extra (torch) only when an export actually runs.
"""
from __future__ import annotations

import hashlib
import json
from pathlib import Path

from .fetch import building_dir, cache_root, fetch_smollm2

# the HF checkpoint the embedded default is exported from (`ovdflash train --target default`)
DEFAULT_TARGET_FETCH = fetch_smollm2

SHIPPED_DRAFTER = Path(__file__).resolve().parent / "smollm2_dflash"
EXPORT_DIRNAME = "smollm2-135m-dflash-ov"
STAMP_NAME = "ovdflash_default.json"
# Target fp16 weights: the CPU plugin verifies 2-4 tokens faster than with int8 weights and steps
# one as fast, for more resident memory (docs/BENCHMARKS.md, Compile settings); an fp16 target is
# compiled without the compile cache (runners.FP16_UNCACHED). The drafter stays int8: less memory,
# the same acceptance as f32.
TARGET_WEIGHT_FORMAT = "fp16"
DRAFTER_WEIGHT_FORMAT = "int8"
# The block size a call gets when it names none (the manifest's default_block_size): 4, three
# drafts a round, the widest verify that costs about one AR step on every CPU measured (a fifth
# token costs a step more: docs/BENCHMARKS.md, Verify cost). "auto" stays opt-in.
DEFAULT_BLOCK_SIZE = 4
# recorded in the manifest: bf16 compute degrades SmolLM2's answers, so it runs f32 on every CPU
COMPILE_OPTIONS = {"INFERENCE_PRECISION_HINT": "f32"}
# part of the export's fingerprint: bump it when the exported graphs change (2: GQA attention
# without the K/V broadcast), so a cached default model is exported again
EXPORT_RECIPE = (f"target={TARGET_WEIGHT_FORMAT};drafter={DRAFTER_WEIGHT_FORMAT};graphs=2;block={DEFAULT_BLOCK_SIZE};"
                 f"compile={json.dumps(COMPILE_OPTIONS, sort_keys=True)}")


def drafter_fingerprint(drafter_dir: Path | None = None) -> str:
    """sha256 over the drafter checkpoint's files (default: the shipped one) and EXPORT_RECIPE."""
    drafter_dir = SHIPPED_DRAFTER if drafter_dir is None else drafter_dir
    h = hashlib.sha256(EXPORT_RECIPE.encode())
    for name in ("config.json", "model.safetensors", "draft_vocab.json"):
        path = Path(drafter_dir) / name
        if path.is_file():  # draft_vocab.json is optional
            h.update(name.encode())
            h.update(path.read_bytes())
    return h.hexdigest()


def default_model_dir(cache_dir=None) -> Path:
    return cache_root(cache_dir) / EXPORT_DIRNAME


def _up_to_date(out: Path, fingerprint: str) -> bool:
    stamp = out / STAMP_NAME
    if not (out / "manifest.json").is_file() or not stamp.is_file():
        return False
    try:
        if json.loads(stamp.read_text()).get("drafter_sha256") != fingerprint:
            return False
        manifest = json.loads((out / "manifest.json").read_text())
    except (json.JSONDecodeError, UnicodeDecodeError):
        return False
    from ovdflash.manifest import verify_files

    return not verify_files(out, manifest)  # damaged IR files: export again (None: no checksums recorded)


def ensure_default_model(cache_dir=None, progress: bool = True) -> Path:
    """Fetch + export the default pair into the cache if needed; return the model directory."""
    if not (SHIPPED_DRAFTER / "model.safetensors").is_file():
        raise FileNotFoundError(f"the shipped drafter is missing: {SHIPPED_DRAFTER}")
    out = default_model_dir(cache_dir)
    fingerprint = drafter_fingerprint()
    if _up_to_date(out, fingerprint):
        return out
    hf_dir = fetch_smollm2(cache_dir, progress=progress)
    from rich.console import Console

    console = Console(stderr=True, quiet=not progress)
    # torch side, imported only when an export runs
    from ovdflash_export.exporter import export_pair

    with building_dir(out) as tmp, \
            console.status("exporting SmolLM2-135M-Instruct + DFlash drafter to OpenVINO") as status:
        export_pair(hf_dir, SHIPPED_DRAFTER, tmp, target_weight_format=TARGET_WEIGHT_FORMAT,
                    drafter_weight_format=DRAFTER_WEIGHT_FORMAT, default_block_size=DEFAULT_BLOCK_SIZE,
                    compile_options=COMPILE_OPTIONS,
                    progress=lambda msg: status.update(f"export: {msg}"))
        (tmp / STAMP_NAME).write_text(json.dumps({"drafter_sha256": fingerprint, "target": str(hf_dir)}, indent=1))
    console.print(f"[green]default model ready:[/green] {out}")
    return out


if __name__ == "__main__":
    print(ensure_default_model())
