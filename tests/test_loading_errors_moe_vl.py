"""Qwen3-MoE and Qwen3-VL folders, broken: each problem is refused with a RefengineError naming the
file, tensor or field (the weights' problems all in one error, as for dense models); and a VL folder
is read as its language model, the vision tower on disk but never counted as unexpected."""
from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
from safetensors.numpy import load_file, save_file
from test_loading_errors import WEIGHTS, edit_config, rewrite_weights

from refengine.errors import RefengineError
from refengine.model import load_config, load_model
from refengine.model.tiny import TinySpec, make_tiny
from refengine.reference import prompt_logits

MOE = TinySpec(arch="qwen3_moe", layers=3, hidden=32, heads=2, kv_heads=1, head_dim=16, intermediate=48, vocab=260,
               tie=False, experts=4, experts_per_tok=2, moe_intermediate=24, mlp_only_layers=(1,))
DENSE = TinySpec(layers=2, hidden=32, heads=2, kv_heads=1, head_dim=16, intermediate=48, vocab=260, tie=False)
MROPE = {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [4, 2, 2], "mrope_interleaved": True}


@pytest.fixture(scope="module")
def pristine_moe(tmp_path_factory):
    return make_tiny(tmp_path_factory.mktemp("moe"), MOE)


@pytest.fixture
def moe(pristine_moe, tmp_path):
    return shutil.copytree(pristine_moe, tmp_path / "moe")


@pytest.fixture(scope="module")
def dense(tmp_path_factory):
    return make_tiny(tmp_path_factory.mktemp("dense"), DENSE)


@pytest.fixture
def vl(dense, tmp_path):
    """The dense tiny model as a Qwen3-VL checkpoint saves it: its fields under text_config, its tensors
    under model.language_model., a vision tower beside them."""
    folder = shutil.copytree(dense, tmp_path / "vl")
    tensors = as_vl(folder, "Qwen3VLForConditionalGeneration")
    tensors["model.visual.blocks.0.attn.qkv.weight"] = np.ones((24, 8), np.float32)
    save_file(tensors, folder / WEIGHTS)
    return folder


def as_vl(folder, arch: str) -> dict:
    """Rewrite the causal-LM folder's config.json as a VL checkpoint's (fields under text_config)."""
    text = json.loads((folder / "config.json").read_text())
    top = {key: text.pop(key) for key in ("architectures", "tie_word_embeddings", "torch_dtype")}
    text.pop("rope_theta")
    text |= {"rope_parameters": MROPE}
    config = {**top, "architectures": [arch], "text_config": text, "vision_config": {"depth": 1}}
    (folder / "config.json").write_text(json.dumps(config))
    tensors = {name.replace("model.", "model.language_model.", 1): t for name, t in load_file(folder / WEIGHTS).items()}
    return tensors | {"model.visual.patch_embed.proj.weight": np.ones((8, 3, 2, 4, 4), np.float32)}


@pytest.fixture
def vl_moe(pristine_moe, tmp_path):
    """The tiny MoE model as Qwen3-VL-MoE saves it: experts fused, [experts, 2 * moe_intermediate, hidden]."""
    folder = shutil.copytree(pristine_moe, tmp_path / "vl-moe")
    config = json.loads((folder / "config.json").read_text())
    del config["norm_topk_prob"]  # not a Qwen3-VL-MoE field
    (folder / "config.json").write_text(json.dumps(config))
    tensors = as_vl(folder, "Qwen3VLMoeForConditionalGeneration")
    for n in (0, 2):
        p = f"model.language_model.layers.{n}.mlp.experts."
        gate, up, down = ([tensors.pop(f"{p}{e}.{w}_proj.weight") for e in range(MOE.experts)] for w in ("gate", "up", "down"))
        tensors[p + "gate_up_proj"] = np.stack([np.concatenate([g, u]) for g, u in zip(gate, up)])
        tensors[p + "down_proj"] = np.stack(down)
    save_file(tensors, folder / WEIGHTS)
    return folder


def weights_error(folder) -> str:
    with pytest.raises(RefengineError) as error:
        load_model(folder)
    message = str(error.value)
    assert message.startswith(f"{folder}: weights do not match config.json: ")
    return message


def test_the_untouched_moe_copy_loads_and_runs(moe):
    model = load_model(moe)
    assert model.config.sparse_layers == (0, 2)
    assert np.isfinite(prompt_logits(model, [1, 2, 3])).all()


def test_missing_expert_misshaped_router_and_fused_experts_are_all_named_in_one_error(moe):
    def edit(tensors):
        del tensors["model.layers.2.mlp.experts.3.up_proj.weight"]
        tensors["model.layers.0.mlp.gate.weight"] = np.zeros((3, MOE.hidden), np.float32)
        tensors["model.layers.2.mlp.experts.gate_up_proj"] = np.zeros((4, 32, MOE.hidden), np.float32)

    rewrite_weights(moe, edit)
    message = weights_error(moe)
    assert "missing tensor model.layers.2.mlp.experts.3.up_proj.weight [24, 32]" in message
    assert "tensor model.layers.0.mlp.gate.weight has shape [3, 32], expected [4, 32]" in message
    assert "unexpected tensor model.layers.2.mlp.experts.gate_up_proj [4, 32, 32]" in message


def test_a_dense_layer_the_config_calls_sparse_misses_its_router_and_experts(moe):
    edit_config(moe, mlp_only_layers=[])  # now every layer is sparse, layer 1 included
    message = weights_error(moe)
    assert "missing tensor model.layers.1.mlp.gate.weight [4, 32]" in message
    assert "missing tensor model.layers.1.mlp.experts.0.gate_proj.weight [24, 32]" in message
    assert "unexpected tensor model.layers.1.mlp.down_proj.weight [32, 48]" in message


def test_decoder_sparse_step_decides_which_layers_are_sparse(moe):
    edit_config(moe, mlp_only_layers=[], decoder_sparse_step=2)  # (n + 1) % 2 == 0: layer 1 only
    assert load_config(moe).sparse_layers == (1,)


@pytest.mark.parametrize("field, value", [
    ("shared_expert_intermediate_size", 64), ("n_shared_experts", 1), ("routed_scaling_factor", 2.5),
    ("scoring_func", "sigmoid"), ("first_k_dense_replace", 1), ("n_group", 4),
])
def test_moe_fields_the_forward_does_not_implement_are_refused(moe, field, value):
    edit_config(moe, **{field: value})
    with pytest.raises(RefengineError, match=rf"config\.json: field {field}={value!r} is not supported"):
        load_config(moe)


@pytest.mark.parametrize("field, value, message", [
    ("hidden_act", "gelu", "field hidden_act='gelu' is not supported"),
    ("use_sliding_window", True, "field use_sliding_window=true"),
    ("num_experts_per_tok", 5, "field num_experts_per_tok=5 is not supported"),
])
def test_dense_refusals_apply_to_moe_too(moe, field, value, message):
    edit_config(moe, **{field: value}, sliding_window=16)
    with pytest.raises(RefengineError, match=message):
        load_config(moe)


def test_training_only_router_fields_are_ignored(moe):
    edit_config(moe, router_aux_loss_coef=0.5, output_router_logits=True)
    assert load_config(moe).num_experts == MOE.experts


def test_missing_moe_field(moe):
    edit_config(moe, remove=["moe_intermediate_size"])
    with pytest.raises(RefengineError, match=r"config\.json: required field moe_intermediate_size is missing"):
        load_config(moe)


def test_a_vl_checkpoint_is_its_language_model(vl, dense):
    """Same language model, other names: the same logits bit for bit; the vision tower is ignored."""
    cfg = load_config(vl)
    assert (cfg.arch, cfg.weight_prefix, cfg.tie_word_embeddings) == ("qwen3_vl", "model.language_model.", False)
    ids = [3, 50, 7, 200, 11]
    np.testing.assert_array_equal(prompt_logits(load_model(vl), ids), prompt_logits(load_model(dense), ids))


def test_a_vl_stray_tensor_outside_the_tower_is_unexpected(vl):
    rewrite_weights(vl, lambda t: t.update({"model.projector.weight": np.zeros(4, np.float32)}))
    assert "unexpected tensor model.projector.weight [4]" in weights_error(vl)


def test_vl_ties_by_the_top_level_field_only_as_transformers(vl):
    config = json.loads((vl / "config.json").read_text())
    config.pop("tie_word_embeddings")
    config["text_config"]["tie_word_embeddings"] = True
    (vl / "config.json").write_text(json.dumps(config))
    assert load_config(vl).tie_word_embeddings is False  # transformers 5.24 reads Qwen3VLConfig's own (False)


def test_vl_without_text_config(vl):
    edit_config(vl, remove=["text_config"])
    with pytest.raises(RefengineError, match=r"config\.json: required field text_config is missing"):
        load_config(vl)


def test_vl_text_config_rope_scaling_is_checked(vl):
    config = json.loads((vl / "config.json").read_text())
    config["text_config"]["rope_parameters"] = {**MROPE, "rope_type": "yarn", "factor": 4.0}
    (vl / "config.json").write_text(json.dumps(config))
    with pytest.raises(RefengineError, match=r"config\.json: text_config: field rope_parameters\.rope_type='yarn'"):
        load_config(vl)


def test_multimodal_rope_outside_a_vl_checkpoint_is_refused(moe):
    edit_config(moe, rope_parameters=MROPE)
    with pytest.raises(RefengineError, match=r"field rope_parameters\.mrope_section is not supported"):
        load_config(moe)


@pytest.mark.parametrize("layout", ["as-saved", "hub"])
def test_fused_experts_in_either_layout_are_the_per_expert_ones(vl_moe, pristine_moe, layout):
    """Qwen3-VL-MoE's fused experts, as transformers saves them or transposed as the Hub stores them,
    give the Qwen3-MoE model's logits bit for bit (hidden 32 != 2 * moe_intermediate 48: a square
    tensor is taken as stored, as transformers takes it)."""
    if layout == "hub":
        rewrite_weights(vl_moe, lambda t: t.update({n: np.ascontiguousarray(v.transpose(0, 2, 1)) for n, v in t.items()
                                                    if n.endswith(("gate_up_proj", "down_proj"))}))
    cfg = load_config(vl_moe)
    assert (cfg.arch, cfg.fused_experts, cfg.norm_topk_prob) == ("qwen3_vl_moe", True, True)
    ids = [3, 50, 7, 200, 11]
    np.testing.assert_array_equal(prompt_logits(load_model(vl_moe), ids), prompt_logits(load_model(pristine_moe), ids))


def test_a_fused_expert_tensor_of_neither_shape_names_both(vl_moe):
    name = "model.language_model.layers.2.mlp.experts.gate_up_proj"
    rewrite_weights(vl_moe, lambda t: t.update({name: np.zeros((4, 30, 32), np.float32)}))
    assert f"tensor {name} has shape [4, 30, 32], expected [4, 48, 32] or [4, 32, 48]" in weights_error(vl_moe)
