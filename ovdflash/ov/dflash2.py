"""DFlash 2 drafters on OpenVINO: their runtime graph and their proposer, the selector walk.

Contract (docs/DESIGN.md, "DFlash 2 drafters"):
- `selector_for_runtime(drafter, target, draft_vocab=None)`: the runtime graph of a saved DFlash 2
  drafter IR (rt_info `dflash/kind` "dflash2"; inputs `candidate_ids`, `anchor_ids`; output
  `transition_scores`). Like `graphs.drafter_for_runtime` it takes `input_ids [1,B]` and applies the
  target's head (over the draft vocabulary when given); the logits are scaled by
  `dflash/output_multiplier` and capped by `dflash/final_logit_softcapping` (0: no cap), each draft
  slot's top `dflash/selector_top_k` become the IR's `candidate_ids` (as target ids) and
  `input_ids[:, 0]` its `anchor_ids`. Outputs: `draft_candidates [1,B-1,k] i64`, `draft_scores
  [1,B-1,k] f32` (their capped logits: the unary scores) and `transition_scores [1,B-1,k,k] f32`.
  In place; a DFlash 1 IR, or a draft vocabulary smaller than k, is a one-line ValueError.
- `walk(candidates, unary, transitions)`: z-lab's greedy selector walk: from the anchor, slot p
  takes candidate `argmax_j unary[p,j] + transitions[p,i,j]`, i being slot p-1's choice (row 0 at
  p = 0, where every row scores from the anchor). Returns the chosen target ids. A walk over the
  first n slots is the first n of a longer walk.
- `SelectorWalk(compiled)`: the proposal reader `runners.OVDrafter` uses on such a compiled graph
  (`is_selector_graph`): `read(request, num_drafts)` walks the first num_drafts slots of its last
  inference. The walk's choice is a deterministic proposal (q = one-hot), which is what
  `decode.sampling` verifies exactly.
May import: numpy, openvino and `.graphs`.
"""
from __future__ import annotations

import numpy as np
import openvino as ov
import openvino.opset13 as ops

from .graphs import add_named_result, graft_embedding, graft_head, to_target_ids

SELECTOR_OUTPUTS = ("draft_candidates", "draft_scores", "transition_scores")


def _rt_value(model: ov.Model, key: str, role: str) -> str:
    if not model.has_rt_info(["dflash", key]):
        raise ValueError(f"the DFlash 2 drafter IR has no rt_info dflash/{key} ({role}): re-export it")
    raw = model.get_rt_info(["dflash", key])
    return raw.astype(str) if hasattr(raw, "astype") else str(raw)


def selector_for_runtime(drafter: ov.Model, target: ov.Model, draft_vocab=None) -> ov.Model:
    """Graft the target's embedding and head, the top-k and the candidates' feed onto a DFlash 2 drafter."""
    kind = drafter.get_rt_info(["dflash", "kind"]).astype(str) if drafter.has_rt_info(["dflash", "kind"]) \
        else "dflash"
    if kind != "dflash2":
        raise ValueError(f"the drafter IR is a {kind!r} drafter, not 'dflash2': re-export the model directory")
    top_k = int(_rt_value(drafter, "selector_top_k", "candidates per slot"))
    multiplier = float(_rt_value(drafter, "output_multiplier", "logit scale"))
    softcap = float(_rt_value(drafter, "final_logit_softcapping", "logit cap"))

    input_ids = graft_embedding(drafter, target)
    logits, vocab_ids = graft_head(drafter, target, draft_vocab)
    vocab_size = logits.get_partial_shape()[2].get_length()
    if top_k > vocab_size:
        raise ValueError(f"selector_top_k {top_k} exceeds the draft vocabulary's {vocab_size} ids")
    if multiplier != 1.0:
        logits = ops.multiply(logits, ops.constant(np.float32(multiplier))).output(0)
    if softcap > 0:
        cap = ops.constant(np.float32(softcap))
        logits = ops.multiply(ops.tanh(ops.divide(logits, cap)), cap).output(0)
    top = ops.topk(logits, ops.constant(top_k, ov.Type.i64), axis=-1, mode="max", sort="value",
                   index_element_type=ov.Type.i64)
    candidates = to_target_ids(top.output(1), vocab_ids)
    anchor = ops.gather(input_ids, ops.constant([0], ov.Type.i64), ops.constant(1, ov.Type.i64))
    anchor = ops.reshape(anchor, ops.constant([-1], ov.Type.i64), special_zero=False)
    for name, source in (("candidate_ids", candidates), ("anchor_ids", anchor.output(0))):
        port = drafter.input(name)
        for consumer in list(port.get_target_inputs()):
            consumer.replace_source_output(source)
        drafter.remove_parameter(port.get_node())
    add_named_result(drafter, candidates, "draft_candidates")
    add_named_result(drafter, top.output(0), "draft_scores")
    drafter.validate_nodes_and_infer_types()
    return drafter


def walk(candidates: np.ndarray, unary: np.ndarray, transitions: np.ndarray) -> np.ndarray:
    """candidates, unary [n,k]; transitions [n,k,k] -> the n chosen ids (module contract)."""
    chosen = np.empty(len(candidates), dtype=np.int64)
    previous = 0  # at slot 0 every row scores from the anchor
    for slot in range(len(candidates)):
        previous = int(np.argmax(unary[slot] + transitions[slot, previous]))
        chosen[slot] = candidates[slot, previous]
    return chosen


def is_selector_graph(compiled: ov.CompiledModel) -> bool:
    names = {name for port in compiled.outputs for name in port.get_names()}
    return all(name in names for name in SELECTOR_OUTPUTS)


class SelectorWalk:
    """DFlash 2 proposals: the selector walk over the compiled graph's candidates and scores."""

    def __init__(self, compiled: ov.CompiledModel):
        self.outputs = [compiled.output(name) for name in SELECTOR_OUTPUTS]

    def read(self, request: ov.InferRequest, num_drafts: int) -> np.ndarray:
        candidates, unary, transitions = (request.get_tensor(out).data[0, :num_drafts] for out in self.outputs)
        return walk(candidates, unary, transitions)
