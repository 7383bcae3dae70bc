"""Prompt files: how a prompt pool is stored, and the domains it is split by.

Contract: a pool is a directory of `<split>_<d>.jsonl` files, split `train` or `eval`, one per
domain d in `DOMAINS`, one prompt a line: `{"id": str, "domain": d, "source": str, "turns": [user
message, ...]}` (a follow-up prompt adds `replies`: the earlier answers). `write_prompts(path,
rows, pack)` writes one, plain or xz-packed (`path` + ".xz"); `prompt_file(path)` is whichever form
exists; `load_prompts(path)` reads either. Both the pool builders (`prompts`) and the data
generator (`data`) use this module, which imports nothing of the package.
"""
from __future__ import annotations

import json
import lzma
from pathlib import Path

DOMAINS = ("code", "math", "chat")


def write_prompts(path, rows: list[dict], pack: bool = False) -> int:
    """One JSON object a line (the shape load_prompts reads); returns the row count. pack=True
    writes `path` + ".xz" instead (how the train pools are kept: follow-up pools carry whole
    replies, and xz shrinks them ~9x), and either way the other form of `path` is removed."""
    path = Path(path)
    text = "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows)
    written, other = (Path(str(path) + ".xz"), path) if pack else (path, Path(str(path) + ".xz"))
    with (lzma.open(written, "wt", encoding="utf-8") if pack else open(written, "w", encoding="utf-8")) as f:
        f.write(text)
    other.unlink(missing_ok=True)
    return len(rows)


def prompt_file(path) -> Path | None:
    """`path`, or its packed form `path`.xz, whichever exists (None if neither)."""
    for candidate in (Path(path), Path(str(path) + ".xz")):
        if candidate.is_file():
            return candidate
    return None


def load_prompts(path) -> list[dict]:
    found = prompt_file(path)
    if found is None:
        raise FileNotFoundError(f"no prompt file {path} (nor {Path(path).name}.xz)")
    with (lzma.open(found, "rt", encoding="utf-8") if found.suffix == ".xz" else open(found, encoding="utf-8")) as f:
        return [json.loads(l) for l in f if l.strip()]
