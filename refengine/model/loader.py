"""One loaded model folder: config, validated tensors, tokenizer, fingerprint.

The float64 reference and the float32 engine ask the same object for weights in their dtype;
each dtype is converted once and cached.
"""
from __future__ import annotations

import hashlib
import threading
from functools import cached_property
from pathlib import Path

import numpy as np

from ..errors import RefengineError
from .config import ModelConfig, load_config
from .tokenizer import Tokenizer
from .weights import Checkpoint, StreamedWeights, Weights

FINGERPRINT_FILES = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json")
STREAM_ABOVE_BYTES = 1 << 30  # the reference streams a model whose converted weights would exceed this


class Model:
    def __init__(self, model_dir: str | Path):
        self.path = Path(model_dir)
        self.config: ModelConfig = load_config(self.path)
        self.checkpoint = Checkpoint(self.path, self.config)
        self.tokenizer = Tokenizer(self.path)
        self._weights: dict[np.dtype, Weights] = {}
        self._lock = threading.Lock()

    def weights(self, dtype=np.float32) -> Weights:
        dtype = np.dtype(dtype)
        with self._lock:
            if dtype not in self._weights:
                self._weights[dtype] = self.checkpoint.to_weights(dtype)
            return self._weights[dtype]

    def reference_weights(self, dtype=np.float64) -> Weights | StreamedWeights:
        """What the reference forward reads: the cached weights, or for a model whose weights in `dtype`
        would exceed STREAM_ABOVE_BYTES (a fixed size, not the machine's memory, so a golden refresh
        takes the same path everywhere), StreamedWeights."""
        dtype = np.dtype(dtype)
        if self.config.num_parameters * dtype.itemsize > STREAM_ABOVE_BYTES:
            return StreamedWeights.of(self.checkpoint, dtype)
        return self.weights(dtype)

    @cached_property
    def fingerprint(self) -> str:
        """sha256 over config, generation config, weight files and tokenizer files, in a fixed order."""
        digest = hashlib.sha256()
        files = [self.path / n for n in FINGERPRINT_FILES if (self.path / n).exists()] + self.checkpoint.files
        for path in files:
            digest.update(path.name.encode() + b"\0")
            with open(path, "rb") as f:
                for chunk in iter(lambda: f.read(1 << 22), b""):
                    digest.update(chunk)
        return "sha256:" + digest.hexdigest()

    def check_prompt(self, ids, what: str = "prompt") -> list[int]:
        """Reject prompts the forward cannot take, naming the offending id."""
        ids = [int(i) for i in ids]
        if not ids:
            raise RefengineError(f"{what}: empty prompt (at least one token is needed)")
        for pos, i in enumerate(ids):
            if not 0 <= i < self.config.vocab_size:
                raise RefengineError(
                    f"{what}: token id {i} at position {pos} is outside the vocabulary [0, {self.config.vocab_size})")
        return ids


def load_model(model_dir: str | Path) -> Model:
    return Model(model_dir)
