"""tokenizer.json through `tokenizers`, the model's own chat template, incremental detokenizing.

Prompts are tokenized as transformers does (`AutoTokenizer.from_pretrained(dir)`): text prompts with
the tokenizer's own special tokens (tokenizer.json's post-processor: a Llama-style tokenizer adds
BOS, Qwen3 adds nothing), rendered chat templates without them (the template writes `bos_token`
itself; transformers' `apply_chat_template(tokenize=True)` encodes with `add_special_tokens=False`).
Templates render in transformers' environment: sandboxed, `trim_blocks`, `lstrip_blocks`,
`loopcontrols`, a `tojson` that keeps non-ASCII, `raise_exception` and `strftime_now`.
"""
from __future__ import annotations

import json
import warnings
from datetime import datetime
from pathlib import Path

import jinja2
import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer as HFTokenizer
from tokenizers.decoders import DecodeStream

from ..errors import RefengineError

# What a checkpoint without a chat template gets (with a warning): plain ChatML.
CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
CHAT_TEMPLATE_FILE = "chat_template.jinja"  # newer checkpoints; wins over tokenizer_config.json, as in transformers
# The named special tokens transformers passes to every template (its `special_tokens_map`; unset ones
# are left undefined, not "").
SPECIAL_TOKEN_KEYS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")
# Template arguments a caller cannot set: they come from the request itself.
RESERVED_TEMPLATE_ARGS = ("messages", "chat_template")

_warned_no_template: set[str] = set()


def _raise_exception(message):
    raise jinja2.TemplateError(message)


def _tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    # transformers' filter: Jinja's own escapes HTML characters and cannot keep non-ASCII
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(format):
    return datetime.now().strftime(format)


IMAGE_PART_TYPES = ("image", "image_url", "input_image")  # OpenAI's and transformers' names for an image part
IMAGE_PAD_TOKEN = "<|image_pad|>"  # what a Qwen3-VL template writes per image; its processor's default


def _refuse_images(n: int, message) -> None:
    """The text chat path takes no images: an image would be silently dropped by a text template, so it
    is refused by name. A vision-language model's prompts with images go through encode_chat_with_images."""
    content = message.get("content") if isinstance(message, dict) else None
    if isinstance(content, list):
        for k, part in enumerate(content):
            if isinstance(part, dict) and part.get("type") in IMAGE_PART_TYPES:
                raise RefengineError(f"messages[{n}].content[{k}]: {part['type']} parts are not supported "
                                     f"(a text-only model, or images not given with the messages)")


def template_environment() -> ImmutableSandboxedEnvironment:
    """The Jinja environment transformers renders chat templates in (utils/chat_template_utils.py)."""
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env


def find_chat_template(model_dir: Path, config: dict) -> tuple[str | None, Path]:
    """The model's default chat template and where it came from: `chat_template.jinja` beside the
    tokenizer files if present, else tokenizer_config.json's `chat_template` (a string, or a list of
    {name, template} of which the one named "default" is used). None when the model has none."""
    config_path = model_dir / "tokenizer_config.json"
    jinja_path = model_dir / CHAT_TEMPLATE_FILE
    if jinja_path.exists():
        try:
            return jinja_path.read_text(encoding="utf-8"), jinja_path
        except (OSError, UnicodeDecodeError) as e:
            raise RefengineError(f"{jinja_path}: cannot read ({e})") from None
    template = config.get("chat_template")
    if isinstance(template, list):
        if not all(isinstance(t, dict) and isinstance(t.get("name"), str) and isinstance(t.get("template"), str)
                   for t in template):
            raise RefengineError(f"{config_path}: chat_template: expected a string or a list of "
                                 f"{{\"name\", \"template\"}} objects")
        named = {t["name"]: t["template"] for t in template}
        if "default" not in named:  # transformers refuses to guess too
            raise RefengineError(f"{config_path}: chat_template: several named templates and none is called "
                                 f"'default' (names: {', '.join(sorted(named))})")
        template = named["default"]
    if template is not None and not isinstance(template, str):
        raise RefengineError(f"{config_path}: chat_template: expected a string, got {type(template).__name__}")
    return template or None, config_path


class Tokenizer:
    def __init__(self, model_dir: str | Path):
        model_dir = Path(model_dir)
        self.model_dir = model_dir
        path = model_dir / "tokenizer.json"
        if not path.exists():
            raise RefengineError(f"{path}: file not found")
        try:
            self._tok = HFTokenizer.from_file(str(path))
        except Exception as e:  # the tokenizers library raises a bare Exception on bad files
            raise RefengineError(f"{path}: cannot load tokenizer ({e})") from None
        config_path = model_dir / "tokenizer_config.json"
        self.config = json.loads(config_path.read_text(encoding="utf-8")) if config_path.exists() else {}
        self.config_path = config_path
        template, self.template_path = find_chat_template(model_dir, self.config)
        self.has_chat_template = template is not None
        try:
            self._template = template_environment().from_string(template or CHATML_TEMPLATE)
        except jinja2.TemplateError as e:
            raise RefengineError(f"{self.template_path}: chat_template does not parse ({e})") from None

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size(with_added_tokens=True)

    def special_token(self, key: str) -> str | None:
        value = self.config.get(key)
        return value.get("content") if isinstance(value, dict) else value

    def special_tokens_map(self) -> dict[str, str]:
        """The named special tokens that are set, as transformers hands them to chat templates."""
        return {key: value for key in SPECIAL_TOKEN_KEYS if (value := self.special_token(key)) is not None}

    def special_tokens(self) -> dict[int, str]:
        """The added tokens marked special: the ones decoding with skip_special_tokens drops, by id."""
        return {i: t.content for i, t in sorted(self._tok.get_added_tokens_decoder().items()) if t.special}

    def token_to_id(self, token: str) -> int | None:
        return self._tok.token_to_id(token)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Text as transformers' `tokenizer(text).input_ids`: with the tokenizer's own special tokens
        (tokenizer.json's post-processor, e.g. a Llama BOS) unless `add_special_tokens=False`."""
        return self._tok.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def apply_chat_template(self, messages: list[dict], /, add_generation_prompt: bool = True,
                            **extra) -> str:
        """Render the model's template as transformers' `apply_chat_template(tokenize=False)`; `extra`
        are template arguments (`enable_thinking`, `tools`, ...) and override the special tokens."""
        if not isinstance(messages, list) or not messages:
            raise RefengineError("messages: expected a non-empty list of {role, content} objects")
        for n, m in enumerate(messages):
            _refuse_images(n, m)
            if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
                raise RefengineError(f"messages[{n}]: expected an object with string 'role' and 'content'")
        return self._render(messages, add_generation_prompt, extra)

    def _render(self, messages: list[dict], add_generation_prompt: bool, extra: dict) -> str:
        reserved = [key for key in RESERVED_TEMPLATE_ARGS if key in extra]
        if reserved:
            raise RefengineError(f"chat_template_kwargs: {', '.join(map(repr, reserved))} cannot be set as a "
                                 f"template argument")
        if not self.has_chat_template and str(self.model_dir) not in _warned_no_template:
            _warned_no_template.add(str(self.model_dir))
            warnings.warn(f"{self.model_dir}: the model has no chat template (no {CHAT_TEMPLATE_FILE}, no "
                          f"chat_template in tokenizer_config.json); using plain ChatML", stacklevel=2)
        # transformers drops None-valued message keys (many templates render them as "None")
        messages = [{k: v for k, v in m.items() if v is not None} for m in messages]
        context = {"tools": None, "documents": None, **self.special_tokens_map(), **extra}
        try:
            return self._template.render(messages=messages, add_generation_prompt=add_generation_prompt, **context)
        except jinja2.TemplateError as e:
            raise RefengineError(f"{self.template_path}: chat_template failed on these messages ({e})") from None

    def encode_chat(self, messages: list[dict], /, **extra) -> list[int]:
        """Token ids of the rendered chat as transformers' `apply_chat_template(messages,
        add_generation_prompt=True, tokenize=True, **extra)`: no special tokens added on top of what
        the template wrote. `extra` may override `add_generation_prompt` (as vLLM's chat_template_kwargs)."""
        add_generation_prompt = extra.pop("add_generation_prompt", True)
        text = self.apply_chat_template(messages, add_generation_prompt=add_generation_prompt, **extra)
        return self.encode(text, add_special_tokens=False)

    def encode_chat_with_images(self, messages: list[dict], image_tokens: list[int], /, **extra) -> list[int]:
        """Token ids of a chat whose messages may hold image parts, as transformers' Qwen3-VL processor
        makes them: the model's template renders each image part (its content a list of {"type": "text",
        "text": ...} and {"type": "image", ...} parts) as <|vision_start|><|image_pad|><|vision_end|>,
        and the k-th <|image_pad|> then stands for image_tokens[k] copies of itself, the k-th image's
        tokens (VisionConfig.image_tokens of its grid). `extra` as for encode_chat."""
        if not isinstance(messages, list) or not messages:
            raise RefengineError("messages: expected a non-empty list of {role, content} objects")
        for n, m in enumerate(messages):
            content = m.get("content") if isinstance(m, dict) else None
            parts = content if isinstance(content, list) else []
            if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not isinstance(content, (str, list)):
                raise RefengineError(f"messages[{n}]: expected an object with string 'role' and a string or list "
                                     f"'content'")
            for k, part in enumerate(parts):
                kind = part.get("type") if isinstance(part, dict) else None
                if kind not in IMAGE_PART_TYPES and not (kind == "text" and isinstance(part.get("text"), str)):
                    raise RefengineError(f"messages[{n}].content[{k}]: expected a text part with a string 'text' "
                                         f"or an image part ({', '.join(IMAGE_PART_TYPES)})")
        add_generation_prompt = extra.pop("add_generation_prompt", True)
        ids = self.encode(self._render(messages, add_generation_prompt, extra), add_special_tokens=False)
        pad_token = self.special_token("image_token") or IMAGE_PAD_TOKEN
        pad = self.token_to_id(pad_token)
        pads = [i for i, token in enumerate(ids) if token == pad]
        if pad is None or len(pads) != len(image_tokens):
            raise RefengineError(f"{self.template_path}: the chat template wrote {len(pads)} image placeholders "
                                 f"({pad_token}) for {len(image_tokens)} images")
        out, at = [], 0
        for i, n in zip(pads, image_tokens):
            out += ids[at:i] + [pad] * n
            at = i + 1
        return out + ids[at:]

    def detokenizer(self) -> IncrementalDetokenizer:
        return IncrementalDetokenizer(self)


class IncrementalDetokenizer:
    """Streams text as ids arrive; the concatenated pieces equal `decode(all ids)` (special tokens skipped).

    One `tokenizers.decoders.DecodeStream.step` per token: it re-decodes only a short window of recent
    ids in Rust and holds text back while the tail is an incomplete UTF-8 character (U+FFFD). Should the
    stream ever refuse (a decoder whose window output is not a prefix of the longer one), the pieces
    come from full decodes from then on.
    """

    def __init__(self, tokenizer: Tokenizer):
        self.tokenizer = tokenizer
        self.ids: list[int] = []
        self.text = ""
        self._stream: DecodeStream | None = DecodeStream(skip_special_tokens=True)

    def push(self, token_id: int) -> str:
        token_id = int(token_id)
        self.ids.append(token_id)
        if self._stream is not None:
            try:
                delta = self._stream.step(self.tokenizer._tok, token_id) or ""
            except Exception:  # tokenizers raises a bare Exception (DecodeStreamError)
                self._stream = None
            else:
                self.text += delta
                return delta
        full = self.tokenizer.decode(self.ids)
        if full.endswith("\ufffd") or len(full) <= len(self.text) or not full.startswith(self.text):
            return ""
        delta = full[len(self.text):]
        self.text += delta
        return delta

    def flush(self) -> str:
        """Whatever is still held back (e.g. an incomplete character at the end)."""
        full = self.tokenizer.decode(self.ids)
        delta = full[len(self.text):] if full.startswith(self.text) else ""
        self.text += delta
        return delta
