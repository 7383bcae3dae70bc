"""Cross-check ovdflash against llama.cpp's DFlash / DFlash 2 / DSpark drafting (greedy, one slot).

Not part of the tests or the package: it needs a llama.cpp build the user installed (see
../shared/peers/setup_llamacpp.sh; b11434 has `draft-dflash` for DFlash 1 and 2 and `draft-dspark`)
and GGUFs of the same pair made by llama.cpp's convert_hf_to_gguf.py (`--target-model-dir` for the
drafter; f32 for both so that near-ties resolve alike).

For each prompt it runs
  * ovdflash: DFlashPipeline on MODEL_DIR under STRICT_F32, block size B, lookup drafts and the
    prefix cache off, stopping at the model's EOS ids (or, with --ban-eos, never: those ids get
    logit_bias -100, as llama.cpp's ignore_eos bans its EOG tokens); every verify round's
    (drafted, accepted) is recorded;
  * llama.cpp: llama-server (f32 KV caches, one slot, LLAMA_TRACE=1 so it logs each round's
    "accepted k/n draft tokens") with --spec-type SPEC --spec-draft-n-max B-1, n-min 0, p-min 0,
    /completion with the same token ids, temperature 0, n_predict tokens (ignore_eos with --ban-eos);
and prints, per prompt, whether the token streams are equal, total drafted/accepted on both sides,
and whether the per-round accepted sequences agree. Prompts are raw text tokenized with MODEL_DIR's
tokenizer (no template, no BOS), or the chat template when --chat is given: the same ids go to both.

Found on b11434 (see /tmp/xcheck_42.md of issue 42): pass `--server-arg=-fa --server-arg=off`:
with CPU flash attention (the default "auto") llama.cpp's batched verify can flip a near-tie that
its own AR run (and HF transformers, and ovdflash) decide the other way. llama.cpp stops accepting
at an EOG draft and counts it as the bonus token, while ovdflash counts every draft acceptance
decided (GenerationStats): the last round of a reply that stops on a drafted EOS may differ.

Block mapping: ovdflash block B verifies B-1 drafts. llama.cpp's DFlash (1 and 2) block is
[last, mask * n_max], so n_max = B-1 and its trained `dflash.block_size` should equal the
manifest's block_size (ovdflash drafts with its full trained block, manifest draft_pass
"full_block"). For DSpark ovdflash feeds [last, mask * (B-2)] and reads B-1 slots; llama.cpp feeds
n_max tokens: the same, with the DeepSpec config's block_size (drafts per block) = B-1.

usage:
  python tools/crosscheck_llamacpp.py --model-dir OV_DIR --target-gguf T.gguf --drafter-gguf D.gguf \
      --spec draft-dflash --block 4 --max-tokens 64 [--llama-bin ~/.cache/ovdflash-peers/llama.cpp/build/bin] \
      [--prompt TEXT ...] [--chat] [--ban-eos] [--server-arg=-fa --server-arg=off] [--json OUT.json]
"""
from __future__ import annotations

import argparse
import json
import os
import re
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

DEFAULT_PROMPTS = [
    "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n",
    "The capital of France is",
    "Here is a list of the first ten prime numbers: 2, 3, 5,",
    "Once upon a time, in a small village by the sea, there lived",
    "Q: What is the boiling point of water at sea level?\nA:",
]


def ovdflash_runs(model_dir, prompts, block, max_tokens, threads, chat, ban_eos):
    from ovdflash import STRICT_F32, DFlashPipeline
    from ovdflash.decode import stats as stats_mod

    rounds: list[tuple[int, int]] = []
    original = stats_mod.GenerationStats.record_round

    def record_round(self, num_drafted, num_accepted, from_lookup=False):
        rounds.append((int(num_drafted), int(num_accepted)))
        return original(self, num_drafted, num_accepted, from_lookup)

    stats_mod.GenerationStats.record_round = record_round
    pipe = DFlashPipeline.from_pretrained(model_dir, INFERENCE_NUM_THREADS=threads, **STRICT_F32)
    tok = pipe.tokenizer
    eos = sorted(int(t) for t in pipe.eos_token_ids)
    # llama.cpp's ignore_eos bans its end-of-generation tokens (logit -inf); the same here with -100
    extra = dict(logit_bias={t: -100.0 for t in eos}, eos_token_ids=[]) if ban_eos else {}
    out = []
    for text in prompts:
        if chat:
            ids = tok.encode_chat([{"role": "user", "content": text}], add_generation_prompt=True)
        else:
            ids = tok.encode(text, add_special_tokens=False)
        ids = [int(i) for i in ids]
        rounds.clear()
        t0 = time.perf_counter()
        toks = [int(e.token) for e in pipe.generate_tokens(ids, max_tokens, block_size=block, prompt_lookup=False,
                                                           prefix_cache=False, **extra)]
        while toks and not ban_eos and toks[-1] in eos:  # compare up to the stop token, as llama.cpp reports
            toks.pop()
        out.append(dict(prompt=text, prompt_ids=ids, tokens=toks, eos=eos, rounds=list(rounds),
                        seconds=time.perf_counter() - t0))
    stats_mod.GenerationStats.record_round = original
    return out


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _post(port, path, body, timeout=600):
    req = urllib.request.Request(f"http://127.0.0.1:{port}{path}", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return json.loads(r.read())


def llamacpp_runs(bin_dir, target, drafter, spec, block, runs, max_tokens, threads, log_path, ban_eos, extra=()):
    port = _free_port()
    cmd = [str(Path(bin_dir) / "llama-server"), "-m", str(target), "-md", str(drafter), "--spec-type", spec,
           "--spec-draft-n-max", str(block - 1), "--spec-draft-n-min", "0", "--spec-draft-p-min", "0",
           "-np", "1", "-c", "2048", "-t", str(threads), "-tb", str(threads), "-td", str(threads),
           "-ctk", "f32", "-ctv", "f32", "-ctkd", "f32", "-ctvd", "f32",
           "--host", "127.0.0.1", "--port", str(port), "--no-webui", *extra]
    env = dict(os.environ, LLAMA_TRACE="1")
    log = open(log_path, "w")
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
    try:
        for _ in range(600):
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as r:
                    if r.status == 200:
                        break
            except Exception:
                if proc.poll() is not None:
                    raise SystemExit(f"llama-server exited ({proc.returncode}); see {log_path}")
                time.sleep(0.5)
        out = []
        for run in runs:
            log.flush()
            start = Path(log_path).stat().st_size
            t0 = time.perf_counter()
            r = _post(port, "/completion", dict(prompt=run["prompt_ids"], n_predict=max_tokens, temperature=0.0,
                                                top_k=1, ignore_eos=ban_eos, cache_prompt=False, return_tokens=True,
                                                stream=False))
            seconds = time.perf_counter() - t0
            time.sleep(0.3)
            text = Path(log_path).read_text(errors="replace")[start:]
            rounds = [(int(n), int(a)) for a, n in re.findall(r"accepted\s+(\d+)/\s*(\d+) draft tokens", text)]
            timings = r.get("timings", {})
            toks = [int(t) for t in r.get("tokens", [])]
            while toks and not ban_eos and toks[-1] in run["eos"]:
                toks.pop()
            out.append(dict(tokens=toks, stop_type=r.get("stop_type"), rounds=rounds, seconds=seconds,
                            draft_n=timings.get("draft_n"), draft_n_accepted=timings.get("draft_n_accepted")))
        return out, " ".join(cmd)
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
        log.close()


def compare(ours, theirs):
    rows = []
    for o, t in zip(ours, theirs):
        n = min(len(o["tokens"]), len(t["tokens"]))
        first_diff = next((i for i in range(n) if o["tokens"][i] != t["tokens"][i]), None)
        if first_diff is None and len(o["tokens"]) != len(t["tokens"]):
            first_diff = n
        rows.append(dict(
            prompt=o["prompt"][:40], prompt_tokens=len(o["prompt_ids"]), tokens_equal=first_diff is None,
            first_diff=first_diff, n_ours=len(o["tokens"]), n_theirs=len(t["tokens"]),
            ours_drafted=sum(d for d, _ in o["rounds"]), ours_accepted=sum(a for _, a in o["rounds"]),
            ours_rounds=len(o["rounds"]),
            theirs_drafted=t["draft_n"], theirs_accepted=t["draft_n_accepted"], theirs_rounds=len(t["rounds"]),
            theirs_log_drafted=sum(d for d, _ in t["rounds"]), theirs_log_accepted=sum(a for _, a in t["rounds"]),
            rounds_equal=[a for _, a in o["rounds"]] == [a for _, a in t["rounds"]],
            ours_round_accepts=[a for _, a in o["rounds"]], theirs_round_accepts=[a for _, a in t["rounds"]],
            ours_round_drafts=[d for d, _ in o["rounds"]], theirs_round_drafts=[d for d, _ in t["rounds"]],
        ))
    return rows


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model-dir", required=True)
    p.add_argument("--target-gguf", required=True)
    p.add_argument("--drafter-gguf", required=True)
    p.add_argument("--spec", required=True, choices=["draft-dflash", "draft-dspark"])
    p.add_argument("--block", type=int, default=4)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--llama-bin", default=str(Path.home() / ".cache/ovdflash-peers/llama.cpp/build/bin"))
    p.add_argument("--prompt", action="append")
    p.add_argument("--chat", action="store_true", help="apply the model's chat template (same ids to both)")
    p.add_argument("--ban-eos", action="store_true",
                   help="never stop: llama.cpp ignore_eos (bans EOG tokens), ovdflash logit_bias -100 on its EOS ids")
    p.add_argument("--server-arg", action="append", default=[], help="extra llama-server argument (repeatable)")
    p.add_argument("--json", help="write the full record (tokens, rounds) here")
    p.add_argument("--server-log", default="/tmp/crosscheck_llama_server.log")
    a = p.parse_args(argv)
    prompts = a.prompt or DEFAULT_PROMPTS
    ours = ovdflash_runs(a.model_dir, prompts, a.block, a.max_tokens, a.threads, a.chat, a.ban_eos)
    theirs, cmd = llamacpp_runs(a.llama_bin, a.target_gguf, a.drafter_gguf, a.spec, a.block, ours,
                                a.max_tokens, a.threads, a.server_log, a.ban_eos, a.server_arg)
    rows = compare(ours, theirs)
    for r in rows:
        print(f"{r['prompt']!r:44} tokens_equal={'y' if r['tokens_equal'] else 'n'}"
              f"{'' if r['tokens_equal'] else ' (first diff at ' + str(r['first_diff']) + ')'}"
              f"  accepted ours {r['ours_accepted']}/{r['ours_drafted']} in {r['ours_rounds']} rounds,"
              f" llama.cpp {r['theirs_accepted']}/{r['theirs_drafted']} in {r['theirs_rounds']} rounds,"
              f" per-round equal={'y' if r['rounds_equal'] else 'n'}")
    if a.json:
        Path(a.json).write_text(json.dumps(dict(llama_server=cmd, rows=rows, ours=ours, theirs=theirs), indent=1))
    return 0 if all(r["tokens_equal"] and r["rounds_equal"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
