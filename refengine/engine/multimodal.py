"""A request's images inside the batch (Qwen3-VL): what its rows need that a text request's do not.

Everything here belongs to one request and is computed from that request alone, so its rows are the
same bits whatever else a step holds:
- its patches and grids (model.image), and a hash of them that roots its KV blocks' hashes (a cached
  block is reused only by a request with the same images before it: prefix caching);
- its RoPE positions: three streams per prompt token (model.vision.mrope_positions); a token after the
  prompt turns by its index plus the prompt's delta on all three. A row's angles are computed in
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

from ..model import Model
from ..model.image import ProcessedImage
from ..model.vision import mrope_delta, mrope_positions, mrope_stream
from .vision import encode_images


class RequestImages:
    def __init__(self, model: Model, prompt_ids: list[int], processed: list[ProcessedImage]):
        """`processed`: model.image.preprocess_image's, one per run of image tokens in `prompt_ids`, in order."""
        v = model.vision_config
        self.model = model
        self.grids = [p.grid_thw for p in processed]
        self.pixel_values = np.concatenate([p.pixel_values for p in processed]).astype(np.float32)
        self.positions = mrope_positions(np.asarray(prompt_ids), self.grids, v)  # [3, prompt]
        self.delta = mrope_delta(self.positions)
        ids = np.asarray(prompt_ids)
        # prompt index -> its row of the features (-1: not an image token)
        self.feature_row = np.where(ids == v.image_token_id, np.cumsum(ids == v.image_token_id) - 1, -1)
        self.digest = hashlib.sha256(repr(self.grids).encode() + self.pixel_values.tobytes()).digest()
        self.stream = mrope_stream(model.config.head_dim, v.mrope_section)
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
