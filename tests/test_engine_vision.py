"""The engine's float32 vision tower (refengine/engine/vision.py) against the float64 reference tower
(refengine/vision_reference.vision_forward, itself held to transformers by test_parity_vl_images.py),
on the tiny Qwen3-VL and Qwen3-VL-MoE models transformers builds; and the property the engine is
written for: an image's features have the same bits whatever images are encoded beside it.

The bound. Every step of the tower is a float32 rounding of its float64 counterpart: products of at
most 64 terms (merged_dim), LayerNorms, exp, tanh, erf. A product of K terms rounded at each step errs
by about sqrt(K) units of 2**-24 relative to the magnitudes summed (6e-8 each, 5e-7 for K = 64); the
tower chains about ten of them (two blocks of four products, a merger's two), and the LayerNorms
rescale rather than amplify. So a few 1e-6 of the largest value is float32 noise, and REL = 1e-5
leaves room for it while formulas that are nearly right do not pass: the blocks' exact GELU in place
of its tanh approximation lands at 1.1e-4, attention scores scaled 1% off at 2.4e-3, deepstack
features in the wrong order at 1.4. Measured (numpy 2.4, OpenBLAS 0.3.31 SkylakeX): at most 3.6e-7
of the largest value over the cases below.
"""
from __future__ import annotations

import json
import time

import numpy as np
import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")
pytest.importorskip("PIL")

from test_parity import save_folder  # noqa: E402
from test_parity_vl_images import PREPROCESSOR, build_vl_images, build_vl_moe_images, image, write_tokenizer  # noqa: E402

from refengine.engine.vision import encode_images  # noqa: E402
from refengine.errors import RefengineError  # noqa: E402
from refengine.model import load_model  # noqa: E402
from refengine.model.image import preprocess_image  # noqa: E402
from refengine.vision_reference import vision_forward  # noqa: E402

pytestmark = pytest.mark.parity

REL = 1e-5
# A dense and a mixture-of-experts language model; other seeds, so that the two towers differ too
BUILD = {"vl-untied": lambda: build_vl_images(False, seed=1), "vl-moe": lambda: build_vl_moe_images(seed=2)}
KINDS = list(BUILD)
# Real images through the model's preprocessing (grids of 4 to 36 patches) ...
SIZES = [(16, 24), (40, 13), (70, 45), (8, 8), (9, 33)]
# ... and patch grids beyond what its max_pixels allows: one token (a one-row merger product), a
# 384-patch image, two frames (attention per frame)
GRIDS = [(1, 2, 2), (1, 16, 24), (2, 4, 6)]


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    out = {}
    for kind in KINDS:
        folder = save_folder(BUILD[kind](), tmp_path_factory.mktemp(kind), "f32-single")
        (folder / "preprocessor_config.json").write_text(json.dumps(PREPROCESSOR))
        write_tokenizer(folder)
        out[kind] = load_model(folder)
    return out


def random_pixels(grids, patch_dim: int, seed: int) -> np.ndarray:
    patches = sum(t * h * w for t, h, w in grids)
    return np.random.default_rng(seed).standard_normal((patches, patch_dim)).astype(np.float32).astype(np.float64)


def inputs(model):
    processed = [preprocess_image(image(h, w, seed=h * w), model.image_processor) for h, w in SIZES]
    grids = [p.grid_thw for p in processed] + GRIDS
    pixels = np.concatenate([p.pixel_values for p in processed]
                            + [random_pixels(GRIDS, model.vision_config.patch_dim, seed=7)])
    return pixels, grids


@pytest.mark.parametrize("kind", KINDS)
def test_float32_tower_matches_float64_reference(models, kind):
    model = models[kind]
    pixels, grids = inputs(model)
    start = time.perf_counter()
    embeds, deepstack = encode_images(model, pixels, grids)
    seconds = time.perf_counter() - start
    expected, expected_deepstack = vision_forward(model.vision_weights(np.float64), model.vision_config, pixels,
                                                  grids)
    tokens = sum(model.vision_config.image_tokens(g) for g in grids)
    assert embeds.dtype == np.float32 and embeds.shape == expected.shape == (tokens, 32)
    assert len(deepstack) == len(expected_deepstack) == 2
    for name, got, want in [("embeds", embeds, expected)] + [
            (f"deepstack[{i}]", d, e) for i, (d, e) in enumerate(zip(deepstack, expected_deepstack))]:
        assert got.dtype == np.float32 and got.shape == want.shape
        scale = float(np.max(np.abs(want)))
        rel = float(np.max(np.abs(got - want))) / scale
        print(f"\n{kind} {name}: max |float32 - float64| / max |float64| = {rel:.2e} (max {scale:.2f}); "
              f"{len(grids)} images encoded in {seconds:.3f} s")
        assert scale > 0.5 and rel <= REL, f"{kind} {name}: relative deviation {rel:.2e} > {REL}"


@pytest.mark.parametrize("kind", KINDS)
def test_an_image_has_the_same_bits_alone_and_beside_others(models, kind):
    """[A], [B], [C], then every pair in both orders and all three: each image's rows of the embeddings
    and of every deepstack feature are bit-identical to its rows encoded alone."""
    model = models[kind]
    patch_dim = model.vision_config.patch_dim
    grids = {"A": (1, 16, 24), "B": (1, 2, 2), "C": (1, 6, 10)}
    pixels = {name: random_pixels([g], patch_dim, seed=i) for i, (name, g) in enumerate(grids.items())}
    alone = {name: encode_images(model, pixels[name], [grids[name]]) for name in grids}
    for batch in ["AB", "BA", "AC", "CA", "BC", "CB", "ABC", "CBA", "BCA"]:
        embeds, deepstack = encode_images(model, np.concatenate([pixels[n] for n in batch]),
                                          [grids[n] for n in batch])
        at = 0
        for name in batch:
            rows = slice(at, at + model.vision_config.image_tokens(grids[name]))
            assert np.array_equal(embeds[rows], alone[name][0]), f"{name} in {batch}: embeddings differ"
            for level, feature in enumerate(deepstack):
                assert np.array_equal(feature[rows], alone[name][1][level]), f"{name} in {batch}: deepstack[{level}]"
            at = rows.stop
        assert at == len(embeds)


def test_no_images_and_bad_inputs(models):
    model = models["vl-untied"]
    embeds, deepstack = encode_images(model, np.zeros((0, 96)), [])
    assert embeds.shape == (0, 32) and [d.shape for d in deepstack] == [(0, 32), (0, 32)]
    with pytest.raises(RefengineError, match=r"grid_thws\[1\]: \[1, 3, 2\] is not a patch grid"):
        encode_images(model, np.zeros((10, 96)), [(1, 2, 2), (1, 3, 2)])
    with pytest.raises(RefengineError, match=r"pixel_values: shape \[5, 96\], expected \[4, 96\]"):
        encode_images(model, np.zeros((5, 96)), [(1, 2, 2)])
