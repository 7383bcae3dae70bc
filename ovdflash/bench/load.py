"""The load generator of `ovdflash bench-serve`, for any OpenAI-compatible endpoint, measured as `vllm bench serve` does.

Contract:
- `run_load(base_url, prompts, concurrency, max_tokens, ...)` sends one streamed request per
  prompt (chat: one user message; completions: the raw text), at most `concurrency` at once,
  with `stream_options.include_usage`; with `min_rounds` it cycles the prompts until the
  responses' `usage.spec_decode.num_drafts` add up to that many rounds. Returns a report (dict):
  completed / failed requests, duration, request throughput (req/s), output throughput (tok/s),
  and mean / median / p90 / p99 of TTFT (request sent to first text), TPOT ((latency - TTFT) /
  (output tokens - 1), per request) and end-to-end latency, in ms; plus the summed spec_decode
  counters when the server reports them (ours does; others leave them out), and `replies`: each
  request's prompt and streamed text (in the order they finished), to compare two servers' greedy replies.
- Output tokens come from the usage chunk; a server without one is counted by text chunks.
- Every request opens its own connection (no keep-alive): servers close idle or much-used
  connections on their own schedules, and a request sent on one being closed fails for no fault of its own.
- Prompts come from the held-out eval sets (`ovdflash.bench.prompts`), several sets interleaved
  (`eval_prompts`); `format_report` renders a report as a table.
"""
from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass

import numpy as np

SPEC_COUNTERS = ("num_drafts", "num_draft_tokens", "num_accepted_tokens", "num_lookup_drafts")


@dataclass
class RequestResult:
    ok: bool
    ttft_s: float = 0.0
    latency_s: float = 0.0
    output_tokens: int = 0
    spec_decode: dict | None = None
    error: str = ""
    prompt: str = ""
    text: str = ""


async def _one_request(client, endpoint: str, model: str, prompt: str, max_tokens: int, temperature: float,
                       seed: int | None) -> RequestResult:
    t0 = time.perf_counter()
    first, chunks, usage, texts = None, 0, None, []
    try:
        common = dict(model=model, max_tokens=max_tokens, temperature=temperature, stream=True,
                      stream_options={"include_usage": True}, **({"seed": seed} if seed is not None else {}))
        if endpoint == "chat":
            stream = await client.chat.completions.create(messages=[{"role": "user", "content": prompt}], **common)
        else:
            stream = await client.completions.create(prompt=prompt, **common)
        async for chunk in stream:
            if chunk.choices:
                choice = chunk.choices[0]
                text = choice.delta.content if endpoint == "chat" else choice.text
                if text:
                    chunks += 1
                    texts.append(text)
                    if first is None:
                        first = time.perf_counter()
            if getattr(chunk, "usage", None) is not None:
                usage = chunk.usage
    except Exception as exc:  # one failed request is a number in the report, not the end of the run
        return RequestResult(False, error=f"{type(exc).__name__}: {exc}", prompt=prompt)
    end = time.perf_counter()
    tokens = usage.completion_tokens if usage is not None else chunks
    spec = (usage.model_extra or {}).get("spec_decode") if usage is not None else None
    return RequestResult(True, (first or end) - t0, end - t0, tokens, spec, prompt=prompt, text="".join(texts))


def _percentiles(values_s: list[float]) -> dict:
    if not values_s:
        return {"mean": 0.0, "median": 0.0, "p90": 0.0, "p99": 0.0}
    ms = 1e3 * np.asarray(values_s)
    return {"mean": float(ms.mean()), "median": float(np.median(ms)), "p90": float(np.percentile(ms, 90)),
            "p99": float(np.percentile(ms, 99))}


def summarize(results: list[RequestResult], duration_s: float) -> dict:
    done = [r for r in results if r.ok]
    out_tokens = sum(r.output_tokens for r in done)
    report = {
        "completed": len(done), "failed": len(results) - len(done), "duration_s": duration_s,
        "total_output_tokens": out_tokens,
        "request_throughput": len(done) / duration_s if duration_s > 0 else 0.0,
        "output_throughput": out_tokens / duration_s if duration_s > 0 else 0.0,
        "ttft_ms": _percentiles([r.ttft_s for r in done]),
        "tpot_ms": _percentiles([(r.latency_s - r.ttft_s) / (r.output_tokens - 1) for r in done
                                 if r.output_tokens > 1]),
        "e2e_latency_ms": _percentiles([r.latency_s for r in done]),
        "errors": sorted({r.error for r in results if not r.ok})[:5],
        "replies": [{"prompt": r.prompt, "text": r.text, "ok": r.ok} for r in results],
    }
    specs = [r.spec_decode for r in done if r.spec_decode]
    if specs:
        spec = {name: sum(s.get(name, 0) for s in specs) for name in SPEC_COUNTERS}
        spec["mean_acceptance_length"] = ((spec["num_accepted_tokens"] + spec["num_drafts"]) / spec["num_drafts"]
                                          if spec["num_drafts"] else 0.0)
        spec["draft_acceptance_rate"] = (spec["num_accepted_tokens"] / spec["num_draft_tokens"]
                                         if spec["num_draft_tokens"] else 0.0)
        report["spec_decode"] = spec
    return report


async def _run_load(base_url, prompts, concurrency, max_tokens, model, api_key, endpoint, temperature, seed,
                    min_rounds, timeout_s, on_result):
    import httpx
    import openai

    http = httpx.AsyncClient(limits=httpx.Limits(max_keepalive_connections=0))  # openai sets each request's timeout
    client = openai.AsyncOpenAI(base_url=base_url, api_key=api_key or "EMPTY", max_retries=0, timeout=timeout_s,
                                http_client=http)
    async with client:
        if model is None:
            model = (await client.models.list()).data[0].id
        results: list[RequestResult] = []
        rounds = 0
        next_prompt = 0

        def take() -> str | None:
            nonlocal next_prompt
            if next_prompt >= len(prompts) and (min_rounds is None or rounds >= min_rounds):
                return None
            prompt = prompts[next_prompt % len(prompts)]
            next_prompt += 1
            return prompt

        async def client_loop():
            nonlocal rounds
            while (prompt := take()) is not None:
                result = await _one_request(client, endpoint, model, prompt, max_tokens, temperature, seed)
                results.append(result)
                rounds += (result.spec_decode or {}).get("num_drafts", 0)
                if on_result is not None:
                    on_result(result, len(results))
                if min_rounds is not None and not result.ok and not any(r.ok for r in results):
                    return  # nothing works: do not cycle forever

        t0 = time.perf_counter()
        await asyncio.gather(*(client_loop() for _ in range(concurrency)))
        report = summarize(results, time.perf_counter() - t0)
    report.update(model=model, endpoint=endpoint, concurrency=concurrency, max_tokens=max_tokens,
                  num_prompts=len(prompts), base_url=base_url)
    return report


def run_load(base_url: str, prompts: list[str], concurrency: int = 1, max_tokens: int = 128, model: str | None = None,
             api_key: str | None = None, endpoint: str = "chat", temperature: float = 0.0, seed: int | None = None,
             min_rounds: int | None = None, timeout_s: float = 600.0, on_result=None) -> dict:
    if concurrency < 1:
        raise ValueError(f"concurrency must be >= 1, got {concurrency}")
    if not prompts:
        raise ValueError("no prompts")
    if endpoint not in ("chat", "completions"):
        raise ValueError(f"endpoint must be chat or completions, got {endpoint!r}")
    return asyncio.run(_run_load(base_url, prompts, concurrency, max_tokens, model, api_key, endpoint, temperature,
                                 seed, min_rounds, timeout_s, on_result))


def eval_prompts(sets: list[str], num_prompts: int) -> list[str]:
    """`num_prompts` first turns, taken from the sets in turn (code, math, chat, code, ...)."""
    from .prompts import load_prompts

    per_set = [load_prompts(name, num_prompts) for name in sets]
    mixed = [group[i] for i in range(max(map(len, per_set), default=0)) for group in per_set if i < len(group)]
    return mixed[:num_prompts]


def format_report(report: dict) -> str:
    lines = [f"{'model':<28}{report['model']}  ({report['endpoint']}, concurrency {report['concurrency']})",
             f"{'successful requests':<28}{report['completed']}",
             f"{'failed requests':<28}{report['failed']}",
             f"{'duration (s)':<28}{report['duration_s']:.2f}",
             f"{'total output tokens':<28}{report['total_output_tokens']}",
             f"{'request throughput (req/s)':<28}{report['request_throughput']:.2f}",
             f"{'output throughput (tok/s)':<28}{report['output_throughput']:.1f}"]
    for key, label in (("ttft_ms", "TTFT (ms)"), ("tpot_ms", "TPOT (ms)"), ("e2e_latency_ms", "E2E latency (ms)")):
        p = report[key]
        lines.append(f"{label:<28}mean {p['mean']:.1f}  median {p['median']:.1f}  p90 {p['p90']:.1f}  "
                     f"p99 {p['p99']:.1f}")
    if "spec_decode" in report:
        s = report["spec_decode"]
        lines.append(f"{'spec decode':<28}{s['num_drafts']} drafts, {s['num_accepted_tokens']} of "
                     f"{s['num_draft_tokens']} draft tokens accepted, mean acceptance length "
                     f"{s['mean_acceptance_length']:.2f}, {s['num_lookup_drafts']} lookup rounds")
    for error in report["errors"]:
        lines.append(f"{'error':<28}{error}")
    return "\n".join(lines)

