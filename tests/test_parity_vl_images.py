"""Qwen3-VL and Qwen3-VL-MoE prompts with images: refengine's float64 vision tower and language model
(refengine/vision_reference.py) against transformers' own forward with pixel_values and image_grid_thw,
on tiny random models transformers builds and saves; the image preprocessing against transformers'
PIL image processor; the multimodal RoPE positions against its get_rope_index.

Besides what tests/test_parity_moe_vl.py promotes to float64 (RMSNorm, text RoPE, router softmax),
transformers keeps three things of the vision tower in float32 for float64 weights: the bilinear
weights resizing the learned position grid, the 2-D rotary angles, and the rotation itself
(apply_rotary_pos_emb_vision casts q and k to float32). The test's copy computes those in float64;
then both sides are float64 forwards and agree far inside PARITY_BOUND.
"""
from __future__ import annotations

import json
import shutil
import sys
import types

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
pytest.importorskip("PIL")

from safetensors.numpy import load_file, save_file  # noqa: E402
from test_parity import PARITY_BOUND, save_folder  # noqa: E402
from test_parity_moe_vl import MOE, MROPE, TEXT, hf_float64, randomize  # noqa: E402
from tokenizers import AddedToken, Tokenizer, models, pre_tokenizers  # noqa: E402
from transformers import vision_utils  # noqa: E402
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import (
    Qwen2VLImageProcessorPil,  # noqa: E402
)
from transformers.models.qwen3_vl import modeling_qwen3_vl  # noqa: E402
from transformers.models.qwen3_vl_moe import modeling_qwen3_vl_moe  # noqa: E402

from refengine.check.images import generated_image as image  # noqa: E402
from refengine.errors import RefengineError  # noqa: E402
from refengine.model import load_model  # noqa: E402
from refengine.model.image import ImageProcessorConfig, preprocess_image  # noqa: E402
from refengine.model.tokenizer import Tokenizer as RefTokenizer  # noqa: E402
from refengine.reference import prompt_logits  # noqa: E402
from refengine.vision_reference import (  # noqa: E402
    mrope_delta,
    mrope_positions,
    prompt_logits_with_images,
    prompt_logits_with_pixels,
)

pytestmark = pytest.mark.parity

# Two blocks, deepstack after both (listed out of order: features follow the blocks), a 3x3 learned
# position grid that every image grid is resized from (up and down), head_dim 8 (two frequencies per axis).
VISION = dict(depth=2, hidden_size=16, intermediate_size=32, num_heads=2, out_hidden_size=32, patch_size=4,
              spatial_merge_size=2, temporal_patch_size=2, num_position_embeddings=9, deepstack_visual_indexes=[1, 0])
TOKENS = dict(image_token_id=70, video_token_id=71, vision_start_token_id=72, vision_end_token_id=73)
IMAGE, START, END = TOKENS["image_token_id"], TOKENS["vision_start_token_id"], TOKENS["vision_end_token_id"]
# patch 4 * merge 2: sides multiple of 8, areas 64 to 24 * 24 (tiny images stay tiny, big ones shrink)
PREPROCESSOR = {"patch_size": 4, "temporal_patch_size": 2, "merge_size": 2, "min_pixels": 64, "max_pixels": 576,
                "image_mean": [0.5, 0.4, 0.3], "image_std": [0.2, 0.25, 0.3]}
SPECIALS = {70: "<|image_pad|>", 71: "<|video_pad|>", 72: "<|vision_start|>", 73: "<|vision_end|>",
            74: "<|im_start|>", 75: "<|im_end|>"}
# The image branch of Qwen3-VL's own chat template, around ChatML
TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message.role }}\n"
    "{% if message.content is string %}{{ message.content }}{% else %}{% for part in message.content %}"
    "{% if part.type == 'image' %}<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif part.type == 'text' %}{{ part.text }}{% endif %}{% endfor %}{% endif %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def build_vl_images(tie: bool, seed: int = 0):
    config = transformers.Qwen3VLConfig(text_config=dict(**TEXT, num_hidden_layers=2, rope_parameters=MROPE),
                                        vision_config=VISION, tie_word_embeddings=tie, **TOKENS)
    return randomize(transformers.Qwen3VLForConditionalGeneration(config).to(torch.float32), seed)


def build_vl_moe_images(seed: int = 0):
    text = dict(**TEXT, **MOE["moe-e4k2-norm-mlp-only"], rope_parameters=MROPE)
    del text["norm_topk_prob"]
    config = transformers.Qwen3VLMoeConfig(text_config=text, vision_config=VISION, tie_word_embeddings=False,
                                           **TOKENS)
    return randomize(transformers.Qwen3VLMoeForConditionalGeneration(config).to(torch.float32), seed)


BUILDERS = {"vl-untied": (lambda: build_vl_images(False), transformers.Qwen3VLForConditionalGeneration),
            "vl-tied": (lambda: build_vl_images(True), transformers.Qwen3VLForConditionalGeneration),
            "vl-moe": (build_vl_moe_images, transformers.Qwen3VLMoeForConditionalGeneration)}


def write_tokenizer(folder) -> None:
    """Word-level ids w0.. with Qwen3-VL's special tokens at the config's ids, and a template that renders
    image parts as Qwen3-VL's does."""
    vocab = {SPECIALS.get(i, f"w{i}"): i for i in range(TEXT["vocab_size"])}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.add_special_tokens([AddedToken(t, special=True) for t in SPECIALS.values()])
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({"chat_template": TEMPLATE}))


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """Each tiny model saved once (f32 single file; bf16 sharded for the untied one), with its
    preprocessor_config.json and tokenizer."""
    out = {}
    for name, (build, _) in BUILDERS.items():
        for storage in ["f32-single"] + (["bf16-sharded"] if name == "vl-untied" else []):
            folder = save_folder(build(), tmp_path_factory.mktemp(f"{name}-{storage}"), storage)
            (folder / "preprocessor_config.json").write_text(json.dumps(PREPROCESSOR))
            write_tokenizer(folder)
            out[name, storage] = folder
    return out


def _axis_taps_f64(index, size, side, mode, align_corners, padding="border"):
    """transformers' bilinear taps (vision_utils._interpolation_axis_taps_weights, corners aligned) with
    the source coordinate in float64 instead of float32."""
    assert (mode, align_corners, padding) == ("bilinear", True, "border")
    src = index.to(torch.float64) * (side - 1) / torch.clamp(size - 1, min=1)
    floor = torch.floor(src)
    offsets = torch.arange(0, 2)
    taps = (floor.long()[:, None] + offsets).clamp(0, side - 1)
    return taps, (1 - (src[:, None] - floor[:, None] - offsets).abs()).clamp(min=0)


def _vision_rotary_f64(self, x, position_ids):
    freqs = position_ids[..., None].to(torch.float64) * self.inv_freq
    return self.recomposition_frequencies(freqs.cos()), self.recomposition_frequencies(freqs.sin())


def _rotary_vision_f64(q, k, cos, sin):
    rotate = modeling_qwen3_vl.rotate_half
    cos, sin = cos.unsqueeze(-2), sin.unsqueeze(-2)
    return q * cos + rotate(q) * sin, k * cos + rotate(k) * sin


@pytest.fixture
def float64_vision(monkeypatch):
    for module in (modeling_qwen3_vl, modeling_qwen3_vl_moe):
        monkeypatch.setattr(module, "apply_rotary_pos_emb_vision", _rotary_vision_f64)
    monkeypatch.setattr(vision_utils, "_interpolation_axis_taps_weights", _axis_taps_f64)


def hf_vision_float64(folder, model_cls):
    model = hf_float64(folder, model_cls)
    rotary, vision = model.model.visual.rotary_pos_emb, model.config.vision_config
    quarter = vision.hidden_size // vision.num_heads // 2
    rotary.inv_freq = 1.0 / 10000.0 ** (torch.arange(0, quarter, 2, dtype=torch.float64) / quarter)
    rotary.forward = types.MethodType(_vision_rotary_f64, rotary)
    return model


def hf_processed(processor, images, tensors: str):
    """transformers' processing of uint8 [height, width, 3] arrays (channels last said explicitly: it
    guesses from the shape, and takes a 3-row image for channels first)."""
    return processor(images=images, return_tensors=tensors, input_data_format="channels_last")


def prompt(pieces, grids, seed: int) -> list[int]:
    """Text runs (their lengths) and images in turn: each image <|vision_start|> pads <|vision_end|>."""
    rng, ids, grids = np.random.default_rng(seed), [], iter(grids)
    for piece in pieces:
        if piece == "image":
            t, h, w = next(grids)
            ids += [START] + [IMAGE] * (t * h * w // 4) + [END]
        else:
            ids += rng.integers(0, IMAGE, piece).tolist()
    return ids


CASES = {  # name -> (prompt pieces, image sizes (height, width))
    "one-image-text-around": ([3, "image", 4], [(16, 24)]),
    "one-image-first-tall": (["image", 5], [(40, 13)]),
    "two-images": ([2, "image", 3, "image", 2], [(70, 45), (8, 8)]),
    "two-images-adjacent-last": ([4, "image", "image"], [(9, 33), (24, 16)]),
}


def check_images(folders, kind: str, storage: str, case: str) -> float:
    folder = folders[kind, storage]
    pieces, sizes = CASES[case]
    images = [image(h, w, seed=h * w) for h, w in sizes]
    processed = hf_processed(Qwen2VLImageProcessorPil.from_pretrained(folder), images, "pt")
    grids = processed["image_grid_thw"].tolist()
    ids = prompt(pieces, grids, seed=len(case))
    hf = hf_vision_float64(folder, BUILDERS[kind][1])
    with torch.no_grad():
        expected = hf(input_ids=torch.tensor([ids]), pixel_values=processed["pixel_values"],
                      image_grid_thw=processed["image_grid_thw"],
                      mm_token_type_ids=(torch.tensor([ids]) == IMAGE).int(), use_cache=False).logits[0].numpy()
    model = load_model(folder)
    got = prompt_logits_with_images(model, ids, images)
    assert got.shape == expected.shape == (len(ids), TEXT["vocab_size"])
    # the images matter: the same ids with the pad rows left as token embeddings give other logits
    text_only = prompt_logits(model, ids)
    assert np.max(np.abs(text_only - expected)) > 1e-2 and expected.std() > 0.5
    diff = float(np.max(np.abs(got - expected)))
    print(f"\nparity {kind} {storage} {case} grids={grids}: max |refengine - transformers| = {diff:.3e}")
    assert diff <= PARITY_BOUND, f"{kind} {storage} {case}: max abs diff {diff:.3e} > {PARITY_BOUND}"
    return diff


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("kind", list(BUILDERS))
def test_logits_with_images_match_transformers_float64(folders, float64_vision, kind, case):
    check_images(folders, kind, "f32-single", case)


def test_bf16_sharded_checkpoint_with_images(folders, float64_vision):
    check_images(folders, "vl-untied", "bf16-sharded", "two-images")


def test_text_only_prompt_is_unchanged_and_needs_no_tower(folders, tmp_path):
    """Without images the multimodal path is today's text path, bit for bit; and a text-only request
    never reads the tower (here: deleted from the checkpoint)."""
    model = load_model(folders["vl-untied", "f32-single"])
    ids = prompt([9], [], seed=1)
    np.testing.assert_array_equal(prompt_logits_with_images(model, ids, []), prompt_logits(model, ids))
    folder = shutil.copytree(folders["vl-untied", "f32-single"], tmp_path / "no-tower")
    tensors = {n: t for n, t in load_file(folder / "model.safetensors").items() if not n.startswith("model.visual.")}
    save_file(tensors, folder / "model.safetensors")
    np.testing.assert_array_equal(prompt_logits(load_model(folder), ids), prompt_logits(model, ids))


@pytest.mark.parametrize("size", [(8, 8), (8, 16), (16, 8), (13, 9), (7, 70), (70, 45), (45, 70), (33, 33),
                                  (24, 24), (3, 5), (64, 9)])
def test_preprocessing_equals_transformers_pil_processor(folders, size):
    folder = folders["vl-untied", "f32-single"]
    img = image(*size, seed=size[0] + 100 * size[1])
    expected = hf_processed(Qwen2VLImageProcessorPil.from_pretrained(folder), [img], "np")
    got = preprocess_image(img, load_model(folder).image_processor)
    assert [list(got.grid_thw)] == expected["image_grid_thw"].tolist()
    np.testing.assert_array_equal(got.pixel_values, expected["pixel_values"])


def test_preprocessing_defaults_are_transformers_defaults():
    """A preprocessor_config.json with only the sizes: transformers' class defaults for the rest (CLIP
    mean and std, 56*56 to 28*28*1280 pixels, so a small image grows)."""
    sizes = dict(patch_size=14, temporal_patch_size=2, merge_size=2)
    img = image(30, 50, seed=3)
    expected = hf_processed(Qwen2VLImageProcessorPil(**sizes), [img], "np")
    got = preprocess_image(img, ImageProcessorConfig(**sizes))
    assert [list(got.grid_thw)] == expected["image_grid_thw"].tolist()
    np.testing.assert_array_equal(got.pixel_values, expected["pixel_values"])


@pytest.mark.parametrize("pieces, grids", [
    ([3, "image", 4], [(1, 4, 6)]),
    (["image", 2, "image"], [(1, 8, 2), (1, 2, 2)]),
    ([1, "image", "image", 5], [(1, 6, 4), (1, 2, 10)]),
    ([6], []),
])
def test_mrope_positions_equal_get_rope_index(folders, pieces, grids):
    model = load_model(folders["vl-untied", "f32-single"])
    ids = prompt(pieces, grids, seed=5)
    hf = transformers.Qwen3VLModel(transformers.Qwen3VLConfig(
        text_config=dict(**TEXT, num_hidden_layers=1, rope_parameters=MROPE), vision_config=VISION, **TOKENS))
    tensor = torch.tensor([ids])
    expected, delta = hf.get_rope_index(tensor, (tensor == IMAGE).int(),
                                        image_grid_thw=torch.tensor(grids) if grids else None)
    got = mrope_positions(ids, grids, model.vision_config)
    np.testing.assert_array_equal(got, expected[:, 0].numpy())
    assert mrope_delta(got) == int(delta)


def test_image_tokens_must_match_the_images(folders):
    model = load_model(folders["vl-untied", "f32-single"])
    v = model.vision_config
    ids = prompt([2, "image", 2], [(1, 4, 4)], seed=0)
    with pytest.raises(RefengineError, match=r"1 runs of image tokens \(id 70\) for 2 images"):
        mrope_positions(ids, [(1, 4, 4), (1, 4, 4)], v)
    with pytest.raises(RefengineError, match=r"image tokens at 3 are 4, its image of grid \[1, 4, 6\] needs 6"):
        mrope_positions(ids, [(1, 4, 6)], v)


def test_chat_template_expands_image_placeholders(folders):
    """A message with image parts renders through the model's template as <|vision_start|><|image_pad|>
    <|vision_end|>, each pad then widened to its image's t*h*w / merge**2 tokens, as the processor does."""
    folder = folders["vl-untied", "f32-single"]
    model = load_model(folder)
    tok = RefTokenizer(folder)
    images = [image(16, 24, seed=1), image(40, 13, seed=2)]
    grids = [preprocess_image(img, model.image_processor).grid_thw for img in images]
    counts = [model.vision_config.image_tokens(g) for g in grids]
    assert counts == [6, 5]
    messages = [{"role": "user", "content": [{"type": "text", "text": "w1 w2"}, {"type": "image"},
                                             {"type": "text", "text": "w3"}, {"type": "image"}]}]
    ids = tok.encode_chat_with_images(messages, counts)
    user = assistant = 0  # words outside this vocabulary: its unknown id
    assert ids == ([74, user, 1, 2, START] + [IMAGE] * counts[0] + [END, 3, START] + [IMAGE] * counts[1]
                   + [END, 75, 74, assistant])
    logits = prompt_logits_with_images(model, ids, images)  # the ids the tower's tokens fit
    assert logits.shape == (len(ids), TEXT["vocab_size"])
    with pytest.raises(RefengineError, match=r"wrote 2 image placeholders \(<\|image_pad\|>\) for 1 images"):
        tok.encode_chat_with_images(messages, counts[:1])
    with pytest.raises(RefengineError, match=r"messages\[0\]\.content\[0\]: expected a text part"):
        tok.encode_chat_with_images([{"role": "user", "content": [{"type": "audio"}]}], [])


def _broken(folder, tmp_path, edit):
    broken = shutil.copytree(folder, tmp_path / "broken")
    tensors = load_file(broken / "model.safetensors")
    edit(tensors)
    save_file(tensors, broken / "model.safetensors")
    return load_model(broken)  # loads: only an image asks for the tower


@pytest.mark.parametrize("edit, message", [
    (lambda t: t.pop("model.visual.blocks.1.attn.qkv.weight"),
     r"missing tensor model\.visual\.blocks\.1\.attn\.qkv\.weight \[48, 16\]"),
    (lambda t: t.update({"model.visual.pos_embed.weight": np.zeros((16, 16), np.float32)}),
     r"tensor model\.visual\.pos_embed\.weight has shape \[16, 16\], expected \[9, 16\]"),
    (lambda t: t.update({"model.visual.deepstack_merger_list.2.norm.weight": np.zeros((64,), np.float32)}),
     r"unexpected tensor model\.visual\.deepstack_merger_list\.2\.norm\.weight \[64\]"),
])
def test_vision_tensor_errors_name_the_tensor(folders, tmp_path, edit, message):
    model = _broken(folders["vl-untied", "f32-single"], tmp_path, edit)
    ids = prompt([2, "image", 1], [(1, 2, 2)], seed=0)
    assert prompt_logits(model, ids).shape == (len(ids), TEXT["vocab_size"])  # text still runs
    with pytest.raises(RefengineError, match=message):
        prompt_logits_with_images(model, ids, [image(8, 8, seed=0)])


def test_vision_config_errors_name_the_field(folders, tmp_path):
    folder = shutil.copytree(folders["vl-untied", "f32-single"], tmp_path / "bad-config")
    config = json.loads((folder / "config.json").read_text())
    config["vision_config"]["out_hidden_size"] = 48
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(RefengineError, match=r"out_hidden_size=48 must equal text_config\.hidden_size=32"):
        prompt_logits_with_pixels(load_model(folder), [IMAGE], np.zeros((4, 96)), [(1, 2, 2)])


def test_images_without_pillow_name_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "PIL", None)  # as if Pillow were not installed
    with pytest.raises(RefengineError, match=r"images need Pillow: pip install 'refengine\[vision\]'"):
        preprocess_image(image(8, 8, seed=0), ImageProcessorConfig(patch_size=4, temporal_patch_size=2, merge_size=2))


def test_make_tiny_qwen3_vl_is_the_model_transformers_runs(tmp_path, float64_vision):
    """`make-tiny --arch qwen3_vl` writes a folder transformers loads as Qwen3-VL: its float64 logits on a
    chat with two images (its own template's placeholders, its own preprocessor config) are refengine's,
    and the images move them."""
    from refengine.model.tiny import TinySpec, make_tiny
    folder = make_tiny(tmp_path / "vl", TinySpec(arch="qwen3_vl", layers=2, vocab=320), seed=2)
    model = load_model(folder)
    images = [image(20, 28, seed=1), image(33, 9, seed=2)]
    processed = hf_processed(Qwen2VLImageProcessorPil.from_pretrained(folder), images, "pt")
    grids = processed["image_grid_thw"].tolist()
    messages = [{"role": "user", "content": [{"type": "text", "text": "Look"}, {"type": "image"},
                                             {"type": "text", "text": " and"}, {"type": "image"}]}]
    ids = model.tokenizer.encode_chat_with_images(messages, [model.vision_config.image_tokens(g) for g in grids])
    image_id = model.vision_config.image_token_id
    hf = hf_vision_float64(folder, transformers.Qwen3VLForConditionalGeneration)
    with torch.no_grad():
        expected = hf(input_ids=torch.tensor([ids]), pixel_values=processed["pixel_values"],
                      image_grid_thw=processed["image_grid_thw"],
                      mm_token_type_ids=(torch.tensor([ids]) == image_id).int(), use_cache=False).logits[0].numpy()
    got = prompt_logits_with_images(model, ids, images)
    assert np.max(np.abs(prompt_logits(model, ids) - expected)) > 1e-2 and expected.std() > 0.5
    assert float(np.max(np.abs(got - expected))) <= PARITY_BOUND
