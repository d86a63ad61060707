"""Images in prompt and golden files: a chat case's message content may hold image parts, in OpenAI's
form with one key of ours,

    {"type": "image_url", "image_url": {"url": URL}, "sha256": HEX}

URL is a `data:image/png;base64,...` (or image/jpeg) URL, or the path of a PNG or JPEG file relative to
the prompt or golden file's folder. Nothing is ever fetched: an http(s) URL (any URL but data:) is
an error, because a golden answer is only the answer to an image that cannot change under it, which
a third party's server does not promise. `sha256` is the hex digest of the image file's bytes (of a
data URL, its decoded bytes): optional in a prompt file, always written by `golden refresh` and
required in a golden file; on load a mismatch is an error naming the file, the case and the part
("messages[0].content[1]"), so a golden answer is never held against an image that was replaced.

A case keeps its images as CaseImage: the verified bytes, decoded to pixels (model.image_files, as the
server decodes a request's) only where the reference or the engine needs them; validate sends the
bytes as data URLs, and a golden file written elsewhere than its prompts rewrites each path relative
to its own folder. A case's messages keep their image parts as the file wrote them; these functions
replace them: with the plain {"type": "image"} part a vision-language chat template renders as its
placeholder (as the server does), with data URLs for the wire, or as a golden file writes them.
"""
from __future__ import annotations

import hashlib
import os
import re
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from ..errors import RefengineError
from ..model import Model
from ..model.config import VISION_LANGUAGE
from ..model.image import image_grid
from ..model.image_files import data_url, data_url_bytes, decode_image, media_type

PART_KEYS = {"type", "image_url", "sha256"}
SHA256 = re.compile(r"[0-9a-f]{64}")
URL_SCHEME = re.compile(r"[A-Za-z][A-Za-z0-9+.-]+:")  # two characters at least: C:\ is a Windows path


@dataclass(frozen=True)
class CaseImage:
    where: str = field(compare=False)  # "FILE:LINE: case 'ID': messages[M].content[K]"
    data: bytes = field(repr=False)    # the image file's bytes, their digest verified
    sha256: str
    path: Path | None = None           # the file it was read from; None: given as a data URL
    url: str = field(default="", repr=False)  # the data URL as given (path images: written from `path`)

    def pixels(self) -> np.ndarray:
        """RGB uint8 [height, width, 3], decoded as the server decodes a request's image."""
        return decode_image(self.data, self.where)

    def data_url(self) -> str:
        """The image as a chat request carries it."""
        return self.url or data_url(self.data, self.where)

    def written_url(self, folder: Path) -> str:
        """The URL a file in `folder` gives it: its data URL, or its path relative to `folder`."""
        if self.path is None:
            return self.url
        try:
            return Path(os.path.relpath(self.path, folder.resolve())).as_posix()
        except ValueError:  # another drive (Windows): no relative path
            return self.path.as_posix()


def is_image_part(part) -> bool:
    return isinstance(part, dict) and part.get("type") == "image_url"


def check_content(where: str, messages) -> None:
    """`messages` as a case gives them: a non-empty list of {"role", "content"}, the content a string or
    a list of text parts ({"type": "text", "text"}) and image parts; image parts are read by read_images."""
    if not isinstance(messages, list) or not messages:
        raise RefengineError(f"{where}: 'messages' must be a non-empty list of {{\"role\", \"content\"}} objects")
    for n, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str) or \
                not isinstance(m.get("content"), (str, list)):
            raise RefengineError(f"{where}: messages[{n}]: expected a string 'role' and a 'content' string or "
                                 f"list of parts")
        for k, part in enumerate(m["content"] if isinstance(m["content"], list) else []):
            text = isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str)
            if not text and not is_image_part(part):
                raise RefengineError(f"{where}: messages[{n}].content[{k}]: expected a text part "
                                     f"({{\"type\": \"text\", \"text\": ...}}) or an image part "
                                     f"({{\"type\": \"image_url\", \"image_url\": {{\"url\": ...}}}})")


def image_parts(messages) -> list[tuple[str, dict]]:
    """("messages[M].content[K]", part) of every image part, in order."""
    return [(f"messages[{n}].content[{k}]", part) for n, m in enumerate(messages or [])
            if isinstance(m.get("content"), list) for k, part in enumerate(m["content"]) if is_image_part(part)]


def read_images(where: str, messages, folder: Path, require_sha256: bool) -> tuple[CaseImage, ...]:
    """The images of a case's messages (check_content'ed), read and verified; `where` names the file,
    line and case, `folder` is the one paths are relative to."""
    return tuple(_read_image(f"{where}: {part_where}", part, folder, require_sha256)
                 for part_where, part in image_parts(messages))


def _read_image(where: str, part: dict, folder: Path, require_sha256: bool) -> CaseImage:
    unknown = set(part) - PART_KEYS
    if unknown:
        raise RefengineError(f"{where}: unknown key(s) {', '.join(sorted(unknown))} (an image part has "
                             f"{', '.join(sorted(PART_KEYS))})")
    box = part.get("image_url")
    if not isinstance(box, dict) or set(box) != {"url"} or not isinstance(box["url"], str) or not box["url"]:
        raise RefengineError(f"{where}.image_url: expected {{\"url\": URL}} (a data: URL or a path), got {box!r}")
    url, url_where = box["url"], f"{where}.image_url.url"
    if url.startswith("data:"):
        data, path = data_url_bytes(url, url_where), None
    elif URL_SCHEME.match(url):
        raise RefengineError(f"{url_where}: {url.partition(':')[0]}: URLs are never fetched; give the image as "
                             f"a data: URL or a path relative to the file")
    else:
        path = folder / url
        try:
            data = path.read_bytes()
        except OSError as e:
            raise RefengineError(f"{url_where}: cannot read {path} ({e.strerror})") from None
        media_type(data, f"{url_where}: {path}")
        path = path.resolve()
    digest = hashlib.sha256(data).hexdigest()
    given = part.get("sha256")
    if given is None and require_sha256:
        raise RefengineError(f"{where}: missing sha256 (a golden file pins each image by the sha256 of its bytes; "
                             f"refresh it)")
    if given is not None and (not isinstance(given, str) or not SHA256.fullmatch(given.lower())):
        raise RefengineError(f"{where}.sha256: expected the 64 hex digits of a sha256, got {given!r}")
    if given is not None and given.lower() != digest:
        raise RefengineError(f"{where}: sha256 mismatch: the part says {given}, the image's bytes "
                             f"({path or 'its data URL'}) hash to {digest}")
    return CaseImage(where, data, digest, path, url if path is None else "")


def _replaced(messages, images, new_part) -> list:
    """`messages` with their k-th image part replaced by new_part(images[k])."""
    images, out = iter(images), []
    for m in messages:
        if isinstance(m.get("content"), list):
            m = {**m, "content": [new_part(next(images)) if is_image_part(p) else p for p in m["content"]]}
        out.append(m)
    return out


def written_messages(messages, images, folder: Path) -> list:
    """The messages as a golden file in `folder` writes them: each image part's URL (a path relative to
    the folder) and sha256."""
    return _replaced(messages, images, lambda image: {"type": "image_url", "image_url": {
        "url": image.written_url(folder)}, "sha256": image.sha256})


def inline_messages(messages, images) -> list:
    """The messages as a chat request sends them: every image a data URL, no sha256 (a server may refuse
    keys it does not know)."""
    return _replaced(messages, images, lambda image: {"type": "image_url", "image_url": {"url": image.data_url()}})


def text_messages(messages) -> list:
    """Messages without images as a server renders them: a content list's text parts joined."""
    return [{**m, "content": "".join(p["text"] for p in m["content"])} if isinstance(m.get("content"), list) else m
            for m in messages]


def encode_with_images(model: Model, where: str, messages, images, template_kwargs: dict | None) -> list[int]:
    """The prompt ids of a chat with images: each image's run of placeholder tokens widened to its tokens
    (Tokenizer.encode_chat_with_images), as the server encodes it. A text-only model is an error naming
    `where` (the file and case)."""
    if model.config.arch not in VISION_LANGUAGE:
        raise RefengineError(f"{where}: {len(images)} image(s), but {model.path} is a text-only model "
                             f"({model.config.arch}); images need a vision-language model (Qwen3-VL)")
    tokens = []
    for image in images:
        pixels = image.pixels()
        try:
            tokens.append(model.vision_config.image_tokens(image_grid(pixels, model.image_processor)))
        except RefengineError as e:  # the processor's refusal (an aspect ratio it does not take)
            raise RefengineError(f"{image.where}: {e}") from None
    template = _replaced(messages, images, lambda image: {"type": "image"})
    return model.tokenizer.encode_chat_with_images(template, tokens, **(template_kwargs or {}))
