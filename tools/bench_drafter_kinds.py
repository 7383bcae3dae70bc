"""Draft cost per round of each drafter kind (DFlash 1, DFlash 2, DSpark) of one backbone size, on one target.

Usage: python tools/bench_drafter_kinds.py [--source ~/.cache/ovdflash/smollm2-135m-instruct]
       [--shipped ~/.cache/ovdflash/smollm2-135m-dflash-ov] [--work ~/.cache/ovdflash/bench_drafter_kinds]
       [--kinds dflash,dflash2,dspark] [--blocks 4,8,16] [--reps 7] [--calls 10] [--full-vocab]
       [--out drafter_kinds.json]

Builds (once, cached in --work) one model directory per kind with `export_pair`: the same target (--source,
fp16 weights, as the embedded model's) and a random drafter of that kind with the shipped drafter's geometry
(--shipped: layers, target layers, mask token, int8 weights, its draft vocabulary unless --full-vocab),
trained block max(--blocks) with exact passes, so a round of B - 1 drafts runs B tokens. DFlash 2 and DSpark
settings: the --dflash2-* options, and --dspark-rank with DSpark's vanilla Markov head and a confidence head
reading it (building the DFlash 2 drafter needs z-lab's `dflash` package, a test extra). Random weights: this
measures cost, not acceptance. The numpy walks use numpy's BLAS threads as the runtime does
(OPENBLAS_NUM_THREADS=1 pins them to one: docs/BENCHMARKS.md, "Drafter kinds").

Measured in one process, every kind and block in each repetition (order rotated), medians over --reps:
- draft ms: one steady-state `OVDrafter.propose` of B - 1 drafts after a chat prompt's context, each call
  adding B new context features (every draft of the last round accepted), --calls calls per repetition
  (tools/compare_drafters.time_drafter);
- walk ms: the numpy part of that call (the proposer's `read`: DFlash 2's selector walk, DSpark's Markov
  walk and confidence head; DFlash 1's is a copy of the argmax ids) and its share of the draft ms;
- verify ms: one target forward of B tokens after the same prompt (tools/profile_round.verify_curve);
- ceiling tok/s: B / (verify ms + draft ms), the rate if every draft were accepted (host work left out).
Prints a markdown table and the load average before and after; --out writes everything as JSON.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from compare_drafters import time_drafter  # noqa: E402  (tools/, next to this file)
from profile_round import verify_curve  # noqa: E402

from ovdflash.bench import CpuMeter, encode_prompts, rotated  # noqa: E402
from ovdflash.manifest import DRAFT_VOCAB_FILE  # noqa: E402
from ovdflash.pipeline import DFlashPipeline  # noqa: E402

KINDS = ("dflash", "dflash2", "dspark")
CACHE = Path.home() / ".cache" / "ovdflash"


class TimedProposals:
    """Wraps a drafter's proposer; accumulates the wall time of its `read` (the host-side walk)."""

    def __init__(self, inner):
        self.inner, self.seconds, self.calls = inner, 0.0, 0

    def read(self, request, num_drafts):
        t0 = time.perf_counter()
        out = self.inner.read(request, num_drafts)
        self.seconds += time.perf_counter() - t0
        self.calls += 1
        return out

    def __getattr__(self, name):
        return getattr(self.inner, name)


def kind_settings(args) -> dict:
    return {"dflash": {},
            "dflash2": {"dflash2": dict(conv_kernel_size=args.dflash2_kernel, conv_group_size=args.dflash2_group,
                                        selector_rank=args.dflash2_rank, selector_top_k=args.dflash2_top_k,
                                        output_multiplier=1.0, final_logit_softcapping=None,
                                        input_embedding_scale=1.0)},
            "dspark": {"dspark": dict(markov_rank=args.dspark_rank, markov_head_type="vanilla", confidence_head=True,
                                      confidence_with_markov=True)}}


def build_pair(kind: str, args, settings: dict) -> Path:
    """The model directory of `kind` under --work, exported once for these settings."""
    from ovdflash_export.exporter import export_pair
    from ovdflash_export.tiny import make_tiny_drafter

    shipped = json.loads((args.shipped / "drafter" / "config.json").read_text())
    record = {"kind": kind, "block": max(args.blocks), "full_vocab": args.full_vocab, "source": str(args.source),
              "shipped": str(args.shipped), **settings}
    root = args.work / kind
    if (root / "pair" / "manifest.json").is_file() and (root / "settings.json").is_file() \
            and json.loads((root / "settings.json").read_text()) == record:
        return root / "pair"
    shutil.rmtree(root, ignore_errors=True)
    root.mkdir(parents=True)
    print(f"building the {kind} pair in {root}", flush=True)
    src = make_tiny_drafter(args.source, root / "drafter", num_layers=int(shipped["num_hidden_layers"]),
                            block_size=max(args.blocks), target_layer_ids=shipped["dflash_config"]["target_layer_ids"],
                            mask_token_id=shipped["dflash_config"]["mask_token_id"], seed=0, kind=kind,
                            extra={"ovdflash_short_blocks": 0.5}, **settings)  # short blocks: exact passes
    if not args.full_vocab:
        shutil.copyfile(args.shipped / "drafter" / DRAFT_VOCAB_FILE, src / DRAFT_VOCAB_FILE)
    export_pair(args.source, src, root / "pair", target_weight_format="fp16", drafter_weight_format="int8",
                default_block_size=4, compile_options={"INFERENCE_PRECISION_HINT": "f32"})
    shutil.rmtree(src)
    (root / "settings.json").write_text(json.dumps(record, indent=1))
    return root / "pair"


def med(values):
    return statistics.median(values) if values else float("nan")


def measure(pipes: dict, args) -> dict:
    first = next(iter(pipes.values()))
    prompt = encode_prompts(first, "chat", 1)[0]
    manifest = json.loads((first.model_dir / "manifest.json").read_text())
    width = len(manifest["target_layer_ids"]) * manifest["target"]["hidden_size"]
    rng = np.random.default_rng(0)
    context = rng.standard_normal((len(prompt), width)).astype(np.float32)
    new = {b: rng.standard_normal((b, width)).astype(np.float32) for b in args.blocks}
    for pipe in pipes.values():
        pipe.drafter.proposals = TimedProposals(pipe.drafter.proposals)
    draft = {(k, b): [] for k in pipes for b in args.blocks}
    walk = {(k, b): [] for k in pipes for b in args.blocks}
    verify = {b: [] for b in [1, *args.blocks]}
    meter, busy = CpuMeter(), []
    for rep in range(args.reps + 1):  # repetition 0 warms every shape up and is dropped
        started = meter.start()
        curve = verify_curve(first, prompt, 1, ks=tuple(verify))
        for kind in rotated(list(pipes), rep):
            drafter = pipes[kind].drafter
            for b in rotated(args.blocks, rep):
                drafter.proposals.seconds, drafter.proposals.calls = 0.0, 0
                ms = time_drafter(drafter, context, new[b], b - 1, args.calls)
                if rep:
                    draft[(kind, b)].append(ms)
                    walk[(kind, b)].append(1e3 * drafter.proposals.seconds / drafter.proposals.calls)
        if rep:
            for b in verify:
                verify[b].append(curve[str(b)])
            busy.append(meter.foreign_cores(started))
    rows = []
    for b in args.blocks:
        base = med(draft[("dflash", b)]) if "dflash" in pipes else float("nan")
        for kind in pipes:
            d, w, v = med(draft[(kind, b)]), med(walk[(kind, b)]), med(verify[b])
            rows.append({"kind": kind, "block": b, "draft_ms": d, "walk_ms": w, "walk_share": w / d,
                         "draft_vs_dflash": d / base, "verify_ms": v, "ceiling_tokens_per_s": 1e3 * b / (v + d)})
    return {"prompt_tokens": len(prompt), "ar_step_ms": med(verify[1]), "rows": rows, "foreign_cores": med(busy)}


def table(result: dict) -> str:
    lines = ["| block | kind | draft ms | vs DFlash 1 | numpy walk ms (share) | verify ms | ceiling tok/s |",
             "|---:|---|---:|---:|---:|---:|---:|"]
    for r in result["rows"]:
        lines.append(f"| {r['block']} | {r['kind']} | {r['draft_ms']:.2f} | {r['draft_vs_dflash']:.2f}x | "
                     f"{r['walk_ms']:.3f} ({r['walk_share']:.0%}) | {r['verify_ms']:.2f} | "
                     f"{r['ceiling_tokens_per_s']:.0f} |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--source", type=Path, default=CACHE / "smollm2-135m-instruct", help="the HF target")
    ap.add_argument("--shipped", type=Path, default=CACHE / "smollm2-135m-dflash-ov",
                    help="the model directory whose drafter geometry and draft vocabulary the drafters copy")
    ap.add_argument("--work", type=Path, default=CACHE / "bench_drafter_kinds")
    ap.add_argument("--kinds", default=",".join(KINDS))
    ap.add_argument("--blocks", default="4,8,16")
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--calls", type=int, default=10)
    ap.add_argument("--full-vocab", action="store_true", help="drafters without the shipped draft vocabulary")
    ap.add_argument("--dflash2-kernel", type=int, default=4)
    ap.add_argument("--dflash2-group", type=int, default=64)
    ap.add_argument("--dflash2-rank", type=int, default=64)
    ap.add_argument("--dflash2-top-k", type=int, default=8)
    ap.add_argument("--dspark-rank", type=int, default=64)
    ap.add_argument("--config", default="{}", help="extra compile properties (JSON)")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    args.blocks = [int(b) for b in args.blocks.split(",")]
    kinds = [k for k in args.kinds.split(",") if k]
    settings = kind_settings(args)
    dirs = {k: build_pair(k, args, settings[k]) for k in kinds}
    load_before = os.getloadavg()
    pipes = {k: DFlashPipeline.from_pretrained(d, **json.loads(args.config)) for k, d in dirs.items()}
    result = measure(pipes, args)
    load_after = os.getloadavg()
    from ovdflash.ov.host import collect

    result.update(settings={k: settings[k] for k in kinds}, blocks=args.blocks, reps=args.reps, calls=args.calls,
                  full_vocab=args.full_vocab, config=json.loads(args.config), load_average_before=load_before,
                  load_average_after=load_after, host=collect(), date=time.strftime("%Y-%m-%d %H:%M:%S"))
    print(table(result))
    print(f"prompt {result['prompt_tokens']} tokens; AR step {result['ar_step_ms']:.2f} ms; other processes "
          f"{result['foreign_cores']:.2f} cores; load average {load_before[0]:.2f} before, {load_after[0]:.2f} after")
    if args.out:
        args.out.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
