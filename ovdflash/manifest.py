"""The exported model directory ("ovdflash/1"): its file names, its manifest, and their checks.

Contract:
- A model directory holds `manifest.json`, `target/openvino_model.xml|bin`, `drafter/openvino_model.xml|bin`
  (and optionally `drafter/draft_vocab.json`; a DSpark drafter's `drafter/dspark_heads.npz`), and the tokenizer files (docs/DESIGN.md). The names
  below are the only place these paths are spelled; the export stage writes them, the runtime reads them.
- `load_manifest(model_dir)` reads and validates `manifest.json`: the format string, the keys the
  runtime needs (`REQUIRED_KEYS`, each named in the error when missing or of the wrong type), and
  the optional ones through the `parse_*` helpers. Every problem is a `ManifestError` (a ValueError)
  whose one-line message names the file. It returns the manifest with `draft_pass`, `target_runner`
  and `default_block_size` filled in; `drafter_kind(manifest)` is its drafter's kind.
- `manifest_compile_options(manifest)`: the OpenVINO compile options the export recorded for this
  model (`ovdflash export --compile-option KEY=VALUE`), as a fresh dict; empty when none.
- `checksum_files(model_dir)` -> {relative path: sha256} of the IR files (`IR_FILES`, and `DSPARK_HEADS`
  when present), which export
  records as the manifest's `files`; `verify_files(model_dir, manifest)` -> the paths that are missing
  or differ (empty: all match; None: the manifest records no checksums).
- Nothing here imports openvino: the export stage and the CLI use it before the runtime loads.
"""
from __future__ import annotations

import hashlib
import json
from pathlib import Path

FORMAT = "ovdflash/1"
MANIFEST_FILE = "manifest.json"
TARGET_XML = "target/openvino_model.xml"
DRAFTER_XML = "drafter/openvino_model.xml"
DRAFT_VOCAB_FILE = "draft_vocab.json"  # optional, in a drafter checkpoint and in DIR/drafter/
DRAFT_VOCAB = "drafter/" + DRAFT_VOCAB_FILE
DSPARK_HEADS_FILE = "dspark_heads.npz"  # a DSpark drafter's Markov and confidence heads, beside its IR
DSPARK_HEADS = "drafter/" + DSPARK_HEADS_FILE
IR_FILES = (TARGET_XML, TARGET_XML[:-4] + ".bin", DRAFTER_XML, DRAFTER_XML[:-4] + ".bin")

# How the target's attention and KV cache run (compile.compile_runners): "paged" (openvino's
# paged-attention transformation at load time: host-held block caches, rollback by past_lens;
# cheaper target calls than the stateful IR at every verify width measured, docs/BENCHMARKS.md)
# or "stateful" (the IR as exported: KV in ReadValue/Assign states, SDPA, mask-based rollback).
# A manifest may set `target_runner`; a caller's choice wins over both. A target with linear-attention
# layers (Qwen3.5, a "hybrid" manifest key) runs on "paged" or on "hybrid" (ovdflash.ov.hybrid).
TARGET_RUNNERS = ("paged", "stateful", "hybrid")
DEFAULT_TARGET_RUNNER = "paged"


def runners_for(manifest: dict) -> tuple[str, ...]:
    """The target runners that can run this model directory's target."""
    if manifest.get("target_runner") == "hybrid" or "hybrid" in manifest:
        return ("paged", "hybrid")
    return tuple(r for r in TARGET_RUNNERS if r != "hybrid")

# How many tokens a drafter pass runs when a round verifies k drafts. "full_block": always the block
# the drafter was trained on, reading the first k drafts (a drafter trained only on full blocks drafts
# the first slots of a shorter block worse); "exact": k + 1 (a drafter trained with `--short-blocks`).
DRAFT_PASSES = ("full_block", "exact")

# The drafter's kind (`drafter.kind`; "dflash" when absent): "dflash" (DFlash 1: the head's argmax
# per slot), "dflash2" (DFlash 2: top-k candidates per slot and a selector walk, ovdflash.ov.dflash2)
# or "dspark" (DSpark: a Markov walk over the slots and a confidence head, ovdflash.ov.dspark)
DRAFTER_KINDS = ("dflash", "dflash2", "dspark")

# key -> accepted types; the runtime cannot run a directory without them
REQUIRED_KEYS = {
    "block_size": int,
    "mask_token_id": int,
    "max_position_embeddings": int,
    "target_layer_ids": list,
    "eos_token_ids": list,
}


class ManifestError(ValueError):
    """A model directory whose manifest the runtime cannot use; the message names the file."""


def parse_default_block_size(value, block_size: int) -> int | str:
    """A manifest's `default_block_size`: "auto", or an integer (or its digits) in 1..block_size."""
    if value == "auto":
        return value
    text = str(value).strip()
    if isinstance(value, bool) or not text.isdigit() or not 1 <= int(text) <= block_size:
        raise ValueError(f"default block size must be 'auto' or 1..{block_size} (the block size), got {value!r}")
    return int(text)


def parse_draft_pass(value) -> str:
    """A manifest's `draft_pass`: one of DRAFT_PASSES (see there)."""
    if value not in DRAFT_PASSES:
        raise ValueError(f"draft_pass must be one of {', '.join(DRAFT_PASSES)}, got {value!r}")
    return value


def parse_target_runner(value) -> str:
    """How the target's attention runs: one of TARGET_RUNNERS (see there)."""
    if value not in TARGET_RUNNERS:
        raise ValueError(f"target_runner must be one of {', '.join(TARGET_RUNNERS)}, got {value!r}")
    return value


def drafter_kind(manifest: dict) -> str:
    """The manifest's `drafter.kind`, one of DRAFTER_KINDS ("dflash" when absent)."""
    drafter = manifest.get("drafter")
    kind = drafter.get("kind", "dflash") if isinstance(drafter, dict) else "dflash"
    if kind not in DRAFTER_KINDS:
        raise ValueError(f"drafter kind must be one of {', '.join(DRAFTER_KINDS)}, got {kind!r}")
    return kind


def load_manifest(model_dir: str | Path) -> dict:
    """`model_dir`'s manifest, validated (see the module contract)."""
    path = Path(model_dir) / MANIFEST_FILE
    if not path.is_file():
        raise FileNotFoundError(f"{model_dir} is not an ovdflash model directory (no {MANIFEST_FILE}); "
                                "create one with `ovdflash export`")
    try:
        manifest = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ManifestError(f"{path}: not readable JSON ({exc})") from None
    if not isinstance(manifest, dict):
        raise ManifestError(f"{path}: expected a JSON object, got {type(manifest).__name__}")
    if manifest.get("format") != FORMAT:
        raise ManifestError(f"{path}: format {manifest.get('format')!r}, expected {FORMAT!r}")
    for key, kind in REQUIRED_KEYS.items():
        value = manifest.get(key)
        if value is None:
            raise ManifestError(f"{path}: the manifest lacks {key!r}; re-export the model with `ovdflash export`")
        if not isinstance(value, kind) or isinstance(value, bool):
            raise ManifestError(f"{path}: {key!r} must be {kind.__name__}, got {value!r}")
    if manifest["block_size"] < 1:
        raise ManifestError(f"{path}: 'block_size' must be >= 1, got {manifest['block_size']}")
    try:
        manifest["draft_pass"] = parse_draft_pass(manifest.get("draft_pass", "full_block"))
        manifest["target_runner"] = parse_target_runner(manifest.get("target_runner", DEFAULT_TARGET_RUNNER))
        manifest["default_block_size"] = parse_default_block_size(manifest.get("default_block_size", "auto"),
                                                                  manifest["block_size"])
        drafter_kind(manifest)
        options = manifest.get("compile_options", {})
        if not isinstance(options, dict):
            raise ValueError(f"compile_options must be an object of KEY: VALUE, got {options!r}")
    except ValueError as exc:
        raise ManifestError(f"{path}: {exc}") from None
    return manifest


def manifest_compile_options(manifest: dict) -> dict:
    """The compile options recorded at export (`compile_options`), in a fresh dict."""
    return dict(manifest.get("compile_options", {}))


def file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def checksum_files(model_dir: str | Path) -> dict[str, str]:
    names = IR_FILES + ((DSPARK_HEADS,) if (Path(model_dir) / DSPARK_HEADS).is_file() else ())
    return {name: file_sha256(Path(model_dir) / name) for name in names}


def verify_files(model_dir: str | Path, manifest: dict) -> list[str] | None:
    recorded = manifest.get("files")
    if not isinstance(recorded, dict):
        return None
    bad = []
    for name, digest in recorded.items():
        path = Path(model_dir) / name
        if not path.is_file() or file_sha256(path) != digest:
            bad.append(name)
    return bad
