"""The float64 Qwen3-VL vision tower, and the language model reading its output: the oracle of a
prompt with images.

What an image contributes is computed as transformers 5.24 computes it (models/qwen3_vl), in float64
throughout, one function per step and a shape comment per tensor line:

    patches [patches, C*T*p*p] --patch_embed (a Conv3d whose stride is its kernel: a linear map)-->
    + the learned grid of position embeddings, bilinearly resized to each image's patch grid -->
    blocks: LayerNorm, attention with 2-D rotary positions (row, column) within each image only,
            LayerNorm, MLP -->
    merger: each spatial_merge_size**2 neighbouring patches -> one language-model token,
    and after the blocks listed in deepstack_visual_indexes, a deepstack merger of the same.

The language model then takes the tower's tokens in place of the image placeholder tokens, turns
RoPE by three position streams (model.vision.mrope_positions), and adds the deepstack features to
the image rows after its first layers (reference.final_hidden_with_images). Patches are laid out
merge-block by merge-block (model/image.py), so merging is a reshape. tests/test_parity_vl_images.py
holds the logits to transformers' float64 forward with pixel_values and image_grid_thw.
"""
from __future__ import annotations

import math

import numpy as np

from .model import Model
from .model.image import preprocess_image
from .model.vision import (
    MergerWeights,
    VisionBlockWeights,
    VisionConfig,
    VisionWeights,
    gelu_tanh,
    interpolated_positions,
    layer_norm,
    mrope_positions,
    patch_coordinates,
    vision_angles,
)
from .reference import KVCache, apply_rotary, final_hidden_with_images, linear, mrope_angles, output_head, softmax

_erf = np.vectorize(math.erf, otypes=[np.float64])  # numpy has none; the mergers' GELU is the exact one


def gelu(x):  # exact: x * Phi(x)
    return 0.5 * x * (1.0 + _erf(x / math.sqrt(2.0)).astype(x.dtype))


ACTIVATIONS = {"gelu": gelu, "gelu_pytorch_tanh": gelu_tanh}


def full_attention(q, k, v):  # q, k, v [n, heads, hd]: every patch sees every patch of its frame
    scores = np.einsum("shd,thd->hst", q, k) / np.sqrt(q.shape[-1], dtype=q.dtype)  # [heads, n, n]
    return np.einsum("hst,thd->shd", softmax(scores), v)                  # [n, heads, hd]


def vision_attention(x, b: VisionBlockWeights, v: VisionConfig, bounds, angles):
    """x [patches, hidden]; bounds: where each frame's patches start and end (attention never
    crosses them: patches of different images never see each other)."""
    n = x.shape[0]
    qkv = linear(x, b.qkv, b.qkv_bias).reshape(n, 3, v.num_heads, v.head_dim)  # [patches, 3, heads, hd]
    q, k = apply_rotary(qkv[:, 0], angles), apply_rotary(qkv[:, 1], angles)    # [patches, heads, hd] each
    out = [full_attention(q[lo:hi], k[lo:hi], qkv[lo:hi, 2]) for lo, hi in zip(bounds[:-1], bounds[1:])]
    return linear(np.concatenate(out).reshape(n, v.hidden_size), b.proj, b.proj_bias)  # [patches, hidden]


def vision_block(x, b: VisionBlockWeights, v: VisionConfig, bounds, angles):  # x [patches, hidden]
    x = x + vision_attention(layer_norm(x, b.norm1, b.norm1_bias), b, v, bounds, angles)
    h = ACTIVATIONS[v.hidden_act](linear(layer_norm(x, b.norm2, b.norm2_bias), b.fc1, b.fc1_bias))  # [p, inter]
    return x + linear(h, b.fc2, b.fc2_bias)                                                         # [p, hidden]


def merge(x, m: MergerWeights, v: VisionConfig, postshuffle: bool):
    """x [patches, hidden] -> [patches / merge**2, out_hidden]: the final merger normalises each patch
    before the merge-block's patches are put side by side, a deepstack merger the merged row."""
    if postshuffle:
        x = layer_norm(x.reshape(-1, v.merged_dim), m.norm, m.norm_bias)  # [tokens, merged]
    else:
        x = layer_norm(x, m.norm, m.norm_bias).reshape(-1, v.merged_dim)  # [tokens, merged]
    return linear(gelu(linear(x, m.fc1, m.fc1_bias)), m.fc2, m.fc2_bias)  # [tokens, out_hidden]


def vision_forward(w: VisionWeights, v: VisionConfig, pixel_values, grid_thws):
    """pixel_values [patches, patch_dim] of the images of grid_thws (model.image.preprocess_image, in
    order) -> their language-model embeddings [tokens, out_hidden] and one deepstack feature
    [tokens, out_hidden] per deepstack_visual_indexes entry, tokens = sum of t*h*w / merge**2."""
    x = linear(np.asarray(pixel_values, w.patch_embed.dtype), w.patch_embed, w.patch_bias)  # [patches, hidden]
    x = x + interpolated_positions(w.pos_embed, grid_thws, v)                                # [patches, hidden]
    angles = vision_angles(*patch_coordinates(grid_thws, v.spatial_merge_size), v.head_dim, v.rope_theta)
    bounds = np.cumsum([0] + [h * wd for t, h, wd in grid_thws for _ in range(t)])          # frame bounds
    deepstack = []
    for n, b in enumerate(w.blocks):
        x = vision_block(x, b, v, bounds, angles)                                            # [patches, hidden]
        if n in v.deepstack_visual_indexes:
            merger = w.deepstack_mergers[v.deepstack_visual_indexes.index(n)]
            deepstack.append(merge(x, merger, v, postshuffle=True))                          # [tokens, out]
    return merge(x, w.merger, v, postshuffle=False), deepstack                               # [tokens, out]


def prompt_logits_with_pixels(model: Model, ids, pixel_values, grid_thws, dtype=np.float64):
    """Logits [len(ids), vocab] of a prompt whose runs of image tokens are, in order, the images of
    grid_thws, given as their patches pixel_values [patches, patch_dim] (what transformers calls
    pixel_values and image_grid_thw)."""
    ids = np.asarray(model.check_prompt(ids))
    cfg, v = model.config, model.vision_config
    grid_thws = [tuple(int(n) for n in g) for g in grid_thws]
    positions = mrope_positions(ids, grid_thws, v)                                  # [3, seq]
    embeds, deepstack = vision_forward(model.vision_weights(dtype), v, pixel_values, grid_thws) if grid_thws \
        else (np.zeros((0, cfg.hidden_size), dtype), [])                            # [tokens, hidden]
    weights = model.reference_weights(dtype)
    x = np.array(weights.embed[ids], dtype=dtype)                                   # [seq, hidden]
    image_rows = ids == v.image_token_id                                            # [seq]
    x[image_rows] = embeds
    angles = mrope_angles(positions, cfg.head_dim, cfg.rope_theta, v.mrope_section)  # [seq, head_dim]
    h = final_hidden_with_images(weights, cfg, x, KVCache(), angles, image_rows, deepstack)  # [seq, hidden]
    return output_head(weights, h)                                                  # [seq, vocab]


def prompt_logits_with_images(model: Model, ids, images, dtype=np.float64):
    """Logits [len(ids), vocab] of a prompt with images: `images` RGB uint8 arrays [height, width, 3],
    one per run of image placeholder tokens (Tokenizer.encode_chat_with_images writes them), each
    preprocessed as transformers' image processor does (model.image)."""
    processed = [preprocess_image(image, model.image_processor) for image in images]
    pixel_values = np.concatenate([p.pixel_values for p in processed]) if processed else None
    return prompt_logits_with_pixels(model, ids, pixel_values, [p.grid_thw for p in processed], dtype)
