"""The single-sequence block_size="auto" policy, calibrated on the pipeline's own models.

Contract:
- `auto_block_policy(pipe) -> BlockPolicy` is `DFlashPipeline.auto_block_policy`: on first use it
  measures, under the pipeline's lock, the verify cost of 1..CALIBRATED_DRAFTS + 1 tokens and the
  draft cost on the real models (block_policy.measure_costs, on the chat-rendered
  CALIBRATION_PROMPT, or 32 plain ids without a tokenizer), extended linearly to the trained block
  size, invalidates the prefix cache (the measurement ran the runners) and keeps the policy in
  `pipe.block_policy`, which then learns acceptance across calls. ValueError without a drafter.

Imports: decode/; never ov/ (the runners come in with the pipeline), the pipeline, server/, bench/
or cli/.
"""
from __future__ import annotations

from .decode.block_policy import BlockPolicy, measure_costs

CALIBRATION_PROMPT = "Explain in a few sentences how a CPU cache speeds up a program."


# drafts per round that "auto" times on first use; longer blocks extend the cost curve linearly
# (block_policy.measure_costs: each shape run costs resident memory). 4 drafts: a 5-token verify,
# because 1-4 tokens cost about an AR step and a fifth a step more (docs/BENCHMARKS.md, Verify cost);
# timed only up to 4 tokens, that jump was invisible and "auto" verified blocks past it.
CALIBRATED_DRAFTS = 4


def auto_block_policy(pipe) -> BlockPolicy:
    """The policy behind block_size="auto": on first use, measures the verify cost of
    1..CALIBRATED_DRAFTS + 1 tokens and the draft cost on the real models, extended linearly
    to the trained block size."""
    if pipe.block_policy is None:
        if pipe.drafter is None:
            raise ValueError("block_size='auto' needs a drafter")
        prompt = (pipe.encode_prompt([{"role": "user", "content": CALIBRATION_PROMPT}]) if pipe.tokenizer
                  else list(range(1, 33)))
        with pipe._lock.hold():  # the measurement runs the models
            step_cost_s, draft_cost_s, switch_cost_s = measure_costs(
                pipe.target, pipe.drafter, prompt, pipe.block_size - 1, measured_drafts=CALIBRATED_DRAFTS)
            pipe.prefix_store.invalidate()  # the measurement ran the runners outside the engine
        pipe.block_policy = BlockPolicy(step_cost_s, draft_cost_s, switch_cost_s)
    return pipe.block_policy
