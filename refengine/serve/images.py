"""Images in chat requests: an OpenAI `image_url` content part -> the RGB uint8 pixels the model's image
processing starts from.

Only inline images are accepted, as `data:image/png;base64,...` or `data:image/jpeg;base64,...`. A
remote URL is refused, never fetched: a server that fetched URLs would let any client make it open
connections anywhere, and a request's result would depend on what a third party served at that
moment, which no golden file or replay could reproduce.

Everything a client can get wrong is refused with a RefengineError whose message starts with the
part's path in the request ("messages[0].content[1].image_url.url: ..."), which the server answers
as an HTTP 400: a missing or non-string URL, malformed base64, a media type other than PNG or JPEG,
bytes Pillow cannot decode (Pillow itself refuses a header with a zero width or height), an empty
payload, and an image over MAX_IMAGE_PIXELS, judged from its header before any pixel is decoded
(a few kilobytes of PNG can declare gigapixels).

Conversion to RGB is the one transformers' image processors apply to a Pillow image before
anything else (image_transforms.convert_to_rgb, do_convert_rgb): an image with an alpha band or a
transparent palette entry is composited onto white, any other mode converted by Pillow. The EXIF
orientation tag is not applied, as those processors do not (transformers' load_image, which turns
URL and base64 strings into images for its pipelines, does; and it drops alpha instead of
compositing it).

Pillow is the `vision` extra, imported when the first image arrives.
"""
from __future__ import annotations

import base64
import binascii
import hashlib
import io

import numpy as np

from ..errors import RefengineError

MAX_IMAGE_PIXELS = 32_000_000  # beyond any photo a chat client sends; the model downsizes to ~1 megapixel anyway
MEDIA_TYPES = {"image/png": "PNG", "image/jpeg": "JPEG", "image/jpg": "JPEG"}  # image/jpg: common, if unofficial
# Part type -> the fields its image may be in: OpenAI chat's {"image_url": {"url"}} (or a bare string
# there), the Responses API's input_image, and the {"image"} / {"url"} of transformers' chat templates
URL_FIELDS = {"image_url": ("image_url",), "input_image": ("image_url",), "image": ("image", "url")}


class ImageError(RefengineError):
    """An image part of a request that cannot be used: the message starts with the part's path."""


def decode_image_part(part, where: str) -> np.ndarray:
    """An image content part at `where` (e.g. "messages[0].content[1]") -> RGB pixels uint8 [H, W, 3]."""
    url, where = _data_url(part, where)
    media_type, _, payload = url[len("data:"):].partition(",")
    params = media_type.split(";")
    if params[0].lower() not in MEDIA_TYPES:
        raise ImageError(f"{where}: media type {params[0]!r} is not supported (supported: image/png, image/jpeg)")
    if "base64" not in params[1:]:
        raise ImageError(f"{where}: the data URL must be base64 (data:{params[0]};base64,...)")
    try:
        data = base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError) as e:  # ValueError: a non-ASCII character
        raise ImageError(f"{where}: malformed base64 ({e})") from None
    if not data:
        raise ImageError(f"{where}: the image is empty (no bytes after 'base64,')")
    return _pixels(data, where)


def image_content_hash(pixels) -> str:
    """sha256 (hex) of an image's shape and pixel bytes: the same for the same pixels, whatever file
    format or encoding carried them (a prefix cache or golden file keys on what the model sees)."""
    pixels = np.ascontiguousarray(pixels, dtype=np.uint8)
    return hashlib.sha256(f"uint8{list(pixels.shape)}".encode() + pixels.tobytes()).hexdigest()


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


def _pixels(data: bytes, where: str) -> np.ndarray:
    try:
        from PIL import Image
    except ImportError:
        raise ImageError(f"{where}: images need Pillow: pip install 'refengine[vision]'") from None
    try:
        image = Image.open(io.BytesIO(data), formats=sorted(set(MEDIA_TYPES.values())))  # reads the header only
    except Image.DecompressionBombError:  # Pillow's own refusal, far above our limit
        raise ImageError(f"{where}: the image is over {MAX_IMAGE_PIXELS} pixels") from None
    except Exception as e:  # Pillow's plugins raise many kinds (OSError, SyntaxError, ValueError, ...) for bad bytes
        raise ImageError(f"{where}: the image could not be decoded ({e})") from None
    width, height = image.size
    if width * height > MAX_IMAGE_PIXELS:
        raise ImageError(f"{where}: the image is {width}x{height} = {width * height} pixels, over the limit of "
                         f"{MAX_IMAGE_PIXELS}")
    try:
        image.load()
        if "A" in image.getbands() or image.info.get("transparency") is not None:
            white = Image.new("RGBA", image.size, (255, 255, 255, 255))
            image = Image.alpha_composite(white, image.convert("RGBA"))
        return np.array(image.convert("RGB"), dtype=np.uint8)  # [height, width, 3], its own memory
    except Exception as e:  # a truncated or corrupt body shows only when decoded
        raise ImageError(f"{where}: the image could not be decoded ({e})") from None
