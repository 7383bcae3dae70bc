"""Soak an OpenAI-compatible server under varied traffic and print its resident-memory curve.

Starts a server process (default `ovdflash serve` on the embedded model; `--model-dir` for another
pair; `--server-cmd` for any command line with `{port}` in it, such as llama.cpp's `llama-server`), waits
for it to answer, then sends `--requests` chat requests from `--clients` concurrent clients (the
official `openai` client). Request by request the traffic varies as a user's would: prompts of
5-125 words, `max_tokens` 8-63, temperature 0, 0.5 or 1.0 with a fresh seed, and a share of
streams the client drops after its first chunk (`--broken`). It samples the server's resident set
(VmRSS) every `--every` requests and its peak (VmHWM), and prints a JSON report: the curve, failed
requests, peak RSS, and how flat the curve is after `--settle` requests ((max - min) / min).

Usage: python tools/soak_serve.py [--model-dir DIR | --server-cmd 'CMD {port}'] [--requests 2000]
       [--clients 4] [--every 100] [--settle 300] [--broken 0.05] [--out FILE] [-- SERVE_ARGS...]
Exits 1 when any request failed (a dropped stream is not a failure) or the server did not exit cleanly.
A benchmark, not a test: docs/SERVING.md has the numbers of one run.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import shlex
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

WORDS = ("the a of to and in is it that for on with as this be are code function python value list string "
         "reverse sort number compute explain why how cache memory server request token model write test "
         "short long fast slow data file line loop error return class object array map key tree graph").split()


def proc_status_mb(pid: int, field: str) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) / 1024
    raise RuntimeError(f"no {field} for process {pid}")


def varied_request(rng: random.Random, broken_share: float) -> dict:
    """One request's settings: prompt, max_tokens, temperature, seed, and whether the client drops it."""
    words = [rng.choice(WORDS) for _ in range(rng.randint(5, 125))]
    temperature = rng.choice((0.0, 0.5, 1.0))
    return {"prompt": " ".join(words).capitalize() + "?", "max_tokens": rng.randint(8, 63),
            "temperature": temperature, "seed": rng.randrange(1 << 31), "broken": rng.random() < broken_share}


async def one_request(client, model: str, req: dict) -> str | None:
    """None when the request went as planned, else the error."""
    try:
        stream = await client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": req["prompt"]}], max_tokens=req["max_tokens"],
            temperature=req["temperature"], seed=req["seed"], stream=True)
        async for _ in stream:
            if req["broken"]:  # the client goes away mid-stream
                await stream.close()
                break
        return None
    except Exception as exc:  # counted, not raised: the soak goes on
        return f"{type(exc).__name__}: {exc}"[:200]


async def drive(base_url: str, pid: int, args) -> dict:
    import openai

    rng = random.Random(args.seed)
    plan = [varied_request(rng, args.broken) for _ in range(args.requests)]
    curve, errors, done = [], [], 0
    curve.append((0, round(proc_status_mb(pid, "VmRSS"))))
    async with openai.AsyncOpenAI(base_url=base_url, api_key=args.api_key, max_retries=0, timeout=600) as client:
        model = (await client.models.list()).data[0].id
        queue = list(reversed(plan))

        async def worker():
            nonlocal done
            while queue:
                error = await one_request(client, model, queue.pop())
                done += 1
                if error:
                    errors.append(error)
                if done % args.every == 0:
                    curve.append((done, round(proc_status_mb(pid, "VmRSS"))))
                    print(f"{done:6d} requests  RSS {curve[-1][1]:7d} MB  failed {len(errors)}", file=sys.stderr,
                          flush=True)

        t0 = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(args.clients)))
        duration = time.perf_counter() - t0
    settled = [rss for n, rss in curve if n >= args.settle]
    return {
        "requests": args.requests, "clients": args.clients, "failed": len(errors), "errors": sorted(set(errors))[:5],
        "broken_streams": sum(r["broken"] for r in plan), "duration_s": round(duration, 1),
        "rss_mb_curve": curve, "peak_rss_mb": round(proc_status_mb(pid, "VmHWM")),
        "rss_mb_after_settle": [min(settled), max(settled)] if settled else None,
        "spread_after_settle": round((max(settled) - min(settled)) / min(settled), 4) if settled else None,
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model-dir", default=None, help="the pair ovdflash serves (default: the embedded model)")
    ap.add_argument("--server-cmd", default=None, help="any server command line, with {port} where its port goes")
    ap.add_argument("--requests", type=int, default=2000)
    ap.add_argument("--clients", type=int, default=4)
    ap.add_argument("--every", type=int, default=100, help="sample RSS every N requests")
    ap.add_argument("--settle", type=int, default=300, help="the curve should be flat from this many requests on")
    ap.add_argument("--broken", type=float, default=0.05, help="share of streams the client drops after one chunk")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--api-key", default="EMPTY")
    ap.add_argument("--start-timeout", type=float, default=1800)
    ap.add_argument("--out", type=Path, default=None)
    args, serve_args = ap.parse_known_args()
    serve_args = [a for a in serve_args if a != "--"]

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    if args.server_cmd:
        cmd = shlex.split(args.server_cmd.format(port=port))
    else:
        cmd = [sys.executable, "-m", "ovdflash.cli", "serve", *([args.model_dir] if args.model_dir else []),
               "--port", str(port), "--log-level", "warning", *serve_args]
    log = tempfile.NamedTemporaryFile("w", suffix=".log", delete=False)
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + args.start_timeout
        while True:
            if proc.poll() is not None or time.monotonic() > deadline:
                raise SystemExit(f"the server did not start; see {log.name}")
            try:
                if httpx.get(url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        report = asyncio.run(drive(url + "/v1", proc.pid, args))
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            exit_code = proc.wait(120)
        except subprocess.TimeoutExpired:
            proc.kill()
            exit_code = proc.wait()
    report.update(server=" ".join(cmd[:2] + ["..."] if len(cmd) > 2 else cmd), server_args=serve_args,
                  server_exit_code=exit_code, host_cpus=len(os.sched_getaffinity(0)), server_log=log.name)
    text = json.dumps(report, indent=1)
    print(text)
    if args.out:
        args.out.write_text(text)
    return 0 if report["failed"] == 0 and exit_code == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
