"""Profile a DFlash round and the autoregressive baselines on one model directory.

Usage: python tools/profile_round.py MODEL_DIR [--reps 7] [--tokens 128] [--out profile.json]
       [--sections verify,drafter,round,ar,knobs,loop,policy,switch,weights,runners] [--config '{"INFERENCE_NUM_THREADS": 1}']
       [--compare OTHER_DIR[,OTHER_DIR...]]

--config: extra compile properties for every section (the knobs section overrides its own).

Sections (all in one process; alternatives are interleaved per repetition and medians
reported, because the machine is shared and noisy):
  verify  - target forward of K = 1, 2, 3, 4, 5, 6, 8, 16 tokens after a ~100-token chat prompt
            (forward + commit(1), i.e. the mask rollback of K-1 rejected slots), ms.
  drafter - OVDrafter.propose at block 8 and 16, with and without the draft vocabulary
            (when drafter/draft_vocab.json exists), ms per call.
  round   - greedy dflash@B generations with the OpenVINO infer calls timed separately:
            per round ms of drafter infer, target infer, and host work (everything else:
            numpy accept, feature copies, Python, and time the process waited for a core).
  ar      - our AR vs openvino.genai LLMPipeline AR, tok/s (128 tokens), and our AR step
            split into infer vs host.
  knobs   - our AR tok/s and the K=8 verify for INFERENCE_NUM_THREADS 1/2 (2 also without
            CPU pinning) and KV_CACHE_PRECISION u8/f16/f32 (one compile each).
  loop    - our AR tok/s with each inference as infer() against start_async()+wait()
            (runners.run_request), and openvino.genai's AR, interleaved.
  policy  - the automatic block size: its measured round costs (ms per k drafts, k = 0 is an
            AR step), its switch cost, and the k it picks for a drafter with conditional
            acceptance 0.1 .. 0.9.
  switch  - the cost of changing the target's input length: ms of a forward of T tokens
            (+ commit(1)) when every call has T tokens, against calls alternating T=1 with
            T=2 or T=4, after a 100- and a 1000-token context.
  weights - MODEL_DIR against the `--compare` directories (the same pair exported with other
            weight formats): the verify curve (K = 1, 2, 3, 4, 8) and tokens/s of our AR and
            dflash@2/@3/@4 on one code, math and chat prompt, every directory in each
            repetition, their order rotated.
  runners - the same measurements for MODEL_DIR loaded with each target runner (paged,
            stateful).
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from compare_drafters import time_drafter  # noqa: E402  (tools/, next to this file)

from ovdflash.bench import CpuMeter, GenaiRunner, OursRunner, encode_prompts, rotated  # noqa: E402
from ovdflash.decode.block_policy import BlockPolicy  # noqa: E402
from ovdflash.decode.stats import GenerationStats  # noqa: E402
from ovdflash.manifest import load_manifest, runners_for  # noqa: E402
from ovdflash.ov.precision import compile_config  # noqa: E402
from ovdflash.pipeline import DFlashPipeline  # noqa: E402


class TimedRequest:
    """Wraps an InferRequest; accumulates the wall time of inferences (infer(), or start_async()
    to wait() as runners.run_request does)."""

    def __init__(self, request):
        self._request, self.seconds, self.calls = request, 0.0, 0
        self._started = 0.0

    def infer(self, *args, **kwargs):
        self.start_async(*args, **kwargs)
        return self.wait()

    def start_async(self, *args, **kwargs):
        self._started = time.perf_counter()
        return self._request.start_async(*args, **kwargs)

    def wait(self):
        out = self._request.wait()
        self.seconds += time.perf_counter() - self._started
        self.calls += 1
        return out

    def __getattr__(self, name):
        return getattr(self._request, name)


def med(xs):
    return round(statistics.median(xs), 3) if xs else None


def prompt_ids(pipe, n=1):
    return encode_prompts(pipe, "chat", n)


def verify_curve(pipe, prompt, reps, ks=(1, 2, 3, 4, 5, 6, 8, 16)):
    target = pipe.target
    times = {k: [] for k in ks}
    for rep in range(reps):
        for k in rotated(ks, rep):
            target.reset()
            target.forward(np.asarray(prompt, np.int64), all_logits=False)
            target.commit(len(prompt))
            ids = np.asarray(prompt[:k] if len(prompt) >= k else [1] * k, np.int64)
            target.forward(ids, all_logits=True)   # first K-shaped call after the prefill: not timed
            target.commit(1)
            t0 = time.perf_counter()
            for _ in range(3):
                target.forward(ids, all_logits=True)
                target.commit(1)
            times[k].append(1e3 * (time.perf_counter() - t0) / 3)
    return {str(k): med(v) for k, v in times.items()}


def switch_costs(pipe, reps, contexts=(100, 1000), calls=24):
    """ms per target forward by input length, in runs of one length vs runs alternating lengths."""
    target, rng = pipe.target, np.random.default_rng(0)
    patterns = {"1": [1], "2": [2], "4": [4], "1/2": [1, 2], "1/4": [1, 4]}
    times = {(c, name, k): [] for c in contexts for name, pat in patterns.items() for k in set(pat)}
    for rep in range(reps):
        for context in contexts:
            for name, pattern in patterns.items():
                target.reset()
                target.forward(rng.integers(100, 1000, context).astype(np.int64), all_logits=False)
                target.commit(context)
                for i in range(calls):
                    k = pattern[i % len(pattern)]
                    t0 = time.perf_counter()
                    target.forward(rng.integers(100, 1000, k).astype(np.int64), all_logits=True)
                    target.commit(1)
                    if i >= 2:  # the first calls follow the prefill's shape
                        times[(context, name, k)].append(1e3 * (time.perf_counter() - t0))
    return {f"context {c}, lengths {name}, T={k}": med(v) for (c, name, k), v in times.items()}


def drafter_times(pipes, manifest, prompt, reps, blocks=(8, 16)):
    feat = len(manifest["target_layer_ids"]) * manifest["target"]["hidden_size"]
    rng = np.random.default_rng(0)
    ctx = rng.standard_normal((len(prompt), feat)).astype(np.float32)
    one = rng.standard_normal((3, feat)).astype(np.float32)
    out = {f"{name}@{b}": [] for name in pipes for b in blocks}
    for _ in range(reps):
        for name, pipe in pipes.items():
            for b in blocks:  # 5 steady-state rounds after the prompt: 3 new context features each
                out[f"{name}@{b}"].append(time_drafter(pipe.drafter, ctx, one, b - 1, calls=5))
    return {k: med(v) for k, v in out.items()}


def round_profile(pipe, prompts, tokens, blocks=(4, 8, 16)):
    out = {}
    t_req, d_req = TimedRequest(pipe.target.request), TimedRequest(pipe.drafter.request)
    pipe.target.request, pipe.drafter.request = t_req, d_req
    try:
        for b in blocks:
            rows = []
            for ids in prompts:
                t_req.seconds = d_req.seconds = 0.0
                t_req.calls = d_req.calls = 0
                t0 = time.perf_counter()
                st = GenerationStats()
                list(pipe.generate_tokens(ids, tokens, draft=True, block_size=b, stats=st))
                wall = time.perf_counter() - t0
                rounds = max(st.num_drafts, 1)
                decode_target = t_req.seconds  # includes the prefill call, subtracted below
                rows.append({"wall_ms": 1e3 * wall, "prefill_ms": 1e3 * st.prefill_s, "rounds": st.num_drafts,
                             "drafter_infer_ms_per_round": 1e3 * d_req.seconds / rounds,
                             "target_infer_ms_per_round": 1e3 * (decode_target - st.prefill_s) / rounds,
                             "round_ms": 1e3 * (wall - st.prefill_s) / rounds})
            r = {k: med([row[k] for row in rows]) for k in rows[0]}
            r["host_ms_per_round"] = round(r["round_ms"] - r["drafter_infer_ms_per_round"]
                                           - r["target_infer_ms_per_round"], 3)
            out[f"dflash@{b}"] = r
    finally:
        pipe.target.request, pipe.drafter.request = t_req._request, d_req._request
    return out


def weights_compare(pipe, dirs, extra, tokens, reps, meter):
    """`pipe` is MODEL_DIR's pipeline (already loaded by main); `dirs` the others."""
    pipes = {str(pipe.model_dir): pipe} | {str(d): DFlashPipeline.from_pretrained(d, **extra) for d in dirs}
    return compare_pipelines(pipes, tokens, reps, meter)


def runners_compare(model_dir, extra, tokens, reps, meter):
    """MODEL_DIR with each target runner that can run it (manifest.runners_for), side by side."""
    runners = runners_for(load_manifest(model_dir))
    pipes = {r: DFlashPipeline.from_pretrained(model_dir, target_runner=r, **extra) for r in runners}
    return compare_pipelines(pipes, tokens, reps, meter)


def compare_pipelines(pipes, tokens, reps, meter):
    """The verify curve and tok/s of our AR and dflash@2/@3/@4 on one code, math and chat prompt
    for every pipeline in each repetition, their order rotated."""
    first = next(iter(pipes.values()))
    prompts = [ids for domain in ("code", "math", "chat") for ids in encode_prompts(first, domain, 1)]
    modes = {"ar": None, "dflash@2": 2, "dflash@3": 3, "dflash@4": 4}
    rates = {(d, m): [] for d in pipes for m in modes}
    verify = {d: [] for d in pipes}
    busy = []
    names = list(pipes)
    for rep in range(reps):
        for d in rotated(names, rep):
            started = meter.start()
            verify[d].append(verify_curve(pipes[d], prompts[2], 1, ks=(1, 2, 3, 4, 8)))
            for m, block in modes.items():
                for ids in prompts:
                    toks, wall, _, _ = OursRunner(pipes[d], block)(ids, tokens)
                    rates[(d, m)].append(len(toks) / wall)
            busy.append(meter.foreign_cores(started))
    return {d: {"verify_ms_by_K": {k: med([v[k] for v in verify[d]]) for k in verify[d][0]},
                "tokens_per_s": {m: med(rates[(d, m)]) for m in modes}} for d in names} | {
        "foreign_cores": med(busy)}


def ar_compare(pipe, genai, prompts, tokens, reps, meter):
    ours = OursRunner(pipe, None)
    rates = {"ar": [], "genai-ar": []}
    busy = []
    t_req = TimedRequest(pipe.target.request)
    pipe.target.request = t_req
    wide = getattr(pipe.target, "wide_request", None)
    t_wide = TimedRequest(wide) if wide is not None else None
    if t_wide is not None:  # a prefill on the f32-weight copy is inference, not host work
        pipe.target.wide_request = t_wide
    host = []
    try:
        for rep in range(reps):
            for ids in prompts:
                for name in (("ar", "genai-ar") if rep % 2 == 0 else ("genai-ar", "ar")):
                    if name == "genai-ar" and genai is None:
                        continue
                    started = meter.start()
                    for t in (t_req, t_wide or t_req):
                        t.seconds, t.calls = 0.0, 0
                    toks, wall, ttft, _ = (ours if name == "ar" else genai)(ids, tokens)
                    busy.append(meter.foreign_cores(started))
                    rates[name].append(len(toks) / wall)
                    if name == "ar":
                        timed = [t_req] + ([t_wide] if t_wide is not None else [])
                        infer_s = sum(t.seconds for t in timed)
                        host.append(1e3 * (wall - infer_s) / max(sum(t.calls for t in timed), 1))
    finally:
        pipe.target.request = t_req._request
        if t_wide is not None:
            pipe.target.wide_request = t_wide._request
    return {"tokens_per_s": {k: med(v) for k, v in rates.items() if v},
            "ours_host_ms_per_step": med(host), "foreign_cores": med(busy)}


def loop_compare(pipe, model_dir, manifest, config, prompts, tokens, reps, meter):
    """AR tok/s: inferences via infer() vs start_async()+wait() (the runtime's), and genai-ar."""
    import ovdflash.ov.paged as runners

    def infer_run(request, inputs):
        request.infer(inputs, share_inputs=True, share_outputs=True)

    async_run, ours = runners.run_request, OursRunner(pipe, None)
    try:
        genai = GenaiRunner(model_dir, manifest, config, pipe.eos_token_ids, "ar")
    except Exception as exc:  # genai missing: compare ours alone
        print("genai-ar unavailable:", exc)
        genai = None
    kinds = ["infer", "start_async"] + (["genai-ar"] if genai else [])
    rates, busy = {k: [] for k in kinds}, []
    try:
        for rep in range(reps):
            for ids in prompts:
                for kind in rotated(kinds, rep):
                    runners.run_request = infer_run if kind == "infer" else async_run
                    started = meter.start()
                    toks, wall, _, _ = (genai if kind == "genai-ar" else ours)(ids, tokens)
                    busy.append(meter.foreign_cores(started))
                    rates[kind].append(len(toks) / wall)
    finally:
        runners.run_request = async_run
    tps = {k: med(v) for k, v in rates.items()}
    return {"tokens_per_s": tps, "ratio_to_infer": {k: round(v / tps["infer"], 3) for k, v in tps.items()},
            "foreign_cores": med(busy)}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("model_dir", type=Path)
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--sections", default="verify,drafter,round,ar,knobs")
    ap.add_argument("--config", default="{}", help="extra compile properties (JSON)")
    ap.add_argument("--compare", default="", help="comma-separated model directories for `weights`")
    args = ap.parse_args()
    sections = args.sections.split(",")
    manifest = load_manifest(args.model_dir)
    extra = json.loads(args.config)
    base, _ = compile_config(manifest, extra)
    meter = CpuMeter()
    result = {"model_dir": str(args.model_dir), "config": base, "sections": {}}
    started = meter.start()
    pipe = DFlashPipeline.from_pretrained(args.model_dir, **extra)
    prompts = prompt_ids(pipe, 3)
    prompt = prompts[0]
    result["prompt_tokens"] = len(prompt)

    def report(name, value):
        result["sections"][name] = value
        print(name, json.dumps(value, indent=1), flush=True)

    if "verify" in sections:
        report("verify_ms_by_K", verify_curve(pipe, prompt, args.reps))
    if "drafter" in sections:
        pipes = {"vocab": pipe}
        if (args.model_dir / "drafter" / "draft_vocab.json").exists():
            pipes["full"] = DFlashPipeline.from_pretrained(args.model_dir, use_draft_vocab=False, **extra)
        report("drafter_ms_per_call", drafter_times(pipes, manifest, prompt, args.reps))
        del pipes
    if "round" in sections:
        report("round_profile", round_profile(pipe, prompts, args.tokens))
    if "ar" in sections:
        try:
            genai = GenaiRunner(args.model_dir, manifest, base, pipe.eos_token_ids, "ar")
        except Exception as exc:  # genai missing or refusing the IR: report ours alone
            print("genai-ar unavailable:", exc)
            genai = None
        report("ar", ar_compare(pipe, genai, prompts, args.tokens, max(2, args.reps // 2), meter))
        del genai
    if "knobs" in sections:
        knobs = {"threads=1": {"INFERENCE_NUM_THREADS": 1}, "threads=2": {"INFERENCE_NUM_THREADS": 2},
                 "threads=2,no-pinning": {"INFERENCE_NUM_THREADS": 2, "ENABLE_CPU_PINNING": False},
                 "kv=u8": {"KV_CACHE_PRECISION": "u8"}, "kv=f16": {"KV_CACHE_PRECISION": "f16"},
                 "kv=f32": {"KV_CACHE_PRECISION": "f32"}}
        variants = {name: DFlashPipeline.from_pretrained(args.model_dir, draft=False, **{**extra, **opts})
                    for name, opts in knobs.items()}
        rates = {name: [] for name in knobs}
        verify8 = {name: [] for name in knobs}
        for rep in range(max(2, args.reps // 2)):
            for name in rotated(knobs, rep):
                toks, wall, _, _ = OursRunner(variants[name], None)(prompt, args.tokens)
                rates[name].append(len(toks) / wall)
                verify8[name].append(verify_curve(variants[name], prompt, 1, ks=(8,))["8"])
        report("knobs", {name: {"ar_tokens_per_s": med(rates[name]), "verify8_ms": med(verify8[name])}
                         for name in knobs})
    if "loop" in sections:
        report("loop", loop_compare(pipe, args.model_dir, manifest, base, prompts, args.tokens,
                                    max(2, args.reps // 2), meter))
    if "policy" in sections:
        policy = pipe.auto_block_policy()
        picks = {}
        for p in (0.1, 0.3, 0.5, 0.7, 0.9):
            probe = BlockPolicy(policy.round_cost_s, [0.0] * len(policy.round_cost_s),
                                prior_acceptance=p, prior_strength=1e9)  # draft cost is in round_cost_s
            picks[str(p)] = probe.choose(policy.max_drafts)
        report("policy", {"round_ms_by_drafts": [round(1e3 * c, 2) for c in policy.round_cost_s],
                          "switch_ms": round(1e3 * policy.switch_cost_s, 2),
                          "drafts_chosen_by_acceptance": picks})
    if "switch" in sections:
        report("switch_ms", switch_costs(pipe, max(2, args.reps // 3)))
    if "runners" in sections:
        report("runners", runners_compare(args.model_dir, extra, args.tokens, max(2, args.reps // 2), meter))
    if "weights" in sections:
        others = [Path(d) for d in args.compare.split(",") if d]
        report("weights", weights_compare(pipe, others, extra, args.tokens, max(2, args.reps // 2), meter))
    result["foreign_cores_whole_run"] = round(meter.foreign_cores(started), 2)
    print("foreign cores (other processes) during the whole run:", result["foreign_cores_whole_run"])
    if args.out:
        args.out.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
