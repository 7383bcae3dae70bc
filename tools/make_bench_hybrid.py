"""Build a hybrid of the benchmark geometry in docs/BENCHMARKS.md ("Hybrid targets"): a random Qwen3.5
text target (hidden 1024, 16 layers: 12 Gated DeltaNet with 8 key / 16 value heads of 64, 4 full
attention with 8 query / 2 KV heads of 128; 49,152 embedding rows, the project's tiny byte-level
tokenizer) and a random 2-layer DFlash drafter (block 16), exported with fp16 weights. Random
weights: for timing and memory, not acceptance.
Usage: python tools/make_bench_hybrid.py OUT_DIR [--work DIR]
"""
from __future__ import annotations

import argparse
from pathlib import Path

from ovdflash_export.exporter import export_pair
from ovdflash_export.tiny import make_tiny_drafter, make_tiny_target


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--work", type=Path, default=None, help="where the HF checkpoints go (default: OUT_DIR.hf)")
    args = parser.parse_args()
    work = args.work or args.out.with_name(args.out.name + ".hf")
    target = make_tiny_target("qwen3_5_text", work / "target", vocab_size=49152, seed=1, hidden_size=1024,
                              intermediate_size=3072, num_hidden_layers=16, num_attention_heads=8,
                              num_key_value_heads=2, head_dim=128, linear_num_key_heads=8, linear_num_value_heads=16,
                              linear_key_head_dim=64, linear_value_head_dim=64, max_position_embeddings=4096)
    drafter = make_tiny_drafter(target, work / "drafter", num_layers=2, block_size=16, target_layer_ids=[1, 5, 9, 13],
                                seed=2)
    print(export_pair(target, drafter, args.out, target_weight_format="fp16", drafter_weight_format="fp16",
                      default_block_size=4))


if __name__ == "__main__":
    main()
