"""The compiled kernels as a CPU without 512-bit vectors (AVX2) builds them give this CPU's bits.

Their loop bodies are sized to the vector registers there are (packed.GROUP and ONE_ROW_BLOCKS,
paged_attention.SCORE_HEADS and VALUE_HEADS), so an AVX2 build groups rows and heads differently;
every chain is the same, and so is every bit. numba fixes its target when the package is imported,
so the narrow build runs in a process of its own, on inputs this test writes: the products of
batches of 1-33 rows against a threaded weight, and decode and prefill attention over scattered
paged blocks for head_dims and block sizes that take each body (masked lanes, four and eight value
vectors a body, threads by row and by kv head).
"""
import os
import subprocess
import sys

import numpy as np
import pytest

from refengine.engine import jit, kernels, packed, paged_attention

NARROW = {"NUMBA_CPU_NAME": "haswell", "NUMBA_CPU_FEATURES": "+avx,+avx2,+fma,+f16c,+popcnt,+sse4.2"}
ROWS = 33  # four groups of eight and a group of one
# (heads, kv_heads, head_dim, block_size, rows, longest row): eight value vectors a body and threaded by
# row; four and a masked block; one vector; threaded by kv head
ATTENTION = [(16, 8, 128, 16, 40, 200), (8, 2, 64, 5, 12, 200), (4, 2, 20, 32, 9, 200), (8, 4, 128, 16, 2, 600)]
NAMES = ("products", "attention", "norms")


def compute(inputs):
    """(every batch's products, every case's attention, the norms), each one array, from the inputs."""
    w = packed.pack(inputs["weight"])
    products = np.concatenate([packed.matmul(inputs["x"][:n], w) for n in range(1, ROWS + 1)])
    attention = [paged_attention.attend(inputs[f"q{i}"], inputs[f"k{i}"], inputs[f"v{i}"], inputs[f"tables{i}"],
                                        inputs[f"seqs{i}"], inputs[f"keys{i}"], 0.125).ravel()
                 for i in range(len(ATTENTION))]
    norms = kernels.rms_norm(inputs["x"], inputs["weight"][0, :inputs["x"].shape[1]], 1e-6)
    return products, np.concatenate(attention), norms


def inputs() -> dict:
    rng = np.random.default_rng(4)
    arrays = {"weight": rng.standard_normal((4100, 67), dtype=np.float32),
              "x": rng.standard_normal((ROWS, 67), dtype=np.float32)}
    for i, (heads, kv_heads, head_dim, block_size, rows, longest) in enumerate(ATTENTION):
        lengths = rng.integers(longest // 2, longest, rows)
        counts = -(-lengths // block_size)
        blocks = rng.permutation(counts.sum() + 1)                       # scattered, one left over
        tables = np.zeros((rows, counts.max()), dtype=np.int64)
        for r, (start, count) in enumerate(zip(np.cumsum(counts) - counts, counts)):
            tables[r, :count] = blocks[start:start + count]
        arrays |= {f"q{i}": rng.standard_normal((rows, heads, head_dim), dtype=np.float32),
                   f"k{i}": rng.standard_normal((len(blocks), kv_heads, head_dim, block_size), dtype=np.float32),
                   f"v{i}": rng.standard_normal((len(blocks), kv_heads, block_size, head_dim), dtype=np.float32),
                   f"tables{i}": tables, f"seqs{i}": np.arange(rows), f"keys{i}": lengths}
    heads, _, head_dim, _, _, _ = ATTENTION[-1]
    assert arrays[f"keys{len(ATTENTION) - 1}"].sum() * heads * head_dim >= paged_attention.THREADED_WORK  # threaded
    return arrays


@pytest.mark.skipif(not jit.WIDE_VECTORS, reason="this CPU has no 512-bit vectors: its build is the narrow one")
def test_a_narrower_cpus_build_gives_the_same_bits(tmp_path):
    np.savez(tmp_path / "inputs.npz", **inputs())
    env = {**os.environ, **NARROW, "NUMBA_CACHE_DIR": str(tmp_path / "numba")}
    done = subprocess.run([sys.executable, __file__, tmp_path / "inputs.npz", tmp_path / "narrow.npz"], env=env,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr
    narrow = np.load(tmp_path / "narrow.npz")
    for name, wide in zip(NAMES, compute(np.load(tmp_path / "inputs.npz"))):
        assert narrow[name].tobytes() == wide.tobytes(), name


if __name__ == "__main__":  # the narrow build's side, in the test's subprocess
    assert not jit.WIDE_VECTORS and packed.GROUP == 2 and paged_attention.SCORE_HEADS == 1
    np.savez(sys.argv[2], **dict(zip(NAMES, compute(np.load(sys.argv[1])))))
