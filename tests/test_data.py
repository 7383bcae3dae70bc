"""Training-data storage (crash-safe resume) and the shipped prompt pool's train/eval split."""
import json
from pathlib import Path

import numpy as np

from ovdflash_export.data import ShardWriter, _work_list, data_summary, load_sequences

PROMPTS = Path(__file__).resolve().parents[1] / "models" / "prompts"


def test_shard_writer_round_trip_and_resume_after_torn_write(tmp_path):
    w = ShardWriter(tmp_path)
    w.append([5, 6, 7, 8, 9], 2, "code", "greedy", "a", 0, True)
    w.append([1, 2, 3, 60000], 1, "chat", "sample", "b", 1, False)
    # a writer killed mid-sequence: tokens written, index row not (plus a torn line)
    with open(tmp_path / "tokens.bin", "ab") as f:
        f.write(np.array([11, 12, 13], dtype=np.uint16).tobytes())
    with open(tmp_path / "index.jsonl", "a") as f:
        f.write('{"offset": 9, "prompt_len"')
    w2 = ShardWriter(tmp_path)
    assert w2.done == {("a", "greedy", 0), ("b", "sample", 1)}
    assert (tmp_path / "tokens.bin").stat().st_size == 9 * 2  # orphan tokens dropped
    w2.append([4, 4, 4], 1, "math", "greedy", "c", 0, True)
    seqs = load_sequences(tmp_path)
    assert [s.tokens.tolist() for s in seqs] == [[5, 6, 7, 8, 9], [1, 2, 3, 60000], [4, 4, 4]]
    assert [s.prompt_len for s in seqs] == [2, 1, 1]
    summary = data_summary(tmp_path)
    assert summary["sequences"] == 3 and summary["response_tokens"] == 3 + 3 + 2


def test_work_list_skips_done_and_interleaves_domains():
    prompts = [{"id": f"{d}{i}", "domain": d} for d in ("code", "math", "chat") for i in range(2)]
    work = _work_list(prompts, [("greedy", 0), ("sample", 1)], {("code0", "greedy", 0)})
    assert [(p["id"], m) for p, m, _ in work[:5]] == [
        ("math0", "greedy"), ("chat0", "greedy"), ("code1", "greedy"), ("math1", "greedy"), ("chat1", "greedy")]
    assert len(work) == 11


def _rows(name):
    return [json.loads(l) for l in open(PROMPTS / name)]


def test_eval_prompts_never_enter_training():
    for d in ("code", "math", "chat"):
        train, ev = _rows(f"train_{d}.jsonl"), _rows(f"eval_{d}.jsonl")
        assert len(ev) == 20 and len(train) >= 100
        assert all(r["domain"] == d and r["turns"] and isinstance(r["turns"][0], str) for r in train + ev)
        assert not {r["id"] for r in ev} & {r["id"] for r in train}
        assert not {r["turns"][0] for r in ev} & {r["turns"][0] for r in train}
