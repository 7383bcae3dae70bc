"""Token-level decoding with no OpenVINO: the round, the two executors, sampling, drafts and their policies.

Layout: `round` (one sequence's round, written once: drafts, acceptance, the drafter's context,
events and stop rules; the drafter interface), and its two executors: `sequence` (one sequence on
its own runners: `speculative_round`, `autoregressive_step`, `generate`, the target interface) and
`scheduler` (continuous batching: many sequences, one target call per round); `sampling` (exact
rejection sampling, seeds per position, per-token logprobs), `logits_processors` (penalties and logit
bias, row by row inside a verified block), `structured` (structured outputs: a grammar's mask row by
row, drafts cut where it forbids them), `lookup` (n-gram drafts), `block_policy` (drafts per round
from measured costs, and where a drafter's confidence cuts its proposal), `prefix_cache` (prompt reuse across calls), `stats`. May import: numpy and
this package only; the runners come in as objects that meet the interfaces (tests drive them with
mock models).
"""
