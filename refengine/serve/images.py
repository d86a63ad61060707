"""Images in chat requests: an OpenAI `image_url` content part -> the RGB uint8 pixels the model's image
processing starts from.

Only inline images are accepted, as `data:image/png;base64,...` or `data:image/jpeg;base64,...`. A
remote URL is refused, never fetched: a server that fetched URLs would let any client make it open
connections anywhere, and a request's result would depend on what a third party served at that
moment, which no golden file or replay could reproduce.

Everything a client can get wrong is refused with a RefengineError whose message starts with the
part's path in the request ("messages[0].content[1].image_url.url: ..."), which the server answers
as an HTTP 400: a part of another shape, a missing or non-string URL, a URL that is not a data: URL,
and whatever model/image_files.py refuses in the data URL and the image it holds (malformed base64,
a media type other than PNG or JPEG, bytes Pillow cannot decode, an image over MAX_IMAGE_PIXELS).
The decoding itself (Pillow, RGB conversion compositing alpha on white) is model/image_files.py's,
shared with prompt and golden files.
"""
from __future__ import annotations

import numpy as np

from ..model.image_files import (
    MAX_IMAGE_PIXELS,
    ImageError,
    data_url_bytes,
    decode_image,
)

__all__ = ["MAX_IMAGE_PIXELS", "ImageError", "decode_image_part"]
# Part type -> the fields its image may be in: OpenAI chat's {"image_url": {"url"}} (or a bare string
# there), the Responses API's input_image, and the {"image"} / {"url"} of transformers' chat templates
URL_FIELDS = {"image_url": ("image_url",), "input_image": ("image_url",), "image": ("image", "url")}


def decode_image_part(part, where: str) -> np.ndarray:
    """An image content part at `where` (e.g. "messages[0].content[1]") -> RGB pixels uint8 [H, W, 3]."""
    url, where = _data_url(part, where)
    return decode_image(data_url_bytes(url, where), where)


def _data_url(part, where: str) -> tuple[str, str]:
    """The part's URL string and that URL's path in the request; refuses anything not a data: URL."""
    if not isinstance(part, dict) or part.get("type") not in URL_FIELDS:
        kind = part.get("type") if isinstance(part, dict) else type(part).__name__
        raise ImageError(f"{where}: expected an image part (type {', '.join(URL_FIELDS)}), got {kind!r}")
    fields = [f for f in URL_FIELDS[part["type"]] if f in part]
    if not fields:
        raise ImageError(f"{where}: an {part['type']} part needs the field {' or '.join(URL_FIELDS[part['type']])}")
    value, where = part[fields[0]], f"{where}.{fields[0]}"
    if isinstance(value, dict):
        value, where = value.get("url"), f"{where}.url"
    if not isinstance(value, str):
        raise ImageError(f"{where}: expected a data: URL string, got {type(value).__name__}")
    if not value.startswith("data:"):
        scheme = value.partition(":")[0][:16] if ":" in value else None
        what = f"{scheme}: URLs" if scheme else "anything but data: URLs"
        raise ImageError(f"{where}: only inline images are accepted (data:image/png;base64,... or "
                         f"data:image/jpeg;base64,...); this server never fetches {what}")
    return value, where
