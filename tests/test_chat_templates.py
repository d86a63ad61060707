"""Chat templates and prompt tokens token for token against transformers' own
`AutoTokenizer.from_pretrained(folder)`: templates that branch on `enable_thinking`, use
`{% break %}` / `{% continue %}`, `strftime_now` and `tojson`, `chat_template.jinja` winning over
tokenizer_config.json, the ChatML fallback, and BOS handling for a Qwen3 and a Llama-style tokenizer
(those are `parity` tests); and template arguments through prompt sets and golden files.

Every folder is the default tiny model's files copied into tmp_path, then edited."""
from __future__ import annotations

import json
import shutil
import warnings
from datetime import datetime

import pytest
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import processors

from refengine.check.golden import load_prompts, read_golden, refresh
from refengine.errors import RefengineError
from refengine.model import load_model
from refengine.model.cache import random_model_dir
from refengine.model.tokenizer import CHATML_TEMPLATE, Tokenizer

parity = pytest.mark.parity

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "config.json", "generation_config.json")
CHAT = [{"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Capital of Japan?"},
        {"role": "assistant", "content": "<think>\nJapan's capital.\n</think>\n\nTokyo (東京)."},
        {"role": "user", "content": "And of France?"}]

# Qwen3-like (written for this test): the history's thinking is dropped, and with enable_thinking
# false the generation prompt opens an empty think block so the model answers directly.
THINKING_TEMPLATE = """\
{%- if messages[0]['role'] == 'system' %}
<|im_start|>system
{{ messages[0]['content'] }}<|im_end|>
{% endif %}
{%- for message in messages %}
    {%- if loop.first and message['role'] == 'system' %}{% continue %}{% endif %}
    {%- set content = message['content'] %}
    {%- if message['role'] == 'assistant' and '</think>' in content %}
        {%- set content = content.split('</think>')[-1].lstrip('\\n') %}
    {%- endif %}
<|im_start|>{{ message['role'] }}
{{ content }}<|im_end|>
{% endfor %}
{%- if add_generation_prompt %}
<|im_start|>assistant
{% if enable_thinking is defined and enable_thinking is false %}
<think>

</think>

{% endif %}
{%- endif %}
"""

# Loop controls, the date, and tojson on the tools (non-ASCII kept, options as transformers has them).
CONTROL_TEMPLATE = """\
{%- set ns = namespace(system='You are a helpful assistant.') %}
{%- for message in messages %}
    {%- if message['role'] == 'system' %}{% set ns.system = message['content'] %}{% break %}{% endif %}
{%- endfor %}
<|im_start|>system
Today is {{ strftime_now('%d %B %Y') }}.
{{ ns.system }}
{%- if tools %}

Tools: {{ tools | tojson }}
Pretty: {{ tools[0] | tojson(indent=2, sort_keys=True) }}
Compact: {{ tools[0] | tojson(separators=(',', ':')) }}
{%- endif %}<|im_end|>
{% for message in messages %}
    {%- if message['role'] == 'system' %}{% continue %}{% endif %}
<|im_start|>{{ message['role'] }}
{{ message['content'] }}<|im_end|>
{% endfor %}
{%- if add_generation_prompt %}<|im_start|>assistant
{% endif %}
"""
TOOLS = [{"type": "function", "function": {"name": "météo", "description": "Wetter für eine Stadt (東京)",
                                            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}]

# Writes bos_token itself, as Llama templates do: the rendered text must not get a second BOS.
LLAMA_TEMPLATE = ("{{ bos_token }}{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
                  "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def tokenizer_folder(tmp_path, name="model", config=None, jinja=None, drop_template=False, weights=False):
    folder = tmp_path / name
    folder.mkdir()
    for file in TOKENIZER_FILES + (("model.safetensors", "refengine_tiny.json") if weights else ()):
        shutil.copyfile(random_model_dir() / file, folder / file)
    tokenizer_config = json.loads((folder / "tokenizer_config.json").read_text(encoding="utf-8"))
    if drop_template:
        tokenizer_config.pop("chat_template", None)
    tokenizer_config.update(config or {})
    (folder / "tokenizer_config.json").write_text(json.dumps(tokenizer_config, ensure_ascii=False), encoding="utf-8")
    if jinja is not None:
        (folder / "chat_template.jinja").write_text(jinja, encoding="utf-8")
    return folder


def hf_tokenizer(folder):
    transformers = pytest.importorskip("transformers")
    return transformers.AutoTokenizer.from_pretrained(str(folder))


def hf_chat_ids(hf, messages, **kwargs) -> list[int]:
    return list(hf.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False,
                                       **kwargs))


def hf_chat_text(hf, messages, **kwargs) -> str:
    return hf.apply_chat_template(messages, add_generation_prompt=True, tokenize=False, **kwargs)


def assert_same_chat(folder, messages, **kwargs) -> list[int]:
    ours, hf = Tokenizer(folder), hf_tokenizer(folder)
    assert ours.apply_chat_template(messages, **kwargs) == hf_chat_text(hf, messages, **kwargs)
    ids = ours.encode_chat(messages, **kwargs)
    assert ids == hf_chat_ids(hf, messages, **kwargs)
    return ids


@parity
@pytest.mark.parametrize("enable_thinking", [True, False, None], ids=["thinking", "no-thinking", "unset"])
def test_thinking_template_matches_transformers(tmp_path, enable_thinking):
    folder = tokenizer_folder(tmp_path, config={"chat_template": THINKING_TEMPLATE})
    kwargs = {} if enable_thinking is None else {"enable_thinking": enable_thinking}
    ids = assert_same_chat(folder, CHAT, **kwargs)
    text = Tokenizer(folder).decode(ids, skip_special_tokens=False)
    assert text.endswith("<think>\n\n</think>\n\n") == (enable_thinking is False)
    assert "Japan's capital" not in text and "Tokyo (東京)." in text


def test_thinking_flag_changes_the_prompt(tmp_path):
    tokenizer = Tokenizer(tokenizer_folder(tmp_path, config={"chat_template": THINKING_TEMPLATE}))
    on, off = tokenizer.encode_chat(CHAT, enable_thinking=True), tokenizer.encode_chat(CHAT, enable_thinking=False)
    assert off[:len(on)] == on and len(off) > len(on)
    assert tokenizer.encode_chat(CHAT, enable_thinking=False, add_generation_prompt=False) == \
        tokenizer.encode(tokenizer.apply_chat_template(CHAT, add_generation_prompt=False), add_special_tokens=False)


@parity
@pytest.mark.parametrize("tools", [None, TOOLS], ids=["no-tools", "tools"])
def test_loop_controls_strftime_and_tojson_match_transformers(tmp_path, tools):
    folder = tokenizer_folder(tmp_path, config={"chat_template": CONTROL_TEMPLATE})
    kwargs = {} if tools is None else {"tools": tools}
    for _ in range(3):  # strftime_now: both sides render within one day; retried if midnight passed meanwhile
        today = datetime.now().strftime("%d %B %Y")
        try:
            assert_same_chat(folder, CHAT, **kwargs)
            text = Tokenizer(folder).apply_chat_template(CHAT, **kwargs)
        except AssertionError:
            if datetime.now().strftime("%d %B %Y") == today:
                raise
            continue
        if datetime.now().strftime("%d %B %Y") == today:
            break
    assert f"Today is {today}.\nBe brief." in text and text.count("Be brief.") == 1
    if tools:
        assert '"météo"' in text and "東京" in text and '\n  "function": {' in text and '{"type":"function","function":{' in text


def test_break_keeps_the_first_system_message(tmp_path):
    folder = tokenizer_folder(tmp_path, config={"chat_template": CONTROL_TEMPLATE})
    messages = [{"role": "system", "content": "First."}, {"role": "system", "content": "Second."},
                {"role": "user", "content": "Hi"}]
    text = Tokenizer(folder).apply_chat_template(messages)
    assert "\nFirst.<|im_end|>" in text and "Second." not in text


@parity
def test_chat_template_jinja_wins_over_tokenizer_config(tmp_path):
    jinja = "{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}{% if add_generation_prompt %}[assistant] {% endif %}"
    folder = tokenizer_folder(tmp_path, jinja=jinja)  # tokenizer_config.json keeps the tiny model's ChatML
    assert Tokenizer(folder).apply_chat_template(CHAT[:2]) == "[system] Be brief.\n[user] Capital of Japan?\n[assistant] "
    assert_same_chat(folder, CHAT)
    alone = tokenizer_folder(tmp_path, "jinja-only", jinja=jinja, drop_template=True)
    assert_same_chat(alone, CHAT)


@parity
def test_named_templates_use_the_default(tmp_path):
    named = [{"name": "tool_use", "template": "{{ raise_exception('not this one') }}"},
             {"name": "default", "template": THINKING_TEMPLATE}]
    assert_same_chat(tokenizer_folder(tmp_path, config={"chat_template": named}), CHAT, enable_thinking=False)
    nameless = tokenizer_folder(tmp_path, "nameless", config={"chat_template": named[:1]})
    with pytest.raises(RefengineError, match="default"):
        Tokenizer(nameless)


@parity
def test_no_template_warns_once_and_renders_chatml_as_transformers_would(tmp_path):
    folder = tokenizer_folder(tmp_path, drop_template=True)
    tokenizer, hf = Tokenizer(folder), hf_tokenizer(folder)
    with pytest.raises(ValueError):  # transformers refuses a model without a template; we say so and use ChatML
        hf.apply_chat_template(CHAT, add_generation_prompt=True)
    with pytest.warns(UserWarning, match=f"{folder}.*ChatML"):
        ids = tokenizer.encode_chat(CHAT)
    assert ids == hf_chat_ids(hf, CHAT, chat_template=CHATML_TEMPLATE)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert Tokenizer(folder).encode_chat(CHAT) == ids  # once per folder


def test_template_kwargs_cannot_replace_the_messages(tmp_path):
    tokenizer = Tokenizer(tokenizer_folder(tmp_path))
    with pytest.raises(RefengineError, match="chat_template_kwargs: 'messages'"):
        tokenizer.encode_chat(CHAT, messages=[])


# --- BOS ------------------------------------------------------------------------------------------
TEXTS = ["Once upon a time", "Tokyo 東京 — naïve café ☕", "<|im_start|>user\nhi<|im_end|>"]


@parity
def test_qwen3_tokenizer_adds_no_bos(tmp_path):
    folder = tokenizer_folder(tmp_path)
    ours, hf = Tokenizer(folder), hf_tokenizer(folder)
    for text in TEXTS:
        assert ours.encode(text) == hf(text).input_ids == ours.encode(text, add_special_tokens=False)
    assert_same_chat(folder, CHAT)


def llama_style_folder(tmp_path):
    """A tokenizer.json whose post-processor adds BOS `<s>`, `add_bos_token: true`, a template writing bos_token."""
    folder = tokenizer_folder(tmp_path, "llama", config={
        "bos_token": "<s>", "add_bos_token": True, "chat_template": LLAMA_TEMPLATE})
    backend = HFTokenizer.from_file(str(folder / "tokenizer.json"))
    backend.add_special_tokens(["<s>"])
    bos = backend.token_to_id("<s>")
    backend.post_processor = processors.TemplateProcessing(single="<s> $A", pair="<s> $A <s> $B",
                                                           special_tokens=[("<s>", bos)])
    (folder / "tokenizer.json").write_text(backend.to_str(), encoding="utf-8")
    return folder, bos


@parity
def test_llama_style_tokenizer_adds_bos_to_text_not_to_the_rendered_chat(tmp_path):
    folder, bos = llama_style_folder(tmp_path)
    ours, hf = Tokenizer(folder), hf_tokenizer(folder)
    for text in TEXTS:
        ids = ours.encode(text)
        assert ids == hf(text).input_ids
        assert ids[0] == bos and ids[1:] == ours.encode(text, add_special_tokens=False)
    chat_ids = assert_same_chat(folder, CHAT)
    assert chat_ids[0] == bos and chat_ids.count(bos) == 1  # the template's own bos_token, no second one


# --- template arguments in prompt sets and golden files ---------------------------------------------
def test_prompt_chat_template_kwargs_reach_the_golden_file_only_where_given(tmp_path):
    model = load_model(tokenizer_folder(tmp_path, config={"chat_template": THINKING_TEMPLATE}, weights=True))
    messages = CHAT[-1:]
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("\n".join(json.dumps(case) for case in [
        {"id": "plain", "messages": messages, "max_tokens": 3},
        {"id": "no-think", "messages": messages, "chat_template_kwargs": {"enable_thinking": False}, "max_tokens": 3},
    ]) + "\n", encoding="utf-8")
    cases = load_prompts(prompts)
    assert [c.chat_template_kwargs for c in cases] == [None, {"enable_thinking": False}]
    noise = {"f32_vs_f64": 1e-5, "f32_batched_vs_serial": 1e-5, "safety_factor": 8}
    out = tmp_path / "golden.jsonl"
    refresh(model, prompts, cases, out, noise)
    lines = [json.loads(line) for line in out.read_text(encoding="utf-8").splitlines()[1:]]
    assert "chat_template_kwargs" not in lines[0]
    assert list(lines[1])[:4] == ["id", "messages", "chat_template_kwargs", "prompt_ids"]
    golden = read_golden(out)
    assert [c.chat_template_kwargs for c in golden.cases] == [None, {"enable_thinking": False}]
    plain, no_think = golden.cases
    assert plain.prompt_ids == model.tokenizer.encode_chat(messages)
    assert no_think.prompt_ids == model.tokenizer.encode_chat(messages, enable_thinking=False) != plain.prompt_ids


@pytest.mark.parametrize("case,message", [
    ({"id": "a", "messages": CHAT, "chat_template_kwargs": ["enable_thinking"], "max_tokens": 2}, "must be an object"),
    ({"id": "a", "prompt": "hi", "chat_template_kwargs": {}, "max_tokens": 2}, "needs 'messages'"),
])
def test_bad_prompt_chat_template_kwargs_are_refused(tmp_path, case, message):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(json.dumps(case) + "\n", encoding="utf-8")
    with pytest.raises(RefengineError, match=f"prompts.jsonl:1: 'chat_template_kwargs' {message}"):
        load_prompts(prompts)
