"""The interfaces with every drafter kind: a tiny DFlash 2 and a tiny DSpark pair (the default tiny qwen3 target,
random drafters from `ovdflash_export.tiny.make_tiny_drafter`, block 4) under STRICT_F32.

Checked per kind: `ovdflash serve` (served from a thread, one request at a time and batched) answers the
official `openai` client with the pipeline's no-draft text, with and without n-gram lookup drafts (and
lookup rounds only with them); `generate_batch` over prompts sharing a system prompt (prefix cache on)
gives each prompt its single run and reuses the shared blocks; a chat's second turn reuses the first's KV
with unchanged text; `ovdflash chat --prompt` drafts; `ovdflash bench` completes with acceptance stats,
names the kind, and skips genai-dflash (openvino.genai runs DFlash 1 drafters only); `ovdflash bench
--concurrency` names the kind and its batches give batch-ar's tokens.
"""
import json

import numpy as np
import pytest
from click.testing import CliRunner
from drafter_checks import strict_pipe

from ovdflash import STRICT_F32

openai = pytest.importorskip("openai")
pytest.importorskip("fastapi")

KINDS = ["dflash2", "dspark"]
BLOCK = 4
MAX_NEW = 12
REPEATS = "ab ab ab ab ab ab ab ab"  # lookup finds its n-grams


@pytest.fixture(scope="module", params=KINDS)
def pair(request, tiny_sources, tmp_path_factory):
    """(kind, exported model directory, its STRICT_F32 pipeline)."""
    from ovdflash_export.exporter import export_pair
    from ovdflash_export.tiny import make_tiny_drafter

    if request.param == "dflash2":
        pytest.importorskip("dflash.model")  # z-lab's package builds the tiny DFlash 2 drafter
    kind, root = request.param, tmp_path_factory.mktemp(f"kinds_{request.param}")
    target, _ = tiny_sources()
    drafter = make_tiny_drafter(target, root / "drafter", block_size=BLOCK, target_layer_ids=[1, 2], seed=3, kind=kind)
    model_dir = export_pair(target, drafter, root / "pair")
    return kind, model_dir, strict_pipe(model_dir, root / "ov_cache")


@pytest.mark.parametrize("max_num_seqs", [1, 4], ids=["sequential", "batched"])
def test_serve_replies_equal_the_no_draft_reply_with_and_without_lookup(pair, max_num_seqs):
    from test_serve import serving_app

    from ovdflash.server.wiring import build_server_app

    _, _, pipe = pair
    messages = [{"role": "user", "content": REPEATS}]
    chat_ref = pipe.generate(messages, MAX_NEW, draft=False).text
    text_ref = pipe.generate(REPEATS, MAX_NEW, draft=False).text
    try:
        for lookup in (False, True):
            pipe.prompt_lookup = lookup
            app = build_server_app(pipe, ["tiny"], block_size=BLOCK, max_num_seqs=max_num_seqs)
            with serving_app(app) as url:
                client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=120)
                reply = client.chat.completions.create(model="tiny", messages=messages, max_tokens=MAX_NEW,
                                                       temperature=0)
                stream = client.completions.create(model="tiny", prompt=REPEATS, max_tokens=MAX_NEW, temperature=0,
                                                   stream=True)
                streamed = "".join(chunk.choices[0].text for chunk in stream if chunk.choices)
            assert reply.choices[0].message.content == chat_ref, lookup
            assert streamed == text_ref, lookup
            spec = reply.usage.model_extra["spec_decode"]
            assert spec["num_drafts"] > 0
            assert (spec["num_lookup_drafts"] > 0) == lookup
    finally:
        pipe.prompt_lookup = True


def test_a_batch_sharing_a_prefix_equals_single_runs_and_a_second_turn_reuses_the_first(pair):
    _, _, pipe = pair
    rng = np.random.default_rng(5)
    system = rng.integers(1, 400, 40).tolist()
    prompts = [system + rng.integers(1, 400, n).tolist() for n in (3, 9, 5)]
    for kwargs in ({}, {"temperature": 0.8, "seed": 3}):
        batch = pipe.generate_batch(prompts, max_new_tokens=MAX_NEW, max_batch_size=2, **kwargs)
        single = [pipe.generate(p, max_new_tokens=MAX_NEW, prefix_cache=False, **kwargs) for p in prompts]
        assert [r.token_ids for r in batch] == [r.token_ids for r in single], kwargs
        assert sum(r.stats.num_cached_prompt_tokens for r in batch) > 0  # the shared blocks were reused
    first = pipe.generate(prompts[0], max_new_tokens=MAX_NEW)
    turn = prompts[0] + first.token_ids + [7, 8, 9]
    second = pipe.generate(turn, max_new_tokens=MAX_NEW)
    assert pipe.last_stats.num_cached_prompt_tokens > 0
    assert second.token_ids == pipe.generate(turn, max_new_tokens=MAX_NEW, draft=False).token_ids


def test_chat_cli_drafts(pair, tmp_path):
    from ovdflash.cli import main

    _, model_dir, _ = pair
    res = CliRunner().invoke(main, ["chat", str(model_dir), "--prompt", REPEATS, "-n", str(MAX_NEW), "--block-size",
                                    str(BLOCK), "--cache-dir", str(tmp_path)])
    assert res.exit_code == 0, res.output
    assert "accept len" in res.stderr


def test_bench_cli_names_the_kind_and_reports_acceptance(pair, tmp_path):
    from ovdflash.cli.bench import bench

    kind, model_dir, _ = pair
    out = tmp_path / "bench"
    res = CliRunner().invoke(bench, [str(model_dir), "--prompt-sets", "code", "-n", "1", "--max-new-tokens", "8",
                                     "--modes", "dflash,ar,genai-dflash", "--block-sizes", str(BLOCK),
                                     "--repetitions", "1", "--warmup", "0", "--no-memory", "--out", str(out),
                                     "--config", json.dumps({**STRICT_F32, "CACHE_DIR": str(tmp_path / "c"),
                                                             "INFERENCE_NUM_THREADS": 1})])
    assert res.exit_code == 0, res.output
    data = json.loads((out / "bench.json").read_text())
    assert data["settings"]["drafter_kind"] == kind and f"drafter kind: {kind}" in res.stdout
    entry = data["prompt_sets"]["code"]["modes"][f"dflash@{BLOCK}"]
    assert entry["num_drafts"] > 0 and entry["mean_acceptance_length"] >= 1.0
    assert data["agreement"][f"dflash@{BLOCK}"] == 1.0
    assert data["modes"] == [f"dflash@{BLOCK}", "ar"]
    assert f"genai-dflash: skipped, openvino.genai runs DFlash 1 drafters and this one is {kind!r}" in data["notes"]
    res = CliRunner().invoke(bench, [str(model_dir), "--concurrency", "2", "--prompt-sets", "code", "-n", "2",
                                     "--max-new-tokens", "6", "--modes", "batch-dflash,batch-ar", "--block-sizes",
                                     str(BLOCK), "--repetitions", "1", "--warmup", "0", "--out", str(out),
                                     "--config", json.dumps({**STRICT_F32, "CACHE_DIR": str(tmp_path / "c")})])
    assert res.exit_code == 0, res.output
    data = json.loads((out / "bench_concurrency.json").read_text())
    assert data["settings"]["drafter_kind"] == kind and data["agreement"][f"batch-dflash@{BLOCK}"]["2"] == 1.0


def test_serve_and_chat_take_the_confidence_threshold(pair, tmp_path):
    """`--confidence-threshold` reaches the served pipeline: with DSpark, 1.0 verifies one draft a round
    and 0.0 the whole block, the text the same; out of [0, 1] it is refused before any load."""
    from test_serve import serving_app

    from ovdflash.cli import main
    from ovdflash.server.wiring import build_server_app, load_pipeline

    kind, model_dir, _ = pair
    strict = tuple(f"{k}={v}" for k, v in {**STRICT_F32, "INFERENCE_NUM_THREADS": 1}.items())
    for bad in ("1.5", "-0.1"):
        res = CliRunner().invoke(main, ["serve", str(model_dir), "--confidence-threshold", bad])
        assert res.exit_code == 2 and "--confidence-threshold" in res.output, res.output
    with pytest.raises(ValueError, match="confidence_threshold"):
        load_pipeline(model_dir, "CPU", False, tmp_path, None, False, None, strict, BLOCK, confidence_threshold=2.0)
    if kind != "dspark":
        return
    replies = {}
    for threshold in (0.0, 1.0):
        pipe = load_pipeline(model_dir, "CPU", False, tmp_path, None, False, None, strict, BLOCK,
                             confidence_threshold=threshold)
        assert pipe.confidence_threshold == threshold
        with serving_app(build_server_app(pipe, ["tiny"], block_size=BLOCK)) as url:
            client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=120)
            replies[threshold] = client.completions.create(model="tiny", prompt=REPEATS, max_tokens=MAX_NEW,
                                                           temperature=0)
    spec = {t: r.usage.model_extra["spec_decode"] for t, r in replies.items()}
    assert replies[0.0].choices[0].text == replies[1.0].choices[0].text
    assert spec[1.0]["num_draft_tokens"] == spec[1.0]["num_drafts"] > 0
    assert spec[0.0]["num_draft_tokens"] > spec[0.0]["num_drafts"] > 0
