import json

import pytest
from hypothesis import given
from hypothesis import strategies as st

from refengine.errors import RefengineError
from refengine.model.tiny import SPECIAL_TOKENS
from refengine.model.tokenizer import Tokenizer

MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Capital of Japan?"}]


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir):
    return Tokenizer(tiny_model_dir)


def test_special_tokens_are_single_ids(tokenizer):
    for token in SPECIAL_TOKENS:
        token_id = tokenizer.token_to_id(token)
        assert token_id is not None
        assert tokenizer.encode(token) == [token_id]


def test_chat_template_renders_chatml_with_generation_prompt(tokenizer):
    text = tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True)
    assert text == ("<|im_start|>system\nBe brief.<|im_end|>\n"
                    "<|im_start|>user\nCapital of Japan?<|im_end|>\n<|im_start|>assistant\n")
    without = tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=False)
    assert text.startswith(without) and not without.endswith("assistant\n")
    ids = tokenizer.encode_chat(MESSAGES)
    assert ids[0] == tokenizer.token_to_id("<|im_start|>")
    assert tokenizer.decode(ids, skip_special_tokens=False) == text


def test_model_template_is_used_instead_of_chatml(tmp_path, tiny_model_dir):
    for name in ("tokenizer.json",):
        (tmp_path / name).write_bytes((tiny_model_dir / name).read_bytes())
    template = ("{% for m in messages %}[{{ m['role'] | upper }}] {{ m['content'] }}\n{% endfor %}"
                "{% if add_generation_prompt %}[ASSISTANT] {% endif %}")
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": template}))
    assert Tokenizer(tmp_path).apply_chat_template(MESSAGES) == \
        "[SYSTEM] Be brief.\n[USER] Capital of Japan?\n[ASSISTANT] "


def test_template_without_config_falls_back_to_chatml(tmp_path, tiny_model_dir):
    (tmp_path / "tokenizer.json").write_bytes((tiny_model_dir / "tokenizer.json").read_bytes())
    with pytest.warns(UserWarning, match="no chat template.*ChatML"):
        text = Tokenizer(tmp_path).apply_chat_template(MESSAGES[1:])
    assert text == "<|im_start|>user\nCapital of Japan?<|im_end|>\n<|im_start|>assistant\n"


def test_template_raise_exception_becomes_clear_error(tmp_path, tiny_model_dir):
    (tmp_path / "tokenizer.json").write_bytes((tiny_model_dir / "tokenizer.json").read_bytes())
    template = "{% if messages[0]['role'] != 'user' %}{{ raise_exception('first must be user') }}{% endif %}"
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": template}))
    with pytest.raises(RefengineError, match="first must be user"):
        Tokenizer(tmp_path).apply_chat_template(MESSAGES)


@pytest.mark.parametrize("messages", [[], [{"role": "user"}], "hello", [{"role": 1, "content": "x"}]])
def test_bad_messages_are_refused(tokenizer, messages):
    with pytest.raises(RefengineError, match="messages"):
        tokenizer.apply_chat_template(messages)


def test_missing_tokenizer_file_is_named(tmp_path):
    with pytest.raises(RefengineError, match="tokenizer.json"):
        Tokenizer(tmp_path)


def test_text_round_trips_including_multibyte(tokenizer):
    text = "Tokyo 東京 — naïve café ☕ 🙂"
    assert tokenizer.decode(tokenizer.encode(text)) == text


@given(st.data())
def test_incremental_detokenize_equals_full_decode(tokenizer, data):
    source = st.one_of(
        st.lists(st.integers(0, tokenizer.vocab_size - 1), min_size=1, max_size=40),
        st.text(min_size=1, max_size=30).map(tokenizer.encode).filter(bool))
    ids = data.draw(source)
    detok = tokenizer.detokenizer()
    pieces = [detok.push(i) for i in ids] + [detok.flush()]
    assert "".join(pieces) == tokenizer.decode(ids)
    assert detok.text == tokenizer.decode(ids)


def test_incremental_detokenizer_holds_back_a_split_character_and_skips_special_tokens(tokenizer):
    ids = tokenizer.encode("東京") + [tokenizer.token_to_id("<|im_end|>")] + tokenizer.encode(" ok")
    detok = tokenizer.detokenizer()
    pieces = [detok.push(i) for i in ids]
    assert "\ufffd" not in "".join(pieces) and "<|im_end|>" not in "".join(pieces)
    assert "".join(pieces) + detok.flush() == tokenizer.decode(ids) == "東京 ok"
    assert detok.ids == ids


def test_incremental_detokenizer_ends_with_the_incomplete_tail_on_flush(tokenizer):
    ids = tokenizer.encode("a東")
    detok = tokenizer.detokenizer()
    text = "".join(detok.push(i) for i in ids[:-1])
    assert text + detok.flush() == tokenizer.decode(ids[:-1]) == detok.text


def test_incremental_detokenizer_falls_back_to_full_decodes_if_the_stream_fails(tokenizer):
    class Refusing:
        def step(self, tok, token_id):
            raise Exception("invalid prefix")

    ids = tokenizer.encode("Tokyo 東京 — café")
    detok = tokenizer.detokenizer()
    first = detok.push(ids[0])
    detok._stream = Refusing()
    pieces = [first] + [detok.push(i) for i in ids[1:]] + [detok.flush()]
    assert "".join(pieces) == detok.text == tokenizer.decode(ids)
