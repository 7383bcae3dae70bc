"""Soak `ovdflash serve`: a server process on MODEL_DIR (default: the embedded model) under N concurrent
clients (`ovdflash bench-serve`'s run_load) until the responses add up to at least R verify rounds;
prints the load report with the server's resident memory after warm-up and at the end, as JSON.

Usage: python tools/soak_serve.py [--model-dir DIR] [--clients 4] [--rounds 2000] [--max-tokens 128] [--out FILE]
A benchmark, not a test: docs/SERVING.md has the numbers of one run.
"""
from __future__ import annotations

import argparse
import json
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

from ovdflash.server.load import eval_prompts, run_load


def rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError("no VmRSS")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model-dir", default=None)
    ap.add_argument("--clients", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=2000)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    log = tempfile.NamedTemporaryFile("w", suffix=".log", delete=False)
    cmd = [sys.executable, "-m", "ovdflash.cli", "serve", *([args.model_dir] if args.model_dir else []),
           "--port", str(port), "--log-level", "warning"]
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 1800
        while True:
            if proc.poll() is not None or time.monotonic() > deadline:
                raise SystemExit(f"the server did not start; see {log.name}")
            try:
                if httpx.get(url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        prompts = eval_prompts(["code", "math", "chat"], 30)
        rss_start = rss_mb(proc.pid)
        warm = run_load(url + "/v1", prompts[:args.clients], args.clients, args.max_tokens)  # first shapes, caches
        rss_warm = rss_mb(proc.pid)
        trace = []  # (requests done, RSS MB) every 10 requests: a plateau is shape caches, a slope a leak
        report = run_load(url + "/v1", prompts, args.clients, args.max_tokens, min_rounds=args.rounds,
                          on_result=lambda r, n: n % 10 or trace.append((n, round(rss_mb(proc.pid), 1))))
        rss_end = rss_mb(proc.pid)
    finally:
        proc.send_signal(signal.SIGTERM)
        exit_code = proc.wait(120)
    report.update(rss_mb_start=rss_start, rss_mb_after_warmup=rss_warm, rss_mb_end=rss_end,
                  rss_growth_after_warmup=(rss_end - rss_warm) / rss_warm, warmup_failed=warm["failed"],
                  rss_mb_trace=trace, server_exit_code=exit_code, host_cores=len(__import__("os").sched_getaffinity(0)))
    text = json.dumps(report, indent=1)
    print(text)
    if args.out:
        args.out.write_text(text)
    return 0 if report["failed"] == 0 and exit_code == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
