"""Graph surgery that turns the saved IRs into the runtime's graphs (pure openvino, no torch).

Contract (docs/DESIGN.md, "Runtime graphs"):

* ``target_for_runtime(model, target_layer_ids)``: adds input ``logits_indices [N] i64``
  (the rows of T whose logits are computed: a Gather in front of the lm_head MatMul) and
  output ``target_hidden [1,T,n*Ht]`` (the located decoder-layer outputs, concatenated in
  ``target_layer_ids`` order). Outputs are ``logits [1,N,V]`` and ``target_hidden``.
* ``drafter_for_runtime(drafter, target)``: replaces the drafter's ``inputs_embeds`` by
  ``input_ids [1,B] i64`` looked up in the target's embedding table (the target's weight
  nodes, decompression subgraphs included, are reused, not copied), applies the target's
  lm_head to ``last_hidden_state`` and outputs ``draft_tokens [1,B-1] i64`` (argmax).
* ``drafter_for_runtime(drafter, target, draft_vocab=ids)``: the same, but only the lm_head
  rows of ``ids`` (sorted, unique target token ids: the drafter's draft vocabulary) are
  applied; the argmax over those rows is mapped back to target ids by a constant table, so
  ``draft_tokens`` = argmax of the full logits restricted to ``ids``. Lossless either way (the
  target verifies every draft); it only changes which tokens can be proposed. The rows are
  sliced out of the weight constants (compressed ones stay compressed) when the head weight
  is a plain or decompressed (Convert/Subtract/Multiply) constant; otherwise a runtime Gather.

* The pieces both drafter kinds' graphs are made of (``ovdflash.ov.dflash2`` builds the DFlash 2
  one): ``graft_embedding`` (the ``input_ids`` lookup), ``graft_head`` (the target head's logits of
  ``last_hidden_state``, over the draft vocabulary when given), ``to_target_ids``, ``add_named_result``.

* ``with_int8_head(drafter, target)``: where the drafter applies the target's whole fp16 lm_head (no
  draft vocabulary), it applies an int8 copy instead (one symmetric scale per vocabulary row, compressed
  as openvino compresses quantized weights, so the CPU plugin keeps it int8). In place; True when done.
  Lossless (only the proposals can change; the target verifies them), and the head is most of a
  full-vocabulary drafter's cost: it halves what the plugin packs for it and, with dynamic
  quantization, its time (docs/BENCHMARKS.md, "Drafter head").

* ``with_draft_rows(drafter)``: adds input ``draft_rows [N] i64`` to a DFlash drafter's runtime graph:
  only those batch rows of the block reach the head, so ``draft_tokens`` is ``[N,B-1]``; a batched
  call's rows that do not draft skip the head (``ovdflash.ov.drafter_rows``). In place; True when done.

* ``with_f32_weights(model)``: a copy whose f16 weight constants (Constant f16 -> Convert f32)
  are f32 constants, for the paged target's wide calls (``ovdflash.ov.wide_target``).

The first two edit the given model in place and return it. The layer locators are the
rt_info entry ``hidden_states_decoder_layers`` (optimum-intel's JSON format) that the
export stage writes for every architecture.
"""
from __future__ import annotations

import json

import numpy as np
import openvino as ov
import openvino.opset13 as ops

LOCATOR_KEY = "hidden_states_decoder_layers"

# ops that sit between a weight constant / hidden state and its consumer without changing
# the meaning (decompression, layout); walked through when searching the graph
_PASS_THROUGH = {"Convert", "Reshape", "Squeeze", "Unsqueeze", "Transpose"}


def read_layer_locators(model: ov.Model) -> dict[int, ov.Output]:
    """Layer id -> graph output carrying that decoder layer's output (post residual, pre final norm)."""
    if not model.has_rt_info(LOCATOR_KEY):
        raise ValueError(f"target IR has no '{LOCATOR_KEY}' rt_info: export it with `ovdflash export`")
    raw = model.get_rt_info(LOCATOR_KEY)
    text = raw.astype(str) if hasattr(raw, "astype") else str(raw)
    layers = json.loads(text)["layers"]
    by_name = {op.get_friendly_name(): op for op in model.get_ops()}
    found = {}
    for key, loc in layers.items():
        node = by_name.get(loc["producer"])
        if node is None:
            raise ValueError(f"layer {key} locator points to a missing node {loc['producer']!r}")
        found[int(key)] = node.output(int(loc.get("output_index", 0)))
    return found


def _producer(output: ov.Output):
    return output.get_node()


def find_lm_head(model: ov.Model):
    """The MatMul that produces the `logits` output."""
    node = _producer(model.output("logits").get_node().input_value(0))
    while node.get_type_name() != "MatMul":
        if node.get_type_name() not in _PASS_THROUGH | {"Multiply", "Add", "Gather"} or node.get_input_size() == 0:
            raise ValueError(f"cannot find the lm_head MatMul above `logits` (stopped at {node.get_type_name()})")
        node = _producer(node.input_value(0))
    return node


def find_embedding_gather(model: ov.Model):
    """The Gather that looks `input_ids` up in the embedding table."""
    frontier = [model.input("input_ids")]
    seen = set()
    while frontier:
        out = frontier.pop()
        for target_input in out.get_target_inputs():
            node = target_input.get_node()
            if id(node) in seen:
                continue
            seen.add(id(node))
            if node.get_type_name() == "Gather" and target_input.get_index() == 1:
                return node
            if node.get_type_name() in _PASS_THROUGH:
                frontier.extend(node.outputs())
    raise ValueError("cannot find the embedding Gather fed by `input_ids`")


def _set_name(output: ov.Output, name: str):
    output.get_tensor().set_names({name})


def is_paged(model: ov.Model) -> bool:
    """True after `openvino._offline_transformations.paged_attention_transformation`."""
    return any("past_lens" in p.get_output_tensor(0).get_names() for p in model.get_parameters())


def target_for_runtime(model: ov.Model, target_layer_ids) -> ov.Model:
    """Add `logits_indices` (gather before lm_head) and the `target_hidden` output. In place.
    On a paged model (`is_paged`) the outputs keep its token-major layout: `logits [N,1,V]`,
    `target_hidden [T,1,n*Ht]`."""
    locators = read_layer_locators(model)
    missing = [i for i in target_layer_ids if i not in locators]
    if missing:
        raise ValueError(f"target IR has no locator for layers {missing} (has {sorted(locators)})")

    lm_head = find_lm_head(model)
    indices = ops.parameter(ov.PartialShape([-1]), ov.Type.i64, name="logits_indices")
    _set_name(indices.output(0), "logits_indices")
    hidden = lm_head.input_value(0)
    # gather along T so the vocab projection runs only for the wanted rows: axis 1 of [1,T,H], or
    # axis 0 of [T,1,H] after openvino's paged-attention transformation (tokens become the batch)
    token_axis = 0 if is_paged(model) else 1
    gathered = ops.gather(hidden, indices, ops.constant(token_axis, ov.Type.i64))
    lm_head.input(0).replace_source_output(gathered.output(0))
    model.add_parameters([indices])

    feats = ops.concat([locators[i] for i in target_layer_ids], axis=-1)
    if feats.get_output_element_type(0) != ov.Type.f32:
        feats = ops.convert(feats, ov.Type.f32)
    result = ops.result(feats)
    _set_name(result.output(0), "target_hidden")
    _set_name(feats.output(0), "target_hidden")
    model.add_results([result])
    model.validate_nodes_and_infer_types()
    return model


def f16_weight_converts(model: ov.Model) -> list:
    """The Convert nodes that turn an f16 constant (a compressed weight) into f32."""
    return [op for op in model.get_ordered_ops()
            if op.get_type_name() == "Convert" and op.get_output_element_type(0) == ov.Type.f32
            and op.input_value(0).get_node().get_type_name() == "Constant"
            and op.input_value(0).get_element_type() == ov.Type.f16]


def with_f32_weights(model: ov.Model) -> tuple[ov.Model, int]:
    """(a copy of model with every f16 weight stored as an f32 constant, how many). Same values; the
    CPU plugin then runs plain f32 kernels instead of decompressing the f16 weights anew in every
    call of more than a few rows (ovdflash.ov.wide_target)."""
    copy = model.clone()
    converts = f16_weight_converts(copy)
    for op in converts:
        op.output(0).replace(ops.constant(op.input_value(0).get_node().get_data().astype(np.float32)).output(0))
    return copy, len(converts)


def _f16_constant_of(weight: ov.Output):
    """The f16 Constant behind `weight` when it is one decompressed by a Convert to f32, else None."""
    node = weight.get_node()
    if node.get_type_name() != "Convert" or node.get_output_element_type(0) != ov.Type.f32:
        return None
    source = node.input_value(0).get_node()
    return source if source.get_type_name() == "Constant" and source.get_element_type() == ov.Type.f16 else None


def _int8_rows(weight: ov.Output, rows_chunk: int = 8192) -> ov.Output:
    """An int8 copy of an f16 [V, H] weight, one symmetric scale per row (module contract)."""
    from openvino._offline_transformations import compress_quantize_weights_transformation

    const = _f16_constant_of(weight)
    data = const.get_data()
    high = np.empty((data.shape[0], 1), np.float32)
    for start in range(0, data.shape[0], rows_chunk):  # in chunks: no f32 copy of the whole table
        high[start:start + rows_chunk, 0] = np.abs(data[start:start + rows_chunk].astype(np.float32)).max(axis=1)
    high[high == 0] = 1.0
    low, high = ops.constant(-high), ops.constant(high)
    quantized = ops.fake_quantize(ops.convert(const, ov.Type.f32), low, high, low, high, 255)
    rows = ops.parameter(ov.PartialShape([-1, data.shape[1]]), ov.Type.f32)
    holder = ov.Model([ops.matmul(rows, quantized, False, True)], [rows])
    compress_quantize_weights_transformation(holder)  # i8 constant -> marked Convert -> scale Multiply
    return holder.get_results()[0].input_value(0).get_node().input_value(1)


def with_draft_rows(drafter: ov.Model) -> bool:
    """Input ``draft_rows [N] i64`` in front of a DFlash drafter's head: only those batch rows reach the
    head MatMul (most of a call's cost) and ``draft_tokens`` has N rows. In place; True when done (an
    argmax graph whose head is one MatMul)."""
    if "draft_tokens" not in {name for out in drafter.outputs for name in out.get_names()}:
        return False
    node = drafter.output("draft_tokens").get_node().input_value(0).get_node()
    while node.get_type_name() in ("Gather", "Squeeze"):  # the draft vocabulary's id table, the argmax's axis
        node = node.input_value(1 if node.get_type_name() == "Gather" else 0).get_node()
    head = node.input_value(0).get_node() if node.get_type_name() == "TopK" else None
    if head is None or head.get_type_name() != "MatMul":
        return False
    rows = ops.parameter(ov.PartialShape([-1]), ov.Type.i64, name="draft_rows")
    _set_name(rows.output(0), "draft_rows")
    picked = ops.gather(head.input_value(0), rows, ops.constant(0, ov.Type.i64))
    head.input(0).replace_source_output(picked.output(0))
    drafter.add_parameters([rows])
    drafter.validate_nodes_and_infer_types()
    return True


def with_int8_head(drafter: ov.Model, target: ov.Model) -> bool:
    lm_head = find_lm_head(target)
    weight = lm_head.input_value(1)
    if not lm_head.get_attributes().get("transpose_b", False) or _f16_constant_of(weight) is None:
        return False
    in_drafter = {op.get_instance_id() for op in drafter.get_ordered_ops()}
    consumers = [inp for inp in weight.get_target_inputs()
                 if inp.get_index() == 1 and inp.get_node().get_type_name() == "MatMul"
                 and inp.get_node().get_instance_id() in in_drafter]
    if not consumers:
        return False
    int8_weight = _int8_rows(weight)
    for inp in consumers:
        inp.replace_source_output(int8_weight)
    drafter.validate_nodes_and_infer_types()
    return True


def _slice_rows(weight: ov.Output, rows: np.ndarray, axis: int) -> ov.Output:
    """`weight` restricted to `rows` along `axis`, built from sliced constants where possible.

    Slicing the constants (not the decompressed tensor) keeps an int8/fp16 head in its
    storage format, so the drafter's FullyConnected holds only len(rows) compressed rows."""
    node = weight.get_node()
    kind = node.get_type_name()
    rank = weight.get_partial_shape().rank.get_length()
    size = weight.get_partial_shape()[axis].get_length()
    if kind == "Constant" and node.get_element_type().bitwidth >= 8:
        data = node.get_data()
        if data.shape[axis] == 1:  # broadcast along the vocab axis (a per-tensor scale)
            return weight
        return ops.constant(np.ascontiguousarray(np.take(data, rows, axis=axis)), node.get_element_type()).output(0)
    if kind == "Convert":
        # The new Convert lacks the source's weight-decompression mark (rt_info "decompression_0"),
        # so the CPU plugin folds an fp16 head slice to f32. Kept so on purpose: with the mark a
        # draft call is faster alone but slower inside generation (docs/BENCHMARKS.md, Compile settings).
        return ops.convert(_slice_rows(node.input_value(0), rows, axis), node.get_element_type()).output(0)
    if kind in ("Subtract", "Multiply"):
        args = []
        for i in range(2):
            arg = node.input_value(i)
            shape = arg.get_partial_shape()
            if shape.rank.get_length() != rank or shape.is_dynamic:
                break
            args.append(arg if shape[axis].get_length() == 1 and size != 1 else _slice_rows(arg, rows, axis))
        else:
            make = ops.subtract if kind == "Subtract" else ops.multiply
            return make(args[0], args[1]).output(0)
    # anything else (int4 groups behind a Reshape, ...): gather at run time
    return ops.gather(weight, ops.constant(rows, ov.Type.i64), ops.constant(axis, ov.Type.i64)).output(0)


def read_draft_vocab(path) -> np.ndarray:
    """A `draft_vocab.json` file: a JSON list of target token ids. Returns them sorted, unique, i64."""
    ids = np.asarray(json.loads(open(path).read()), dtype=np.int64)
    if ids.ndim != 1 or len(ids) == 0 or ids.min() < 0:
        raise ValueError(f"{path}: expected a non-empty JSON list of token ids")
    return np.unique(ids)


def graft_embedding(drafter: ov.Model, target: ov.Model) -> ov.Output:
    """Replace the drafter's `inputs_embeds` by `input_ids [1,B] i64` looked up in the target's table. In
    place; returns the new `input_ids` output."""
    embed_gather = find_embedding_gather(target)
    table = embed_gather.input_value(0)  # the (decompressed) [V, H] table, shared with the target
    old_embeds = drafter.input("inputs_embeds")
    input_ids = ops.parameter(ov.PartialShape([-1, -1]), ov.Type.i64, name="input_ids")
    _set_name(input_ids.output(0), "input_ids")
    embeds = ops.gather(table, input_ids, ops.constant(0, ov.Type.i64))
    if embeds.get_output_element_type(0) != ov.Type.f32:
        embeds = ops.convert(embeds, ov.Type.f32)
    for consumer in list(old_embeds.get_target_inputs()):
        consumer.replace_source_output(embeds.output(0))
    drafter.remove_parameter(old_embeds.get_node())
    # keep the conventional input order: input_ids first
    drafter.add_parameters([input_ids])
    return input_ids.output(0)


def graft_head(drafter: ov.Model, target: ov.Model, draft_vocab=None) -> tuple[ov.Output, np.ndarray | None]:
    """(logits [1,B-1,V'] of `last_hidden_state` under the target's lm_head, the draft vocabulary's ids or
    None). With `draft_vocab`, V' is its size and logit j scores target id `ids[j]`. The
    `last_hidden_state` result is removed: the runtime never reads it back."""
    lm_head = find_lm_head(target)
    head_weight = lm_head.input_value(1)
    transpose_b = bool(lm_head.get_attributes().get("transpose_b", False))
    last_result = drafter.output("last_hidden_state").get_node()
    hidden = last_result.input_value(0)
    vocab_ids = None
    if draft_vocab is not None:
        vocab_ids = np.unique(np.asarray(draft_vocab, dtype=np.int64))
        vocab_axis = 0 if transpose_b else 1
        vocab_size = head_weight.get_partial_shape()[vocab_axis].get_length()
        if len(vocab_ids) == 0 or vocab_ids[0] < 0 or vocab_ids[-1] >= vocab_size:
            raise ValueError(f"draft vocabulary ids must lie in [0, {vocab_size})")
        head_weight = _slice_rows(head_weight, vocab_ids, vocab_axis)
    logits = ops.matmul(hidden, head_weight, transpose_a=False, transpose_b=transpose_b)
    # the hidden state is no longer read back: drop it so the runtime does not copy it out
    drafter.remove_result(last_result)
    return logits.output(0), vocab_ids


def to_target_ids(indices: ov.Output, vocab_ids: np.ndarray | None) -> ov.Output:
    """Positions in the draft vocabulary -> target token ids (unchanged without one)."""
    if vocab_ids is None:
        return indices
    return ops.gather(ops.constant(vocab_ids, ov.Type.i64), indices, ops.constant(0, ov.Type.i64)).output(0)


def add_named_result(model: ov.Model, output: ov.Output, name: str) -> None:
    result = ops.result(output)
    _set_name(result.output(0), name)
    _set_name(output, name)
    model.add_results([result])


def drafter_for_runtime(drafter: ov.Model, target: ov.Model, draft_vocab=None) -> ov.Model:
    """Graft the target's embedding lookup and lm_head + argmax onto the drafter. In place.

    `draft_vocab` (token ids, or None for the full vocabulary): restrict the head to those rows."""
    graft_embedding(drafter, target)
    logits, vocab_ids = graft_head(drafter, target, draft_vocab)
    top = ops.topk(logits, ops.constant(1, ov.Type.i64), axis=-1, mode="max", sort="none",
                   index_element_type=ov.Type.i64)
    tokens = ops.squeeze(top.output(1), ops.constant([-1], ov.Type.i64))
    add_named_result(drafter, to_target_ids(tokens.output(0), vocab_ids), "draft_tokens")
    drafter.validate_nodes_and_infer_types()
    return drafter
