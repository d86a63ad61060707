"""tokenizer.json through `tokenizers`, the model's own chat template, incremental detokenizing."""
from __future__ import annotations

import json
from pathlib import Path

import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer as HFTokenizer

from ..errors import RefengineError

# What a checkpoint without a chat template gets: plain ChatML.
CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def _raise_exception(message):
    raise jinja2.TemplateError(message)


class Tokenizer:
    def __init__(self, model_dir: str | Path):
        model_dir = Path(model_dir)
        path = model_dir / "tokenizer.json"
        if not path.exists():
            raise RefengineError(f"{path}: file not found")
        try:
            self._tok = HFTokenizer.from_file(str(path))
        except Exception as e:  # the tokenizers library raises a bare Exception on bad files
            raise RefengineError(f"{path}: cannot load tokenizer ({e})") from None
        config_path = model_dir / "tokenizer_config.json"
        self.config = json.loads(config_path.read_text(encoding="utf-8")) if config_path.exists() else {}
        template = self.config.get("chat_template") or CHATML_TEMPLATE
        if isinstance(template, list):  # a list of named templates: the default one is used
            named = {t["name"]: t["template"] for t in template}
            template = named.get("default", next(iter(named.values())))
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        env.globals["raise_exception"] = _raise_exception
        try:
            self._template = env.from_string(template)
        except jinja2.TemplateError as e:
            raise RefengineError(f"{config_path}: chat_template does not parse ({e})") from None
        self.config_path = config_path

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size(with_added_tokens=True)

    def special_token(self, key: str) -> str | None:
        value = self.config.get(key)
        return value.get("content") if isinstance(value, dict) else value

    def token_to_id(self, token: str) -> int | None:
        return self._tok.token_to_id(token)

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=False).ids

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True, **extra) -> str:
        if not isinstance(messages, list) or not messages:
            raise RefengineError("messages: expected a non-empty list of {role, content} objects")
        for n, m in enumerate(messages):
            if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
                raise RefengineError(f"messages[{n}]: expected an object with string 'role' and 'content'")
        try:
            return self._template.render(
                messages=messages, add_generation_prompt=add_generation_prompt,
                bos_token=self.special_token("bos_token") or "", eos_token=self.special_token("eos_token") or "",
                **extra)
        except jinja2.TemplateError as e:
            raise RefengineError(f"{self.config_path}: chat_template failed on these messages ({e})") from None

    def encode_chat(self, messages: list[dict], **extra) -> list[int]:
        return self.encode(self.apply_chat_template(messages, add_generation_prompt=True, **extra))

    def detokenizer(self) -> IncrementalDetokenizer:
        return IncrementalDetokenizer(self)


class IncrementalDetokenizer:
    """Streams text as ids arrive; the concatenated pieces equal `decode(all ids)`.

    Byte-level BPE can split one UTF-8 character across tokens, so text is held back while the
    tail decodes to U+FFFD, and only a short window of recent ids is re-decoded each time.
    """

    def __init__(self, tokenizer: Tokenizer):
        self.tokenizer = tokenizer
        self.ids: list[int] = []
        self.text = ""
        self._prefix_offset = 0
        self._read_offset = 0

    def push(self, token_id: int) -> str:
        self.ids.append(int(token_id))
        decode = self.tokenizer.decode
        prefix = decode(self.ids[self._prefix_offset:self._read_offset])
        window = decode(self.ids[self._prefix_offset:])
        if len(window) <= len(prefix) or window.endswith("\ufffd"):
            return ""
        delta = window[len(prefix):]
        self._prefix_offset, self._read_offset = self._read_offset, len(self.ids)
        self.text += delta
        return delta

    def flush(self) -> str:
        """Whatever is still held back (e.g. an incomplete character at the end)."""
        full = self.tokenizer.decode(self.ids)
        delta = full[len(self.text):] if full.startswith(self.text) else ""
        self.text += delta
        return delta
