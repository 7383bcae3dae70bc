"""The paged target's f32-weight copy for wide calls: which targets get one, and its IR on disk.

Contract:
- Why: with f16 weights under f32 inference, the CPU plugin decompresses every weight again in
  each call of more than a few rows, so a 5-row call costs about two 4-row ones; compiled from
  f32 weights, the same target computes many rows at once for a little more than a narrow call.
  `paged.OVPagedTarget` runs calls of `wide_from` tokens or more on the copy (docs/DESIGN.md).
- `wanted(target_bin, choice)`: choice True/False decides; None (auto) builds the copy when its
  f32 weights (twice the f16 file) take at most `AUTO_MEMORY_SHARE` of the memory available now.
- `f32_weights_ir(target_xml, cache_dir)` -> the path of an IR equal to target_xml with every
  f16 weight stored as f32 (`graphs.with_f32_weights`). It is written once per target file
  (keyed by the files' size and mtime) under cache_dir/wide, by a child process, so the converting
  process's memory never joins the caller's; the caller maps it like any IR, and its pages can be
  released after the first calls (ovdflash.ov.memory). cache_dir None: a directory removed at exit.
  Writing a copy removes the copies of earlier versions of the same target file (a re-export) and
  those whose target file is gone, so the cache holds one copy per existing target path.
- `cached_wide_from(wide_xml, host)` -> (found, wide_from) and `store_wide_from(wide_xml, host, wide_from)`:
  the calibration's result (an int, or None for "the copy never pays") per host key, in
  `calibration.json` beside the copy's IR, so a later load on the same host, threads and openvino skips
  the calibration (and the narrow target's wide-size kernels it leaves resident). A missing or
  unreadable entry is not found; writes replace the file whole. Delete it to measure again.
- `python -m ovdflash.ov.wide_target SRC_XML DST_XML` is that child.
"""
from __future__ import annotations

import atexit
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from .memory import available_memory_bytes

AUTO_MEMORY_SHARE = 0.25
SOURCE_FILE = "source.txt"  # beside a copy: the target file it was written from


def wanted(target_bin: Path, choice: bool | None = None) -> bool:
    if choice is not None:
        return bool(choice)
    available = available_memory_bytes()
    return available is not None and 2 * target_bin.stat().st_size <= AUTO_MEMORY_SHARE * available


def f32_weights_ir(target_xml: Path, cache_dir: str | Path | None = None) -> Path:
    target_xml = Path(target_xml)
    stamp = hashlib.sha256()
    for path in (target_xml, target_xml.with_suffix(".bin")):
        st = path.stat()
        stamp.update(f"{path.resolve()}:{st.st_size}:{st.st_mtime_ns};".encode())
    if cache_dir:
        root = Path(cache_dir) / "wide"
    else:
        root = Path(tempfile.mkdtemp(prefix="ovdflash-wide-"))
        atexit.register(shutil.rmtree, root, ignore_errors=True)
    out = root / stamp.hexdigest()[:24] / "openvino_model.xml"
    if out.is_file() and out.with_suffix(".bin").is_file():
        return out
    root.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix=".writing-", dir=root))
    source = str(target_xml.resolve())
    try:
        done = subprocess.run([sys.executable, "-m", "ovdflash.ov.wide_target", str(target_xml), str(work / out.name)],
                              capture_output=True, text=True)
        if done.returncode != 0:
            last = (done.stderr.strip().splitlines() or ["no output"])[-1]
            raise RuntimeError(f"{target_xml}: writing its f32-weight copy failed ({last[:200]})")
        (work / SOURCE_FILE).write_text(source)
        try:
            os.replace(work, out.parent)
        except OSError:  # another process wrote it first: use that one
            if not out.is_file():
                raise
    finally:
        shutil.rmtree(work, ignore_errors=True)
    for other in root.iterdir():  # copies of earlier versions of the same file, or of deleted files, are stale
        other_source = _source_of(other)
        if other != out.parent and other_source is not None and (other_source == source
                                                                 or not Path(other_source).is_file()):
            shutil.rmtree(other, ignore_errors=True)
    return out


def _source_of(copy_dir: Path) -> str | None:
    try:
        return (copy_dir / SOURCE_FILE).read_text()
    except OSError:
        return None


def _calibration_file(wide_xml: Path) -> Path:
    return Path(wide_xml).parent / "calibration.json"


def _read_calibrations(wide_xml: Path) -> dict:
    try:
        entries = json.loads(_calibration_file(wide_xml).read_text())
    except (OSError, ValueError):
        return {}
    return entries if isinstance(entries, dict) else {}


def cached_wide_from(wide_xml: Path, host: str) -> tuple[bool, int | None]:
    entries = _read_calibrations(wide_xml)
    if host not in entries:
        return False, None
    value = entries[host]
    if value is None or (isinstance(value, int) and not isinstance(value, bool) and value >= 1):
        return True, value
    return False, None


def store_wide_from(wide_xml: Path, host: str, wide_from: int | None) -> None:
    entries = {**_read_calibrations(wide_xml), host: wide_from}
    path, tmp = _calibration_file(wide_xml), None
    try:
        fd, tmp = tempfile.mkstemp(prefix=".calibration-", dir=path.parent)
        with os.fdopen(fd, "w") as f:
            json.dump(entries, f, indent=1, sort_keys=True)
        os.replace(tmp, path)
    except OSError:  # a read-only cache: the next load measures again
        if tmp is not None:
            Path(tmp).unlink(missing_ok=True)


def _write(source_xml: str, out_xml: str) -> None:
    import openvino as ov

    from .graphs import with_f32_weights

    model, _ = with_f32_weights(ov.Core().read_model(source_xml))
    ov.save_model(model, out_xml, compress_to_fp16=False)


if __name__ == "__main__":
    _write(sys.argv[1], sys.argv[2])
