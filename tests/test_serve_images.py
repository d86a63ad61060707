"""Image parts of chat requests (refengine/serve/images.py): real PNG and JPEG bytes Pillow writes here,
decoded to the pixels transformers' own conversion gives (image_transforms.convert_to_rgb, the PIL-only
path its image processors take for a Pillow image; no torchvision involved), every refusal naming the
part, and no socket ever opened for a remote URL.
"""
from __future__ import annotations

import base64
import io
import socket
import struct
import sys
import zlib

import numpy as np
import pytest

Image = pytest.importorskip("PIL.Image")

from refengine.check.images import generated_image  # noqa: E402
from refengine.errors import RefengineError  # noqa: E402
from refengine.serve.images import MAX_IMAGE_PIXELS, ImageError, decode_image_part  # noqa: E402

WHERE = "messages[0].content[1]"


def encoded(image, fmt: str, **save) -> bytes:
    out = io.BytesIO()
    image.save(out, fmt, **save)
    return out.getvalue()


def data_url(data: bytes, media_type: str = "image/png") -> str:
    return f"data:{media_type};base64,{base64.b64encode(data).decode()}"


def part(url) -> dict:
    return {"type": "image_url", "image_url": {"url": url}}


def rgb(height: int, width: int, seed: int = 0) -> np.ndarray:
    return generated_image(height, width, seed)


def png_header(width: int, height: int) -> bytes:
    """A PNG whose header declares width x height RGB and whose image data is empty."""
    def chunk(kind, body):
        return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body))
    return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0))
            + chunk(b"IDAT", zlib.compress(b"")) + chunk(b"IEND", b""))


@pytest.fixture
def no_network(monkeypatch):
    """Any attempt to reach the network fails the test."""
    def refuse(*args, **kwargs):
        raise AssertionError("the network was touched")
    for name in ("socket", "create_connection", "getaddrinfo"):
        monkeypatch.setattr(socket, name, refuse)


def test_png_round_trips_exactly_in_every_part_shape(no_network):
    pixels = rgb(7, 11)
    url = data_url(encoded(Image.fromarray(pixels), "PNG"))
    shapes = [part(url), {"type": "image_url", "image_url": url}, {"type": "input_image", "image_url": url},
              {"type": "image", "image": url}, {"type": "image", "url": url}]
    for shape in shapes:
        got = decode_image_part(shape, WHERE)
        assert got.dtype == np.uint8 and got.shape == (7, 11, 3) and got.flags.c_contiguous
        np.testing.assert_array_equal(got, pixels)


def test_jpeg_decodes_as_pillow_decodes_it(no_network):
    data = encoded(Image.fromarray(rgb(16, 24)), "JPEG", quality=80)
    expected = np.asarray(Image.open(io.BytesIO(data)).convert("RGB"))
    for media_type in ("image/jpeg", "image/jpg", "IMAGE/JPEG"):
        np.testing.assert_array_equal(decode_image_part(part(data_url(data, media_type)), WHERE), expected)
    gray = encoded(Image.fromarray(rgb(9, 5)[..., 0]), "JPEG")  # one channel
    assert decode_image_part(part(data_url(gray, "image/jpeg")), WHERE).shape == (9, 5, 3)


def _modes():
    """Pillow images of every mode a PNG brings that is not plain RGB, each with content in every band."""
    rng = np.random.default_rng(1)
    rgba = Image.fromarray(np.concatenate([rgb(6, 9, 2), rng.integers(0, 256, (6, 9, 1), dtype=np.uint8)], -1))
    gray = Image.fromarray(rgb(6, 9, 3)[..., 0])
    palette = Image.fromarray(rgb(6, 9, 4)).quantize(16)
    transparent_palette = palette.copy()
    transparent_palette.info["transparency"] = int(np.asarray(palette)[0, 0])  # one palette entry clear
    return {"RGBA": rgba, "LA": Image.merge("LA", (gray, rgba.getchannel("A"))), "L": gray, "P": palette,
            "P-transparent": transparent_palette, "1": gray.convert("1"), "I;16": gray.convert("I;16")}


@pytest.mark.parametrize("mode", list(_modes()))
def test_conversion_to_rgb_is_transformers_own(mode, no_network):
    """Alpha (a band, or a transparent palette entry) composited onto white, other modes converted by
    Pillow: as transformers' convert_to_rgb, which its image processors apply to a Pillow image."""
    convert_to_rgb = pytest.importorskip("transformers.image_transforms").convert_to_rgb
    image = _modes()[mode]
    data = encoded(image, "PNG")
    decoded = Image.open(io.BytesIO(data))
    assert decoded.mode == mode.split("-")[0]
    expected = convert_to_rgb(decoded, return_numpy=True)
    got = decode_image_part(part(data_url(data)), WHERE)
    np.testing.assert_array_equal(got, expected)
    if mode in ("RGBA", "LA", "P-transparent"):  # the case that matters: not just the alpha dropped
        assert not np.array_equal(got, np.asarray(decoded.convert("RGB")))


@pytest.mark.parametrize("url", ["https://example.com/cat.png", "http://127.0.0.1:8000/x.png",
                                 "file:///etc/passwd", "ftp://example.com/a.jpg", "//example.com/a.png",
                                 "iVBORw0KGgo="])
def test_remote_urls_are_refused_without_touching_the_network(url, no_network):
    with pytest.raises(ImageError, match=r"^messages\[0\]\.content\[1\]\.image_url\.url: only inline images "
                                         r"are accepted .* never fetches"):
        decode_image_part(part(url), WHERE)


@pytest.mark.parametrize("bad, message", [
    ("data:image/gif;base64,R0lGODlhAQABAAAAACw=", r"\.image_url\.url: media type 'image/gif' is not supported"),
    ("data:image/png,rawbytes", r"\.image_url\.url: the data URL must be base64"),
    ("data:image/png;base64,iVBOR*w0KGgo=", r"\.image_url\.url: malformed base64"),
    ("data:image/png;base64,iVBORw0KGgo", r"\.image_url\.url: malformed base64"),
    ("data:image/png;base64,iVBORw0KGgo\u00e9", r"\.image_url\.url: malformed base64"),
    ("data:image/png;base64,", r"\.image_url\.url: the image is empty"),
    (data_url(b"this is not an image at all"), r"\.image_url\.url: the image could not be decoded"),
    (data_url(encoded(Image.new("RGB", (4, 4)), "GIF")), r"\.image_url\.url: the image could not be decoded"),
    (data_url(encoded(Image.fromarray(rgb(40, 40)), "PNG")[:-40]), r"\.image_url\.url: the image could not be "
                                                                     r"decoded"),
    (data_url(png_header(0, 5)), r"\.image_url\.url: the image could not be decoded"),  # zero width
    (data_url(png_header(6000, 6000)), r"\.image_url\.url: the image is 6000x6000 = 36000000 pixels, over the "
                                       rf"limit of {MAX_IMAGE_PIXELS}"),
    (data_url(png_header(20000, 20000)), rf"\.image_url\.url: the image is over {MAX_IMAGE_PIXELS} pixels"),
])
def test_bad_images_are_refused_naming_the_part(bad, message, no_network):
    with pytest.raises(ImageError, match=r"^messages\[0\]\.content\[1\]" + message):
        decode_image_part(part(bad), WHERE)


@pytest.mark.parametrize("bad, message", [
    ("just text", r": expected an image part \(type image_url, input_image, image\), got 'str'"),
    ({"type": "text", "text": "hi"}, r": expected an image part .*got 'text'"),
    ({"type": "image_url"}, r": an image_url part needs the field image_url"),
    ({"type": "image_url", "image_url": {"detail": "high"}}, r"\.image_url\.url: expected a data: URL string, "
                                                             r"got NoneType"),
    ({"type": "image", "image": 3}, r"\.image: expected a data: URL string, got int"),
])
def test_malformed_parts_are_refused_naming_the_field(bad, message):
    with pytest.raises(RefengineError, match=r"^messages\[0\]\.content\[1\]" + message):
        decode_image_part(bad, WHERE)


def test_pillow_missing_names_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "PIL", None)  # as if Pillow were not installed
    with pytest.raises(ImageError, match=r"^messages\[0\]\.content\[1\]\.image_url\.url: images need Pillow: "
                                         r"pip install 'refengine\[vision\]'"):
        decode_image_part(part(data_url(b"\x89PNG")), WHERE)


def test_other_bytes_of_the_same_pixels_decode_to_them():
    pixels = rgb(8, 6)
    opaque = Image.fromarray(pixels).convert("RGBA")  # other bytes on the wire, the same pixels
    for image in (Image.fromarray(pixels), opaque):
        np.testing.assert_array_equal(decode_image_part(part(data_url(encoded(image, "PNG"))), WHERE), pixels)
