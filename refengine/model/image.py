"""A still image -> the flattened patches Qwen3-VL's vision tower reads, as transformers makes them.

The pixels an image becomes are part of what the oracle is an oracle of: a different resize rule or
resampling filter changes every logit after the image. So this is transformers' PIL-backed Qwen2-VL
image processor (`Qwen2VLImageProcessorPil`, the one Qwen3-VL checkpoints name) step for step: the
smart-resize rule (each side a multiple of patch_size * merge_size, the area between min and max
pixels, the aspect ratio kept as closely as that allows), Pillow's BICUBIC on the uint8 image,
rescale (in float64, then rounded to float32) and normalisation (in float32), the patches laid out
merge-block by merge-block, and a still image repeated temporal_patch_size times. The values are
float32 numbers, as transformers' are, handed on widened (exactly) to float64;
tests/test_parity_vl_images.py checks them equal to transformers' own.

Pillow is the `vision` extra, imported only when an image is processed.
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ..errors import RefengineError

PREPROCESSOR_FILE = "preprocessor_config.json"
# Qwen2VLImageProcessorPil's class defaults: what a field absent from preprocessor_config.json means.
OPENAI_CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
OPENAI_CLIP_STD = (0.26862954, 0.26130258, 0.27577711)
DEFAULT_MIN_PIXELS = 56 * 56
DEFAULT_MAX_PIXELS = 28 * 28 * 1280
PIL_BICUBIC = 3
MAX_ASPECT_RATIO = 200


@dataclass(frozen=True)
class ImageProcessorConfig:
    patch_size: int
    temporal_patch_size: int
    merge_size: int
    min_pixels: int = DEFAULT_MIN_PIXELS
    max_pixels: int = DEFAULT_MAX_PIXELS
    image_mean: tuple[float, ...] = OPENAI_CLIP_MEAN
    image_std: tuple[float, ...] = OPENAI_CLIP_STD
    rescale_factor: float = 1 / 255
    do_resize: bool = True
    do_rescale: bool = True
    do_normalize: bool = True
    resample: int = PIL_BICUBIC


@dataclass(frozen=True)
class ProcessedImage:
    pixel_values: np.ndarray        # [grid_t * grid_h * grid_w, channels * temporal_patch * patch * patch], float64
    grid_thw: tuple[int, int, int]  # patches along time, height, width


def load_image_processor_config(model_dir: str | Path, patch_size: int, temporal_patch_size: int,
                                merge_size: int) -> ImageProcessorConfig:
    """preprocessor_config.json of the folder, each absent field as Qwen2VLImageProcessorPil defaults it,
    except the three sizes the vision tower fixes (given here from its config), which the file may only
    repeat. Older files write the area bounds as min_pixels / max_pixels, newer as size.shortest_edge /
    size.longest_edge; min_pixels / max_pixels win where both are present, as in transformers."""
    path = Path(model_dir) / PREPROCESSOR_FILE
    raw = {}
    if path.exists():
        try:
            raw = json.loads(path.read_text(encoding="utf-8"))
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise RefengineError(f"{path}: not valid JSON ({e})") from None
        if not isinstance(raw, dict):
            raise RefengineError(f"{path}: expected a JSON object")
    tower = {"patch_size": patch_size, "temporal_patch_size": temporal_patch_size, "merge_size": merge_size}
    for field, value in tower.items():
        if field in raw and raw[field] != value:
            raise RefengineError(f"{path}: field {field}={raw[field]!r} disagrees with config.json's vision_config "
                                 f"({value})")
    size = raw.get("size") or {}
    if not isinstance(size, dict):
        raise RefengineError(f"{path}: field size must be an object, got {size!r}")
    fields = dict(tower, min_pixels=raw.get("min_pixels", size.get("shortest_edge", DEFAULT_MIN_PIXELS)),
                  max_pixels=raw.get("max_pixels", size.get("longest_edge", DEFAULT_MAX_PIXELS)))
    for field in ("image_mean", "image_std"):
        value = raw.get(field)
        if value is not None:
            fields[field] = tuple(float(v) for v in (value if isinstance(value, list) else [value] * 3))
            if len(fields[field]) != 3:
                raise RefengineError(f"{path}: field {field} must have 3 values (R, G, B), got {value!r}")
    for field in ("rescale_factor", "do_resize", "do_rescale", "do_normalize", "resample"):
        if raw.get(field) is not None:
            fields[field] = raw[field]
    if fields.get("resample", PIL_BICUBIC) != PIL_BICUBIC:
        raise RefengineError(f"{path}: field resample={fields['resample']!r} is not supported (only 3, BICUBIC)")
    if not 0 < fields["min_pixels"] <= fields["max_pixels"]:
        raise RefengineError(f"{path}: min_pixels={fields['min_pixels']} / max_pixels={fields['max_pixels']}: "
                             f"expected 0 < min_pixels <= max_pixels")
    return ImageProcessorConfig(**fields)


def smart_resize(height: int, width: int, factor: int, min_pixels: int, max_pixels: int) -> tuple[int, int]:
    """The size transformers resizes an image to: each side rounded to a multiple of `factor`; if that
    area is above max_pixels, both sides scaled down (floored to the factor, at least one factor); if
    below min_pixels, scaled up (ceiled). Python's round() is half-to-even, as transformers' is."""
    if max(height, width) / min(height, width) > MAX_ASPECT_RATIO:
        raise RefengineError(f"image of {height}x{width}: aspect ratio above {MAX_ASPECT_RATIO} is not supported")
    h_bar, w_bar = round(height / factor) * factor, round(width / factor) * factor
    if h_bar * w_bar > max_pixels:
        beta = math.sqrt(height * width / max_pixels)
        h_bar = max(factor, math.floor(height / beta / factor) * factor)
        w_bar = max(factor, math.floor(width / beta / factor) * factor)
    elif h_bar * w_bar < min_pixels:
        beta = math.sqrt(min_pixels / (height * width))
        h_bar = math.ceil(height * beta / factor) * factor
        w_bar = math.ceil(width * beta / factor) * factor
    return h_bar, w_bar


def _bicubic(image: np.ndarray, height: int, width: int) -> np.ndarray:  # [H, W, 3] uint8 -> [height, width, 3]
    try:
        from PIL import Image
    except ImportError:
        raise RefengineError("images need Pillow: pip install 'refengine[vision]'") from None
    return np.asarray(Image.fromarray(image).resize((width, height), resample=Image.Resampling.BICUBIC))


def _checked(image) -> np.ndarray:
    image = np.asarray(image)
    if image.dtype != np.uint8 or image.ndim != 3 or image.shape[2] != 3 or 0 in image.shape:
        raise RefengineError(f"image: expected an RGB uint8 array [height, width, 3], got {image.dtype} "
                             f"{list(image.shape)}")
    return image


def processed_size(image, proc: ImageProcessorConfig) -> tuple[int, int]:
    """(height, width) an RGB uint8 array [height, width, 3] is processed at: what preprocess_image
    resizes it to, without resizing it (a prompt's placeholders need only this)."""
    height, width = _checked(image).shape[:2]
    factor = proc.patch_size * proc.merge_size
    if proc.do_resize:
        height, width = smart_resize(height, width, factor, proc.min_pixels, proc.max_pixels)
    if height % factor or width % factor:
        raise RefengineError(f"image of {height}x{width}: without resizing, each side must be a multiple of "
                             f"patch_size * merge_size = {factor}")
    return height, width


def image_grid(image, proc: ImageProcessorConfig) -> tuple[int, int, int]:
    """The patch grid (t, h, w) preprocess_image gives the image."""
    height, width = processed_size(image, proc)
    return 1, height // proc.patch_size, width // proc.patch_size


def preprocess_image(image, proc: ImageProcessorConfig) -> ProcessedImage:
    """An RGB uint8 array [height, width, 3] -> its patches and grid, as transformers' PIL processor."""
    image = _checked(image)
    p, m, t = proc.patch_size, proc.merge_size, proc.temporal_patch_size
    height, width = processed_size(image, proc)
    if (height, width) != image.shape[:2]:
        image = _bicubic(image, height, width)                                  # [height, width, 3] uint8
    # transformers' order and precisions: rescale in float64 rounded to float32, normalise in float32
    x = image.astype(np.float32)                                                # [height, width, 3]
    if proc.do_rescale:
        x = (image.astype(np.float64) * proc.rescale_factor).astype(np.float32)
    if proc.do_normalize:
        x = (x - np.array(proc.image_mean, np.float32)) / np.array(proc.image_std, np.float32)
    x = x.transpose(2, 0, 1)                                                    # [3, height, width]
    gh, gw = height // p, width // p
    # Patches in merge-block order (block row, block column, row in block, column in block), so the
    # merger's m * m neighbours are consecutive rows; within a patch (channel, time, y, x), time being
    # the still image repeated.
    x = x.reshape(3, gh // m, m, p, gw // m, m, p).transpose(1, 4, 2, 5, 0, 3, 6)  # [gh/m, gw/m, m, m, 3, p, p]
    x = np.broadcast_to(x[:, :, :, :, :, None], x.shape[:5] + (t, p, p))         # [gh/m, gw/m, m, m, 3, t, p, p]
    return ProcessedImage(x.reshape(gh * gw, 3 * t * p * p).astype(np.float64), (1, gh, gw))
