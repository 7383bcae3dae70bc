"""Serve the same pair with several engines, one fresh server per leg, and load each alike.

Each leg is NAME=COMMAND: a shell command that starts an OpenAI-compatible server on PORT (written
`{port}` in the command) and keeps it in the foreground. For every repetition the legs run in turn
(interleaved), and for every concurrency level: start the server, wait for GET /v1/models, run
`ovdflash bench-serve` per prompt set, sample the resident memory of the server's whole process tree
every 0.2 s, stop it. Failed requests are counted, not fatal.
Prints a table of medians over the repetitions (tok/s, TTFT median and mean, TPOT median, peak RSS) and the greedy
agreement of every leg's replies with a reference leg's, and writes every report to --out.

    python tools/bench_peers.py --out peers.json --repetitions 2 \\
      'ours=ovdflash serve --port {port}' \\
      'ours-ar=ovdflash serve --no-draft --port {port}' \\
      'llama.cpp-ar=llama-server -m target-f16.gguf -t 2 -np 4 -c 8192 --kv-unified --port {port}'

The peers are installed by the user; docs/BENCHMARKS.md (Peers) has the commands used there.
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

HERE = Path(__file__).resolve().parent


def tree_rss_mb(pid: int) -> float:
    """Resident MB of pid and all its descendants (from /proc)."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                ppid = int(Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(entry))
    total, todo = 0.0, [pid]
    while todo:
        p = todo.pop()
        todo.extend(children.get(p, []))
        try:
            for line in Path(f"/proc/{p}/status").read_text().splitlines():
                if line.startswith("VmRSS:"):
                    total += int(line.split()[1]) / 1024
        except OSError:
            pass
    return total


class Server:
    def __init__(self, command: str, port: int, log: Path, ready_timeout_s: float):
        self.proc = subprocess.Popen(command.format(port=port), shell=True, start_new_session=True,
                                     stdout=log.open("w"), stderr=subprocess.STDOUT)
        self.base = f"http://127.0.0.1:{port}/v1"
        self.peak_mb, self._stop = 0.0, threading.Event()
        threading.Thread(target=self._sample, daemon=True).start()
        deadline = time.time() + ready_timeout_s
        while time.time() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}; see {log}")
            try:
                urllib.request.urlopen(self.base + "/models", timeout=2).read()
                return
            except OSError:
                time.sleep(1)
        self.stop()
        raise RuntimeError(f"server not ready in {ready_timeout_s:.0f} s; see {log}")

    def _sample(self):
        while not self._stop.is_set():
            self.peak_mb = max(self.peak_mb, tree_rss_mb(self.proc.pid))
            time.sleep(0.2)

    def stop(self):
        self._stop.set()
        try:
            os.killpg(self.proc.pid, signal.SIGTERM)
            self.proc.wait(30)
        except (ProcessLookupError, subprocess.TimeoutExpired):
            os.killpg(self.proc.pid, signal.SIGKILL)
        time.sleep(2)


def bench(base: str, prompt_set: str, concurrency: int, num_prompts: int, max_tokens: int, out: Path) -> dict:
    out.unlink(missing_ok=True)
    done = subprocess.run([sys.executable, "-m", "ovdflash.cli", "bench-serve", "--base-url", base, "--prompt-set",
                           prompt_set, "--num-prompts", str(num_prompts), "--concurrency", str(concurrency),
                           "--max-tokens", str(max_tokens), "--temperature", "0", "--output-json", str(out)],
                          stdout=subprocess.DEVNULL)
    if not out.exists():  # bench-serve writes its report even when some requests failed (exit 1)
        raise SystemExit(f"bench-serve against {base} wrote no report (exit {done.returncode})")
    return json.loads(out.read_text())


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("legs", nargs="+", help="NAME=COMMAND with {port}")
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--repetitions", type=int, default=2)
    ap.add_argument("--prompt-sets", default="code,math,chat")
    ap.add_argument("--concurrency", default="1,4")
    ap.add_argument("--num-prompts", type=int, default=5)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--port", type=int, default=8190)
    ap.add_argument("--reference", default=None, help="leg whose greedy replies the others are compared with "
                                                       "(default: the first)")
    ap.add_argument("--ready-timeout", type=float, default=300.0)
    args = ap.parse_args()
    legs = dict(leg.split("=", 1) for leg in args.legs)
    sets, concs = args.prompt_sets.split(","), [int(c) for c in args.concurrency.split(",")]
    work = args.out.with_suffix(".d")
    work.mkdir(parents=True, exist_ok=True)
    runs = []
    for rep in range(args.repetitions):
        for c in concs:  # a fresh server per concurrency too: no prompt cache carries over from the last level
            for name, command in legs.items():
                load = os.getloadavg()[0]
                server = Server(command, args.port, work / f"{name}.{rep}.c{c}.log", args.ready_timeout)
                ready_mb = tree_rss_mb(server.proc.pid)
                leg_runs = []
                try:
                    for s in sets:
                        report = bench(server.base, s, c, args.num_prompts, args.max_tokens, work / "last.json")
                        leg_runs.append(dict(leg=name, rep=rep, set=s, concurrency=c, load_before=load, report=report))
                        print(f"{name:<16} rep {rep} c={c} {s:<5} {report['output_throughput']:7.1f} tok/s  "
                              f"TTFT {report['ttft_ms']['median']:6.0f} ms  TPOT {report['tpot_ms']['median']:5.1f} ms"
                              f"  failed {report['failed']}",
                              flush=True)
                finally:
                    server.stop()
                for r in leg_runs:
                    r.update(ready_mb=ready_mb, peak_mb=server.peak_mb)
                runs.extend(leg_runs)
                args.out.write_text(json.dumps(runs, indent=1))
    print(table(runs, list(legs), sets, concs, args.reference or next(iter(legs))))


def table(runs: list[dict], legs: list[str], sets: list[str], concs: list[int], reference: str) -> str:
    def med(leg, c, s, key):
        values = [key(r) for r in runs if r["leg"] == leg and r["concurrency"] == c and r["set"] == s]
        return statistics.median(values) if values else float("nan")

    def texts(leg, c):
        return {(r["set"], reply["prompt"]): reply["text"] for r in runs if r["leg"] == leg and r["concurrency"] == c
                and r["rep"] == 0 for reply in r["report"]["replies"] if reply["ok"]}

    head = "| leg | " + " | ".join(f"c={c} tok/s {'/'.join(sets)}" for c in concs) + " | " + \
        " | ".join(f"c={c} TTFT median / mean, TPOT ms" for c in concs) + " | peak MB | greedy = " + reference + \
        f" (c={concs[0]}) | failed requests |"
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    ref = texts(reference, concs[0])
    for leg in legs:
        tok = [" / ".join(f"{med(leg, c, s, lambda r: r['report']['output_throughput']):.1f}" for s in sets)
               for c in concs]
        lat = [f"{statistics.median(med(leg, c, s, lambda r: r['report']['ttft_ms']['median']) for s in sets):.0f} / "
               f"{statistics.median(med(leg, c, s, lambda r: r['report']['ttft_ms']['mean']) for s in sets):.0f}, "
               f"{statistics.median(med(leg, c, s, lambda r: r['report']['tpot_ms']['median']) for s in sets):.1f}"
               for c in concs]
        peak = max((r["peak_mb"] for r in runs if r["leg"] == leg and "peak_mb" in r), default=float("nan"))
        mine = texts(leg, concs[0])
        same = sum(1 for k, v in mine.items() if ref.get(k) == v)
        failed = sum(r["report"]["failed"] for r in runs if r["leg"] == leg)
        lines.append(f"| {leg} | " + " | ".join(tok) + " | " + " | ".join(lat) +
                     f" | {peak:.0f} | {same} of {len(mine)} | {failed} |")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
