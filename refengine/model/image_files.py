"""Image files -> the RGB uint8 pixels the model's image processing starts from: the bytes of a PNG or
JPEG file, or of a `data:image/png;base64,...` URL, decoded one way wherever an image comes from (a
chat request to the server, a prompt or golden file).

Every refusal is an ImageError whose message starts with `where` (the caller's name for the image:
a request's "messages[0].content[1].image_url.url", a file's case and part): a data URL that is not
base64, a media type other than PNG or JPEG, malformed base64, an empty payload, bytes Pillow cannot
decode (Pillow itself refuses a header with a zero width or height), and an image over
MAX_IMAGE_PIXELS, judged from its header before any pixel is decoded (a few kilobytes of PNG can
declare gigapixels).

Conversion to RGB is the one transformers' image processors apply to a Pillow image before
anything else (image_transforms.convert_to_rgb, do_convert_rgb): an image with an alpha band or a
transparent palette entry is composited onto white, any other mode converted by Pillow. The EXIF
orientation tag is not applied, as those processors do not (transformers' load_image, which turns
URL and base64 strings into images for its pipelines, does; and it drops alpha instead of
compositing it).

Pillow is the `vision` extra, imported when the first image is decoded.
"""
from __future__ import annotations

import base64
import binascii
import io

import numpy as np

from ..errors import RefengineError

MAX_IMAGE_PIXELS = 32_000_000  # beyond any photo a chat client sends; the model downsizes to ~1 megapixel anyway
MEDIA_TYPES = {"image/png": "PNG", "image/jpeg": "JPEG", "image/jpg": "JPEG"}  # image/jpg: common, if unofficial
# How each format's files begin: the media type a file's bytes are sent as
MAGIC = {b"\x89PNG\r\n\x1a\n": "image/png", b"\xff\xd8\xff": "image/jpeg"}


class ImageError(RefengineError):
    """An image that cannot be used: the message starts with where it was given."""


def data_url_bytes(url: str, where: str) -> bytes:
    """The image bytes of a `data:image/png;base64,...` (or image/jpeg) URL."""
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
    return data


def media_type(data: bytes, where: str) -> str:
    """image/png or image/jpeg, from the file's first bytes (its name may say otherwise)."""
    for magic, kind in MAGIC.items():
        if data.startswith(magic):
            return kind
    raise ImageError(f"{where}: not a PNG or JPEG file (it starts with {data[:8]!r})")


def data_url(data: bytes, where: str) -> str:
    """The image file's bytes as the data URL a chat request carries."""
    return f"data:{media_type(data, where)};base64,{base64.b64encode(data).decode('ascii')}"


def decode_image(data: bytes, where: str) -> np.ndarray:
    """A PNG or JPEG file's bytes -> RGB pixels uint8 [height, width, 3]."""
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
