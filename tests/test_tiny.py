import hashlib
import subprocess
import sys

import numpy as np
import pytest

from refengine.check.margins import measure_margins
from refengine.model import load_model
from refengine.model.safetensors_io import bf16_bits_to_f32, f32_to_bf16_bits
from refengine.model.tiny import TinySpec, make_tiny
from refengine.reference import prompt_logits


def folder_digests(path):
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(path.iterdir())}


def make_tiny_cli(out, *args):
    subprocess.run([sys.executable, "-m", "refengine", "make-tiny", str(out), *args], check=True,
                   capture_output=True)
    return out


def test_same_arguments_give_identical_files(tmp_path):
    args = ["--seed", "3", "--arch", "qwen2", "--no-tie", "--dtype", "bf16", "--shards", "2"]
    first = folder_digests(make_tiny_cli(tmp_path / "a", *args))
    second = folder_digests(make_tiny_cli(tmp_path / "b", *args))
    assert first == second
    assert "model.safetensors.index.json" in first
    other_seed = folder_digests(make_tiny_cli(tmp_path / "c", *args[2:]))
    assert other_seed["model-00001-of-00002.safetensors"] != first["model-00001-of-00002.safetensors"]


@pytest.mark.parametrize("arch", ["qwen3", "qwen2", "llama"])
@pytest.mark.parametrize("tie", [True, False])
def test_every_arch_loads_and_runs(tmp_path, arch, tie):
    spec = TinySpec(arch=arch, tie=tie, layers=1, hidden=32, heads=4, kv_heads=1, head_dim=8, intermediate=64,
                    vocab=300)
    model = load_model(make_tiny(tmp_path, spec))
    assert (model.config.arch, model.config.tie_word_embeddings, model.config.num_kv_heads) == (arch, tie, 1)
    assert model.config.qkv_bias == (arch == "qwen2") and model.config.qk_norm == (arch == "qwen3")
    stored = {name: f.tensors[name][1] for name, f in model.checkpoint.sources.items()}
    assert model.config.num_parameters == sum(int(np.prod(shape)) for shape in stored.values())
    logits = prompt_logits(model, [1, 2, 3])
    assert logits.shape == (3, 300) and np.isfinite(logits).all()


def test_bf16_and_sharded_folders_hold_the_rounded_f32_weights(tmp_path):
    f32 = load_model(make_tiny(tmp_path / "f32"))
    bf16 = load_model(make_tiny(tmp_path / "bf16", dtype="BF16", shards=3))
    assert len(bf16.checkpoint.files) == 3 and bf16.checkpoint.stored_dtypes == ["BF16"]
    for name in f32.checkpoint.sources:
        rounded = bf16_bits_to_f32(f32_to_bf16_bits(f32.checkpoint.tensor(name, np.float32)))
        np.testing.assert_array_equal(bf16.checkpoint.tensor(name, np.float32), rounded)


def test_default_model_has_realistic_margins(tiny_model):
    """Both clear decisions and near-ties must occur, so tests exercise both sides of the rule."""
    stats = measure_margins(tiny_model, num_prompts=32, max_tokens=32)
    assert 0.3 <= stats.median <= 3.0
    assert 0.005 <= stats.fraction_below(0.05) <= 0.10


def test_a_file_written_a_tensor_at_a_time_in_any_order_has_save_files_bytes(tmp_path, monkeypatch):
    """make-tiny writes a model a tensor at a time (a Qwen3-8B shape does not fit in memory whole), each
    encoded a block of elements at a time, with the bytes save_file gives the whole dict: sorted names,
    each tensor's data the whole tensor's encoding; and the library reads them back."""
    from safetensors.numpy import load_file

    from refengine.model import safetensors_io
    from refengine.model.safetensors_io import save_file, streamed_file

    monkeypatch.setattr(safetensors_io, "ENCODE_BLOCK", 4)  # tensors of 7, 15 and 16 elements span blocks

    rng = np.random.default_rng(0)
    tensors = {"b.weight": rng.standard_normal((3, 5)).astype(np.float32), "a.bias": np.ones(7, np.float32),
               "c.weight": rng.standard_normal((2, 2, 4)).astype(np.float32)}
    for dtype in ("F32", "BF16"):
        save_file(tensors, tmp_path / "whole.safetensors", dtype)
        with streamed_file(tmp_path / "streamed.safetensors", {n: t.shape for n, t in tensors.items()}, dtype) as put:
            for name in ["c.weight", "a.bias", "b.weight"]:
                put(name, tensors[name])
        data = (tmp_path / "streamed.safetensors").read_bytes()
        assert data == (tmp_path / "whole.safetensors").read_bytes()
        encoded = [f32_to_bf16_bits(tensors[n]).tobytes() if dtype == "BF16" else tensors[n].tobytes()
                   for n in sorted(tensors)]
        assert data.endswith(b"".join(encoded))
    back = load_file(tmp_path / "streamed.safetensors")
    rounded = bf16_bits_to_f32(f32_to_bf16_bits(tensors["c.weight"]))
    np.testing.assert_array_equal(np.asarray(back["c.weight"]).astype(np.float32), rounded)


def test_a_streamed_file_refuses_a_wrong_shape_and_a_tensor_never_written(tmp_path):
    from refengine.errors import RefengineError
    from refengine.model.safetensors_io import streamed_file

    with pytest.raises(RefengineError, match="'x' has shape \\[2\\], the layout \\[3\\]"):
        with streamed_file(tmp_path / "a.safetensors", {"x": (3,)}) as put:
            put("x", np.zeros(2, np.float32))
    with pytest.raises(RefengineError, match="tensors \\['y'\\] never written"):
        with streamed_file(tmp_path / "b.safetensors", {"x": (3,), "y": (1,)}) as put:
            put("x", np.zeros(3, np.float32))


def test_a_large_tensor_drawn_in_blocks_of_rows_is_the_same_tensor(tmp_path, monkeypatch):
    """Each tensor draws ROWS_PER_DRAW rows at a time from the model's one generator: the same stream, so
    the same weights whatever the block size (the presets' and the shipped golden files' bytes)."""
    from refengine.model import tiny

    spec = TinySpec(layers=1, hidden=32, heads=4, kv_heads=1, head_dim=8, intermediate=64, vocab=300, tie=False)
    whole = folder_digests(make_tiny(tmp_path / "whole", spec, dtype="BF16", shards=2))
    monkeypatch.setattr(tiny, "ROWS_PER_DRAW", 7)
    assert folder_digests(make_tiny(tmp_path / "blocks", spec, dtype="BF16", shards=2)) == whole


@pytest.mark.parametrize("tie", [True, False])
def test_a_model_cut_to_its_first_layers_is_the_model_stopped_there(tmp_path, tie):
    """first_layers writes a folder whose float64 logits are the source's embedding, its first n layers,
    its final norm and head, computed here from the source's own weights with the later layers dropped;
    the tokenizer files are the source's."""
    from dataclasses import replace

    from refengine.model.tiny import first_layers
    from refengine.reference import KVCache, final_hidden, output_head
    source = make_tiny(tmp_path / "source", TinySpec(layers=3, tie=tie), seed=4, dtype="BF16", shards=2)
    cut = load_model(first_layers(source, tmp_path / "cut", 2))
    whole = load_model(source)
    assert cut.config.num_layers == 2 and cut.config.tie_word_embeddings == tie
    assert (tmp_path / "cut" / "tokenizer.json").read_bytes() == (source / "tokenizer.json").read_bytes()
    ids = [5, 17, 3, 99, 42, 7]
    weights = whole.weights(np.float64)
    stopped = replace(weights, layers=weights.layers[:2])
    want = output_head(stopped, final_hidden(stopped, whole.config, ids, KVCache()))
    assert np.array_equal(prompt_logits(cut, ids), want)
    assert not np.array_equal(prompt_logits(whole, ids), want)


def test_a_cut_outside_the_models_layers_is_refused_by_name(tmp_path):
    from refengine.errors import RefengineError
    from refengine.model.tiny import first_layers
    source = make_tiny(tmp_path / "source", TinySpec(layers=2))
    for layers in (0, 3):
        with pytest.raises(RefengineError, match="^layers: "):
            first_layers(source, tmp_path / f"cut{layers}", layers)
    moe = make_tiny(tmp_path / "moe", TinySpec(arch="qwen3_moe", layers=2, experts=2, experts_per_tok=1,
                                               moe_intermediate=8))
    with pytest.raises(RefengineError, match="only a dense text model"):
        first_layers(moe, tmp_path / "cut-moe", 1)


def test_a_tiny_qwen3_vl_model_takes_images_batched_as_alone(tmp_path):
    """make-tiny's Qwen3-VL folder (tests/test_parity_vl_images.py holds it to transformers): in the
    engine, invariant mode, two requests with images beside a text one, prefills cut inside the images,
    give each the token ids and logits bits it gets alone."""
    pytest.importorskip("PIL")
    from refengine.engine import EngineConfig, LLMEngine
    from refengine.sampling import SamplingParams
    model = load_model(make_tiny(tmp_path, TinySpec(arch="qwen3_vl", layers=2, vocab=320)))
    rng = np.random.default_rng(0)
    pictures = {"a": rng.integers(0, 256, (20, 28, 3), dtype=np.uint8),
                "b": rng.integers(0, 256, (33, 9, 3), dtype=np.uint8)}
    chats = {"text": ("Hello", []),
             "one": ([{"type": "text", "text": "Look"}, {"type": "image"}], ["a"]),
             "two": ([{"type": "image"}, {"type": "text", "text": "or"}, {"type": "image"}], ["b", "a"])}

    def run(chosen, budget):
        engine = LLMEngine(model, EngineConfig(mode="invariant", max_num_seqs=4, max_num_batched_tokens=budget,
                                               block_size=4, max_model_len=128), keep_logits=True)
        for rid in chosen:
            parts, names = chats[rid]
            engine.add_request(rid, messages=[{"role": "user", "content": parts}],
                               images=[pictures[n] for n in names] or None,
                               params=SamplingParams(max_tokens=5, ignore_eos=True))
        return engine.run(), engine

    together, engine = run(list(chats), 7)
    assert engine.status()["images_encoded"] == 3
    for rid in chats:
        alone, _ = run([rid], 64)
        assert together[rid].token_ids == alone[rid].token_ids
        assert all(np.array_equal(a.logits, b.logits) for a, b in zip(together[rid].steps, alone[rid].steps))
