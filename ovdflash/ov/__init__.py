"""Everything that touches OpenVINO: compiling the pair, the target runners (stateful, paged, hybrid), the batched paged target and its KV pool, the drafter and its pool, graph surgery, precision, the f32-weight copy, memory and host facts.

Layout: `compile` (read, adapt, compile: `compile_runners`), `runners` (OVTarget, OVPagedTarget,
OVDrafter, `run_request`), `paged_batch` (the batched paged target, its block pool and prefix cache,
the drafter pool), `hybrid` (linear-attention targets), `graphs` (IR edits), `precision` (numerics
per host), `wide_target` (the f32-weight copy), `memory` (resident pages), `host` (CPU, ISA,
versions). May import: `decode` (its interfaces and stats), the manifest; never the pipeline, the
server, the bench or `cli`.
"""
