"""A request's images inside the batch (Qwen3-VL): what its rows need that a text request's do not.

Everything here belongs to one request and is computed from that request alone, so its rows are the
same bits whatever else a step holds:
- its patches and grids (model.image), and a hash of them that roots its KV blocks' hashes (a cached
  block is reused only by a request with the same images before it: prefix caching);
- its RoPE positions: three streams (t, h, w) per prompt token (`positions`, the engine's own reading of
  Qwen3-VL's rule, held to the reference's by tests/test_engine_images.py); a token after the prompt turns
  by its index plus the prompt's delta on all three. A row's angles are computed in
  float64 as the engine's RoPE tables compute theirs (position x inverse frequency, one product), so a
  text row gets the tables' bits;
- its image features: the vision tower's output (engine/vision.py, each image on its own), computed the
  first time a step feeds one of its image tokens and kept for the request's life (a chunk boundary
  inside an image, and a preemption's recompute, read the same rows again).
The runner puts the features in place of the image tokens' embeddings and adds each deepstack level
after the matching first decoder layers (model_runner.ModelRunner._multimodal).
"""
from __future__ import annotations

import hashlib

import numpy as np

from ..errors import RefengineError
from ..model import Model
from ..model.image import ProcessedImage
from ..model.vision import VisionConfig
from .vision import encode_images


def longer_side(rows: int, cols: int) -> int:
    return max(rows, cols)


def positions(ids: np.ndarray, grids: list, v: VisionConfig, span=longer_side) -> tuple[np.ndarray, int]:
    """(t, h, w) RoPE positions [3, len(ids)] of a prompt whose runs of image tokens are the images of
    `grids`, in order, and what a token after it adds to its index. Walking the prompt, a text token takes
    the next position on all three streams; an image's run, starting at position p, takes p + its frame
    on t and p + its merged row and column on h and w, and the next position is p + the longer merged
    side of the image (`span`: Fault.TEXT_AFTER_IMAGE_ONE_POSITION's one instead)."""
    is_image = ids == v.image_token_id
    runs = int(np.count_nonzero(is_image[1:] & ~is_image[:-1]) + (len(ids) > 0 and is_image[0]))
    if runs != len(grids):
        raise RefengineError(f"prompt: {runs} runs of image tokens (id {v.image_token_id}) for {len(grids)} images")
    out, index, position, m = np.empty((3, len(ids)), dtype=np.int64), 0, 0, v.spatial_merge_size
    images = iter(grids)
    while index < len(ids):
        if not is_image[index]:
            out[:, index], index, position = position, index + 1, position + 1
            continue
        t, h, w = next(images)
        rows, cols, tokens = h // m, w // m, v.image_tokens((t, h, w))
        if index + tokens > len(ids) or not is_image[index:index + tokens].all() or \
                (index + tokens < len(ids) and is_image[index + tokens]):
            raise RefengineError(f"prompt: the image tokens at {index} are not the {tokens} its image of grid "
                                 f"{[t, h, w]} takes")
        frame, rest = np.divmod(np.arange(tokens), rows * cols)
        out[:, index:index + tokens] = position + np.stack([frame, rest // cols, rest % cols])
        index, position = index + tokens, position + span(rows, cols)
    return out, position - len(ids)


def frequency_streams(head_dim: int, section) -> np.ndarray:
    """The stream (0 t, 1 h, 2 w) each of the head_dim / 2 rotary frequencies turns by, interleaved as
    Qwen3-VL lays them out: h takes every third frequency from the second while section[1] last, w every
    third from the third while section[2] last, t the rest."""
    streams = np.zeros(head_dim // 2, dtype=np.int64)
    streams[1:3 * section[1]:3] = 1
    streams[2:3 * section[2]:3] = 2
    return streams


class RequestImages:
    def __init__(self, model: Model, prompt_ids: list[int], processed: list[ProcessedImage], span=longer_side):
        """`processed`: model.image.preprocess_image's, one per run of image tokens in `prompt_ids`, in order;
        `span`: what positions() advances by after an image."""
        v = model.vision_config
        self.model = model
        self.grids = [p.grid_thw for p in processed]
        self.pixel_values = np.concatenate([p.pixel_values for p in processed]).astype(np.float32)
        ids = np.asarray(prompt_ids)
        self.positions, self.delta = positions(ids, self.grids, v, span)  # [3, prompt], int
        # prompt index -> its row of the features (-1: not an image token)
        self.feature_row = np.where(ids == v.image_token_id, np.cumsum(ids == v.image_token_id) - 1, -1)
        self.digest = hashlib.sha256(repr(self.grids).encode() + self.pixel_values.tobytes()).digest()
        self.stream = frequency_streams(model.config.head_dim, v.mrope_section)
        self.features: tuple[np.ndarray, list[np.ndarray]] | None = None  # encode()

    def angles(self, at: np.ndarray, inv_freq: np.ndarray) -> np.ndarray:
        """RoPE angles [len(at), head_dim] float64 of the tokens at indices `at`."""
        prompt = self.positions.shape[1]
        inside = at < prompt
        streams = np.where(inside, self.positions[:, np.minimum(at, prompt - 1)], at + self.delta)  # [3, n]
        half = streams[self.stream].T * inv_freq                                                   # [n, hd/2]
        return np.concatenate([half, half], axis=-1)

    def rows(self, at: np.ndarray) -> np.ndarray:
        """The feature row of each token at indices `at`, -1 where it is no image token of the prompt."""
        prompt = len(self.feature_row)
        return np.where(at < prompt, self.feature_row[np.minimum(at, prompt - 1)], -1)

    def encode(self) -> int:
        """Run the vision tower over the request's images, once: `features` becomes (embeddings [image
        tokens, hidden], deepstack features per level), float32. Returns how many images it encoded."""
        if self.features is not None:
            return 0
        self.features = encode_images(self.model, self.pixel_values, self.grids)
        return len(self.grids)
