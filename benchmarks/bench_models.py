"""What the benchmarks share: the mid-size model, the batch sizes, the modes."""
from __future__ import annotations

from refengine.model.tiny import TinySpec

# About 29M parameters (117 MB in float32): weights stream from memory rather than cache, yet the
# whole benchmark set runs in a few minutes. `refengine bench --preset qwen3-0.6b-shape` measures
# the full-size shape.
MID_SPEC = TinySpec(layers=4, hidden=512, heads=8, kv_heads=4, head_dim=64, intermediate=1536, vocab=32768)
BATCH_SIZES = (1, 8, 32)
MODES = ("fast", "invariant")
