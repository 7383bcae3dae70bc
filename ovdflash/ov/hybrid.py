"""Hybrid targets (Qwen3.5: Gated DeltaNet + full attention): the recurrence graph and the target runner.

Contract (docs/DESIGN.md, "Hybrid targets: exact rollback of linear-attention state"):

* `gated_delta_loop(query, key, value, g, beta, state)` builds the Gated DeltaNet recurrence as an
  OpenVINO `Loop` over the token axis: per token, S <- S * exp(g); S <- S + k (x) beta (v - S^T k);
  o = S^T q. Shapes: query/key [B,H,T,dk], value [B,H,T,dv], g/beta [B,H,T], state [B,H,dk,dv] (f32).
  Returns (out [B,H,T,dv], final state). The export stage converts its torch cell with it, and
  the runtime builds the replay graph with it, so both run the same loop body.
* The hybrid target IR (export stage: `ovdflash_export.qwen3_5`) keeps the full-attention K/V in
  ReadValue/Assign states (as the stateful runner's IR) and takes the Gated DeltaNet states as
  plain inputs, host-held: `conv_state.<i>` [B, conv_dim, K] (the last K conv inputs) and
  `recurrent_state.<i>` [B, H, dk, dv] per linear-attention layer i (any batch B; the runners use
  1). It outputs, per such layer, `conv_window.<i>` [B, conv_dim, K+T] (old conv state followed by
  this call's conv inputs), `recurrent_state_out.<i>`
  (the state after all T tokens) and the loop's inputs `gdn_key.<i>`, `gdn_value.<i>`, `gdn_g.<i>`,
  `gdn_beta.<i>`, which is all a replay needs.
* `HybridTarget` implements `decode.sequence.TargetRunner`. The K/V of the full-attention layers roll back
  as in `runners.OVTarget` (physical mask, logical positions, rare compaction). The linear-attention
  state rolls back exactly by snapshot and replay: a forward never changes the host-held committed
  states (the snapshot costs nothing), and `commit(n)` of T tokens sets each conv state to the
  window's columns n..n+K-1 and each recurrent state to the forward's final state when n == T (every
  AR step and prefill, and fully accepted blocks), else to a replay of the n kept tokens' loop
  inputs from the committed state, one call of a recurrence-only graph for all layers
  (`replay_graph`). Every forward reads the committed states, so a round with no drafts never
  sees a stale one. `num_replays` counts replays. `rewinds_exactly` is False: `rewind` only keeps
  the committed length (prefix reuse across calls extends a cached sequence, never cuts it).
* `linear_states_as_variables(model)` turns those host-held ports into ReadValue/Assign states for
  the paged runner: openvino's paged-attention transformation then runs each linear-attention
  layer as PagedCausalConv1D + PagedGatedDeltaNet over state tables (`ov.linear_states`).
"""
from __future__ import annotations

import numpy as np
import openvino as ov
import openvino.opset14 as ops

from .inference import run_request
from .runners import OVTarget

# name prefixes of the hybrid IR's per-layer Gated DeltaNet ports (suffix: the layer index)
CONV_STATE, RECURRENT_STATE = "conv_state.", "recurrent_state."
CONV_WINDOW, RECURRENT_OUT = "conv_window.", "recurrent_state_out."
LOOP_INPUTS = ("gdn_key.", "gdn_value.", "gdn_g.", "gdn_beta.")


def gated_delta_loop(query, key, value, g, beta, state):
    """The recurrence as an OpenVINO Loop over axis 2 (see module contract); returns (out, final state)."""
    query, key, value, g, beta, state = (x.output(0) if isinstance(x, ov.Node) else x
                                         for x in (query, key, value, g, beta, state))
    minus_one, minus_two = ops.constant(-1, np.int32), ops.constant(-2, np.int32)
    timestep = ops.parameter([], np.int32, "timestep")
    q_t = ops.parameter([-1, -1, 1, -1], np.float32, "q_t")
    k_t = ops.parameter([-1, -1, 1, -1], np.float32, "k_t")
    v_t = ops.parameter([-1, -1, 1, -1], np.float32, "v_t")
    g_t = ops.parameter([-1, -1, 1], np.float32, "g_t")
    beta_t = ops.parameter([-1, -1, 1], np.float32, "beta_t")
    state_t = ops.parameter([-1, -1, -1, -1], np.float32, "state_t")
    out_t = ops.parameter([-1, -1, -1, -1], np.float32, "out_t")

    axis_t = ops.constant(2, np.int32)
    q_col = ops.unsqueeze(ops.squeeze(q_t, axis_t), minus_one)   # [B,H,dk,1]
    k_col = ops.unsqueeze(ops.squeeze(k_t, axis_t), minus_one)
    v_row = ops.squeeze(v_t, axis_t)                              # [B,H,dv]
    decayed = ops.multiply(state_t, ops.unsqueeze(ops.exp(g_t), minus_one))
    kv_mem = ops.reduce_sum(ops.multiply(decayed, k_col), minus_two, False)
    delta = ops.multiply(ops.subtract(v_row, kv_mem), beta_t)
    new_state = ops.add(decayed, ops.multiply(k_col, ops.unsqueeze(delta, minus_two)))
    out_row = ops.reduce_sum(ops.multiply(new_state, q_col), minus_two, True)  # [B,H,1,dv]
    new_out = ops.scatter_update(out_t, ops.unsqueeze(timestep, ops.constant(0, np.int32)), out_row, axis_t)
    body = ov.Model([ops.constant([True], dtype=bool), new_state, new_out],
                    [timestep, q_t, k_t, v_t, g_t, beta_t, state_t, out_t], "gated_delta_step")

    steps = ops.convert(ops.gather(ops.shape_of(value), ops.constant(2, np.int32), ops.constant(0, np.int32)), "i32")
    loop = ops.loop(steps, ops.constant(True, dtype="bool"))
    loop.set_function(body)
    for param, source in ((q_t, query), (k_t, key), (v_t, value), (g_t, g), (beta_t, beta)):
        loop.set_sliced_input(param, source, 0, 1, 1, -1, 2)
    loop.set_merged_input(state_t, state, new_state.output(0))
    zeros = ops.broadcast(ops.constant(0, np.float32), ops.shape_of(value))
    loop.set_merged_input(out_t, zeros.output(0), new_out.output(0))
    loop.set_special_body_ports([0, 0])
    return loop.get_iter_value(new_out.output(0), -1), loop.get_iter_value(new_state.output(0), -1)


def linear_layer_ids(model) -> list[int]:
    """The linear-attention layer indices of a hybrid target IR (from its `recurrent_state.<i>` inputs)."""
    names = [p.get_any_name() for p in model.inputs]
    return sorted(int(n[len(RECURRENT_STATE):]) for n in names if n.startswith(RECURRENT_STATE))


def scaled_query(key) -> ov.Node:
    """key / sqrt(head size) in the form the plugin's GatedDeltaNet fusion matches (the replay's query
    is never read, but without it the loop stays a per-token TensorIterator)."""
    head_size = ops.convert(ops.gather(ops.shape_of(key), ops.constant(3, np.int64), ops.constant(0, np.int64)), "f32")
    return ops.divide(key, ops.power(head_size, ops.constant(np.float32(0.5))))


def replay_graph(target_model: ov.Model) -> ov.Model:
    """Recurrence-only graph for every linear-attention layer of `target_model`: inputs
    `recurrent_state.<i>` and the four loop inputs (any token count), outputs `recurrent_state_out.<i>`."""
    params, results = [], []
    for i in linear_layer_ids(target_model):
        state_shape = target_model.input(f"{RECURRENT_STATE}{i}").get_partial_shape()
        heads, dk, dv = (state_shape[d].get_length() for d in (1, 2, 3))
        state = ops.parameter(state_shape, ov.Type.f32, name=f"{RECURRENT_STATE}{i}")
        key = ops.parameter([1, heads, -1, dk], ov.Type.f32, name=f"gdn_key.{i}")
        value = ops.parameter([1, heads, -1, dv], ov.Type.f32, name=f"gdn_value.{i}")
        g = ops.parameter([1, heads, -1], ov.Type.f32, name=f"gdn_g.{i}")
        beta = ops.parameter([1, heads, -1], ov.Type.f32, name=f"gdn_beta.{i}")
        for p in (state, key, value, g, beta):
            p.output(0).get_tensor().set_names({p.get_friendly_name()})
        _, final = gated_delta_loop(scaled_query(key), key, value, g, beta, state)  # its output rows go unused
        result = ops.result(final)
        result.output(0).get_tensor().set_names({f"{RECURRENT_OUT}{i}"})
        params += [state, key, value, g, beta]
        results.append(result)
    return ov.Model(results, params, "gated_delta_replay")


class HybridTarget(OVTarget):
    """decode.sequence.TargetRunner for a hybrid target IR (module contract)."""

    kind = "hybrid"  # one of ovdflash.TARGET_RUNNERS
    rewinds_exactly = False  # prefix reuse may extend its cached tokens, never cut them

    def __init__(self, compiled: ov.CompiledModel, max_length: int, seq_axes: dict[str, int] | None = None,
                 replay: ov.CompiledModel | None = None, **options):
        inputs = {p.get_any_name(): p for p in compiled.inputs}
        self.linear_layers = sorted(int(n[len(RECURRENT_STATE):]) for n in inputs if n.startswith(RECURRENT_STATE))
        if not self.linear_layers:
            raise ValueError("target IR has no recurrent_state.<i> inputs: not a hybrid target")
        # the committed Gated DeltaNet states, host-held; forward shares them with the request (no copy)
        self.states = {}
        for i in self.linear_layers:
            for prefix in (CONV_STATE, RECURRENT_STATE):
                shape = [1] + [d.get_length() for d in inputs[f"{prefix}{i}"].get_partial_shape()[1:]]
                self.states[f"{prefix}{i}"] = np.zeros(shape, dtype=np.float32)
        self.replay = replay
        self.replay_request = replay.create_infer_request() if replay is not None else None
        self.num_replays = 0
        super().__init__(compiled, max_length, seq_axes, **options)
        for name, array in self.states.items():
            self.request.set_tensor(name, ov.Tensor(array, shared_memory=True))

    def reset(self) -> None:
        super().reset()
        for array in self.states.values():
            array[...] = 0.0

    def rewind(self, num_kept: int) -> None:
        """Only to the committed length: the linear-attention state of an earlier position is gone."""
        if num_kept != self.committed:
            raise ValueError(f"a hybrid target cannot rewind from {self.committed} to {num_kept} tokens: "
                             "its linear-attention state keeps no earlier position")

    def commit(self, num_kept: int) -> None:
        num = self.pending
        super().commit(num_kept)
        out = self.request.get_tensor
        replay_inputs = {}
        for i in self.linear_layers:
            conv = self.states[f"{CONV_STATE}{i}"]
            conv[...] = out(f"{CONV_WINDOW}{i}").data[:, :, num_kept:num_kept + conv.shape[2]]
            if num_kept == num:
                self.states[f"{RECURRENT_STATE}{i}"][...] = out(f"{RECURRENT_OUT}{i}").data
            else:
                replay_inputs[f"{RECURRENT_STATE}{i}"] = self.states[f"{RECURRENT_STATE}{i}"]
                for prefix in LOOP_INPUTS:
                    replay_inputs[f"{prefix}{i}"] = np.ascontiguousarray(out(f"{prefix}{i}").data[:, :, :num_kept])
        if replay_inputs:
            if self.replay_request is None:
                raise RuntimeError("a partial commit needs the replay graph (HybridTarget(replay=...))")
            run_request(self.replay_request, replay_inputs)
            for i in self.linear_layers:
                self.states[f"{RECURRENT_STATE}{i}"][...] = self.replay_request.get_tensor(f"{RECURRENT_OUT}{i}").data
            self.num_replays += 1


def has_linear_states(model: ov.Model) -> bool:
    """True for a hybrid target IR (it takes `recurrent_state.<i>` inputs)."""
    return bool(linear_layer_ids(model))


def linear_states_as_variables(model: ov.Model) -> ov.Model:
    """In place (and returned): every host-held Gated DeltaNet port of a hybrid target IR becomes a
    ReadValue/Assign state, the form openvino's paged-attention transformation turns into its
    PagedCausalConv1D / PagedGatedDeltaNet ops with per-sequence state tables. The conv state keeps
    the last K conv inputs (the export's layout since the paged ops); an older export's K-1 is a
    ValueError naming the fix."""
    from openvino.op.util import Variable, VariableInfo

    results = {r.output(0).get_any_name(): r for r in model.get_results()}
    batch = ops.gather(ops.shape_of(model.input("input_ids")), ops.constant([0], np.int64), ops.constant(0, np.int64))
    assigns = []
    for i in linear_layer_ids(model):
        for prefix, out_prefix in ((CONV_STATE, CONV_WINDOW), (RECURRENT_STATE, RECURRENT_OUT)):
            param = model.input(f"{prefix}{i}").get_node()
            tail = [d.get_length() for d in param.get_partial_shape()[1:]]
            source = results[f"{out_prefix}{i}"].input_value(0)
            if prefix == CONV_STATE:
                width = source.get_partial_shape()[1].get_length()
                kernel = next(t.get_node().get_input_partial_shape(1)[-1].get_length()
                              for t in source.get_target_inputs() if t.get_node().get_type_name() == "GroupConvolution")
                if tail[-1] != kernel:
                    raise ValueError(f"this hybrid target IR keeps {tail[-1]} conv inputs per layer, the paged "
                                     f"runner needs {kernel}: re-export it (ovdflash export)")
                assert width == tail[0]
                new_value = ops.slice(source, ops.constant([-kernel], np.int64),
                                      ops.constant([np.iinfo(np.int64).max], np.int64),
                                      ops.constant([1], np.int64), ops.constant([2], np.int64))
            else:
                new_value = source  # the Loop's final-state output
            info = VariableInfo()
            info.data_shape = ov.PartialShape([-1, *tail])
            info.data_type = ov.Type.f32
            info.variable_id = f"{prefix}{i}"
            variable = Variable(info)
            zeros = ops.broadcast(ops.constant(np.float32(0)),
                                  ops.concat([batch, ops.constant(np.array(tail, np.int64))], 0))
            state = ov.opset13.read_value(zeros, variable)
            for target in list(param.output(0).get_target_inputs()):
                target.replace_source_output(state.output(0))
            model.remove_parameter(param)
            assign = ov.opset13.assign(zeros, variable)  # its value is set below: assign() takes a node
            assign.input(0).replace_source_output(new_value.output(0) if isinstance(new_value, ov.Node) else new_value)
            assigns.append(assign)
    for name, result in results.items():
        if name.startswith((CONV_WINDOW, RECURRENT_OUT, *LOOP_INPUTS)):
            model.remove_result(result)
    model.add_sinks(assigns)
    model.validate_nodes_and_infer_types()
    return model


def compile_hybrid_target(core: ov.Core, target_model: ov.Model, manifest: dict, device: str, config: dict,
                          seq_axes: dict[str, int], **options) -> HybridTarget:
    """Build the replay graph from the read IR, apply `graphs.target_for_runtime`, compile both."""
    from . import graphs

    replay = core.compile_model(replay_graph(target_model), device, config)
    graphs.target_for_runtime(target_model, manifest["target_layer_ids"])
    compiled = core.compile_model(target_model, device, config)
    return HybridTarget(compiled, int(manifest["max_position_embeddings"]), seq_axes, replay=replay, **options)
