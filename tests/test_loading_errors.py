"""Every bad model folder or prompt is refused with a RefengineError naming what is wrong (the
safetensors library reads the weights: its exceptions come back translated, naming the file); and
our safetensors writer and the library agree bit for bit."""
from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
from safetensors.numpy import load_file as st_load_file
from safetensors.numpy import save_file as st_save_file

from refengine.errors import RefengineError
from refengine.model import load_config, load_model
from refengine.model.safetensors_io import SafetensorsFile, save_file
from refengine.model.tiny import TinySpec, make_tiny
from refengine.reference import prompt_logits

SPEC = TinySpec(layers=1, hidden=32, heads=2, kv_heads=1, head_dim=16, intermediate=48, vocab=260)
WEIGHTS = "model.safetensors"


@pytest.fixture(scope="module")
def pristine(tmp_path_factory):
    return make_tiny(tmp_path_factory.mktemp("pristine"), SPEC)


@pytest.fixture
def folder(pristine, tmp_path):
    """A private copy of a valid tiny model to break."""
    return shutil.copytree(pristine, tmp_path / "model")


def edit_config(folder, remove=(), **changes):
    path = folder / "config.json"
    config = json.loads(path.read_text())
    for key in remove:
        config.pop(key, None)
    config.update(changes)
    path.write_text(json.dumps(config))


def rewrite_weights(folder, edit):
    """Rewrite model.safetensors with the safetensors library after `edit(tensors)`."""
    tensors = st_load_file(folder / WEIGHTS)
    edit(tensors)
    st_save_file(tensors, folder / WEIGHTS)


def rewrite_header(folder, edit):
    """Rewrite model.safetensors' JSON header after `edit(header)`, keeping the data bytes."""
    data = (folder / WEIGHTS).read_bytes()
    header_len = int.from_bytes(data[:8], "little")
    header = json.loads(data[8:8 + header_len])
    edit(header)
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    (folder / WEIGHTS).write_bytes(len(raw).to_bytes(8, "little") + raw + data[8 + header_len:])


def test_the_untouched_copy_loads(folder):
    model = load_model(folder)
    assert prompt_logits(model, [1, 2, 3]).shape == (3, SPEC.vocab)


def test_non_existent_folder(tmp_path):
    missing = tmp_path / "no-such-model"
    with pytest.raises(RefengineError, match="no-such-model.*does not exist"):
        load_model(missing)


def test_missing_config_json(folder):
    (folder / "config.json").unlink()
    with pytest.raises(RefengineError, match="config.json.*not found"):
        load_model(folder)


def test_config_json_that_is_not_json(folder):
    (folder / "config.json").write_text("{not json")
    with pytest.raises(RefengineError, match="config.json.*not valid JSON"):
        load_model(folder)


def test_missing_weights(folder):
    (folder / WEIGHTS).unlink()
    with pytest.raises(RefengineError, match="no model.safetensors or model.safetensors.index.json"):
        load_model(folder)


def test_missing_tokenizer(folder):
    (folder / "tokenizer.json").unlink()
    with pytest.raises(RefengineError, match="tokenizer.json.*not found"):
        load_model(folder)


@pytest.mark.parametrize("keep_fraction", [0.5, 0.99])
def test_truncated_weights_file(folder, keep_fraction):
    data = (folder / WEIGHTS).read_bytes()
    (folder / WEIGHTS).write_bytes(data[:int(len(data) * keep_fraction)])
    # The library only says the data section is short; refengine names the tensor that runs past its end.
    with pytest.raises(RefengineError, match=r"model\.safetensors: truncated safetensors file.*: tensor '"):
        load_model(folder)


def test_trailing_bytes_after_the_last_tensor(folder):
    """The library refuses a data section longer than the header's tensors (the old reader ignored it)."""
    with open(folder / WEIGHTS, "ab") as f:
        f.write(b"\0" * 16)
    with pytest.raises(RefengineError, match=r"model\.safetensors: truncated safetensors file \(or trailing bytes\)"):
        load_model(folder)


def test_weights_file_cut_before_the_header_length(folder):
    (folder / WEIGHTS).write_bytes(b"\x10\x00\x00")
    with pytest.raises(RefengineError, match=r"model\.safetensors: truncated safetensors file"):
        load_model(folder)


def test_header_length_beyond_the_file(folder):
    data = (folder / WEIGHTS).read_bytes()
    (folder / WEIGHTS).write_bytes((len(data) * 2).to_bytes(8, "little") + data[8:])
    with pytest.raises(RefengineError, match=r"model\.safetensors: corrupt safetensors header"):
        load_model(folder)


def test_header_that_is_not_json(folder):
    data = bytearray((folder / WEIGHTS).read_bytes())
    data[8:12] = b"#!@$"  # header length unchanged, JSON destroyed
    (folder / WEIGHTS).write_bytes(bytes(data))
    with pytest.raises(RefengineError, match=r"model\.safetensors: corrupt safetensors header"):
        load_model(folder)


def test_header_offsets_that_contradict_the_shape(folder):
    rewrite_header(folder, lambda h: h["model.norm.weight"].update(shape=[SPEC.hidden + 1]))
    # safetensors' TensorInvalidInfo carries no name: refengine finds the tensor for the message.
    with pytest.raises(RefengineError, match=r"model\.safetensors: corrupt safetensors header: a tensor's offsets "
                                             r"do not match its shape and dtype: tensor 'model\.norm\.weight'"):
        load_model(folder)


def test_two_tensors_sharing_a_byte_range(folder):
    """The library refuses overlapping tensors (the old reader accepted them), naming where the ranges break."""
    def edit(header):
        header["model.layers.0.input_layernorm.weight"]["data_offsets"] = header["model.norm.weight"]["data_offsets"]

    rewrite_header(folder, edit)
    with pytest.raises(RefengineError, match=r"model\.safetensors: corrupt safetensors header: tensor byte ranges "
                                             r"overlap or leave a gap: tensor 'model\..+'"):
        load_model(folder)


def test_dtype_the_library_reads_but_a_model_cannot_use(folder):
    rewrite_header(folder, lambda h: h["model.norm.weight"].update(dtype="I16", shape=[2 * SPEC.hidden]))
    with pytest.raises(RefengineError,
                       match=r"model\.safetensors: tensor 'model\.norm\.weight' has unsupported dtype I16"):
        load_model(folder)


def test_dtype_unknown_to_the_format(folder):
    rewrite_header(folder, lambda h: h["model.norm.weight"].update(dtype="Q4"))
    with pytest.raises(RefengineError, match=r"model\.safetensors: corrupt safetensors header \(safetensors: .+\)"):
        load_model(folder)


def test_missing_unexpected_and_misshaped_tensors_are_all_named_in_one_error(folder):
    def edit(tensors):
        del tensors["model.layers.0.self_attn.q_norm.weight"]
        del tensors["model.layers.0.mlp.up_proj.weight"]
        tensors["model.layers.0.self_attn.extra.weight"] = np.zeros(3, np.float32)
        tensors["model.norm.weight"] = np.ones(SPEC.hidden + 1, np.float32)

    rewrite_weights(folder, edit)
    with pytest.raises(RefengineError) as error:
        load_model(folder)
    message = str(error.value)
    assert "model.layers.0.self_attn.q_norm.weight" in message
    assert "model.layers.0.mlp.up_proj.weight" in message
    assert "model.layers.0.self_attn.extra.weight" in message
    assert f"model.norm.weight has shape [{SPEC.hidden + 1}], expected [{SPEC.hidden}]" in message


def test_lm_head_in_a_tied_model_is_unexpected(folder):
    rewrite_weights(folder, lambda t: t.update({"lm_head.weight": t["model.embed_tokens.weight"].copy()}))
    with pytest.raises(RefengineError, match=r"unexpected tensor lm_head\.weight"):
        load_model(folder)


def test_untied_config_needs_lm_head(folder):
    edit_config(folder, tie_word_embeddings=False)
    with pytest.raises(RefengineError, match=r"missing tensor lm_head\.weight"):
        load_model(folder)


def test_sharded_index_naming_a_missing_shard(pristine, tmp_path):
    folder = make_tiny(tmp_path / "sharded", SPEC, shards=3)
    (folder / "model-00002-of-00003.safetensors").unlink()
    with pytest.raises(RefengineError, match=r"model-00002-of-00003\.safetensors: file not found"):
        load_model(folder)


@pytest.mark.parametrize("architectures", [["MistralForCausalLM"], [], ["Qwen3ForCausalLM", "LlamaForCausalLM"]])
def test_unsupported_architecture(folder, architectures):
    edit_config(folder, architectures=architectures)
    with pytest.raises(RefengineError, match=r"config\.json: field architectures=.* is not supported"):
        load_config(folder)


@pytest.mark.parametrize("field, value, named", [
    ("rope_scaling", {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768}, "yarn"),
    ("rope_scaling", {"rope_type": "llama3", "factor": 8.0}, "llama3"),
    ("rope_parameters", {"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0}, "linear"),
    ("rope_parameters", {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0}, "dynamic"),
])
def test_unsupported_rope_scaling(folder, field, value, named):
    edit_config(folder, **{field: value})
    with pytest.raises(RefengineError, match=rf"field {field}\.rope_type='{named}' is not supported"):
        load_config(folder)


def test_rope_scaling_beside_default_rope_parameters_is_not_ignored(folder):
    edit_config(folder, rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
                rope_scaling={"type": "yarn", "factor": 4.0})
    with pytest.raises(RefengineError, match=r"field rope_scaling\.rope_type='yarn' is not supported"):
        load_config(folder)


def test_rope_scaling_that_is_not_an_object(folder):
    edit_config(folder, rope_scaling=[4.0])
    with pytest.raises(RefengineError, match=r"field rope_scaling must be an object"):
        load_config(folder)


def test_active_sliding_window(folder):
    edit_config(folder, use_sliding_window=True, sliding_window=16)
    with pytest.raises(RefengineError, match="field use_sliding_window=true"):
        load_config(folder)


def test_inactive_sliding_window_is_accepted(folder):
    edit_config(folder, use_sliding_window=False, sliding_window=4096)
    assert load_config(folder).num_layers == SPEC.layers


def test_sliding_attention_layer_type(folder):
    edit_config(folder, layer_types=["sliding_attention"])
    with pytest.raises(RefengineError, match=r"field layer_types contains \['sliding_attention'\]"):
        load_config(folder)


@pytest.mark.parametrize("field", ["num_experts", "num_local_experts", "n_routed_experts"])
def test_mixture_of_experts(folder, field):
    edit_config(folder, **{field: 8})
    with pytest.raises(RefengineError, match=f"field {field}=8 .*not supported"):
        load_config(folder)


def test_unsupported_activation(folder):
    edit_config(folder, hidden_act="gelu")
    with pytest.raises(RefengineError, match="field hidden_act='gelu' is not supported"):
        load_config(folder)


def test_missing_required_config_field(folder):
    edit_config(folder, remove=["hidden_size"])
    with pytest.raises(RefengineError, match="required field hidden_size is missing"):
        load_config(folder)


@pytest.mark.parametrize("bad_id, position", [(SPEC.vocab, 1), (SPEC.vocab + 1000, 1), (-1, 1)])
def test_token_id_outside_the_vocabulary(pristine, bad_id, position):
    model = load_model(pristine)
    with pytest.raises(RefengineError, match=rf"token id {bad_id} at position {position} is outside the vocabulary"):
        prompt_logits(model, [3, bad_id, 4])


def test_last_valid_token_id_is_accepted(pristine):
    assert prompt_logits(load_model(pristine), [SPEC.vocab - 1]).shape == (1, SPEC.vocab)


def test_empty_prompt(pristine):
    with pytest.raises(RefengineError, match="empty prompt"):
        prompt_logits(load_model(pristine), [])


def _edge_case_floats():
    special = np.array([0.0, -0.0, 1.0, -1.0, np.inf, -np.inf, 3.4028235e38, -3.4028235e38,
                        1e-45, -1e-45, 1.1754944e-38, 1e-40], np.float32)
    # Exact halfway cases between two bf16 values, both even and odd below: rounding must go to even.
    halfway = (np.array([0x3F808000, 0x3F818000, 0xC0108000, 0x42FF8000], np.uint32)).view(np.float32)
    rng = np.random.default_rng(0)
    random = (rng.standard_normal(4000) * np.exp(rng.uniform(-30, 30, 4000))).astype(np.float32)
    return np.concatenate([special, halfway, random]).reshape(4, -1)


def test_bf16_write_rounds_like_torch_and_reads_back_widened_exactly(tmp_path):
    torch = pytest.importorskip("torch")
    from safetensors.torch import load_file as st_torch_load_file

    x = _edge_case_floats()
    save_file({"x": x}, tmp_path / "ours.safetensors", dtype="BF16")
    expected = torch.from_numpy(x.copy()).to(torch.bfloat16)

    read_by_library = st_torch_load_file(tmp_path / "ours.safetensors")["x"]
    assert read_by_library.dtype == torch.bfloat16
    assert torch.equal(read_by_library.view(torch.int16), expected.view(torch.int16))

    as_stored = SafetensorsFile(tmp_path / "ours.safetensors").get("x")
    import ml_dtypes  # here, not at collection: it takes a second to import
    assert as_stored.dtype == ml_dtypes.bfloat16 and as_stored.shape == x.shape
    ours = SafetensorsFile(tmp_path / "ours.safetensors").get_float("x")
    assert ours.dtype == np.float32
    np.testing.assert_array_equal(ours.view(np.uint32), expected.to(torch.float32).numpy().view(np.uint32))


def test_bf16_widening_matches_torch_for_every_bit_pattern(tmp_path):
    torch = pytest.importorskip("torch")
    from safetensors.torch import save_file as st_torch_save_file

    every_bf16 = torch.arange(-2**15, 2**15, dtype=torch.int32).to(torch.int16).view(torch.bfloat16).reshape(256, 256)
    st_torch_save_file({"every": every_bf16}, tmp_path / "torch.safetensors")
    ours = SafetensorsFile(tmp_path / "torch.safetensors").get_float("every")
    np.testing.assert_array_equal(ours.view(np.uint32), every_bf16.to(torch.float32).numpy().view(np.uint32))


def test_bf16_write_keeps_nan_a_nan(tmp_path):
    nans = np.array([0x7FC00000, 0x7F800001, 0xFF800001, 0x7FFFFFFF], np.uint32).view(np.float32)
    save_file({"nan": nans}, tmp_path / "nan.safetensors", dtype="BF16")
    assert np.isnan(SafetensorsFile(tmp_path / "nan.safetensors").get_float("nan")).all()


@pytest.mark.parametrize("dtype, numpy_dtype", [("F32", np.float32), ("F16", np.float16)])
def test_our_files_read_identically_by_the_safetensors_library(tmp_path, dtype, numpy_dtype):
    rng = np.random.default_rng(1)
    tensors = {"b.weight": rng.standard_normal((5, 3)).astype(numpy_dtype),
               "a.bias": rng.standard_normal(7).astype(numpy_dtype),
               "scalar_row": np.array([[1.5]], numpy_dtype)}
    save_file(tensors, tmp_path / "ours.safetensors", dtype=dtype)
    read = st_load_file(tmp_path / "ours.safetensors")
    assert set(read) == set(tensors)
    for name, array in tensors.items():
        assert read[name].dtype == numpy_dtype and read[name].shape == array.shape
        np.testing.assert_array_equal(read[name], array)


@pytest.mark.parametrize("numpy_dtype, stored", [(np.float32, "F32"), (np.float16, "F16"), (np.float64, "F64")])
def test_library_files_read_identically_by_ours(tmp_path, numpy_dtype, stored):
    rng = np.random.default_rng(2)
    tensors = {"w": rng.standard_normal((4, 6)).astype(numpy_dtype), "v": rng.standard_normal(9).astype(numpy_dtype)}
    st_save_file(tensors, tmp_path / "theirs.safetensors")
    ours = SafetensorsFile(tmp_path / "theirs.safetensors")
    assert ours.tensors == {"w": (stored, (4, 6)), "v": (stored, (9,))}
    for name, array in tensors.items():
        np.testing.assert_array_equal(ours.get(name), array)
        np.testing.assert_array_equal(ours.get_float(name, np.float64), array.astype(np.float64))


def test_our_writer_is_deterministic(tmp_path):
    tensors = {"z": np.arange(6, dtype=np.float32).reshape(2, 3), "a": np.ones(2, np.float32)}
    save_file(tensors, tmp_path / "one.safetensors")
    save_file(dict(reversed(tensors.items())), tmp_path / "two.safetensors")
    assert (tmp_path / "one.safetensors").read_bytes() == (tmp_path / "two.safetensors").read_bytes()
