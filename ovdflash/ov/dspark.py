"""DSpark drafters on OpenVINO: their runtime graph and their proposer, the Markov walk.

Contract (docs/DESIGN.md, "DSpark drafters"):
- `dspark_for_runtime(drafter, target, draft_vocab=None)`: the runtime graph of a saved DSpark drafter IR
  (rt_info `dflash/kind` "dspark"): `input_ids [1,B]` looked up in the target's table as for DFlash, and
  outputs `draft_logits [1,B-1,V']` (the target head's logits of every slot, over the draft vocabulary
  when given) and `draft_hidden [1,B-1,H]` (the slots' hidden states, for the confidence head). In place;
  a graph of another kind is a one-line ValueError.
- `read_heads(path, vocab_ids=None)`: the Markov and confidence heads the export wrote
  (`manifest.DSPARK_HEADS`), `markov_w2`'s rows cut to the draft vocabulary when given.
  `attach_heads(compiled, heads)` records them for that compiled graph, so every `OVDrafter` built on it
  (the batch's drafter pool too) walks with them.
- `walk(logits, anchor, heads, vocab_ids)`: DeepSpec's greedy draft: slot i takes the argmax of
  `logits[i] + markov_w2 @ markov_w1[prev]`, prev being the anchor at slot 0 and slot i-1's draft after.
  Returns the drafts as target ids; a walk over the first n slots is the first n of a longer one.
- `DSparkWalk(compiled)`: the proposal reader `runners.OVDrafter` uses on such a graph: `read(request,
  num_drafts)` walks the first num_drafts slots of its last inference and keeps each slot's predicted
  acceptance in `confidence` (None without a confidence head): conditional on the slots before it being
  accepted, as DeepSpec trains the head (its target is slot i's acceptance given the true prefix; the
  chance of reaching slot i is the product), which the block policy's cut reads
  (decode.block_policy, `cut`). The walk's choice is a deterministic
  proposal (q = one-hot), which is what `decode.sampling` verifies exactly.
May import: numpy, openvino and `.graphs`.
"""
from __future__ import annotations

import weakref
from dataclasses import dataclass

import numpy as np
import openvino as ov

from .graphs import add_named_result, graft_embedding, graft_head

DSPARK_OUTPUTS = ("draft_logits", "draft_hidden")
_HEADS: "weakref.WeakKeyDictionary[ov.CompiledModel, DSparkHeads]" = weakref.WeakKeyDictionary()


@dataclass
class DSparkHeads:
    markov_w1: np.ndarray | None = None  # [V, r], rows by target id
    markov_w2: np.ndarray | None = None  # [V', r], rows by draft-vocabulary position
    confidence_weight: np.ndarray | None = None  # [H] or [H + r]
    confidence_bias: float = 0.0
    vocab_ids: np.ndarray | None = None  # draft vocabulary position -> target id (None: the identity)


def dspark_for_runtime(drafter: ov.Model, target: ov.Model, draft_vocab=None) -> ov.Model:
    """Graft the target's embedding and head onto a DSpark drafter; output every slot's logits and hidden state."""
    kind = drafter.get_rt_info(["dflash", "kind"]).astype(str) if drafter.has_rt_info(["dflash", "kind"]) \
        else "dflash"
    if kind != "dspark":
        raise ValueError(f"the drafter IR is a {kind!r} drafter, not 'dspark': re-export the model directory")
    hidden = drafter.output("last_hidden_state").get_node().input_value(0)
    graft_embedding(drafter, target)
    logits, _ = graft_head(drafter, target, draft_vocab)
    add_named_result(drafter, logits, "draft_logits")
    add_named_result(drafter, hidden, "draft_hidden")
    drafter.validate_nodes_and_infer_types()
    return drafter


def read_heads(path, vocab_ids=None) -> DSparkHeads:
    with np.load(path, allow_pickle=False) as f:
        arrays = {k: np.ascontiguousarray(f[k], dtype=np.float32) for k in f.files}
    heads = DSparkHeads(arrays.get("markov_w1"), arrays.get("markov_w2"), arrays.get("confidence_weight"),
                        float(arrays["confidence_bias"][0]) if "confidence_bias" in arrays else 0.0)
    if vocab_ids is not None:
        heads.vocab_ids = np.unique(np.asarray(vocab_ids, dtype=np.int64))
        if heads.markov_w2 is not None:
            heads.markov_w2 = np.ascontiguousarray(heads.markov_w2[heads.vocab_ids])
    return heads


def attach_heads(compiled: ov.CompiledModel, heads: DSparkHeads) -> None:
    _HEADS[compiled] = heads


def is_dspark_graph(compiled: ov.CompiledModel) -> bool:
    names = {name for port in compiled.outputs for name in port.get_names()}
    return all(name in names for name in DSPARK_OUTPUTS)


def slot_logits(logits: np.ndarray, previous: np.ndarray, heads: DSparkHeads) -> np.ndarray:
    """logits [n,V'] plus each slot's Markov bias from its previous token (target ids [n])."""
    if heads.markov_w1 is None:
        return np.asarray(logits, dtype=np.float32)
    # einsum's own loop, not BLAS: BLAS threads fight the plugin's for the cores right after an inference
    return logits + np.einsum("nr,vr->nv", heads.markov_w1[previous], heads.markov_w2)


def walk(logits: np.ndarray, anchor: int, heads: DSparkHeads) -> np.ndarray:
    """logits [n,V'] -> the n greedy drafts (target ids), each slot biased by the previous choice."""
    chosen = np.empty(len(logits), dtype=np.int64)
    previous = int(anchor)
    for slot in range(len(logits)):
        row = slot_logits(logits[slot:slot + 1], np.array([previous]), heads)[0]
        index = int(np.argmax(row))
        previous = index if heads.vocab_ids is None else int(heads.vocab_ids[index])
        chosen[slot] = previous
    return chosen


def predicted_acceptance(hidden: np.ndarray, previous: np.ndarray, heads: DSparkHeads) -> np.ndarray | None:
    """Each slot's predicted acceptance (sigmoid of the confidence head), or None without the head."""
    if heads.confidence_weight is None:
        return None
    features = hidden
    if len(heads.confidence_weight) > hidden.shape[-1]:  # the head also reads the Markov embedding
        features = np.concatenate([hidden, heads.markov_w1[previous]], axis=-1)
    return 1.0 / (1.0 + np.exp(-(features @ heads.confidence_weight + heads.confidence_bias)))


class DSparkWalk:
    """DSpark proposals: the Markov walk over the compiled graph's slot logits."""

    def __init__(self, compiled: ov.CompiledModel):
        if compiled not in _HEADS:
            raise ValueError("a DSpark drafter graph needs its heads (ovdflash.ov.dspark.attach_heads)")
        self.heads = _HEADS[compiled]
        self.logits_out, self.hidden_out = (compiled.output(name) for name in DSPARK_OUTPUTS)
        self.input_ids = compiled.input("input_ids")
        self.confidence: np.ndarray | None = None

    def read(self, request: ov.InferRequest, num_drafts: int) -> np.ndarray:
        logits = request.get_tensor(self.logits_out).data[0, :num_drafts]
        anchor = int(request.get_tensor(self.input_ids).data[0, 0])
        drafts = walk(logits, anchor, self.heads)
        previous = np.concatenate(([anchor], drafts[:-1])).astype(np.int64)
        hidden = request.get_tensor(self.hidden_out).data[0, :num_drafts]
        self.confidence = predicted_acceptance(hidden, previous, self.heads)
        return drafts
