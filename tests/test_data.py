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


def test_torch_generator_matches_unbatched_greedy_and_resumes(tmp_path):
    """The CUDA-machine backend on CPU: left-padded batches give each prompt exactly its own
    unbatched greedy continuation; a second run finds everything done; sampled rows are stored too."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from ovdflash_export.data import chat_prompt_ids, generate_dataset_torch
    from ovdflash_export.tiny import make_tiny_target

    target = make_tiny_target("llama", tmp_path / "target", vocab_size=512, num_hidden_layers=2)
    prompts = tmp_path / "prompts"
    prompts.mkdir()
    words = ["add two numbers", "sort a list please", "hi", "what is seven times eight, exactly?"]
    for d in ("code", "math", "chat"):
        with open(prompts / f"train_{d}.jsonl", "w") as f:
            for i, w in enumerate(words):
                f.write(json.dumps({"id": f"{d}{i}", "domain": d, "turns": [f"{d}: {w}"]}) + "\n")
    out = tmp_path / "data"
    generate_dataset_torch(target, prompts, out, max_new_tokens=10, batch=5, sample_reps=1, device="cpu",
                           log=lambda s: None)
    seqs = load_sequences(out, min_response=1)
    assert len(seqs) == 24 and {s.mode for s in seqs} == {"greedy", "sample"}
    tok = AutoTokenizer.from_pretrained(str(target))
    model = AutoModelForCausalLM.from_pretrained(str(target), dtype=torch.float32).eval()
    eos = tok.convert_tokens_to_ids("<|im_end|>")
    rows = {json.loads(l)["offset"]: json.loads(l) for l in open(out / "index.jsonl")}
    for s in seqs:
        if s.mode != "greedy":
            continue
        turn = next(json.loads(l)["turns"] for l in open(prompts / f"train_{s.domain}.jsonl")
                    if json.loads(l)["id"] == s.prompt_id)
        ids = chat_prompt_ids(tok, turn)
        assert s.tokens[: s.prompt_len].tolist() == ids
        with torch.no_grad():
            want = model.generate(torch.tensor([ids]), max_new_tokens=10, do_sample=False, eos_token_id=eos,
                                  pad_token_id=eos)[0, len(ids):].tolist()
        if eos in want:
            want = want[: want.index(eos) + 1]
        assert s.tokens[s.prompt_len:].tolist() == want, s.prompt_id
        assert rows[s.offset]["finished"] == (want[-1] == eos)
    n_before = (out / "tokens.bin").stat().st_size
    generate_dataset_torch(target, prompts, out, max_new_tokens=10, batch=5, sample_reps=1, device="cpu",
                           log=lambda s: None)
    assert (out / "tokens.bin").stat().st_size == n_before
