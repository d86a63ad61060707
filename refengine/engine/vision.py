"""The engine's Qwen3-VL vision tower, in float32: an image's patches -> the rows that take its
placeholder tokens' place in the language model, and the deepstack features added to those rows
after the first decoder layers.

An image is encoded once per request, before or during the prefill of its placeholder tokens, and
what it becomes must not depend on which other requests' images happen to be encoded in the same
step: a request's tokens would otherwise change with the traffic around it, which is exactly what
the suite looks for. So the unit of work is one image. Its patches go through each weight product
as one matrix (hundreds to thousands of rows, where BLAS is efficient already); attention runs per
frame, one head at a time (the scores of a head are patches x patches floats; all heads at once
would be gigabytes for a large image). Images are never stacked into one product: BLAS's sgemm
gives a row other bits depending on the rows beside it (one row goes through gemv, small products
through other kernels), so the same tower with all images' patches in each product gives an image
other features than it has encoded alone. Encoded alone, an image's features are a function of its
pixels: tests/test_engine_vision.py checks every image's bits alone and in several orders with
others. (The engine's packed product, engine/packed.py, is row-independent by construction, but
it is built for a decode step's few rows, not an image's thousands.)

The arithmetic is numpy float32 (BLAS products, its own LayerNorm, tanh GELU and position grid), the
rotary turn of the language model's compiled kernel, and a compiled exact GELU for the mergers
(numpy has no erf, and a Python call per element would outweigh the mergers' products). It is held
to the float64 reference (vision_reference.vision_forward) within float32 rounding noise by the
same test.
"""
from __future__ import annotations

import math

import numpy as np

from ..errors import RefengineError
from ..model import Model
from ..model.vision import (
    LAYER_NORM_EPS,
    MergerWeights,
    VisionBlockWeights,
    VisionConfig,
    VisionWeights,
)
from .jit import jit
from .kernels import apply_rope, softmax_rows


def encode_images(model: Model, pixel_values, grid_thws):
    """pixel_values [patches, patch_dim] of the images of grid_thws, in order (as
    model.image.preprocess_image makes them, concatenated) -> their embeddings [tokens, out_hidden]
    float32 and one deepstack feature [tokens, out_hidden] float32 per deepstack_visual_indexes entry,
    tokens = sum of t*h*w / merge**2. Each image is encoded on its own (the module says why)."""
    v = model.vision_config
    grids = [tuple(int(n) for n in g) for g in grid_thws]
    for i, grid in enumerate(grids):
        if len(grid) != 3 or min(grid) < 1 or grid[1] % v.spatial_merge_size or grid[2] % v.spatial_merge_size:
            raise RefengineError(f"grid_thws[{i}]: {list(grid)} is not a patch grid (t, h, w) with h and w "
                                 f"multiples of spatial_merge_size={v.spatial_merge_size}")
    pixels = np.asarray(pixel_values, dtype=np.float32)
    bounds = np.cumsum([0] + [t * h * w for t, h, w in grids])
    if pixels.shape != (bounds[-1], v.patch_dim):
        raise RefengineError(f"pixel_values: shape {list(pixels.shape)}, expected [{bounds[-1]}, {v.patch_dim}] "
                             f"for grids {[list(g) for g in grids]}")
    weights = model.vision_weights(np.float32)
    encoded = [encode_image(weights, v, pixels[lo:hi], grid) for lo, hi, grid in zip(bounds[:-1], bounds[1:], grids)]
    empty = np.zeros((0, v.out_hidden_size), dtype=np.float32)
    embeds = np.concatenate([empty] + [e for e, _ in encoded])
    deepstack = [np.concatenate([empty] + [d[level] for _, d in encoded])
                 for level in range(len(v.deepstack_visual_indexes))]  # the order of the blocks they follow
    return embeds, deepstack


def encode_image(w: VisionWeights, v: VisionConfig, pixels, grid_thw):
    """One image: pixels [t*h*w, patch_dim] float32 -> embeddings [tokens, out_hidden] and the deepstack
    features [tokens, out_hidden], in the order of the blocks they follow (as transformers lists them,
    whatever the order of deepstack_visual_indexes)."""
    x = _linear(pixels, w.patch_embed, w.patch_bias)                                 # [patches, hidden]
    rows, cols = _patch_rows_cols(grid_thw, v.spatial_merge_size)                   # [patches] each
    x += _grid_positions(w.pos_embed, rows, cols, grid_thw, v.grid_side)
    quarter = v.head_dim // 2
    inv_freq = 1.0 / v.rope_theta ** (np.arange(0, quarter, 2, dtype=np.float64) / quarter)  # [head_dim/4]
    half = np.concatenate([rows[:, None] * inv_freq, cols[:, None] * inv_freq], axis=1)  # [patches, head_dim/2]
    angles = np.concatenate([half, half], axis=1)                                    # [patches, head_dim]
    cos, sin = np.cos(angles).astype(np.float32), np.sin(angles).astype(np.float32)
    deepstack = []
    for n, b in enumerate(w.blocks):
        x = _block(x, b, v, grid_thw[0], cos, sin)                                   # [patches, hidden]
        if n in v.deepstack_visual_indexes:
            merger = w.deepstack_mergers[v.deepstack_visual_indexes.index(n)]
            deepstack.append(_merge(x, merger, v, postshuffle=True))                # [tokens, out_hidden]
    return _merge(x, w.merger, v, postshuffle=False), deepstack


def _patch_rows_cols(grid_thw, merge: int) -> tuple[np.ndarray, np.ndarray]:
    """The (row, column) of each patch of an image, in the order its patches come: frame by frame, and
    within a frame merge-block by merge-block (blocks in row order, a block's patches in row order)."""
    t, h, w = grid_thw
    index = np.arange(t * h * w) % (h * w)                        # within its frame
    block, inside = np.divmod(index, merge * merge)
    block_row, block_col = np.divmod(block, w // merge)
    return block_row * merge + inside // merge, block_col * merge + inside % merge


def _grid_positions(pos_embed, rows, cols, grid_thw, side: int) -> np.ndarray:
    """The learned side x side position embeddings [side * side, hidden] read bilinearly at each patch,
    the image's corners on the grid's corners: [patches, hidden] float32."""
    _, h, w = grid_thw
    y = rows * (side - 1) / max(h - 1, 1)                          # [patches], on the grid
    x = cols * (side - 1) / max(w - 1, 1)
    y0, x0 = np.floor(y).astype(np.int64), np.floor(x).astype(np.int64)
    y1, x1 = np.minimum(y0 + 1, side - 1), np.minimum(x0 + 1, side - 1)
    fy, fx = (y - y0)[:, None].astype(np.float32), (x - x0)[:, None].astype(np.float32)
    grid = pos_embed.reshape(side, side, -1)
    top = grid[y0, x0] * (1 - fx) + grid[y0, x1] * fx
    bottom = grid[y1, x0] * (1 - fx) + grid[y1, x1] * fx
    return top * (1 - fy) + bottom * fy


def _layer_norm(x, weight, bias):  # x [rows, dim] float32
    centered = x - x.mean(axis=-1, keepdims=True)
    return centered / np.sqrt((centered * centered).mean(axis=-1, keepdims=True) + np.float32(LAYER_NORM_EPS)) \
        * weight + bias


def _gelu_tanh(x):  # the tanh approximation, transformers' gelu_pytorch_tanh
    return np.float32(0.5) * x * (np.float32(1) + np.tanh(np.float32(math.sqrt(2 / math.pi))
                                                          * (x + np.float32(0.044715) * x * x * x)))


def _linear(x, weight, bias):  # x [rows, in] float32, weight [out, in] -> [rows, out]
    y = x @ weight.T
    y += bias
    return y


def _block(x, b: VisionBlockWeights, v: VisionConfig, frames: int, cos, sin):  # x [patches, hidden]
    x = x + _attention(_layer_norm(x, b.norm1, b.norm1_bias), b, v, frames, cos, sin)
    hidden = _linear(_layer_norm(x, b.norm2, b.norm2_bias), b.fc1, b.fc1_bias)      # [patches, intermediate]
    return x + _linear(ACTIVATIONS[v.hidden_act](hidden), b.fc2, b.fc2_bias)     # [patches, hidden]


def _attention(x, b: VisionBlockWeights, v: VisionConfig, frames: int, cos, sin):
    """Every patch attends to every patch of its own frame; no mask, no cache."""
    n, heads = x.shape[0], v.num_heads
    qkv = _linear(x, b.qkv, b.qkv_bias).reshape(n, 3, heads, v.head_dim)          # [patches, 3, heads, hd]
    q = apply_rope(qkv[:, 0], cos, sin).transpose(1, 0, 2)                         # [heads, patches, hd]
    k = apply_rope(qkv[:, 1], cos, sin).transpose(1, 2, 0)                         # [heads, hd, patches]
    values = qkv[:, 2].transpose(1, 0, 2)                                          # [heads, patches, hd]
    out = np.empty((n, heads, v.head_dim), dtype=np.float32)
    scale, size = np.float32(1 / math.sqrt(v.head_dim)), n // frames
    for lo in range(0, n, size):
        for h in range(heads):
            scores = q[h, lo:lo + size] @ k[h, :, lo:lo + size]                    # [size, size]
            scores *= scale
            out[lo:lo + size, h] = softmax_rows(scores) @ values[h, lo:lo + size]  # [size, hd]
    return _linear(out.reshape(n, v.hidden_size), b.proj, b.proj_bias)             # [patches, hidden]


def _merge(x, m: MergerWeights, v: VisionConfig, postshuffle: bool):
    """x [patches, hidden] -> [patches / merge**2, out_hidden]: the final merger normalises each patch
    before a merge-block's patches are put side by side (patches come merge-block by merge-block),
    a deepstack merger the merged row."""
    if postshuffle:
        x = _layer_norm(x.reshape(-1, v.merged_dim), m.norm, m.norm_bias)          # [tokens, merged]
    else:
        x = _layer_norm(x, m.norm, m.norm_bias).reshape(-1, v.merged_dim)          # [tokens, merged]
    return _linear(gelu(_linear(x, m.fc1, m.fc1_bias)), m.fc2, m.fc2_bias)        # [tokens, out_hidden]


def gelu(x):  # exact: x * Phi(x); x float32 -> a new float32 array of its shape
    out = np.empty(x.shape, dtype=np.float32)
    _gelu(np.ascontiguousarray(x, dtype=np.float32).reshape(-1), out.reshape(-1))
    return out


@jit
def _gelu(x, out):
    """Each element in float64 (erf of a float32's exact widening), rounded once to float32."""
    for i in range(x.size):
        value = np.float64(x[i])
        out[i] = 0.5 * value * (1.0 + math.erf(value * 0.7071067811865476))


ACTIVATIONS = {"gelu": gelu, "gelu_pytorch_tanh": _gelu_tanh}
