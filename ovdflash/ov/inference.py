"""One inference on an InferRequest, and the logits rows of a forward: what every runner shares.

Contract:
- `run_request(request, inputs)`: one inference, inputs shared (no copies), start_async + wait.
  Each module that runs requests calls it through its own global name (`runners`, `paged`,
  `hybrid`), so a tool or test may replace it there for that module's requests.
- `LogitRows._logit_rows(num, all_logits)`: the `logits_indices` of a forward of num tokens: all
  rows (a reused buffer, grown as needed) or the last one.
- `grow_rows(tensors, inputs, kept, rows)`: every host tensor of `inputs` ((name, element type, shape
  of one row)) in `tensors` replaced by one of `rows` rows holding the first `kept` of the old one
  (the paged KV blocks and the linear-attention state slots grow so).
May import: numpy and openvino only (every other module of `ov` imports this one).
"""
from __future__ import annotations

import numpy as np
import openvino as ov


def grow_rows(tensors: dict, inputs, kept: int, rows: int) -> None:
    """`tensors[name]` for every input: `rows` rows, the first `kept` copied from the old tensor."""
    for name, element_type, shape in inputs:
        tensor = ov.Tensor(element_type, [rows, *shape])
        old = tensors.get(name)
        if old is not None:
            tensor.data[:kept] = old.data[:kept]
        tensors[name] = tensor


def run_request(request: ov.InferRequest, inputs: dict) -> None:
    """One inference, inputs shared (no copies). start_async + wait, as openvino.genai's decode
    loop does, not infer(): infer() runs the graph on the calling Python thread, and with 2
    threads on a shared 2-vCPU VM our AR made fewer tokens/s that way
    (docs/BENCHMARKS.md, Compile settings; `tools/profile_round.py --sections loop`)."""
    request.start_async(inputs, share_inputs=True)
    request.wait()


class LogitRows:
    """`logits_indices` for a forward of num tokens: all rows (a reused buffer), or the last."""

    row_indices = np.arange(256, dtype=np.int64)

    def _logit_rows(self, num: int, all_logits: bool) -> np.ndarray:
        if not all_logits:
            return np.array([num - 1], dtype=np.int64)
        if num > len(self.row_indices):
            self.row_indices = np.arange(num, dtype=np.int64)
        return self.row_indices[:num]
