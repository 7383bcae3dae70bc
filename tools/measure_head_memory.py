"""Resident-memory cost of the drafter with the grafted target embedding + lm_head.

Usage: python tools/measure_head_memory.py MODEL_DIR [--config strict|default]

Each variant runs in a fresh subprocess: compile the runtime target (and run one step),
read RSS, then compile the drafter and run one draft, read RSS again:
  plain   - the saved drafter IR (inputs_embeds in, last_hidden_state out; no head)
  grafted - drafter_for_runtime(drafter, target): embedding lookup + lm_head + argmax
  vocab   - the same with the draft vocabulary of drafter/draft_vocab.json (when it exists):
            only those lm_head rows
The difference grafted - plain is the resident cost of applying the target head inside the
drafter graph (weights are shared with the target graph when the plugin does not repack them).
"""
import json
import subprocess
import sys
from pathlib import Path

from ovdflash.bench import rss_mb as rss_mib


def run_variant(model_dir: Path, variant: str, config_name: str) -> dict:
    import numpy as np
    import openvino as ov

    from ovdflash import STRICT_F32
    from ovdflash.manifest import load_manifest
    from ovdflash.ov.graphs import drafter_for_runtime, target_for_runtime

    config = STRICT_F32 if config_name == "strict" else {}
    m = load_manifest(model_dir)
    core = ov.Core()
    base = rss_mib()
    target = target_for_runtime(core.read_model(str(model_dir / "target" / "openvino_model.xml")),
                                m["target_layer_ids"])
    t_req = core.compile_model(target, "CPU", config).create_infer_request()
    t_req.infer({"input_ids": np.zeros((1, 8), np.int64), "attention_mask": np.ones((1, 8), np.int64),
                 "position_ids": np.arange(8)[None], "beam_idx": np.zeros(1, np.int32),
                 "logits_indices": np.array([7])})
    after_target = rss_mib()
    drafter = core.read_model(str(model_dir / "drafter" / "openvino_model.xml"))
    bs, feat = m["block_size"], len(m["target_layer_ids"]) * m["target"]["hidden_size"]
    feed = {"hidden_states": np.zeros((1, 8, feat), np.float32), "position_ids": np.arange(8 + bs)[None],
            "attention_mask": np.ones((1, 8 + bs), np.int64), "beam_idx": np.zeros(1, np.int32)}
    if variant in ("grafted", "vocab"):
        vocab = None
        if variant == "vocab":
            from ovdflash.ov.graphs import read_draft_vocab
            vocab = read_draft_vocab(model_dir / "drafter" / "draft_vocab.json")
        drafter = drafter_for_runtime(drafter, target, vocab)
        feed["input_ids"] = np.zeros((1, bs), np.int64)
    else:
        feed["inputs_embeds"] = np.zeros((1, bs, m["target"]["hidden_size"]), np.float32)
    d_req = core.compile_model(drafter, "CPU", config).create_infer_request()
    d_req.infer(feed)
    after_drafter = rss_mib()
    return {"variant": variant, "base_mib": round(base, 1), "target_mib": round(after_target - base, 1),
            "drafter_mib": round(after_drafter - after_target, 1)}


def main():
    model_dir = Path(sys.argv[1])
    config_name = sys.argv[3] if len(sys.argv) > 3 and sys.argv[2] == "--config" else "default"
    if len(sys.argv) > 2 and sys.argv[2] == "--variant":
        print(json.dumps(run_variant(model_dir, sys.argv[3], sys.argv[4] if len(sys.argv) > 4 else "default")))
        return
    results = {}
    variants = ["plain", "grafted"] + (["vocab"] if (model_dir / "drafter" / "draft_vocab.json").exists() else [])
    for variant in variants:
        out = subprocess.run([sys.executable, __file__, str(model_dir), "--variant", variant, config_name],
                             check=True, capture_output=True, text=True).stdout.strip().splitlines()[-1]
        results[variant] = json.loads(out)
        print(results[variant])
    cost = results["grafted"]["drafter_mib"] - results["plain"]["drafter_mib"]
    print(f"grafted head resident cost: {cost:.1f} MiB (config {config_name})")
    if "vocab" in results:
        cost = results["vocab"]["drafter_mib"] - results["plain"]["drafter_mib"]
        print(f"grafted head with the draft vocabulary: {cost:.1f} MiB (config {config_name})")


if __name__ == "__main__":
    main()
