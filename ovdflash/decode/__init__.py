"""Token-level decoding with no OpenVINO: the round, the two executors, sampling, drafts and their policies.

Layout: `sequence` (one sequence's loop: `speculative_round`, `autoregressive_step`, `generate`,
and the runner interfaces it drives), `scheduler` (continuous batching: many sequences, one target
call per round), `sampling` (exact rejection sampling, seeds per position), `lookup` (n-gram
drafts), `block_policy` (drafts per round from measured costs), `prefix_cache` (prompt reuse across
calls), `stats`. May import: numpy and this package only; the runners come in as objects that meet
the interfaces (tests drive them with mock models).
"""
