"""Training-data storage (crash-safe resume, packed at rest), the shipped prompt pools' train/eval
split, and the shipped data sets: packed, readable whole, each answering the pool it is named after."""
import json
from pathlib import Path

import numpy as np
import pytest

from ovdflash_export.training.data import (ShardWriter, _work_list, data_summary, load_sequences, pack_data_dir, read_index,
                                  read_tokens)
from ovdflash_export.training.prompt_files import DOMAINS, load_prompts, write_prompts

ROOT = Path(__file__).resolve().parents[1]
PROMPTS = ROOT / "models" / "prompts"              # the eval sets, shipped with the runtime
POOLS = ROOT / "models" / "data" / "prompts"        # the train prompt pools
DATA = ROOT / "models" / "data" / "smollm2"         # SmolLM2's replies, one directory per pool


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


def test_a_closed_writer_leaves_only_packed_files_that_read_and_resume_the_same(tmp_path):
    with ShardWriter(tmp_path) as w:
        w.append([5, 6, 7, 8, 9], 2, "code", "greedy", "a", 0, True)
        w.append([1, 2, 3, 60000], 1, "chat", "sample", "b", 1, False)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["index.jsonl.xz", "tokens.bin.xz"]
    assert read_tokens(tmp_path).tolist() == [5, 6, 7, 8, 9, 1, 2, 3, 60000]
    assert [s.prompt_id for s in load_sequences(tmp_path)] == ["a", "b"]
    w2 = ShardWriter(tmp_path)   # unpacks, then appends to the plain files
    assert w2.done == {("a", "greedy", 0), ("b", "sample", 1)}
    w2.append([4, 4, 4], 1, "math", "greedy", "c", 0, True)
    # killed before close: the plain files extend the packed ones, and readers take them
    assert (tmp_path / "tokens.bin").is_file()
    assert [s.tokens.tolist() for s in load_sequences(tmp_path)][-1] == [4, 4, 4]
    w3 = ShardWriter(tmp_path)
    w3.append([7, 7, 7], 1, "code", "greedy", "d", 0, True)
    w3.close()
    assert not (tmp_path / "tokens.bin").exists() and not (tmp_path / "index.jsonl").exists()
    assert [s.prompt_id for s in load_sequences(tmp_path)] == ["a", "b", "c", "d"]
    assert data_summary(tmp_path)["response_tokens"] == 3 + 3 + 2 + 2


def test_packing_drops_orphan_tokens_and_refuses_copies_that_disagree(tmp_path):
    w = ShardWriter(tmp_path)
    w.append([1, 2, 3], 1, "code", "greedy", "a", 0, True)
    with open(tmp_path / "tokens.bin", "ab") as f:   # a sequence whose index row never got written
        f.write(np.array([9, 9], dtype=np.uint16).tobytes())
    pack_data_dir(tmp_path)
    assert read_tokens(tmp_path).tolist() == [1, 2, 3]
    (tmp_path / "index.jsonl").write_text(json.dumps({"offset": 0, "prompt_len": 1, "total_len": 2}) + "\n")
    with pytest.raises(ValueError, match="disagree"):
        read_index(tmp_path)


def test_prompt_files_read_the_same_plain_or_packed(tmp_path):
    rows = [{"id": "x", "domain": "chat", "source": "s", "turns": ["héllo"]}]
    write_prompts(tmp_path / "train_chat.jsonl", rows)
    assert load_prompts(tmp_path / "train_chat.jsonl") == rows
    write_prompts(tmp_path / "train_chat.jsonl", rows + rows, pack=True)   # replaces the plain file
    assert [p.name for p in tmp_path.iterdir()] == ["train_chat.jsonl.xz"]
    assert load_prompts(tmp_path / "train_chat.jsonl") == rows + rows
    with pytest.raises(FileNotFoundError, match="train_code.jsonl"):
        load_prompts(tmp_path / "train_code.jsonl")


def _pool_ids(pool: Path, split: str = "train") -> set[str]:
    return {r["id"] for d in ("code", "math", "chat") for r in load_prompts(pool / f"{split}_{d}.jsonl")}


def test_every_shipped_data_set_is_packed_reads_whole_and_answers_its_pool():
    dirs = sorted(p for p in DATA.iterdir() if p.is_dir())
    pools = sorted(p.name for p in POOLS.iterdir() if p.is_dir())
    # every pool has been answered, and every data set but the eval replies and the foreign text answers a pool
    assert sorted({d.name for d in dirs} - {"eval", "stdlib_text"}) == pools
    for d in dirs:
        assert sorted(p.name for p in d.iterdir()) == ["index.jsonl.xz", "meta.json", "tokens.bin.xz"], d
        rows, tokens = read_index(d), read_tokens(d)
        assert rows and max(r["offset"] + r["total_len"] for r in rows) == tokens.size, d
        asked = {r["prompt_id"] for r in rows}
        if d.name == "stdlib_text":
            assert {r["mode"] for r in rows} == {"text"}
        elif d.name == "eval":
            assert asked == _pool_ids(PROMPTS, "eval")
        else:
            assert asked <= _pool_ids(POOLS / d.name), d


def test_work_list_skips_done_and_interleaves_domains():
    prompts = [{"id": f"{d}{i}", "domain": d} for d in ("code", "math", "chat") for i in range(2)]
    work = _work_list(prompts, [("greedy", 0), ("sample", 1)], {("code0", "greedy", 0)})
    assert [(p["id"], m) for p, m, _ in work[:5]] == [
        ("math0", "greedy"), ("chat0", "greedy"), ("code1", "greedy"), ("math1", "greedy"), ("chat1", "greedy")]
    assert len(work) == 11


def _rows(name):
    """A file of the first-turn pool: its eval sets ship with the runtime, its train pool with the data."""
    return load_prompts((PROMPTS if name.startswith("eval_") else POOLS / "turn1") / name)


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

    from ovdflash_export.training.data import chat_prompt_ids, generate_dataset_torch
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
    rows = {r["offset"]: r for r in read_index(out)}
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
    n_before = read_tokens(out).size
    generate_dataset_torch(target, prompts, out, max_new_tokens=10, batch=5, sample_reps=1, device="cpu",
                           log=lambda s: None)
    assert read_tokens(out).size == n_before
    # one domain only (--domains chat): a second sampled pass adds chat rows and nothing else
    generate_dataset_torch(target, prompts, out, max_new_tokens=10, batch=5, sample_reps=2, device="cpu",
                           domains=("chat",), log=lambda s: None)
    new = [r for r in read_index(out) if r["rep"] == 2]
    assert len(new) == 4 and {r["domain"] for r in new} == {"chat"}
    with pytest.raises(ValueError, match="domains"):
        generate_dataset_torch(target, prompts, out, device="cpu", domains=("poetry",), log=lambda s: None)


def _tiny_tokenizer(tmp_path):
    """(tiny target directory, its HF tokenizer, the <|im_end|> id)."""
    from transformers import AutoTokenizer

    from ovdflash_export.tiny import make_tiny_target

    target = make_tiny_target("llama", tmp_path / "t", vocab_size=512, num_hidden_layers=1)
    tok = AutoTokenizer.from_pretrained(str(target))
    return target, tok, tok.convert_tokens_to_ids("<|im_end|>")


def test_chat_prompt_ids_carry_the_earlier_exchange(tmp_path):
    import pytest

    from ovdflash_export.training.data import chat_prompt_ids

    _, tok, _ = _tiny_tokenizer(tmp_path)
    first = chat_prompt_ids(tok, ["add two numbers", "now in C"])
    assert first == chat_prompt_ids(tok, ["add two numbers"])  # no reply: the first turn only
    follow = tok.decode(chat_prompt_ids(tok, ["add two numbers", "now in C"], ["def add(a, b): return a + b"]))
    assert follow.index("add two numbers") < follow.index("def add(a, b)") < follow.index("now in C")
    assert follow.count("<|im_start|>assistant") == 2 and follow.endswith("<|im_start|>assistant\n")
    with pytest.raises(ValueError, match="user turn after its 1 replies"):
        chat_prompt_ids(tok, ["q"], ["a"])


def _one_train_prompt_per_domain(tmp_path):
    """A tiny tokenizer, a prompt pool with one train prompt per domain, an empty data directory
    and the token ids of one reply."""
    target, tok, eos = _tiny_tokenizer(tmp_path)
    prompts = tmp_path / "prompts"
    prompts.mkdir()
    for d in ("code", "math", "chat"):
        (prompts / f"train_{d}.jsonl").write_text(json.dumps({"id": f"{d}0", "domain": d, "source": "s",
                                                               "turns": [f"{d} question"]}) + "\n")
    return target, tok, eos, prompts, ShardWriter(tmp_path / "data"), tok("the answer", add_special_tokens=False)["input_ids"]


def test_followup_pool_takes_whole_replies_to_train_prompts_only(tmp_path):
    from ovdflash_export.training.prompts import FOLLOW_UPS, build_followup_pool

    target, tok, eos, prompts, w, reply = _one_train_prompt_per_domain(tmp_path)
    w.append([1, 2] + reply + [eos], 2, "code", "greedy", "code0", 0, True)        # kept
    w.append([1, 2] + reply + [eos], 2, "code", "sample", "code0", 1, True)        # kept: another reply
    w.append([1, 2] + reply, 2, "math", "greedy", "math0", 0, False)               # cut off: dropped
    w.append([1, 2] + reply * 40 + [eos], 2, "chat", "greedy", "chat0", 0, True)   # too long: dropped
    w.append([1, 2] + reply + [eos], 2, "chat", "greedy", "chat-eval-0", 0, True)  # not a train prompt
    counts = build_followup_pool(tmp_path / "data", prompts, target, tmp_path / "fu", max_reply_tokens=20)
    assert counts == {"train_code.jsonl": 2, "train_math.jsonl": 0, "train_chat.jsonl": 0}
    rows = load_prompts(tmp_path / "fu" / "train_code.jsonl")
    assert len({r["id"] for r in rows}) == 2
    for r in rows:
        assert r["turns"][0] == "code question" and r["turns"][1] in FOLLOW_UPS["code"]
        assert r["replies"] == [tok.decode(reply).strip()] and r["source"] == "followup-s"


def test_a_variant_followup_pool_asks_each_conversation_a_new_request(tmp_path):
    from ovdflash_export.training.prompts import FOLLOW_UPS, build_followup_pool, root_prompt_id

    target, tok, eos, prompts, w, reply = _one_train_prompt_per_domain(tmp_path)
    other = tok("another answer", add_special_tokens=False)["input_ids"]
    w.append([1, 2] + reply + [eos], 2, "code", "greedy", "code0", 0, True)
    w.append([1, 2] + other + [eos], 2, "code", "sample", "code0", 1, True)
    pools, asked = [], {}
    # each pool avoids every earlier one: the code list's requests run out after len(FOLLOW_UPS["code"]) pools
    for variant in range(len(FOLLOW_UPS["code"]) + 1):
        out = tmp_path / f"fu{variant}"
        counts = build_followup_pool(tmp_path / "data", prompts, target, out, variant=variant,
                                     avoid_pools=tuple(pools), seed=variant)
        rows = load_prompts(out / "train_code.jsonl")
        if variant == len(FOLLOW_UPS["code"]):
            assert counts["train_code.jsonl"] == 0
            break
        assert len(rows) == 2, variant
        for r in rows:
            assert r["id"].startswith(f"fu{variant or ''}-code0-") and root_prompt_id(r["id"]) == "code0"
            key = tuple(r["replies"])  # the conversation: same first turn, two different replies
            assert r["turns"][1] not in asked.setdefault(key, set())
            asked[key].add(r["turns"][1])
        pools.append(out)
    assert all(v == set(FOLLOW_UPS["code"]) for v in asked.values())


def test_a_followup_of_a_followup_keeps_the_whole_conversation(tmp_path):
    from ovdflash_export.training.prompts import build_followup_pool

    target, tok, eos = _tiny_tokenizer(tmp_path)
    pool = tmp_path / "fu"
    pool.mkdir()
    second = {"id": "fu-q0", "domain": "chat", "source": "followup-s", "turns": ["q", "Can you make that shorter?"],
              "replies": ["a long answer"]}
    for d in ("code", "math", "chat"):
        (pool / f"train_{d}.jsonl").write_text(json.dumps(second) + "\n" if d == "chat" else "")
    w = ShardWriter(tmp_path / "data")
    reply = tok("short", add_special_tokens=False)["input_ids"]
    w.append([1] * 30 + reply + [eos], 30, "chat", "greedy", "fu-q0", 0, True)
    w.append([1] * 30 + reply + [eos], 30, "chat", "sample", "fu-q0", 1, True)
    counts = build_followup_pool(tmp_path / "data", pool, target, tmp_path / "fu3", max_conversation_tokens=40)
    assert counts["train_chat.jsonl"] == 2
    for r in load_prompts(tmp_path / "fu3" / "train_chat.jsonl"):
        assert r["turns"][:2] == second["turns"] and r["turns"][2] != second["turns"][1]
        assert r["replies"] == ["a long answer", tok.decode(reply).strip()] and r["source"] == "followup-s"
    # a conversation longer than the cap is skipped: its next prompt would be cut
    assert build_followup_pool(tmp_path / "data", pool, target, tmp_path / "fu3b",
                               max_conversation_tokens=30)["train_chat.jsonl"] == 0


def test_shipped_followup_pools_hold_no_eval_prompt():
    for name, turns in (("turn2", 2), ("turn2_asked_again", 2), ("turn3", 3), ("turn4", 4),
                        ("turn3_asked_again", 3)):
        for d in ("code", "math", "chat"):
            rows = load_prompts(POOLS / name / f"train_{d}.jsonl")
            train_firsts = {r["turns"][0] for r in _rows(f"train_{d}.jsonl")}
            assert len(rows) >= 200
            assert {r["turns"][0] for r in rows} <= train_firsts
            assert not {r["turns"][0] for r in rows} & {r["turns"][0] for r in _rows(f"eval_{d}.jsonl")}
            assert all(len(r["turns"]) == turns and len(r["replies"]) == turns - 1 and all(r["replies"])
                       for r in rows)


def test_stdlib_code_prompts_take_public_documented_functions(tmp_path):
    from ovdflash_export.training.prompts import stdlib_code_prompts
    (tmp_path / "tests").mkdir()
    (tmp_path / "tests" / "t.py").write_text('def test_it(x):\n    """A test helper that nobody should see here."""\n')
    (tmp_path / "_private.py").write_text('def hidden(x):\n    """A function in a private module is left out too."""\n')
    (tmp_path / "mod.py").write_text(
        'def add(a: int, b: int = 1) -> int:\n    """Return the sum of a and b, as integers.\n\n    More text."""\n'
        'def _inner(x):\n    """A private function that is left out."""\n'
        'def short(x):\n    """Too short."""\n'
        'def doc(x):\n    """>>> doc(1) gives one back, a doctest summary."""\n'
        'class Box:\n    def put(self, item):\n        """Put an item into the box and return it."""\n'
        'class _Hidden:\n    def put(self, item):\n        """Put an item into the box and return it."""\n')
    rows = stdlib_code_prompts(tmp_path)
    assert [r["id"] for r in rows] == ["stdlib-mod-add-0", "stdlib-mod-Box.put-1"]
    assert rows[0]["turns"] == ['Complete the following Python function.\n```python\n'
                                'def add(a: int, b: int=1) -> int:\n    """Return the sum of a and b, as integers.\n'
                                '    """\n```']
    assert "class Box:\n    def put(self, item):\n" in rows[1]["turns"][0]
    assert all(r["domain"] == "code" and r["source"] == "stdlib-doc" for r in rows)


def test_wide_pool_avoids_eval_prompts_and_rebuilds_identically(tmp_path):
    from ovdflash_export.training.prompts import build_wide_pool, wide_chat_prompts
    import random
    first = wide_chat_prompts(random.Random(7))[0]["turns"][0]
    evals = tmp_path / "prompts"
    evals.mkdir()
    for d in DOMAINS:
        (evals / f"eval_{d}.jsonl").write_text(
            json.dumps({"id": "e", "domain": d, "source": "s", "turns": [first if d == "chat" else "x"]}) + "\n")
    (tmp_path / "lib").mkdir()
    (tmp_path / "lib" / "m.py").write_text('def f(x):\n    """Return x doubled, for any number x."""\n')
    counts = build_wide_pool(tmp_path / "a", evals, seed=7, stdlib_dir=tmp_path / "lib")
    build_wide_pool(tmp_path / "b", evals, seed=7, stdlib_dir=tmp_path / "lib")
    for d in DOMAINS:
        assert load_prompts(tmp_path / "a" / f"train_{d}.jsonl") == load_prompts(tmp_path / "b" / f"train_{d}.jsonl")
    chat = load_prompts(tmp_path / "a" / "train_chat.jsonl")
    assert first not in {r["turns"][0] for r in chat} and len(chat) == counts["train_chat.jsonl"] > 400
    assert len({r["id"] for r in chat}) == len(chat)
    assert counts["train_code.jsonl"] == 1 and counts["train_math.jsonl"] == 0


def test_shipped_wide_pool_holds_no_eval_prompt():
    for d in ("code", "chat"):
        rows = load_prompts(POOLS / "turn1_stdlib_code_wide_chat" / f"train_{d}.jsonl")
        assert len(rows) >= 500 and len({r["id"] for r in rows}) == len(rows)
        assert not {r["turns"][0] for r in rows} & {r["turns"][0] for r in _rows(f"eval_{d}.jsonl")}
        assert not {r["turns"][0] for r in rows} & {r["turns"][0] for r in _rows(f"train_{d}.jsonl")}


def test_chat2_pool_avoids_eval_and_earlier_first_turns_and_rebuilds_identically(tmp_path):
    from ovdflash_export.training.prompts import build_chat2_pool, chat2_prompts
    import random
    candidates = [r["turns"][0] for r in chat2_prompts(random.Random(7))]
    evals, earlier = tmp_path / "prompts", tmp_path / "earlier"
    evals.mkdir()
    earlier.mkdir()
    for d in DOMAINS:
        (evals / f"eval_{d}.jsonl").write_text(
            json.dumps({"id": "e", "domain": d, "source": "s", "turns": [candidates[0] if d == "chat" else "x"]}) + "\n")
    write_prompts(earlier / "train_chat.jsonl", [{"id": "p", "domain": "chat", "source": "s", "turns": [candidates[1]]}],
                  pack=True)
    counts = build_chat2_pool(tmp_path / "a", evals, [earlier], seed=7)
    build_chat2_pool(tmp_path / "b", evals, [earlier], seed=7)
    chat = load_prompts(tmp_path / "a" / "train_chat.jsonl")
    assert chat == load_prompts(tmp_path / "b" / "train_chat.jsonl")
    firsts = {r["turns"][0] for r in chat}
    assert candidates[0] not in firsts and candidates[1] not in firsts
    assert len(chat) == counts["train_chat.jsonl"] == len(set(candidates)) - 2
    assert len({r["id"] for r in chat}) == len(chat)
    assert counts["train_code.jsonl"] == counts["train_math.jsonl"] == 0


def test_shipped_chat2_pool_asks_nothing_asked_before():
    rows = load_prompts(POOLS / "turn1_chat_more_topics" / "train_chat.jsonl")
    assert len(rows) >= 1000 and len({r["id"] for r in rows}) == len(rows)
    firsts = {r["turns"][0] for r in rows}
    assert len(firsts) == len(rows)
    for pool in ("turn1", "turn1_stdlib_code_wide_chat"):
        assert not firsts & {r["turns"][0] for r in load_prompts(POOLS / pool / "train_chat.jsonl")}
    assert not firsts & {r["turns"][0] for d in ("code", "math", "chat") for r in _rows(f"eval_{d}.jsonl")}


def test_shipped_wide_followup_pool_asks_second_turns_of_wide_prompts_only():
    for d in ("code", "chat"):
        wide = POOLS / "turn1_stdlib_code_wide_chat" / f"train_{d}.jsonl"
        firsts = {r["turns"][0] for r in load_prompts(wide)}
        rows = load_prompts(POOLS / "turn2_stdlib_code_wide_chat" / f"train_{d}.jsonl")
        assert len(rows) >= 200 and len({r["id"] for r in rows}) == len(rows)
        assert {r["turns"][0] for r in rows} <= firsts
        assert not {r["turns"][0] for r in rows} & {r["turns"][0] for r in _rows(f"eval_{d}.jsonl")}
        assert all(len(r["turns"]) == 2 and len(r["replies"]) == 1 and r["replies"][0] for r in rows)
