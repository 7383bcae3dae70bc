"""Every sequence's drafter as a row of one request (ov.drafter_rows), on the tiny exported pair under
STRICT_F32: each row proposes what its own OVDrafter proposes, through joins, departures, rounds it
sits out, rewinds and compactions, and a batched round makes one drafter inference."""
import numpy as np
import pytest

from ovdflash import STRICT_F32, DFlashPipeline
from ovdflash.decode.sampling import SamplingParams
from ovdflash.decode.scheduler import Scheduler
from ovdflash.decode.sequence import generate
from ovdflash.ov import drafter_rows
from ovdflash.ov.drafter_rows import DrafterRows
from ovdflash.ov.paged_batch import DrafterPool, batch_target_for
from ovdflash.ov.runners import OVDrafter


@pytest.fixture(scope="module")
def pipe(tiny_pair, tmp_path_factory):
    return DFlashPipeline.from_pretrained(tiny_pair, cache_dir=tmp_path_factory.mktemp("cache"),
                                          INFERENCE_NUM_THREADS=1, **STRICT_F32)


def own_drafter(pipe, exact):
    d = pipe.drafter
    return OVDrafter(d.compiled, d.block_size, d.mask_token_id, pipe.target.max_length, exact_passes=exact,
                     seq_axes=d.seq_axes)


@pytest.mark.parametrize("exact", [False, True])
def test_each_row_proposes_what_its_own_drafter_proposes(pipe, exact):
    rows = DrafterRows(own_drafter(pipe, exact), compact_fraction=0.3, compact_min_garbage=8)
    assert rows.heads_rows  # the runtime graph scores only the drafting rows (graphs.with_draft_rows)
    width = pipe.drafter.compiled.input("hidden_states").get_partial_shape()[2].get_length()
    rng = np.random.default_rng(1 + exact)
    live, checked, rewound, sizes = {}, 0, 0, set()
    for step in range(80):
        if not live or (len(live) < 4 and rng.random() < 0.4):
            live[step] = [rows.take(), own_drafter(pipe, exact), 0, int(rng.integers(3, 60))]
        if len(live) > 1 and rng.random() < 0.12:
            rows.give(live.pop(list(live)[int(rng.integers(len(live)))])[0])
        if rng.random() < 0.1:  # prefix reuse cuts a context back
            row, own, length, _ = live[list(live)[0]]
            if length > 4:
                kept = int(rng.integers(1, length))
                row.rewind(kept)
                own.rewind(kept)
                live[list(live)[0]][2] = kept
                rewound += 1
        calls, wanted = [], []
        for entry in live.values():
            row, own, length, first = entry
            if length and rng.random() < 0.25:
                continue  # sits this round out (lookup drafts, or an AR step)
            feats = rng.standard_normal((first if not length else int(rng.integers(1, 6)), width)).astype(np.float32)
            start, last, k = length + len(feats), int(rng.integers(1, 500)), int(rng.integers(1, pipe.block_size))
            calls.append((row, last, feats, start, k))
            wanted.append(own.propose(last, feats, start, k))
            entry[2] = start
        if calls:
            sizes.add(len(calls))
            for got, want in zip(rows.propose_many(calls), wanted):
                np.testing.assert_array_equal(got, want)
                checked += 1
        assert rows.state_rows == len(rows.members) == len(live) or not calls
    assert checked > 100 and rewound and rows.num_compactions > 0 and max(sizes) >= 3


def test_a_batched_round_makes_one_drafter_inference_and_every_sequence_equals_its_run_alone(pipe, monkeypatch):
    calls = []
    real = drafter_rows.run_request
    monkeypatch.setattr(drafter_rows, "run_request", lambda request, inputs: (calls.append(len(inputs["beam_idx"])),
                                                                             real(request, inputs)))
    rng = np.random.default_rng(4)
    reqs = [(i, rng.integers(1, 500, size=int(rng.integers(3, 30))).tolist(), int(rng.integers(4, 14)))
            for i in range(6)]
    scheduler = Scheduler(batch_target_for(pipe.target, pool_blocks=64), DrafterRows(pipe.drafter), max_batch_size=4)
    for i, prompt, max_new in reqs:
        scheduler.add(i, prompt, max_new, SamplingParams(), pipe.block_size)
    events, steps = {}, 0
    while scheduler.has_work():
        before = len(calls)
        for rid, evs in scheduler.step():
            events.setdefault(rid, []).extend(evs)
        assert len(calls) - before <= 1
        steps += 1
    for i, prompt, max_new in reqs:
        want = list(generate(pipe.target, pipe.drafter, prompt, max_new, SamplingParams(), (), pipe.block_size))
        assert events[i] == want, i
    assert 0 < len(calls) <= steps and max(calls) == 4


def test_generate_batch_uses_rows_and_a_drafter_pool_still_serves(pipe):
    assert isinstance(pipe.drafter_pool(), DrafterRows)
    rng = np.random.default_rng(7)
    prompts = [rng.integers(1, 500, size=int(n)).tolist() for n in (5, 19, 12)]
    batch = pipe.generate_batch(prompts, max_new_tokens=9, max_batch_size=3, block_size=pipe.block_size,
                               prompt_lookup=False)
    scheduler = Scheduler(batch_target_for(pipe.target, pool_blocks=64), DrafterPool(pipe.drafter), max_batch_size=3)
    stats = [scheduler.add(i, p, 9, SamplingParams(), pipe.block_size) for i, p in enumerate(prompts)]
    events = {}
    while scheduler.has_work():
        for rid, evs in scheduler.step():
            events.setdefault(rid, []).extend(evs)
    for i, got in enumerate(batch):
        assert got.token_ids == [e.token for e in events[i]]
        assert got.stats.num_accepted_tokens == stats[i].num_accepted_tokens


def test_a_row_given_back_or_out_of_step_is_refused(pipe):
    rows = DrafterRows(pipe.drafter)
    width = pipe.drafter.compiled.input("hidden_states").get_partial_shape()[2].get_length()
    row = rows.take()
    feats = np.zeros((3, width), dtype=np.float32)
    with pytest.raises(RuntimeError, match="out of sync: 0 \\+ 3 != 4"):
        row.propose(5, feats, 4, 1)
    rows.give(row)
    with pytest.raises(RuntimeError, match="given back"):
        row.propose(5, feats, 3, 1)
