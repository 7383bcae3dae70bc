"""Shared fixtures: tiny exported (target, drafter) pairs, built once per test session.

* ``export_tiny_pair(arch="qwen3", vocab_size=512, block_size=4, ...)``: a factory that
  builds a random tiny HF target + random z-lab drafter and exports them with
  ``export_pair`` into a session tmp dir; cached by its arguments. Returns the model
  directory (``manifest.json["target"]["source"]`` / ``["drafter"]["source"]`` point at the
  HF sources, for reference runs with transformers).
* ``tiny_pair``: ``export_tiny_pair()`` with the defaults: qwen3 target (4 layers, hidden
  64, vocab 512), 1-layer drafter reading target layers [1, 2], block 4, fp32 weights.
"""
import os

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


@pytest.fixture(scope="session")
def tiny_sources(tmp_path_factory):
    """Factory: (target_dir, drafter_dir) of random tiny HF sources, cached by arguments."""
    cache = {}

    def build(arch="qwen3", vocab_size=512, num_drafter_layers=1, block_size=4, target_layer_ids=(1, 2),
              mask_token_id=None, seed=0, **target_overrides):
        from ovdflash_export.tiny import make_tiny_drafter, make_tiny_target

        key = (arch, vocab_size, num_drafter_layers, block_size, tuple(target_layer_ids or ()), mask_token_id, seed,
               tuple(sorted(target_overrides.items())))
        if key not in cache:
            root = tmp_path_factory.mktemp(f"src_{arch}_v{vocab_size}")
            target = make_tiny_target(arch, root / "target", vocab_size=vocab_size, seed=seed, **target_overrides)
            drafter = make_tiny_drafter(target, root / "drafter", num_layers=num_drafter_layers,
                                        block_size=block_size,
                                        target_layer_ids=list(target_layer_ids) if target_layer_ids else None,
                                        mask_token_id=mask_token_id, seed=seed + 1)
            cache[key] = (target, drafter)
        return cache[key]

    return build


@pytest.fixture(scope="session")
def export_tiny_pair(tmp_path_factory, tiny_sources):
    """Factory: an exported tiny pair directory, cached by arguments (see module docstring)."""
    cache = {}

    def build(arch="qwen3", vocab_size=512, block_size=4, num_drafter_layers=1, target_layer_ids=(1, 2),
              mask_token_id=None, target_weight_format="fp32", drafter_weight_format="fp32", seed=0,
              **target_overrides):
        from ovdflash_export.exporter import export_pair

        key = (arch, vocab_size, block_size, num_drafter_layers, tuple(target_layer_ids or ()), mask_token_id,
               target_weight_format, drafter_weight_format, seed, tuple(sorted(target_overrides.items())))
        if key not in cache:
            target, drafter = tiny_sources(arch, vocab_size, num_drafter_layers, block_size, target_layer_ids,
                                           mask_token_id, seed, **target_overrides)
            out = tmp_path_factory.mktemp("pair") / f"{arch}_v{vocab_size}_b{block_size}_{target_weight_format}"
            cache[key] = export_pair(target, drafter, out, target_weight_format=target_weight_format,
                                     drafter_weight_format=drafter_weight_format)
        return cache[key]

    return build


@pytest.fixture(scope="session")
def tiny_pair(export_tiny_pair):
    return export_tiny_pair()
