"""Resident memory: a loaded pipeline drops the mapped IR weight pages and decodes the same tokens.

`from_pretrained` primes every kernel shape and then advises away the resident pages of the mapped
`openvino_model.bin` files (ovdflash.ov.memory); the pages are clean file pages, so output cannot change.
"""
import numpy as np
import pytest

from ovdflash import STRICT_F32, DFlashPipeline
from ovdflash.ov.memory import mapped_resident_bytes, release_mapped_files

pytestmark = pytest.mark.skipif(not __import__("os").path.exists("/proc/self/smaps"), reason="needs Linux /proc")


@pytest.mark.parametrize("runner", ["paged", "stateful"])
def test_release_drops_the_mapped_weights_and_keeps_the_output(tiny_pair, tmp_path, runner):
    target_bin = tiny_pair / "target" / "openvino_model.bin"
    kept = DFlashPipeline.from_pretrained(tiny_pair, cache_dir=tmp_path, target_runner=runner,
                                          release_weight_pages=False, **STRICT_F32)
    prompts = [list(np.random.default_rng(i).integers(1, 500, size=5 + 7 * i)) for i in range(4)]
    before = [kept.generate([int(t) for t in p], max_new_tokens=16, block_size=4).token_ids for p in prompts]
    resident = mapped_resident_bytes([target_bin])
    assert resident > 0.5 * target_bin.stat().st_size  # the plugin read the mapped file
    assert release_mapped_files([target_bin]) >= target_bin.stat().st_size
    assert mapped_resident_bytes([target_bin]) < 0.1 * resident
    after = [kept.generate([int(t) for t in p], max_new_tokens=16, block_size=4).token_ids for p in prompts]
    assert after == before
    fresh = DFlashPipeline.from_pretrained(tiny_pair, cache_dir=tmp_path, target_runner=runner, **STRICT_F32)
    assert mapped_resident_bytes([target_bin]) < 0.1 * resident  # from_pretrained released them itself
    assert [fresh.generate([int(t) for t in p], max_new_tokens=16, block_size=4).token_ids for p in prompts] == before
    assert fresh.stats.num_calls == 4  # the priming generations are not counted as calls


def test_release_leaves_other_files_alone(tmp_path):
    path = tmp_path / "w.bin"
    path.write_bytes(b"\1" * (1 << 20))
    assert release_mapped_files([path]) == 0  # not mapped: nothing to advise
    assert mapped_resident_bytes([path]) == 0
