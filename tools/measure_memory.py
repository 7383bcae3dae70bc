"""Resident memory of a loaded pipeline over its IR weight bytes, per target runner and precision.

Usage: python tools/measure_memory.py MODEL_DIR [--runners paged,stateful] [--precisions f32,bf16]
       [--tokens 64] [--json OUT]

Each configuration loads in a fresh process (so one cannot inherit another's pages) and reports
VmRSS after `from_pretrained`, after one greedy generation of `--tokens` tokens, and VmHWM (the
peak), against the bytes of target/ and drafter/ openvino_model.bin. A precision the CPU does not
offer is skipped. The ratio the runtime aims at is resident <= 1.3 x IR weights + the KV cache in use.
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

CHILD = r"""
import json, sys
def status():
    fields = dict(line.split(":", 1) for line in open("/proc/self/status"))
    return {k: int(fields[k].split()[0]) / 1024 for k in ("VmRSS", "VmHWM", "RssAnon", "RssFile")}
from ovdflash import DFlashPipeline
model_dir, runner, precision, tokens, draft = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4]), sys.argv[5] == "1"
before = status()["VmRSS"]
pipe = DFlashPipeline.from_pretrained(model_dir, target_runner=runner, precision=precision, draft=draft)
loaded = status()["VmRSS"]
prompt = pipe.encode_prompt([{"role": "user", "content": "Write a Python function that reverses a string."}])
pipe.generate(prompt, max_new_tokens=tokens)
after = status()
kv = 0
caches = getattr(pipe.target, "caches", None)
if caches:
    kv = sum(t.byte_size for t in caches.values()) / 2**20
print(json.dumps({"start_mb": before, "loaded_mb": loaded, "after_mb": after["VmRSS"], "peak_mb": after["VmHWM"],
                  "anon_mb": after["RssAnon"], "file_mb": after["RssFile"],
                  "kv_alloc_mb": kv, "numerics": pipe.numerics.describe()}))
"""


def measure(model_dir: Path, runner: str, precision: str, tokens: int, draft: bool) -> dict:
    proc = subprocess.run([sys.executable, "-c", CHILD, str(model_dir), runner, precision, str(tokens),
                           "1" if draft else "0"], capture_output=True, text=True)
    if proc.returncode != 0:
        return {"error": (proc.stderr.strip().splitlines() or ["failed"])[-1][:200]}
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model_dir", type=Path)
    ap.add_argument("--runners", default="paged,stateful")
    ap.add_argument("--precisions", default="f32,bf16")
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()
    from ovdflash.ov.precision import host_precisions

    offered = host_precisions()
    weights = {part: (args.model_dir / part / "openvino_model.bin").stat().st_size / 2**20 for part in ("target", "drafter")}
    rows = []
    print(f"IR weights: target {weights['target']:.0f} MB, drafter {weights['drafter']:.0f} MB")
    print("| runner | precision | drafter | loaded MB | after MB (anon + file) | peak MB | KV alloc MB | after / IR weights |")
    print("|---|---|---|---|---|---|---|---|")
    for runner in args.runners.split(","):
        for precision in args.precisions.split(","):
            if precision not in offered:
                print(f"| {runner} | {precision} | - | not offered by this CPU |")
                continue
            for draft in (False, True):
                r = measure(args.model_dir, runner, precision, args.tokens, draft)
                ir = weights["target"] + (weights["drafter"] if draft else 0)
                r.update(runner=runner, precision=precision, drafter=draft, ir_mb=ir)
                rows.append(r)
                if "error" in r:
                    print(f"| {runner} | {precision} | {draft} | error: {r['error']} |")
                    continue
                print(f"| {runner} | {precision} | {'yes' if draft else 'no'} | {r['loaded_mb']:.0f} | {r['after_mb']:.0f} ({r['anon_mb']:.0f} + {r['file_mb']:.0f}) "
                      f"| {r['peak_mb']:.0f} | {r['kv_alloc_mb']:.0f} | {r['after_mb'] / ir:.2f} |", flush=True)
    if args.json:
        args.json.write_text(json.dumps({"weights_mb": weights, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
