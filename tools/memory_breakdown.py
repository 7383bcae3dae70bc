"""Where a serving process's resident memory goes, and what grows with traffic (docs/SERVING.md, Memory).

Two measurements, each configuration in a fresh process so none inherits another's pages:
- `--load`: VmRSS after importing the runtime, then after loading the target alone, with the drafter,
  and with the f32-weight copy of the target (`wide_target`), each warmed up as `ovdflash serve` does.
- `--grow`: the batch engine of the server (BatchGeneration, 4 requests at a time) under varied
  requests (5-125 word prompts, 8-63 tokens, temperature 0 / 0.5 / 1.0, fresh seeds), printing VmRSS,
  the anonymous part, the Python heap (tracemalloc) and the pool's blocks every `--every` requests.
  `-c KEY=VALUE` compile options (e.g. `-c CPU_RUNTIME_CACHE_CAPACITY=5000`, the plugin's own default),
  `--pool-blocks`, and `--trim` (glibc malloc_trim after every request) change one factor at a time.

Usage: python tools/memory_breakdown.py --load [MODEL_DIR]
       python tools/memory_breakdown.py --grow [MODEL_DIR] [--requests 400] [--pool-blocks N] [-c K=V] [--trim]
A measurement, not a test.
"""
from __future__ import annotations

import argparse
import json
import random
import subprocess
import sys
import time
import tracemalloc

WORDS = "the a cat dog code function python return value list string reverse sort number compute explain why how".split()


def status_mb(field: str) -> float:
    for line in open("/proc/self/status"):
        if line.startswith(field + ":"):
            return int(line.split()[1]) / 1024
    return 0.0


def load_child(model_dir, draft: bool, wide: bool) -> dict:
    import ovdflash.pipeline  # noqa: F401  (the runtime's imports, openvino included)
    from ovdflash import DFlashPipeline

    imported = status_mb("VmRSS")
    pipe = DFlashPipeline.from_pretrained(model_dir, draft=draft, wide_target=wide)
    pipe.warm_up()
    return {"draft": draft, "wide_target": wide, "rss_mb_imported": round(imported),
            "rss_mb_loaded": round(status_mb("VmRSS")), "wide_in_use": pipe.target.wide_request is not None}


def grow(args) -> None:
    from ovdflash import DFlashPipeline
    from ovdflash.batch_generation import BatchGeneration
    from ovdflash.decode.sampling import SamplingParams
    from ovdflash.ov.memory import release_free_heap

    config = dict(item.split("=", 1) for item in args.config)
    tracemalloc.start()
    pipe = DFlashPipeline.from_pretrained(args.model_dir, **config)
    pipe.warm_up()
    print(json.dumps({"requests": 0, "rss_mb": round(status_mb("VmRSS")), "config": config}), flush=True)
    batch = BatchGeneration(pipe, 8, args.pool_blocks)
    rng = random.Random(0)
    added = done = 0
    t0 = time.time()
    while done < args.requests:
        while batch.num_running + batch.num_waiting < 4 and added < args.requests:
            words = " ".join(rng.choice(WORDS) for _ in range(rng.randint(5, 125)))
            temperature = rng.choice((0.0, 0.5, 1.0))
            batch.add(added, pipe.encode_prompt([{"role": "user", "content": words}]), rng.randint(8, 63),
                      SamplingParams(temperature=temperature, seed=rng.randrange(1 << 30)), block_size="auto")
            added += 1
        for out in batch.step():
            if not out.finished:
                continue
            done += 1
            if args.trim:
                release_free_heap()
            if done % args.every == 0:
                usage = batch.pool_usage()
                print(json.dumps({"requests": done, "rss_mb": round(status_mb("VmRSS")),
                                  "anon_mb": round(status_mb("RssAnon")),
                                  "python_heap_mb": round(tracemalloc.get_traced_memory()[0] / 2 ** 20, 1),
                                  "pool": usage, "s": round(time.time() - t0)}), flush=True)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model_dir", nargs="?", default=None)
    ap.add_argument("--load", action="store_true")
    ap.add_argument("--grow", action="store_true")
    ap.add_argument("--requests", type=int, default=400)
    ap.add_argument("--every", type=int, default=50)
    ap.add_argument("--pool-blocks", type=int, default=None)
    ap.add_argument("-c", "--config", action="append", default=[], metavar="KEY=VALUE")
    ap.add_argument("--trim", action="store_true")
    ap.add_argument("--child", nargs=2, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        print(json.dumps(load_child(args.model_dir, args.child[0] == "1", args.child[1] == "1")))
        return 0
    if args.grow:
        grow(args)
        return 0
    for draft, wide in ((False, False), (True, False), (True, True)):
        cmd = [sys.executable, __file__, *([args.model_dir] if args.model_dir else []), "--child",
               str(int(draft)), str(int(wide))]
        out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout.strip().splitlines()[-1]
        print(out, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
