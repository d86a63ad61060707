"""Qwen3-MoE, Qwen3-VL and Qwen3-VL-MoE (text-only) against transformers itself, as tests/test_parity.py does for
the dense models: tiny random models built and saved by transformers (bf16 and f32, single-file and
sharded), loaded by refengine, logits at every position within 1e-9 of transformers in float64.

Besides RMSNorm and the RoPE angles (test_parity.py), transformers keeps one more thing in float32
for float64 weights: the router's softmax (`softmax(..., dtype=torch.float)`). The test's copy
computes it in float64 and still picks experts with torch.topk, so exact ties (identical router
rows, a zero router) are broken by torch itself, and refengine must pick the same experts.
Experts run through transformers' eager loop (its grouped_mm kernel refuses float64).
"""
from __future__ import annotations

import types

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from safetensors.torch import load_file, save_file  # noqa: E402
from test_parity import (  # noqa: E402
    PARITY_BOUND,
    PROMPT_LEN,
    _rms_norm_f64,
    hf_logits,
    random_prompt,
    save_folder,
)

from refengine.check.driver import run_alone, run_batched  # noqa: E402
from refengine.check.schedule import parse_schedule  # noqa: E402
from refengine.model import load_config, load_model  # noqa: E402
from refengine.model.routing import top_k, torch_topk  # noqa: E402
from refengine.reference import generate, prompt_logits  # noqa: E402

pytestmark = pytest.mark.parity

TEXT = dict(vocab_size=80, hidden_size=32, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2,
            head_dim=8, max_position_embeddings=64, rms_norm_eps=1e-6)
MOE = {  # name -> Qwen3MoeConfig fields: several experts per token, dense layers among sparse ones
    "moe-e4k2-norm-mlp-only": dict(num_hidden_layers=3, num_experts=4, num_experts_per_tok=2,
                                   moe_intermediate_size=24, norm_topk_prob=True, mlp_only_layers=[1]),
    "moe-e8k3-sparse-step-2": dict(num_hidden_layers=4, num_experts=8, num_experts_per_tok=3,
                                   moe_intermediate_size=16, norm_topk_prob=False, decoder_sparse_step=2),
}
VISION = dict(depth=1, hidden_size=16, intermediate_size=32, num_heads=2, out_hidden_size=32, patch_size=4,
              spatial_merge_size=2, temporal_patch_size=2, num_position_embeddings=16, deepstack_visual_indexes=[0])
MROPE = {"rope_type": "default", "rope_theta": 700.0, "mrope_section": [2, 1, 1], "mrope_interleaved": True}
STORAGES = ["f32-single", "bf16-sharded"]


def randomize(model, seed: int):
    torch.manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(1.0 + 0.4 * torch.randn_like(p)) if "norm" in name else p.normal_(0.0, 0.3)
    return model


def build_moe(name: str, seed: int = 0):
    config = transformers.Qwen3MoeConfig(**TEXT, **MOE[name], tie_word_embeddings=False,
                                         rope_parameters={"rope_type": "default", "rope_theta": 500.0})
    return randomize(transformers.Qwen3MoeForCausalLM(config).to(torch.float32), seed)


def build_vl(tie: bool, seed: int = 0):
    config = transformers.Qwen3VLConfig(text_config=dict(**TEXT, num_hidden_layers=2, rope_parameters=MROPE),
                                        vision_config=VISION, tie_word_embeddings=tie)
    return randomize(transformers.Qwen3VLForConditionalGeneration(config).to(torch.float32), seed)


def build_vl_moe(seed: int = 0):
    text = dict(**TEXT, **MOE["moe-e4k2-norm-mlp-only"], rope_parameters=MROPE)
    del text["norm_topk_prob"]  # not a Qwen3-VL-MoE field: it always renormalizes
    config = transformers.Qwen3VLMoeConfig(text_config=text, vision_config=VISION, tie_word_embeddings=False)
    return randomize(transformers.Qwen3VLMoeForConditionalGeneration(config).to(torch.float32), seed)


def _router_f64(self, hidden_states):
    """Qwen3MoeTopKRouter.forward with the softmax in the input dtype, the pick still torch.topk."""
    logits = torch.nn.functional.linear(hidden_states.reshape(-1, self.hidden_dim), self.weight)
    top_value, top_index = torch.topk(torch.softmax(logits, dim=-1), self.top_k, dim=-1)
    if getattr(self, "norm_topk_prob", True):  # Qwen3-VL-MoE's router always renormalizes
        top_value = top_value / top_value.sum(dim=-1, keepdim=True)
    return logits, top_value, top_index


def _rotary_f64(self, x, position_ids):
    """transformers' rotary forward (Qwen3VLText's keeps its multimodal recomposition) in float64."""
    if hasattr(self, "mrope_section"):
        freqs = position_ids.expand(3, -1, -1)[..., None].to(torch.float64) * self.inv_freq
        return self.recomposition_frequencies(freqs.cos()), self.recomposition_frequencies(freqs.sin())
    angles = position_ids[..., None].to(torch.float64) * self.inv_freq
    return torch.cat((angles, angles), -1).cos(), torch.cat((angles, angles), -1).sin()


def hf_float64(folder, model_cls):
    model = model_cls.from_pretrained(folder, dtype="auto", attn_implementation="sdpa",
                                      experts_implementation="eager").to(torch.float64).eval()
    for module in model.modules():
        kind = type(module).__name__
        if kind.endswith("RMSNorm"):
            module.forward = types.MethodType(_rms_norm_f64, module)
        elif kind.endswith("TopKRouter"):
            module.forward = types.MethodType(_router_f64, module)
        elif kind.endswith("RotaryEmbedding") and "Vision" not in kind:
            cfg = module.config
            theta, dim = cfg.rope_parameters["rope_theta"], cfg.head_dim
            module.inv_freq = 1.0 / theta ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim)
            module.forward = types.MethodType(_rotary_f64, module)
    return model


def check_parity(hf_model, model_cls, folder, label: str) -> float:
    vocab = TEXT["vocab_size"]
    ids = random_prompt(vocab, seed=len(label))
    expected = hf_logits(hf_float64(folder, model_cls), ids)
    got = prompt_logits(load_model(folder), ids)
    assert got.shape == expected.shape == (PROMPT_LEN, vocab)
    assert expected.std() > 0.5 and len(set(expected.argmax(-1).tolist())) > 1
    diff = float(np.max(np.abs(got - expected)))
    print(f"\nparity {label}: max |refengine - transformers| = {diff:.3e}")
    assert diff <= PARITY_BOUND, f"{label}: max abs diff {diff:.3e} > {PARITY_BOUND}"
    return diff


@pytest.mark.parametrize("storage", STORAGES)
@pytest.mark.parametrize("name", list(MOE))
def test_moe_reference_matches_transformers_float64(name, storage, tmp_path):
    hf_model = build_moe(name)
    folder = save_folder(hf_model, tmp_path, storage)
    cfg = load_config(folder)
    dense = [n for n in range(cfg.num_layers) if n not in cfg.sparse_layers]
    assert cfg.sparse_layers and dense and cfg.num_experts_per_tok >= 2
    assert dense == [n for n, layer in enumerate(hf_model.model.layers)
                     if type(layer.mlp).__name__ == "Qwen3MoeMLP"]  # transformers' own dense/sparse choice
    assert cfg.num_parameters == sum(p.numel() for p in hf_model.parameters())
    check_parity(hf_model, transformers.Qwen3MoeForCausalLM, folder, f"{name} {storage}")


@pytest.mark.parametrize("tie_kind", ["identical-rows", "zero-router"])
def test_router_ties_pick_the_experts_torch_topk_picks(tie_kind, tmp_path):
    """Every token ties between all experts of layer 0 (identical rows) or of every sparse layer (zero
    router): which k of them a token uses is torch.topk's choice (for 4 experts, k=2: experts 2 and 3,
    not 0 and 1), and the logits only agree if refengine makes the same one."""
    hf_model = build_moe("moe-e4k2-norm-mlp-only", seed=5)
    with torch.no_grad():
        for n, layer in enumerate(hf_model.model.layers):
            if hasattr(layer.mlp, "gate"):
                router = layer.mlp.gate.weight
                router.copy_(router[:1].expand_as(router) if n == 0 or tie_kind == "zero-router" else router)
                if tie_kind == "zero-router":
                    router.zero_()
    assert torch.topk(torch.full((4,), 0.25), 2).indices.tolist() == [2, 3]  # a tie is not lowest-index-first
    folder = save_folder(hf_model, tmp_path, "f32-single")
    check_parity(hf_model, transformers.Qwen3MoeForCausalLM, folder, f"moe ties {tie_kind}")


def test_the_replayed_selection_is_torch_topk_on_ties():
    """model.routing replays libstdc++'s nth_element / partial_sort as torch.topk runs them on the CPU:
    on rows of few distinct values (ties everywhere) and every k, both paths (k * 64 <= n or not), the
    same indices in the same order; and top_k (the replay only where a tie straddles the k-th place)
    keeps torch's experts on every row."""
    rng = np.random.default_rng(0)
    for _ in range(3000):
        n = int(rng.choice([2, 3, 4, 5, 8, 9, 16, 17, 60, 64, 65, 128, 130, 256]))
        k = int(rng.integers(1, min(n, 17) + 1))
        values = rng.integers(0, int(rng.integers(1, 5)), n) / 7.0
        assert torch_topk(values, k) == torch.topk(torch.tensor(values), k).indices.tolist(), (values.tolist(), k)
    probs = rng.integers(0, 3, (400, 8)) / 3.0
    assert [set(row) for row in top_k(probs, 3)] == [set(row) for row in torch.topk(torch.tensor(probs), 3).indices.tolist()]


@pytest.mark.parametrize("storage", STORAGES)
@pytest.mark.parametrize("tie", [False, True])
def test_vl_text_only_reference_matches_transformers_float64(tie, storage, tmp_path):
    hf_model = build_vl(tie)
    folder = save_folder(hf_model, tmp_path, storage)
    cfg = load_config(folder)
    assert (cfg.arch, cfg.tie_word_embeddings, cfg.rope_theta) == ("qwen3_vl", tie, MROPE["rope_theta"])
    language = hf_model.model.language_model.parameters()
    assert cfg.num_parameters == sum(p.numel() for p in language) + (0 if tie else hf_model.lm_head.weight.numel())
    check_parity(hf_model, transformers.Qwen3VLForConditionalGeneration, folder, f"qwen3-vl tie={tie} {storage}")


@pytest.mark.parametrize("layout", ["as-saved", "hub"])
@pytest.mark.parametrize("storage", STORAGES)
def test_vl_moe_text_only_reference_matches_transformers_float64(storage, layout, tmp_path):
    """Qwen3-VL-MoE: fused 3-D experts, [experts, 2 * moe_intermediate, hidden] as transformers saves
    them, or transposed as the Hub stores them (transformers' loader transposes those back; checked
    here by loading them with transformers itself)."""
    hf_model = build_vl_moe()
    folder = save_folder(hf_model, tmp_path, storage)
    if layout == "hub":
        for path in folder.glob("*.safetensors"):
            tensors = load_file(path)
            fused = [n for n in tensors if n.endswith(("mlp.experts.gate_up_proj", "mlp.experts.down_proj"))]
            tensors |= {n: tensors[n].transpose(1, 2).contiguous() for n in fused}
            save_file(tensors, path, metadata={"format": "pt"})
    cfg = load_config(folder)
    assert (cfg.arch, cfg.fused_experts, cfg.norm_topk_prob, cfg.sparse_layers) == ("qwen3_vl_moe", True, True, (0, 2))
    language = hf_model.model.language_model.parameters()
    assert cfg.num_parameters == sum(p.numel() for p in language) + hf_model.lm_head.weight.numel()
    check_parity(hf_model, transformers.Qwen3VLMoeForConditionalGeneration, folder, f"qwen3-vl-moe {storage} {layout}")


def test_text_only_mrope_is_the_1d_rope():
    """Qwen3-VL's rotary gives each frequency the position of one axis (t, h or w: mrope_section,
    interleaved). A text-only prompt has t = h = w = the token's position, so every frequency gets
    that position: transformers' own multimodal cos/sin equal its 1-D ones bit for bit, and only
    positions that differ between axes (an image's) tell them apart."""
    vl = transformers.Qwen3VLForConditionalGeneration(transformers.Qwen3VLConfig(
        text_config=dict(**TEXT, num_hidden_layers=1, rope_parameters=MROPE), vision_config=VISION))
    plain = transformers.Qwen3ForCausalLM(transformers.Qwen3Config(
        **TEXT, num_hidden_layers=1, rope_parameters={"rope_type": "default", "rope_theta": MROPE["rope_theta"]}))
    x = torch.zeros(1, PROMPT_LEN, TEXT["head_dim"])
    text = torch.arange(PROMPT_LEN)[None]
    with torch.no_grad():
        mrope = vl.model.language_model.rotary_emb(x, text[None].expand(3, -1, -1))
        rope = plain.model.rotary_emb(x, text)
        image = vl.model.language_model.rotary_emb(x, torch.stack([text, text // 2, text % 3]))
    assert all(torch.equal(a, b) for a, b in zip(mrope, rope))
    assert not torch.equal(image[0], rope[0])


@pytest.mark.parametrize("mode", ["invariant", "fast"])
@pytest.mark.parametrize("kind", ["moe", "vl", "vl-moe"])
def test_float32_engine_against_the_float64_reference(kind, mode, tmp_path):
    """Sanity of the engine on both architectures: batched equals alone (bit for bit in invariant mode),
    and its float32 logits stay within float32 noise of the float64 reference on agreeing tokens."""
    hf_model = {"moe": lambda: build_moe("moe-e4k2-norm-mlp-only"), "vl": lambda: build_vl(tie=False),
                "vl-moe": build_vl_moe}[kind]()
    model = load_model(save_folder(hf_model, tmp_path, "bf16-sharded"))
    rng = np.random.default_rng(3)
    prompts = [rng.integers(0, TEXT["vocab_size"], n).tolist() for n in (1, 4, 9, 13)]
    schedule = parse_schedule({"engine": {"mode": mode, "max_num_seqs": 4, "max_num_batched_tokens": 8,
                                          "block_size": 4},
                               "requests": [{"id": f"r{i}", "prompt_ids": p, "max_tokens": 8, "ignore_eos": True,
                                             "arrival_step": i} for i, p in enumerate(prompts)]}, "test")
    engine, failure = run_batched(model, schedule, schedule.engine)
    assert failure is None
    batched = engine.outputs()
    for request, prompt in zip(schedule.requests, prompts):
        alone = run_alone(model, schedule.engine, request)
        want = generate(model, prompt, request.params, keep_logits=True)
        got = batched[request.id]
        if mode == "invariant":
            assert [s.logits.tobytes() for s in got.steps] == [s.logits.tobytes() for s in alone.steps]
        for g, w in zip(got.steps, want.steps):
            if g.token_id != w.token_id:
                break
            assert np.max(np.abs(g.logits - w.logits)) < 1e-3
