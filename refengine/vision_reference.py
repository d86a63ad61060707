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
RoPE by three position streams (mrope_positions, as transformers' get_rope_index: text counts up on
all three; an image's tokens take its start on t and spread over its merged grid on h and w; the text
after it continues from the image's start plus its longer merged side), and adds the deepstack features to
the image rows after its first layers (reference.final_hidden_with_images). Patches are laid out
merge-block by merge-block (model/image.py), so merging is a reshape. tests/test_parity_vl_images.py
holds the logits to transformers' float64 forward with pixel_values and image_grid_thw.
"""
from __future__ import annotations

import math

import numpy as np

from .errors import RefengineError
from .model import Model
from .model.image import preprocess_image
from .model.vision import (
    LAYER_NORM_EPS,
    MergerWeights,
    VisionBlockWeights,
    VisionConfig,
    VisionWeights,
)
from .reference import (
    GenerationResult,
    Greedy,
    KVCache,
    apply_rotary,
    final_hidden_with_images,
    linear,
    mrope_angles,
    output_head,
    prompt_logprobs_of,
    softmax,
)
from .sampling import SamplingParams


def layer_norm(x, weight, bias, eps=LAYER_NORM_EPS):  # x [..., dim]
    mean = x.mean(axis=-1, keepdims=True)
    var = ((x - mean) ** 2).mean(axis=-1, keepdims=True)
    return (x - mean) / np.sqrt(var + eps) * weight + bias


def gelu_tanh(x):  # the tanh approximation (transformers' gelu_pytorch_tanh)
    return 0.5 * x * (1.0 + np.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * x ** 3)))


def patch_coordinates(grid_thws, merge):
    """(row, column) [patches] of every patch of every image, in the order the patches come:
    merge-block by merge-block within a frame, frame after frame."""
    rows, cols = [], []
    for t, h, w in grid_thws:
        r, c = np.meshgrid(np.arange(h), np.arange(w), indexing="ij")       # [h, w] each
        blocks = (h // merge, merge, w // merge, merge)
        rows.append(np.tile(r.reshape(blocks).transpose(0, 2, 1, 3).ravel(), t))  # [t*h*w]
        cols.append(np.tile(c.reshape(blocks).transpose(0, 2, 1, 3).ravel(), t))  # [t*h*w]
    return np.concatenate(rows), np.concatenate(cols)


def _bilinear_taps(index, size, side):
    """Where each of `index` [n] (on an axis of `size` patches) falls on the `side` learned positions,
    corners aligned (patch 0 on position 0, patch size-1 on position side-1): the two neighbouring
    positions [n, 2] and their weights [n, 2]."""
    src = index * (side - 1) / max(size - 1, 1)                             # [n]
    low = np.floor(src)                                                     # [n]
    frac = src - low                                                        # [n]
    taps = np.minimum(np.stack([low, low + 1], axis=-1).astype(np.int64), side - 1)  # [n, 2]
    return taps, np.stack([1.0 - frac, frac], axis=-1)                     # [n, 2], [n, 2]


def interpolated_positions(pos_embed, grid_thws, v: VisionConfig):
    """The side x side grid of learned position embeddings [side*side, hidden] resized bilinearly to
    each image's patch grid: [patches, hidden], one row per patch in the patches' order."""
    side, out = v.grid_side, []
    for t, h, w in grid_thws:
        rows, cols = patch_coordinates([(t, h, w)], v.spatial_merge_size)  # [n] each
        row_taps, row_w = _bilinear_taps(rows, h, side)                    # [n, 2], [n, 2]
        col_taps, col_w = _bilinear_taps(cols, w, side)                    # [n, 2], [n, 2]
        index = (row_taps[:, :, None] * side + col_taps[:, None, :]).reshape(-1, 4)  # [n, 4]
        weight = (row_w[:, :, None] * col_w[:, None, :]).reshape(-1, 4).astype(pos_embed.dtype)  # [n, 4]
        out.append((pos_embed[index] * weight[:, :, None]).sum(axis=1))             # [n, hidden]
    return np.concatenate(out)                                                      # [patches, hidden]


def vision_angles(rows, cols, head_dim, theta):  # rows, cols [patches] -> [patches, head_dim]
    """2-D RoPE: a quarter of the frequencies of a head_dim / 2 RoPE turned by the row, the same
    turned by the column, the pair then rotating both halves of the head as the 1-D RoPE does."""
    quarter = head_dim // 2
    inv_freq = 1.0 / theta ** (np.arange(0, quarter, 2, dtype=np.float64) / quarter)   # [head_dim/4]
    angles = np.concatenate([np.outer(rows, inv_freq), np.outer(cols, inv_freq)], axis=-1)  # [patches, hd/2]
    return np.concatenate([angles, angles], axis=-1)                                     # [patches, head_dim]


def mrope_positions(ids, grid_thws, v: VisionConfig) -> np.ndarray:
    """The (t, h, w) RoPE positions [3, len(ids)] of a prompt whose runs of image_token_id are, in order,
    the images of `grid_thws` (each a patch grid (t, h, w)), as transformers' get_rope_index gives them.
    Each run must be exactly its image's tokens (transformers groups consecutive image tokens into one
    image: two images must be separated, as <|vision_end|><|vision_start|> do)."""
    ids = np.asarray(ids)
    m = v.spatial_merge_size
    is_image = ids == v.image_token_id
    starts = np.flatnonzero(is_image & ~np.concatenate([[False], is_image[:-1]]))  # where each run begins
    if len(starts) != len(grid_thws):
        raise RefengineError(f"prompt: {len(starts)} runs of image tokens (id {v.image_token_id}) for "
                             f"{len(grid_thws)} images")
    out, at, pos = [], 0, 0  # the positions so far, the next index, the next position
    for start, (t, h, w) in zip(starts, grid_thws):
        out.append(np.broadcast_to(pos + np.arange(start - at), (3, start - at)))  # text: equal streams
        pos += start - at
        n = v.image_tokens((t, h, w))
        run = int(np.argmin(np.append(is_image[start:], False)))  # length of the run
        if run != n:
            raise RefengineError(f"prompt: the image tokens at {start} are {run}, its image of grid "
                                 f"{[t, h, w]} needs {n}")
        tt, hh, ww = np.meshgrid(np.arange(t), np.arange(h // m), np.arange(w // m), indexing="ij")
        out.append(pos + np.stack([tt, hh, ww]).reshape(3, n))               # [3, n]
        pos += max(h, w) // m
        at = start + n
    out.append(np.broadcast_to(pos + np.arange(len(ids) - at), (3, len(ids) - at)))
    return np.concatenate(out, axis=1).astype(np.int64)                      # [3, len(ids)]


def mrope_delta(positions) -> int:
    """What a token after the prompt adds to its index to get its (equal) t, h, w positions: the
    prompt's largest position + 1 - its length (transformers' rope_deltas); 0 without an image."""
    positions = np.asarray(positions)
    return int(positions.max()) + 1 - positions.shape[1]


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
    grid_thws = [tuple(int(n) for n in g) for g in grid_thws]
    embeds, deepstack = vision_forward(model.vision_weights(dtype), model.vision_config, pixel_values, grid_thws) \
        if grid_thws else (np.zeros((0, model.config.hidden_size), dtype), [])      # [tokens, hidden]
    return logits_with_features(model, ids, grid_thws, embeds, deepstack, dtype)


def logits_with_features(model: Model, ids, grid_thws, embeds, deepstack, dtype=np.float64):
    """Logits [len(ids), vocab] of a prompt whose image tokens take the tower's output: `embeds` [image
    tokens, hidden] and the deepstack features, of the images of grid_thws (vision_forward's)."""
    ids = np.asarray(model.check_prompt(ids))
    cfg, v = model.config, model.vision_config
    positions = mrope_positions(ids, grid_thws, v)                                  # [3, seq]
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


def generate_with_images(model: Model, prompt_ids, images, params: SamplingParams, top_k_logprobs: int = 5,
                         keep_logits: bool = False) -> GenerationResult:
    """reference.generate for a prompt with images (`images` as prompt_logits_with_images takes them):
    greedy, stopping as the engine stops, each next token's logits the last row of a forward over the
    prompt and the answer so far (the answer's tokens continue the prompt's three position streams, all
    equal after the last image), the tower run once. Prompt logprobs, where asked, from the first forward."""
    processed = [preprocess_image(image, model.image_processor) for image in images]
    grids = [p.grid_thw for p in processed]
    pixel_values = np.concatenate([p.pixel_values for p in processed])                # [patches, patch_dim]
    embeds, deepstack = vision_forward(model.vision_weights(np.float64), model.vision_config, pixel_values, grids)
    decode = Greedy(model, prompt_ids, params, top_k_logprobs, keep_logits)
    prompt_rows = None
    while decode.result is None:
        logits = logits_with_features(model, decode.prompt_ids + decode.token_ids, grids, embeds, deepstack)
        prompt_rows = logits if prompt_rows is None else prompt_rows                  # [len(prompt), vocab]
        decode.take(logits[-1])
    if params.prompt_logprobs is not None:
        decode.result.prompt_logprobs = prompt_logprobs_of(prompt_rows, decode.prompt_ids, params.prompt_logprobs,
                                                           keep_logits)
    return decode.result
