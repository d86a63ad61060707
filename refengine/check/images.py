"""Images in schedules: generated from three numbers, so a schedule, a repro file and a shrunk example
carry an image as `{"height": h, "width": w, "seed": s}` and every run rebuilds the same pixels.

The pixels are uniform noise (numpy's PCG64 from `seed`): a random-weight model's answers depend on an
image's content through its tower either way, and noise has no structure a fault could happen to
preserve. Sizes around the model's patch-merge multiple matter (the processor resizes to multiples of
patch_size * merge_size, so 7, 8 and 9 pixels may all become one merged patch, 15-17 two); the
strategies draw them there (strategies.schedules.IMAGE_SIDES).

A schedule request with images gives prompt_ids holding each image's run of image tokens as
add_request takes it (`image_run` writes one: vision start, the image's tokens, vision end; `placed`
puts images into a prompt of token ids), or messages with image parts.
"""
from __future__ import annotations

from dataclasses import astuple, dataclass

import numpy as np

from ..errors import RefengineError
from ..model import Model
from ..model.image import image_grid

IMAGE_KEYS = ("height", "width", "seed")
MAX_SIDE = 4096


@dataclass(frozen=True)
class GeneratedImage:
    """A schedule's image. A request's images are anything with `pixels()` (a golden case's are
    check.case_images.CaseImage)."""
    height: int
    width: int
    seed: int

    def pixels(self) -> np.ndarray:
        return generated_image(*astuple(self))

    def as_json(self) -> dict:
        return dict(zip(IMAGE_KEYS, astuple(self)))


def parse_image(raw, where: str) -> GeneratedImage:
    """The image of a schedule's image object at `where`."""
    if not isinstance(raw, dict) or set(raw) != set(IMAGE_KEYS):
        raise RefengineError(f"{where}: expected an object with exactly {', '.join(IMAGE_KEYS)}, got {raw!r}")
    height, width, seed = (raw[k] for k in IMAGE_KEYS)
    for key, value, low, high in (("height", height, 1, MAX_SIDE), ("width", width, 1, MAX_SIDE),
                                  ("seed", seed, 0, 2**63 - 1)):
        if not isinstance(value, int) or isinstance(value, bool) or not low <= value <= high:
            raise RefengineError(f"{where}.{key}: expected an integer in [{low}, {high}], got {value!r}")
    return GeneratedImage(height, width, seed)


def generated_image(height: int, width: int, seed: int) -> np.ndarray:
    """The RGB uint8 pixels [height, width, 3] of image (height, width, seed)."""
    return np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8)


def image_run(model: Model, image: np.ndarray) -> list[int]:
    """The prompt ids an image takes in `model`'s prompts: vision start, one image token per merged patch
    of the image as the model's processor resizes it, vision end."""
    v = model.vision_config
    tokens = v.image_tokens(image_grid(image, model.image_processor))
    return [v.vision_start_token_id, *[v.image_token_id] * tokens, v.vision_end_token_id]


def placed(model: Model, prompt: list[int], images: list[tuple[int, GeneratedImage]]) -> list[int]:
    """`prompt` with each (at, image) of `images` as its run of image tokens before the
    prompt's token `at` (at its end where `at` is past it; images at one token in the listed order), and
    the prompt's own image tokens made 0, so that the runs are the images'. The images must be listed in
    the order of their `at`."""
    pad = model.vision_config.image_token_id
    out = [0 if token == pad else token for token in prompt]
    for at, image in reversed(images):  # the last first: each goes where the prompt's own tokens put it
        at = min(at, len(prompt))
        out[at:at] = image_run(model, image.pixels())
    return out
