"""Teacher-forced drafter data: existing text wrapped as chat answers, stored as token ids.

Contract:
- `build_text_dataset(tokenizer_dir, out_dir, code_tokens, prose_tokens, seed)` writes the same
  data-directory format as `ovdflash_export.training.data` (tokens.bin + index.jsonl, `mode="text"`), so
  `ovdflash train` reads it like generated data. Each sequence is a chat-templated user turn
  followed by an "assistant answer" that is a chunk of existing text: Python source (domain
  `code`) or long docstrings (domain `chat`), both from the Python standard library of the
  interpreter that runs it (present on every machine, nothing downloaded).
- The text is only context. Its labels are never the text itself: `ovdflash train` relabels every
  position with the frozen target's own greedy prediction and keeps a slot's label only while the
  text agrees with the target's greedy chain up to that slot (`relabel`, see train.py). So a text
  token costs one target prefill (~1,000 tok/s on 2 cores) instead of one generated token
  (~100 tok/s), and still yields exact greedy-continuation labels for the drafter's first slots.
- Deterministic for a given stdlib and seed; resumable like the generator (prompt ids are the
  source file and chunk number).
Run: `python -m ovdflash_export.training.textdata --tokenizer DIR --out models/data/smollm2/stdlib_text`.
"""
from __future__ import annotations

import ast
import json
import random
import sys
import sysconfig
from pathlib import Path

from .data import ShardWriter, chat_prompt_ids, data_summary, read_index

CODE_ASKS = ("Show me the Python source of a module like `{name}`.",
             "Write Python code in the style of the standard library module `{name}`.",
             "Give me an example Python implementation from `{name}`.")
PROSE_ASKS = ("Explain what `{name}` does.", "Describe `{name}` in plain English.",
              "What is `{name}` for?")
SKIP_DIRS = {"test", "tests", "idle_test", "site-packages", "lib2to3", "turtledemo", "__pycache__", "ensurepip"}


def stdlib_files(root: Path | None = None) -> list[Path]:
    root = Path(root or sysconfig.get_paths()["stdlib"])
    files = [p for p in root.rglob("*.py") if not (set(p.relative_to(root).parts[:-1]) & SKIP_DIRS)]
    return sorted(files)


def docstrings(source: str, min_chars: int = 300) -> list[tuple[str, str]]:
    """(qualified name, docstring) for module/class/function docstrings of at least min_chars."""
    try:
        tree = ast.parse(source)
    except (SyntaxError, ValueError):
        return []
    out = []
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            doc = ast.get_docstring(node)
            if doc and len(doc) >= min_chars:
                out.append((getattr(node, "name", "module"), doc))
    return out


def _chunks(ids: list[int], size: int) -> list[list[int]]:
    return [ids[i:i + size] for i in range(0, len(ids), size) if len(ids[i:i + size]) >= 32]


def build_text_dataset(tokenizer_dir, out_dir, code_tokens: int = 800_000, prose_tokens: int = 300_000,
                       chunk_tokens: int = 448, seed: int = 0, stdlib_root=None, log=print) -> dict:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(tokenizer_dir))
    end = tok.convert_tokens_to_ids("<|im_end|>")
    writer = ShardWriter(out_dir)
    with writer:  # closing packs the directory, also when a run is stopped (ovdflash_export.training.data docstring)
        rng = random.Random(seed)
        files = stdlib_files(stdlib_root)
        rng.shuffle(files)
        budget = {"code": code_tokens, "chat": prose_tokens}
        made = {"code": 0, "chat": 0}
        for r in read_index(out_dir):  # count what a resumed run already holds
            made[r["domain"]] += r["total_len"] - r["prompt_len"]
        for path in files:
            if all(made[d] >= budget[d] for d in budget):
                break
            try:
                source = path.read_text(encoding="utf-8")
            except (UnicodeDecodeError, OSError):
                continue
            name = path.stem if path.stem != "__init__" else path.parent.name
            items = []
            if made["code"] < budget["code"]:
                body = tok(source, add_special_tokens=False)["input_ids"]
                for j, chunk in enumerate(_chunks(body, chunk_tokens)[:6]):  # at most 6 chunks per file
                    items.append(("code", f"{name}:{j}", rng.choice(CODE_ASKS).format(name=name),
                                  tok("```python\n", add_special_tokens=False)["input_ids"] + chunk))
            if made["chat"] < budget["chat"]:
                for j, (qual, doc) in enumerate(docstrings(source)[:8]):
                    body = tok(doc, add_special_tokens=False)["input_ids"][:chunk_tokens]
                    items.append(("chat", f"{name}.{qual}:{j}", rng.choice(PROSE_ASKS).format(name=f"{name}.{qual}"),
                                  body + [end]))
            for domain, pid, ask, answer in items:
                if made[domain] >= budget[domain] or (f"stdlib:{pid}", "text", 0) in writer.done:
                    continue
                prompt = chat_prompt_ids(tok, [ask])
                writer.append(prompt + answer, len(prompt), domain, "text", f"stdlib:{pid}", 0,
                              finished=answer[-1] == end)
                made[domain] += len(answer)
    summary = data_summary(out_dir)
    (Path(out_dir) / "meta.json").write_text(json.dumps({
        "generator": "ovdflash_export.training.textdata", "source": f"Python {sys.version.split()[0]} standard library",
        "chunk_tokens": chunk_tokens, "seed": seed, "labels": "relabelled by the target at training time",
        "summary": summary}, indent=1))
    log(f"text data: {summary}")
    return summary


if __name__ == "__main__":
    import argparse

    from . import SMOLLM2_DATA

    ap = argparse.ArgumentParser(description="Build teacher-forced drafter data from the Python stdlib.")
    ap.add_argument("--tokenizer", required=True, help="HF directory with the target's tokenizer")
    ap.add_argument("--out", default=f"{SMOLLM2_DATA}/stdlib_text")
    ap.add_argument("--code-tokens", type=int, default=800_000)
    ap.add_argument("--prose-tokens", type=int, default=300_000)
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args()
    print(json.dumps(build_text_dataset(a.tokenizer, a.out, a.code_tokens, a.prose_tokens, seed=a.seed), indent=1))
