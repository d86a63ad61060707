"""Requests with images in the engine's batch (Qwen3-VL, engine/multimodal.py), on the tiny Qwen3-VL and
Qwen3-VL-MoE models transformers builds (tests/test_parity_vl_images.py):

- in invariant mode a request with images gets the same token ids and logits bits batched with text
  and other image requests, its prefill chunked through its images, as alone;
- its float32 logits agree with the float64 reference's (vision_reference.prompt_logits_with_pixels)
  within float32 noise;
- a prefix-cache hit needs the same images before the block, not only the same tokens;
- a preempted request with images resumes to the same answer.
"""
from __future__ import annotations

import json

import numpy as np
import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")
pytest.importorskip("PIL")

from test_parity import save_folder  # noqa: E402
from test_parity_vl_images import (  # noqa: E402
    END,
    IMAGE,
    PREPROCESSOR,
    START,
    build_vl_images,
    build_vl_moe_images,
    image,
    write_tokenizer,
)

from refengine.engine import EngineConfig, LLMEngine  # noqa: E402
from refengine.errors import RefengineError  # noqa: E402
from refengine.model import load_model  # noqa: E402
from refengine.model.image import preprocess_image  # noqa: E402
from refengine.sampling import SamplingParams  # noqa: E402
from refengine.vision_reference import prompt_logits_with_pixels  # noqa: E402

pytestmark = pytest.mark.parity

SIZES = {"wide": (13, 30), "square": (20, 20), "tall": (40, 9)}


@pytest.fixture(scope="module", params=["vl", "vl-moe"])
def model(request, tmp_path_factory):
    build = (lambda: build_vl_images(False, seed=3)) if request.param == "vl" else (lambda: build_vl_moe_images(seed=3))
    folder = save_folder(build(), tmp_path_factory.mktemp(request.param), "f32-single")
    (folder / "preprocessor_config.json").write_text(json.dumps(PREPROCESSOR))
    write_tokenizer(folder)
    return load_model(folder)


def prompt_with(model, pieces: list, images: dict) -> list[int]:
    """Token ids of `pieces`: ints are text tokens, a str names an image of SIZES, placed as
    <|vision_start|> + its tokens + <|vision_end|>."""
    ids = []
    for piece in pieces:
        if isinstance(piece, str):
            grid = preprocess_image(images[piece], model.image_processor).grid_thw
            ids += [START] + [IMAGE] * model.vision_config.image_tokens(grid) + [END]
        else:
            ids.append(piece)
    return ids


def requests(model):
    images = {name: image(h, w, seed=n) for n, (name, (h, w)) in enumerate(SIZES.items())}
    greedy = SamplingParams(max_tokens=6, ignore_eos=True)
    sampled = SamplingParams(max_tokens=6, ignore_eos=True, temperature=1.0, seed=7)
    return {
        "text": ([5, 9, 12, 3], [], greedy),
        "one": ([5, 6, "wide", 7, 8], ["wide"], greedy),
        "two": ([4, "square", 11, "tall", 9], ["square", "tall"], sampled),
    }, images


def run(model, chosen, mode="invariant", **config):
    cases, images = requests(model)
    engine = LLMEngine(model, EngineConfig(mode=mode, max_num_seqs=4, max_model_len=64, **config), keep_logits=True)
    for rid in chosen:
        pieces, names, params = cases[rid]
        engine.add_request(rid, prompt_with(model, pieces, images), params=params,
                           images=[images[n] for n in names] or None)
    return engine.run(), engine


def test_a_request_with_images_is_bit_identical_batched_and_alone(model):
    """Budget 5 cuts the image requests' prompts inside their images; block size 2 with the batch's
    requests crossing blocks together."""
    together, engine = run(model, ["text", "one", "two"], max_num_batched_tokens=5, block_size=2)
    assert any(len(c) > 1 for c in (t["scheduled"] for t in engine.trace))
    assert engine.status()["images_encoded"] == 3  # once per request, through chunks cut inside them
    for rid in together:
        alone, _ = run(model, [rid], max_num_batched_tokens=64, block_size=16)
        assert together[rid].token_ids == alone[rid].token_ids
        for a, b in zip(together[rid].steps, alone[rid].steps):
            assert np.array_equal(a.logits, b.logits), rid


def test_float32_logits_agree_with_the_float64_reference(model):
    """The first token's logits row, engine (fast and invariant) against the float64 reference on the
    same pixels: within 1e-5 of the row's spread (float32 roundings through the tower's two blocks and
    the model's two layers, each of a few dozen terms: a few 1e-7 of the spread); the images move the
    row far more than that."""
    cases, images = requests(model)
    for rid in ("one", "two"):
        pieces, names, _ = cases[rid]
        ids = prompt_with(model, pieces, images)
        processed = [preprocess_image(images[n], model.image_processor) for n in names]
        want = prompt_logits_with_pixels(model, ids, np.concatenate([p.pixel_values for p in processed]),
                                         [p.grid_thw for p in processed])[-1]
        without = prompt_logits_with_pixels(model, [i if i != IMAGE else 5 for i in ids], None, [])[-1]
        for mode in ("fast", "invariant"):
            got = run(model, [rid], mode=mode)[0][rid].steps[0].logits
            spread = float(np.ptp(want))
            assert np.max(np.abs(got - want)) <= 1e-5 * spread, (rid, mode)
            assert np.max(np.abs(without - want)) > 1e-2 * spread


def test_a_cache_hit_needs_the_same_images(model):
    cases, images = requests(model)
    ids = prompt_with(model, [5, 6, "square", 7, 8, 9, 10, 11], images)
    engine = LLMEngine(model, EngineConfig(max_num_seqs=4, max_model_len=64, block_size=2, enable_prefix_caching=True))
    params = SamplingParams(max_tokens=2, ignore_eos=True)
    engine.add_request("first", ids, params=params, images=[images["square"]])
    engine.run()
    other = image(20, 20, seed=99)
    engine.add_request("other-image", ids, params=params, images=[other])
    engine.add_request("same-image", ids, params=params, images=[images["square"].copy()])
    engine.run()
    assert engine.output("other-image").num_cached_tokens == 0
    assert engine.output("same-image").num_cached_tokens > len(ids) // 2


def test_a_preempted_request_with_images_resumes_to_its_answer(model):
    """One-token blocks for both prompts and 3 tokens more: as they grow, the later one is preempted and
    recomputes through its images (features kept from its first prefill)."""
    cases, images = requests(model)
    prompts = sum(len(prompt_with(model, cases[rid][0], images)) for rid in ("one", "two"))
    together, engine = run(model, ["one", "two"], max_num_batched_tokens=64, block_size=1, num_blocks=prompts + 3)
    assert sum(len(t["preempted"]) for t in engine.trace) > 0
    for rid in together:
        assert together[rid].token_ids == run(model, [rid])[0][rid].token_ids


def test_a_chat_with_image_parts_is_the_prompt_its_template_writes(model):
    """messages with image parts and the images in their order: the template's placeholders widened to
    each image's tokens, the same request as those ids given directly."""
    _, images = requests(model)
    messages = [{"role": "user", "content": [{"type": "text", "text": "w5 w6"}, {"type": "image"},
                                             {"type": "text", "text": "w7"}, {"type": "image"}]}]
    chosen = [images["wide"], images["tall"]]
    engine = LLMEngine(model, EngineConfig(max_num_seqs=4, max_model_len=64), keep_logits=True)
    params = SamplingParams(max_tokens=3, ignore_eos=True)
    engine.add_request("chat", messages=messages, images=chosen, params=params)
    ids = model.tokenizer.encode_chat_with_images(
        messages, [model.vision_config.image_tokens(preprocess_image(i, model.image_processor).grid_thw)
                   for i in chosen])
    assert ids.count(IMAGE) > 2 and ids.count(START) == 2
    engine.add_request("ids", ids, images=chosen, params=params)
    out = engine.run()
    assert out["chat"].token_ids == out["ids"].token_ids
    assert all(np.array_equal(a.logits, b.logits) for a, b in zip(out["chat"].steps, out["ids"].steps))


def test_images_that_do_not_fit_the_prompt_are_refused_by_request(model):
    cases, images = requests(model)
    engine = LLMEngine(model, EngineConfig(max_num_seqs=4, max_model_len=64))
    ids = prompt_with(model, [5, "wide", 6], images)
    with pytest.raises(RefengineError, match="^request 'r': .*2 images"):
        engine.add_request("r", ids, images=[images["wide"], images["tall"]])
    engine.add_request("ok", ids, images=[images["wide"]], params=SamplingParams(max_tokens=2))
    assert engine.run()["ok"].finish_reason == "length"


def data_url(pixels: np.ndarray) -> str:
    import base64
    import io

    from PIL import Image
    buffer = io.BytesIO()
    Image.fromarray(pixels).save(buffer, "PNG")
    return "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()


def test_the_server_answers_a_chat_with_image_parts_as_the_engine_does(model):
    """OpenAI image_url parts with PNG data URLs, on 127.0.0.1: the answer is the engine's for the same
    messages and pixels; a remote URL is a 400 naming the part, never fetched, and the server goes on."""
    from test_server import call, start_server
    _, images = requests(model)
    parts = [{"type": "text", "text": "w5 w6"}, {"type": "image_url", "image_url": {"url": data_url(images["wide"])}},
             {"type": "text", "text": "w7"}, {"type": "image_url", "image_url": {"url": data_url(images["tall"])}}]
    messages = [{"role": "user", "content": parts}]
    engine = LLMEngine(model, EngineConfig(mode="invariant", max_num_seqs=4, max_model_len=64))
    plain = [{"role": "user", "content": [p if p["type"] == "text" else {"type": "image"} for p in parts]}]
    engine.add_request("want", messages=plain, images=[images["wide"], images["tall"]],
                       params=SamplingParams(max_tokens=5, ignore_eos=True))
    want = engine.run()["want"]
    server = start_server(model, max_num_seqs=4, max_model_len=64)
    try:
        status, raw = call(server.url, "POST", "/v1/chat/completions",
                           {"messages": messages, "max_tokens": 5, "ignore_eos": True})
        assert status == 200, raw
        assert json.loads(raw)["choices"][0]["message"]["content"] == want.text
        remote = [{"role": "user", "content": [parts[0], {"type": "image_url",
                                                          "image_url": {"url": "https://example.com/cat.png"}}]}]
        status, raw = call(server.url, "POST", "/v1/chat/completions", {"messages": remote, "max_tokens": 2})
        assert status == 400 and json.loads(raw)["error"]["message"].startswith("messages[0].content[1]")
        sliver = [{"role": "user", "content": [{"type": "image_url",  # an aspect ratio the processor refuses
                                                "image_url": {"url": data_url(image(2, 600, seed=1))}}]}]
        status, raw = call(server.url, "POST", "/v1/chat/completions", {"messages": sliver, "max_tokens": 2})
        assert status == 400 and json.loads(raw)["error"]["message"].startswith("messages[0].content[0]: image of")
        status, raw = call(server.url, "POST", "/v1/chat/completions", {"messages": messages, "max_tokens": 5,
                                                                        "ignore_eos": True})
        assert status == 200 and json.loads(raw)["choices"][0]["message"]["content"] == want.text
        from prometheus_client.parser import text_string_to_metric_families
        status, raw = call(server.url, "GET", "/metrics")
        encoded = [s.value for f in text_string_to_metric_families(raw.decode()) for s in f.samples
                   if s.name == "refengine_images_encoded_total"]
        assert encoded == [4.0]  # two requests of two images, each image once
    finally:
        server.close()


@pytest.mark.parametrize("pieces", [[3, "wide", 4], ["tall"], [2, "square", "tall", 1], ["wide", 5, "square"]])
def test_the_engines_positions_are_the_references(model, pieces):
    """engine.multimodal.positions, the engine's own walk of Qwen3-VL's rule, against the reference's
    (vision_reference.mrope_positions, itself held to transformers' get_rope_index)."""
    from refengine.engine.multimodal import positions
    from refengine.vision_reference import mrope_delta, mrope_positions
    _, images = requests(model)
    ids = np.asarray(prompt_with(model, pieces, images))
    grids = [preprocess_image(images[p], model.image_processor).grid_thw for p in pieces if isinstance(p, str)]
    got, delta = positions(ids, grids, model.vision_config)
    want = mrope_positions(ids, grids, model.vision_config)
    assert np.array_equal(got, want) and delta == mrope_delta(want)
