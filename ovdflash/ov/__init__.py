"""Everything that touches OpenVINO: compiling the pair, the target runners (stateful, paged, hybrid), the batched paged target and its KV pool, the drafter and its pool, graph surgery, precision, the f32-weight copy, memory and host facts.

Layout: `compile` (read, adapt, compile: `compile_runners`), `inference` (`run_request`, the
logits rows of a call), `runners` (OVTarget, the stateful runner; OVDrafter and the DFlash
proposer), `dflash2` (a DFlash 2 drafter's runtime graph and its proposer, the selector walk), `paged` (`PagedKV`, the
paged KV cache both paged targets share, and OVPagedTarget), `paged_batch` (the batched paged
target, the pool's default size, a request per sequence's drafter), `drafter_rows` (a batch's DFlash
drafters as rows of one request: a round's drafter calls in one inference), `block_pool` (bookings, block tables and the
prefix cache of the batch's KV blocks), `hybrid` (linear-attention targets), `graphs` (IR edits), `precision` (numerics
per host), `wide_target` (the f32-weight copy), `memory` (resident pages), `host` (CPU, ISA,
versions). May import: `decode` (its interfaces and stats), the manifest; never the pipeline, the
server, the bench or `cli`.
"""
