"""`ovdflash bench --concurrency` on the tiny pair (fast: C = 1, 2, short replies, two repetitions).

Checks content, not just that it ran: every mode ran every concurrency every repetition in a rotated
order; the tokens counted equal the requests' lengths and the rounds' tokens add up to them; batched
AR sends the target exactly one token per emitted decode token; ratios follow from the medians;
under STRICT_F32 batched DFlash, sequential DFlash and genai's continuous batching emit exactly
batched AR's tokens; the CLI writes its JSON and PNG.
"""
import json
import statistics
import time

import click
import pytest
from click.testing import CliRunner

from ovdflash import STRICT_F32, DFlashPipeline
from ovdflash.bench import encode_prompts
from ovdflash.bench.concurrency import GenaiCBRunner, parse_concurrency, run_concurrency
from ovdflash.cli.bench import bench
from ovdflash.manifest import load_manifest
from ovdflash.ov.precision import compile_config

try:
    import openvino_genai  # noqa: F401
    HAVE_GENAI = True
except ImportError:
    HAVE_GENAI = False

MAX_NEW = 10


@pytest.fixture(scope="module")
def setup(tiny_pair, tmp_path_factory):
    config = {**STRICT_F32, "CACHE_DIR": str(tmp_path_factory.mktemp("ov_cache")), "INFERENCE_NUM_THREADS": 1}
    pipe = DFlashPipeline.from_pretrained(tiny_pair, **config)
    prompts = {"code": encode_prompts(pipe, "code", 3)}
    genai = None
    if HAVE_GENAI:
        manifest = load_manifest(tiny_pair)
        full, _ = compile_config(manifest, config)
        genai = lambda: GenaiCBRunner(tiny_pair, manifest, full, pipe.eos_token_ids)  # noqa: E731
    modes = ["batch-dflash", "batch-ar", "genai-cb", "seq-dflash"]
    result = run_concurrency(pipe, prompts, [1, 2], MAX_NEW, modes, [4], repetitions=2, warmup=0, genai_cb=genai)
    return result, prompts


def test_every_mode_every_concurrency_interleaved(setup):
    result, _ = setup
    expected = ["batch-dflash@4", "batch-ar"] + (["genai-cb"] if HAVE_GENAI else []) + ["seq-dflash@4"]
    assert result["modes"] == expected
    runs = result["runs"]
    assert len(runs) == 2 * 2 * len(expected)  # repetitions x concurrencies x modes
    assert [r["mode"] for r in runs[:len(expected)]] == expected
    assert runs[2 * len(expected)]["mode"] == expected[1]  # repetition 1 starts one mode later
    for r in runs:
        assert len(r["tokens"]) == r["concurrency"] == len(r["prompts"])
        assert all(1 <= n <= MAX_NEW for n in r["tokens"])
    # the batch of C=2 in repetition 1 is prompts 2 and 0 (3 prompts, cycled)
    assert next(r for r in runs if r["concurrency"] == 2 and r["repetition"] == 1)["prompts"] == [2, 0]


def test_tokens_and_rounds_add_up(setup):
    result, prompts = setup
    lengths = [len(p) for p in prompts["code"]]
    for c in ("1", "2"):
        for name, e in result["prompt_sets"]["code"][c]["modes"].items():
            runs = [r for r in result["runs"] if r["mode"] == name and r["concurrency"] == int(c)]
            assert e["num_tokens"] == sum(sum(r["tokens"]) for r in runs)
            assert e["num_requests"] == 2 * int(c)
            rates = [sum(r["tokens"]) / r["wall_s"] for r in runs]
            assert e["tokens_per_s"] == pytest.approx(statistics.median(rates), rel=0.02)
            assert e["tpot_ms"] > 0 and e["ttft_ms"] > 0
            p = e["profile"]
            # every request's first token comes from its prefill, the rest from decode rounds
            assert p["rounds"] * p["tokens_per_round"] == pytest.approx(e["num_tokens"] - e["num_requests"])
            if name == "genai-cb":  # one token a request a step, the first step prefilling them all
                assert p["rounds"] >= max(n for r in runs for n in r["tokens"]) - 1
                assert p["rounds"] * p["target_tokens_per_round"] == pytest.approx(e["num_tokens"] - e["num_requests"])
                continue
            assert p["target_ms_per_round"] > 0 and p["host_ms_per_round"] > -1.0
            if name.startswith("batch-"):
                assert p["num_steps"] == p["rounds"] + p["prefill_calls"]
                prompt_tokens = sum(lengths[i] for r in runs for i in r["prompts"])
                decode_sent = p["num_batched_tokens"] - prompt_tokens
                assert decode_sent == pytest.approx(p["rounds"] * p["target_tokens_per_round"])
                if name == "batch-ar":  # one token a sequence a round: sent == emitted
                    assert decode_sent == e["num_tokens"] - e["num_requests"]
                    assert p["draft_ms_per_round"] < p["target_ms_per_round"]  # bookkeeping only, no drafter
            if name.startswith(("batch-dflash", "seq-dflash")):
                assert e["mean_acceptance_length"] >= 1.0 and p["draft_ms_per_round"] > 0
                assert 0 <= e["num_lookup_accepted_tokens"] <= e["num_accepted_tokens"]


def test_lossless_and_ratios(setup):
    result, _ = setup
    for name, per_c in result["agreement"].items():
        assert per_c == {"1": 1.0, "2": 1.0}, name  # STRICT_F32: every mode emits batch-ar's tokens
    for c in ("1", "2"):
        data = result["prompt_sets"]["code"][c]
        tps = {n: e["tokens_per_s"] for n, e in data["modes"].items()}
        best = max(tps[m] for m in ("batch-ar", "genai-cb") if m in tps)
        assert data["ratios"]["batch-dflash@4 / best batched AR"] == pytest.approx(tps["batch-dflash@4"] / best)
        assert data["ratios"]["batch-dflash@4 / seq-dflash@4"] == pytest.approx(
            tps["batch-dflash@4"] / tps["seq-dflash@4"])
    worst = min(result["prompt_sets"]["code"][c]["ratios"]["batch-dflash@4 / best batched AR"] for c in ("1", "2"))
    goal = result["goals"]["batch-dflash >= 1.0x best batched AR at every concurrency (worst case)"]
    assert goal["value"] == pytest.approx(worst) and goal["met"] == (worst >= 1.0)
    json.dumps(result, allow_nan=False)  # strict JSON


def test_batch_oracle_accepts_whole_blocks_at_the_drafters_cost(setup, tiny_pair):
    """batch-oracle@B: each sequence drafts its own greedy continuation (the real drafter called and
    paid), so every round but a truncated last one accepts all B-1 drafts, each sequence its own
    (the references differ), and the output is batch-ar's; the ratio is a ceiling, not a goal."""
    _, prompts = setup
    pipe = DFlashPipeline.from_pretrained(tiny_pair, **STRICT_F32, INFERENCE_NUM_THREADS=1)
    real_pool = pipe.drafter_pool()
    reference = pipe.generate_tokens

    def slow_reference(*args, **kwargs):  # the references are computed outside the timed run
        time.sleep(1.0)
        return reference(*args, **kwargs)

    pipe.generate_tokens = slow_reference
    result = run_concurrency(pipe, prompts, [2, 3], 13, ["batch-oracle", "batch-ar"], [4, "auto"], repetitions=1,
                             warmup=0)
    assert all(r["wall_s"] < 1.0 for r in result["runs"])
    assert result["modes"] == ["batch-oracle@4", "batch-ar"]
    assert any(n.startswith("batch-oracle@auto: skipped") for n in result["notes"])
    assert pipe.drafter_pool() is real_pool  # put back after every run
    assert result["agreement"]["batch-oracle@4"] == {"2": 1.0, "3": 1.0}
    for c in ("2", "3"):
        data = result["prompt_sets"]["code"][c]
        e = data["modes"]["batch-oracle@4"]
        assert e["mean_acceptance_length"] > 3.0 and e["num_drafts"] > 0 and e["num_lookup_drafts"] == 0
        assert e["profile"]["draft_ms_per_round"] > 0  # the real drafter ran
        assert data["ratios"]["batch-oracle@4 / best batched AR, ceiling"] == pytest.approx(
            e["tokens_per_s"] / data["modes"]["batch-ar"]["tokens_per_s"])
    assert result["goals"] == {}  # no batch-dflash ran: the oracle is never a goal's value


def test_parse_concurrency():
    assert parse_concurrency("1,2, 4,8") == [1, 2, 4, 8]
    for bad in ("0,2", "a", ""):
        with pytest.raises(click.BadParameter):
            parse_concurrency(bad)


def test_cli_writes_json_and_png(tiny_pair, tmp_path):
    """The tiny pair's manifest says block "auto": seq-dflash runs it, batch-dflash only if generate_batch can."""
    out = tmp_path / "out"
    config = json.dumps({**STRICT_F32, "CACHE_DIR": str(tmp_path / "cache"), "INFERENCE_NUM_THREADS": 1})
    res = CliRunner().invoke(bench, [str(tiny_pair), "--concurrency", "2", "--modes", "batch-dflash,batch-ar,seq-dflash",
                                     "--prompt-sets", "code", "-n", "2", "--max-new-tokens", "4", "--repetitions", "1",
                                     "--warmup", "0", "--config", config, "--out", str(out)])
    assert res.exit_code == 0, res.output
    data = json.loads((out / "bench_concurrency.json").read_text())
    assert data["settings"]["concurrency"] == [2] and data["settings"]["block_sizes"] == ["auto"]  # the manifest's
    modes = set(data["prompt_sets"]["code"]["2"]["modes"])
    assert {"batch-ar", "seq-dflash@auto"} <= modes
    assert "batch-dflash@auto" in modes or any(n.startswith("batch-dflash@auto: skipped") for n in data["notes"])
    assert "optimization_capabilities" in data["host"]["cpu"]
    assert (out / "bench_concurrency.png").stat().st_size > 0
    assert "agg tok/s" in res.output and "goal: " in res.output
    bad = CliRunner().invoke(bench, [str(tiny_pair), "--concurrency", "2", "--modes", "dflash", "--no-memory"])
    assert bad.exit_code != 0 and "unknown concurrency mode 'dflash'" in bad.output
