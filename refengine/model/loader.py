"""One loaded model folder: config, validated tensors, tokenizer, fingerprint.

The float64 reference and the float32 engine ask the same object for weights in their dtype;
each dtype is converted once and cached.
"""
from __future__ import annotations

import hashlib
import os
import threading
from functools import cached_property
from pathlib import Path

import numpy as np

from ..errors import RefengineError
from .config import ModelConfig, load_config
from .image import ImageProcessorConfig, load_image_processor_config
from .tokenizer import Tokenizer
from .vision import VisionConfig, VisionWeights, load_vision_config, load_vision_weights
from .weights import Checkpoint, StreamedWeights, Weights

FINGERPRINT_FILES = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json")
# The reference holds a model's converted weights in memory up to this size, and above it while they
# fit in MEMORY_SHARE of the memory available when first asked; otherwise it streams them.
STREAM_ABOVE_BYTES = 1 << 30
MEMORY_SHARE = 0.5


def available_memory() -> int:
    """Bytes the system can hand out now without swapping: Linux's MemAvailable (free memory plus
    the page cache it can drop), elsewhere the free pages, 0 when neither is known -- and never
    more than this process's cgroup has left (a container sees the host's MemAvailable)."""
    free = 0
    try:
        with open("/proc/meminfo") as f:
            free = next((int(line.split()[1]) * 1024 for line in f if line.startswith("MemAvailable:")), 0)
    except OSError:
        pass
    if not free:
        try:
            free = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        except (ValueError, OSError, AttributeError):
            free = 0
    headroom = cgroup_headroom()
    return free if headroom is None else min(free, headroom)


def cgroup_headroom(proc_cgroup: str | Path = "/proc/self/cgroup", root: str | Path = "/sys/fs/cgroup") -> int | None:
    """Bytes left under the memory limit of this process's cgroup (v2 memory.max - memory.current, or
    v1 memory.limit_in_bytes - memory.usage_in_bytes, usage counting page cache: an underestimate);
    None without a limit or where cgroups cannot be read."""
    try:
        lines = Path(proc_cgroup).read_text().splitlines()
    except OSError:
        return None
    for line in lines:
        _, controllers, path = line.split(":", 2)
        if controllers == "":
            base, limit_name, usage_name = Path(root) / path.lstrip("/"), "memory.max", "memory.current"
        elif "memory" in controllers.split(","):
            base, limit_name, usage_name = Path(root) / "memory" / path.lstrip("/"), "memory.limit_in_bytes", \
                "memory.usage_in_bytes"
        else:
            continue
        try:
            limit, usage = (base / limit_name).read_text().strip(), int((base / usage_name).read_text())
            if limit != "max" and int(limit) < 1 << 60:  # v1 writes "no limit" as about 2**63
                return max(int(limit) - usage, 0)
        except (OSError, ValueError):
            continue
    return None


class Model:
    def __init__(self, model_dir: str | Path):
        self.path = Path(model_dir)
        self.config: ModelConfig = load_config(self.path)
        self.checkpoint = Checkpoint(self.path, self.config)
        self.tokenizer = Tokenizer(self.path)
        self._weights: dict[np.dtype, Weights] = {}
        self._vision_weights: dict[np.dtype, VisionWeights] = {}
        self._lock = threading.Lock()

    def weights(self, dtype=np.float32) -> Weights:
        dtype = np.dtype(dtype)
        with self._lock:
            if dtype not in self._weights:
                self._weights[dtype] = self.checkpoint.to_weights(dtype)
            return self._weights[dtype]

    def reference_weights(self, dtype=np.float64) -> Weights | StreamedWeights:
        """What the reference forward reads: the weights in `dtype`, converted once and cached, unless
        they exceed STREAM_ABOVE_BYTES and would not fit in MEMORY_SHARE of the memory available now:
        then StreamedWeights, which hold one layer at a time and widen the checkpoint on every pass.
        Both give the same bits (tests/test_streamed_reference.py), so the machine's memory decides
        only a refresh's speed and footprint, never its results."""
        dtype = np.dtype(dtype)
        size = self.config.num_parameters * dtype.itemsize
        with self._lock:
            cached = dtype in self._weights
        if cached or size <= STREAM_ABOVE_BYTES or size <= MEMORY_SHARE * available_memory():
            return self.weights(dtype)
        return StreamedWeights.of(self.checkpoint, dtype)

    @cached_property
    def vision_config(self) -> VisionConfig:
        """The vision tower's config (Qwen3-VL), read when an image first needs it."""
        return load_vision_config(self.path, self.config)

    @cached_property
    def image_processor(self) -> ImageProcessorConfig:
        v = self.vision_config
        return load_image_processor_config(self.path, v.patch_size, v.temporal_patch_size, v.spatial_merge_size)

    def vision_weights(self, dtype=np.float64) -> VisionWeights:
        """The vision tower in `dtype`, validated and converted when first asked for, then cached: a
        text-only request never reads it."""
        dtype = np.dtype(dtype)
        with self._lock:
            if dtype not in self._vision_weights:
                self._vision_weights[dtype] = load_vision_weights(self.checkpoint, self.vision_config, dtype)
            return self._vision_weights[dtype]

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
