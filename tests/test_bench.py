"""`ovdflash bench` end to end on the tiny pair (fast: a few short interleaved runs).

Checks real content, not just that it ran: every mode ran every prompt every repetition,
in an order rotated per repetition; speedup and cost reduction follow from the medians; under
STRICT_F32 every mode (genai's autoregressive LLMPipeline included) produces exactly the
tokens of our `ar` mode; the CLI writes bench.json and a PNG.
"""
import json
import statistics

import click
import pytest
from click.testing import CliRunner

from ovdflash import STRICT_F32
from ovdflash.bench import Run, run_benchmark, summarize
from ovdflash.cli.bench import bench, parse_block_sizes

try:
    import openvino_genai  # noqa: F401
    HAVE_GENAI = True
except ImportError:
    HAVE_GENAI = False


@pytest.fixture(scope="module")
def result(tiny_pair, tmp_path_factory):
    modes = ["dflash", "dflash-nopl", "ar"] + (["genai-ar"] if HAVE_GENAI else [])
    config = {**STRICT_F32, "CACHE_DIR": str(tmp_path_factory.mktemp("ov_cache")), "INFERENCE_NUM_THREADS": 1}
    return run_benchmark(tiny_pair, ["code"], num_prompts=2, max_new_tokens=12, modes=modes, block_sizes=[2, 4],
                         repetitions=2, warmup=0, config=config)


def test_every_mode_runs_every_prompt_interleaved(result):
    expected = ["dflash@2", "dflash@4", "dflash-nopl@2", "dflash-nopl@4", "ar"] + (["genai-ar"] if HAVE_GENAI else [])
    assert result["modes"] == expected
    assert result["target_runner"] == "paged"  # the default
    runs = result["runs"]
    assert len(runs) == len(expected) * 2 * 2   # modes x prompts x repetitions
    # repetition 0 starts with the first mode, repetition 1 with the second (rotation)
    per_prompt = len(expected)
    assert runs[0]["mode"] == expected[0] and runs[2 * per_prompt]["mode"] == expected[1]
    assert all(1 <= r["tokens"] <= 12 for r in runs)  # 12 unless the model emitted EOS
    assert all(r["foreign_cores"] >= 0 for r in runs)


def test_summary_arithmetic(result):
    data = result["prompt_sets"]["code"]
    modes = data["modes"]
    wall = {}
    for r in result["runs"]:
        wall.setdefault(r["mode"], []).append(r["tokens"] / r["wall_s"])
    for name, rates in wall.items():  # medians of per-run tok/s (JSON rounds wall_s to 0.1 ms)
        assert modes[name]["tokens_per_s"] == pytest.approx(statistics.median(rates), rel=0.02)
    best = max(modes[m]["tokens_per_s"] for m in ("ar", "genai-ar") if m in modes)
    assert data["best_ar_tokens_per_s"] == best
    for name in ("dflash@2", "dflash@4", "dflash-nopl@2", "dflash-nopl@4"):
        b, e = int(name[-1]), modes[name]
        assert e["speedup"] == pytest.approx(e["tokens_per_s"] / best)
        assert e["cost_reduction_per_token"] == pytest.approx(1 - 1 / e["speedup"])
        assert data["ratios"][f"{name} / best AR"] == pytest.approx(e["speedup"])
        assert 0 <= e["num_lookup_accepted_tokens"] and e["num_lookup_drafts"] <= e["num_drafts"]
        if "nopl" in name:  # the drafter alone
            assert e["num_lookup_drafts"] == 0
        # blocks shrink near max_new_tokens, never grow
        assert e["num_drafts"] <= e["num_draft_tokens"] <= (b - 1) * e["num_drafts"]
        assert 0 <= e["num_accepted_tokens"] <= e["num_draft_tokens"]
        assert e["mean_acceptance_length"] == pytest.approx((e["num_accepted_tokens"] + e["num_drafts"])
                                                            / e["num_drafts"])
        assert len(e["per_position_acceptance_rate"]) == b - 1
        assert e["draft_ms_per_round"] > 0 and e["verify_ms_per_round"] > 0
    assert "speedup" not in modes["ar"] and "num_drafts" not in modes["ar"]
    if HAVE_GENAI:
        assert data["ratios"]["ar / genai-ar"] == pytest.approx(modes["ar"]["tokens_per_s"]
                                                               / modes["genai-ar"]["tokens_per_s"])


def test_lossless_agreement_under_strict_numerics(result):
    assert result["agreement"] and set(result["agreement"].values()) == {1.0}
    assert set(result["agreement"]) == set(result["modes"])


def test_agreement_detects_a_different_output():
    runs = [Run("ar", "code", 0, 3, 1.0, 0.1, [1, 2, 3], {"tpot_ms": 1.0}),
            Run("ar", "code", 1, 3, 1.0, 0.1, [4, 5, 6], {"tpot_ms": 1.0}),
            Run("genai-ar", "code", 0, 3, 0.5, 0.1, [1, 2, 3]),
            Run("genai-ar", "code", 1, 3, 0.5, 0.1, [4, 5, 7])]
    out = summarize(runs, ["ar", "genai-ar"], ["code"], [])
    assert out["agreement"] == {"ar": 1.0, "genai-ar": 0.5}
    assert out["prompt_sets"]["code"]["best_ar_tokens_per_s"] == 6.0
    assert out["prompt_sets"]["code"]["ratios"]["ar / genai-ar"] == 0.5


def test_an_acceptance_only_bench_reports_no_speedups_and_writes_strict_json():
    from ovdflash.decode.stats import GenerationStats
    spec = GenerationStats()
    spec.record_round(3, 2)   # 3 drafted, 2 accepted: 3 tokens a round
    runs = [Run("dflash@4", "code", 0, 3, 1.0, 0.1, [1, 2, 3], {"tpot_ms": 1.0}, foreign_cores=0.0, spec=spec)]
    out = summarize(runs, ["dflash@4"], ["code"], [])
    data = out["prompt_sets"]["code"]
    assert data["best_ar_tokens_per_s"] is None and data["ratios"] == {}
    assert "speedup" not in data["modes"]["dflash@4"] and data["modes"]["dflash@4"]["mean_acceptance_length"] == 3.0
    json.dumps(out, allow_nan=False)   # no NaN anywhere: strict JSON readers take it


def test_cli_writes_json_and_png(tiny_pair, tmp_path):
    out = tmp_path / "bench"
    res = CliRunner().invoke(bench, [str(tiny_pair), "--prompt-sets", "math", "-n", "1", "--max-new-tokens", "6",
                                     "--modes", "dflash,ar", "--block-sizes", "4", "--repetitions", "1",
                                     "--warmup", "0", "--no-memory", "--out", str(out), "--target-runner", "stateful",
                                     "--config", json.dumps({**STRICT_F32, "CACHE_DIR": str(tmp_path / "c")})])
    assert res.exit_code == 0, res.output
    data = json.loads((out / "bench.json").read_text())
    assert data["settings"]["max_new_tokens"] == 6 and set(data["prompt_sets"]) == {"math"}
    assert data["settings"]["target_runner"] == "stateful"
    assert (out / "bench.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "GSM8K is not on PyPI" in res.output and "dflash@4" in res.output


@pytest.mark.skipif(not HAVE_GENAI, reason="openvino_genai is not installed")
def test_export_writes_an_openvino_tokenizer_that_genai_reads(tiny_pair):
    import openvino_genai as og

    from ovdflash.tokenizer import Tokenizer

    assert (tiny_pair / "target/openvino_tokenizer.xml").is_file()
    assert (tiny_pair / "target/openvino_detokenizer.xml").is_file()
    text = "def add(a, b):\n    return a + b  # The quick brown fox"
    ours = Tokenizer.from_dir(tiny_pair).encode(text, add_special_tokens=False)
    theirs = og.Tokenizer(str(tiny_pair / "target")).encode(text, add_special_tokens=False).input_ids.data[0]
    assert list(theirs) == ours
    assert og.Tokenizer(str(tiny_pair / "target")).decode(ours) == text


def test_block_sizes_parse_auto():
    assert parse_block_sizes("4, 8,auto") == [4, 8, "auto"]
    with pytest.raises(click.BadParameter):
        parse_block_sizes("4,big")


def test_auto_mode_runs_lossless_and_records_its_policy(tiny_pair, tmp_path):
    out = tmp_path / "bench"
    res = CliRunner().invoke(bench, [str(tiny_pair), "--prompt-sets", "code", "-n", "2", "--max-new-tokens", "12",
                                     "--modes", "dflash,ar", "--block-sizes", "2,auto", "--repetitions", "1",
                                     "--warmup", "0", "--no-memory", "--out", str(out),
                                     "--config", json.dumps({**STRICT_F32, "CACHE_DIR": str(tmp_path / "c"),
                                                             "INFERENCE_NUM_THREADS": 1})])
    assert res.exit_code == 0, res.output
    data = json.loads((out / "bench.json").read_text())
    assert data["modes"] == ["dflash@2", "dflash@auto", "ar"]
    assert data["agreement"]["dflash@auto"] == 1.0
    auto = data["prompt_sets"]["code"]["modes"]["dflash@auto"]
    assert auto["num_drafts"] + auto["num_ar_steps"] > 0 and "dflash@auto / best AR" in \
        data["prompt_sets"]["code"]["ratios"]
    policy = data["block_policy"]
    assert len(policy["round_ms_by_drafts"]) == len(policy["acceptance_by_position"]) + 1 == 4  # tiny block 4
    assert policy["switch_ms"] >= 0
    assert (out / "bench.png").exists()


@pytest.mark.skipif(not HAVE_GENAI, reason="openvino_genai not installed")
def test_genai_modes_never_reuse_a_cached_prompt(monkeypatch, tiny_pair):
    """Every genai pipeline gets a scheduler config with prefix caching off: with it on, a prompt
    repeated across repetitions skips its prefill, which our modes never do."""
    import openvino_genai as og

    from ovdflash.bench import GenaiRunner

    seen = []

    class FakePipeline:
        def __init__(self, *args, **kwargs):
            seen.append(kwargs.get("scheduler_config"))

    monkeypatch.setattr(og, "LLMPipeline", FakePipeline)
    manifest = json.loads((tiny_pair / "manifest.json").read_text())
    for kind in ("ar", "dflash", "pl"):
        GenaiRunner(tiny_pair, manifest, {}, [0], kind, block_size=4)
    assert len(seen) == 3
    assert all(sc is not None and sc.enable_prefix_caching is False for sc in seen)


def test_oracle_mode_accepts_whole_blocks_at_the_drafters_cost(tiny_pair, tmp_path):
    """oracle@B: the real drafter runs every round, its proposals replaced by the greedy
    continuation, so (strict f32) every round but the truncated last one accepts all B-1 drafts,
    and the output is the `ar` output."""
    config = {**STRICT_F32, "CACHE_DIR": str(tmp_path / "ov_cache"), "INFERENCE_NUM_THREADS": 1}
    res = run_benchmark(tiny_pair, ["code"], num_prompts=2, max_new_tokens=13, modes=["oracle", "dflash", "ar"],
                        block_sizes=[4, "auto"], repetitions=1, warmup=0, config=config)
    assert "oracle@4" in res["modes"] and "oracle@auto" not in res["modes"]
    assert any("oracle@auto" in note for note in res["notes"])
    e = res["prompt_sets"]["code"]["modes"]["oracle@4"]
    assert res["agreement"]["oracle@4"] == 1.0
    # a run of 13 tokens whose first token comes from the prefill: 12 = 4 rounds of 3 accepted + bonus
    runs = [r for r in res["runs"] if r["mode"] == "oracle@4"]
    full = [r for r in runs if r["tokens"] == 13]
    assert full, "the tiny target emitted EOS early in every run"
    assert e["per_position_acceptance_rate"][0] == 1.0
    assert e["mean_acceptance_length"] > 3.0
    assert e["draft_ms_per_round"] > 0  # the real drafter ran
    assert res["prompt_sets"]["code"]["ratios"]["oracle@4 / best AR"] == pytest.approx(e["speedup"])


def test_the_oracle_reuses_no_prefix_when_the_pipeline_does_not(tiny_pair):
    """A prompt run again by oracle@B prefills it whole, as every other mode of the bench does."""
    from ovdflash import DFlashPipeline
    from ovdflash.bench.modes import OracleRunner

    for prefix_cache in (False, True):
        pipe = DFlashPipeline.from_pretrained(tiny_pair, prefix_cache=prefix_cache, **STRICT_F32)
        oracle = OracleRunner(pipe, 4)
        prompt = list(range(5, 25))
        first = oracle(prompt, 9)
        again = oracle(prompt, 9)  # its reference is known: nothing else ran on the target in between
        assert again[0] == first[0]
        assert (again[3].num_cached_prompt_tokens > 0) == prefix_cache


def test_plot_gives_every_mode_its_own_label_and_style(tmp_path):
    """The speedup panel: one legend entry per (prompt set, mode kind), each naming its mode, and
    each mode kind its own line style (the drafter alone is not the perfect drafter)."""
    from ovdflash.bench import plot

    kinds = ("dflash", "dflash-nopl", "oracle", "genai-dflash")
    result = {"prompt_sets": {s: {"modes": {f"{k}@{b}": {"speedup": 1.0 + b / 10, "per_position_acceptance_rate": [0.5]}
                                            for k in kinds for b in (2, 4)}} for s in ("code", "chat")}}
    fig = plot(result, tmp_path / "bench.png")
    lines = [line for line in fig.axes[1].get_lines() if not line.get_label().startswith("_")]
    labels = [line.get_label() for line in lines]
    assert len(labels) == len(set(labels)) == 2 * len(kinds)
    for s in ("code", "chat"):
        for k in kinds:  # exactly one label names this set and this mode (not a longer mode's name)
            named = [label for label in labels if label.startswith(f"{s}, ") and label.split(", ")[1].split()[0] == k]
            assert len(named) == 1, (s, k, labels)
    styles = {label.split(", ")[1].split()[0]: line.get_linestyle() for label, line in zip(labels, lines)}
    assert len(set(styles.values())) == len(kinds)
    assert [t.get_text() for t in fig.axes[1].get_legend().get_texts()] == labels


def test_cli_reports_progress_per_run_and_records_the_host(tiny_pair, tmp_path):
    from ovdflash.ov.host import collect

    out = tmp_path / "bench"
    res = CliRunner().invoke(bench, [str(tiny_pair), "--prompt-sets", "code", "-n", "2", "--max-new-tokens", "4",
                                     "--modes", "dflash,ar", "--block-sizes", "2", "--repetitions", "1",
                                     "--warmup", "0", "--no-memory", "--out", str(out),
                                     "--config", json.dumps({**STRICT_F32, "CACHE_DIR": str(tmp_path / "c")})])
    assert res.exit_code == 0, res.output
    lines = [line for line in res.stderr.splitlines() if line.startswith("run ")]
    assert [line.split(":")[0] for line in lines] == [f"run {i}/4" for i in range(1, 5)]  # 2 modes x 2 prompts
    assert {line.split(": ")[1].split()[-1] for line in lines} == {"dflash@2", "ar"}
    assert "run 1/4" not in res.stdout  # the tables' stdout stays clean
    host = json.loads((out / "bench.json").read_text())["host"]
    assert set(host) == set(collect()) and "model" not in host
    assert host["cpu"] == collect()["cpu"]
