"""The float64 reference against transformers itself, on random tiny models transformers builds.

transformers computes RMSNorm and the RoPE angles in float32 whatever the weight dtype, so the
test's copy of each transformers model gets float64 versions of exactly those two. Attention runs
through SDPA, which stays in the input dtype (eager attention would softmax in float32). Then both
sides are true float64 forwards and agree to ~1e-13, far inside the 1e-9 bound; the float32
RMSNorm + RoPE, or the float32 softmax, each move the logits by ~1e-6.
"""
from __future__ import annotations

import copy
import json
import types

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
from safetensors import safe_open  # noqa: E402
from tokenizers import Tokenizer, models, pre_tokenizers  # noqa: E402

from refengine.model import (
    load_config,  # noqa: E402
    load_model,  # noqa: E402
)
from refengine.reference import KVCache, forward, prompt_logits  # noqa: E402

pytestmark = pytest.mark.parity

PARITY_BOUND = 1e-9
PROMPT_LEN = 12

COMMON = dict(num_hidden_layers=2, max_position_embeddings=64, rms_norm_eps=1e-6)
VARIANTS = {
    "qwen3-untied-gqa": ("Qwen3", dict(
        vocab_size=96, hidden_size=48, intermediate_size=80, num_attention_heads=4, num_key_value_heads=2,
        head_dim=16, tie_word_embeddings=False, rope_theta=1000.0)),
    "qwen3-tied-gqa": ("Qwen3", dict(
        vocab_size=80, hidden_size=32, intermediate_size=64, num_attention_heads=6, num_key_value_heads=2,
        head_dim=8, tie_word_embeddings=True, rope_theta=300.0)),
    "qwen2-bias": ("Qwen2", dict(
        vocab_size=72, hidden_size=48, intermediate_size=96, num_attention_heads=4, num_key_value_heads=2,
        tie_word_embeddings=False, rope_theta=500.0)),
    "llama-gqa": ("Llama", dict(
        vocab_size=64, hidden_size=64, intermediate_size=96, num_attention_heads=4, num_key_value_heads=1,
        tie_word_embeddings=False, rope_theta=2000.0)),
    "llama-all-bias": ("Llama", dict(
        vocab_size=64, hidden_size=32, intermediate_size=48, num_attention_heads=4, num_key_value_heads=4,
        tie_word_embeddings=True, attention_bias=True, mlp_bias=True, rope_theta=10000.0)),
}
def hf_classes(family: str):
    """(config class, model class) of a family, looked up when a test needs them: the lookup imports
    transformers' modeling code, seconds that every pytest process would otherwise spend collecting
    this module, whatever -m selects."""
    return getattr(transformers, f"{family}Config"), getattr(transformers, f"{family}ForCausalLM")


STORAGES = ["f32-single", "f32-sharded", "bf16-single", "bf16-sharded", "f16-sharded"]
STORED = {"f32": "F32", "bf16": "BF16", "f16": "F16"}
TORCH_DTYPES = {"bf16": "bfloat16", "f16": "float16"}


def build_hf_model(variant: str, seed: int = 0):
    """A transformers model with weights large enough that every norm weight and bias matters."""
    family, kwargs = VARIANTS[variant]
    config_cls, model_cls = hf_classes(family)
    kwargs = dict(kwargs)
    theta = kwargs.pop("rope_theta")
    config = config_cls(**COMMON, **kwargs, rope_parameters={"rope_type": "default", "rope_theta": theta})
    torch.manual_seed(seed)
    model = model_cls(config).to(torch.float32)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1.0 + 0.4 * torch.randn_like(p))
            else:
                p.normal_(0.0, 0.3)
    return model


def write_tokenizer(folder, vocab_size: int) -> None:
    """refengine's Model needs a loadable tokenizer.json; these tests only use ids."""
    tok = Tokenizer(models.WordLevel({f"w{i}": i for i in range(vocab_size)}, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(folder / "tokenizer.json"))


def save_folder(hf_model, folder, storage: str):
    dtype, layout = storage.split("-")
    to_save = copy.deepcopy(hf_model).to(getattr(torch, TORCH_DTYPES[dtype])) if dtype in TORCH_DTYPES else hf_model
    to_save.save_pretrained(folder, max_shard_size="12KB" if layout == "sharded" else "1GB")
    write_tokenizer(folder, hf_model.config.get_text_config().vocab_size)  # a VL config nests it
    shards = sorted(folder.glob("*.safetensors"))
    assert stored_dtypes(shards) == {STORED[dtype]}
    if layout == "sharded":
        assert (folder / "model.safetensors.index.json").exists() and len(shards) > 1
    else:
        assert [p.name for p in shards] == ["model.safetensors"]
    return folder


def hf_head_dim(config) -> int:
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


def stored_dtypes(files) -> set[str]:
    found = set()
    for path in files:
        with safe_open(path, framework="pt") as f:
            found |= {f.get_slice(name).get_dtype() for name in f.keys()}
    return found


def _rms_norm_f64(self, hidden_states):
    x = hidden_states.to(torch.float64)
    return self.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.variance_epsilon))


def _rotary_f64(self, x, position_ids):
    angles = position_ids[..., None].to(torch.float64) * self.inv_freq
    emb = torch.cat((angles, angles), dim=-1)
    return emb.cos().to(x.dtype), emb.sin().to(x.dtype)


def hf_float64(folder, variant: str):
    """transformers' own load of the saved files, widened exactly to float64, made float64 throughout."""
    _, model_cls = hf_classes(VARIANTS[variant][0])
    model = model_cls.from_pretrained(folder, dtype="auto", attn_implementation="sdpa").to(torch.float64).eval()
    for module in model.modules():
        if type(module).__name__.endswith("RMSNorm"):
            module.forward = types.MethodType(_rms_norm_f64, module)
    rotary = model.model.rotary_emb
    head_dim = hf_head_dim(model.config)
    theta = model.config.rope_parameters["rope_theta"]
    rotary.inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
    rotary.forward = types.MethodType(_rotary_f64, rotary)
    return model


def hf_logits(model, ids) -> np.ndarray:
    with torch.no_grad():
        out = model(input_ids=torch.tensor([ids]), use_cache=False).logits[0]
    assert out.dtype == torch.float64
    return out.numpy()


def random_prompt(vocab_size: int, seed: int) -> list[int]:
    return np.random.default_rng(seed).integers(0, vocab_size, PROMPT_LEN).tolist()


@pytest.fixture(scope="module", params=list(VARIANTS))
def variant(request):
    return request.param


@pytest.fixture(scope="module")
def hf_model(variant):
    return build_hf_model(variant)


@pytest.mark.parametrize("storage", STORAGES)
def test_reference_matches_transformers_float64(hf_model, variant, storage, tmp_path):
    folder = save_folder(hf_model, tmp_path, storage)
    ids = random_prompt(hf_model.config.vocab_size, seed=len(variant) + len(storage))
    expected = hf_logits(hf_float64(folder, variant), ids)
    got = prompt_logits(load_model(folder), ids)
    assert got.dtype == np.float64 and got.shape == expected.shape == (PROMPT_LEN, hf_model.config.vocab_size)
    # A near-constant output would make any bound meaningless.
    assert expected.std() > 0.5 and len(set(expected.argmax(-1).tolist())) > 1
    diff = float(np.max(np.abs(got - expected)))
    print(f"\nparity {variant} {storage}: max |refengine - transformers| = {diff:.3e}")
    assert diff <= PARITY_BOUND, f"{variant} {storage}: max abs diff {diff:.3e} > {PARITY_BOUND}"


def test_refengine_reads_the_config_transformers_wrote(hf_model, variant, tmp_path):
    folder = save_folder(hf_model, tmp_path, "f32-single")
    hf_cfg = hf_model.config
    cfg = load_config(folder)
    assert cfg.arch == {"Qwen3Config": "qwen3", "Qwen2Config": "qwen2", "LlamaConfig": "llama"}[type(hf_cfg).__name__]
    assert (cfg.vocab_size, cfg.hidden_size, cfg.num_layers, cfg.intermediate_size) == (
        hf_cfg.vocab_size, hf_cfg.hidden_size, hf_cfg.num_hidden_layers, hf_cfg.intermediate_size)
    assert (cfg.num_heads, cfg.num_kv_heads, cfg.head_dim) == (
        hf_cfg.num_attention_heads, hf_cfg.num_key_value_heads, hf_head_dim(hf_cfg))
    assert cfg.rope_theta == hf_cfg.rope_parameters["rope_theta"]
    assert cfg.tie_word_embeddings == hf_cfg.tie_word_embeddings
    assert cfg.num_parameters == sum(p.numel() for p in hf_model.parameters())


def test_incremental_decode_equals_full_prompt(hf_model, variant, tmp_path):
    model = load_model(save_folder(hf_model, tmp_path, "f32-single"))
    ids = random_prompt(model.config.vocab_size, seed=7)
    full = prompt_logits(model, ids)
    weights = model.weights(np.float64)

    one_by_one = KVCache()
    stepwise = np.concatenate([forward(weights, model.config, [i], one_by_one) for i in ids])
    assert one_by_one.length == len(ids)
    np.testing.assert_allclose(stepwise, full, rtol=0, atol=1e-12)

    chunked = KVCache()
    prefill_then_steps = np.concatenate(
        [forward(weights, model.config, ids[:5], chunked)] + [forward(weights, model.config, [i], chunked) for i in ids[5:]])
    np.testing.assert_allclose(prefill_then_steps, full, rtol=0, atol=1e-12)


def test_old_style_rope_theta_is_read_identically(tmp_path):
    hf_model = build_hf_model("qwen3-untied-gqa", seed=3)
    new_style = save_folder(hf_model, tmp_path / "new", "f32-single")
    old_style = save_folder(hf_model, tmp_path / "old", "f32-single")
    config_path = old_style / "config.json"
    raw = json.loads(config_path.read_text())
    theta = raw.pop("rope_parameters")["rope_theta"]
    assert theta != 10000.0  # a theta equal to the default would not show it being read
    raw["rope_theta"] = theta
    config_path.write_text(json.dumps(raw))

    assert load_config(old_style) == load_config(new_style)
    ids = random_prompt(raw["vocab_size"], seed=11)
    np.testing.assert_array_equal(prompt_logits(load_model(old_style), ids), prompt_logits(load_model(new_style), ids))
    old_style_hf = hf_logits(hf_float64(old_style, "qwen3-untied-gqa"), ids)
    assert np.max(np.abs(prompt_logits(load_model(old_style), ids) - old_style_hf)) <= PARITY_BOUND
