"""A small dense model's layers in one compiled call (engine/fused.py) give every row the bits of the
layer-by-layer path: the claim that lets the fused path replace it without touching any guarantee.

Each drawn batch runs twice on the same tiny model, with the fused path and with it switched off, and
every sampled logits row must be identical. The tiny models cover grouped, multi- and single-query
attention, q/k norms or none, qkv biases (qwen2), tied and untied heads and a one-layer model; fast
mode mixes fused decode steps with layer-by-layer prefill steps in the same run.
"""
import dataclasses

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from refengine.engine import EngineConfig, LLMEngine, fused, model_runner, packed
from refengine.model.weights import LayerWeights
from refengine.sampling import SamplingParams
from refengine.strategies.models import TINY_CONFIGS, VOCAB_SIZE, tiny_model

DENSE = [name for name, spec in TINY_CONFIGS.items() if not spec.experts]
prompts = st.lists(st.lists(st.integers(0, VOCAB_SIZE - 1), min_size=1, max_size=40), min_size=1, max_size=6)


def _rows(model, mode, batch, seats, budget, use_fused):
    engine = LLMEngine(model, EngineConfig(mode=mode, max_num_seqs=seats, max_num_batched_tokens=budget))
    if not use_fused:
        engine.runner.stacked = None
    for i, prompt in enumerate(batch):
        engine.add_request(f"r{i}", prompt, params=SamplingParams(max_tokens=6, ignore_eos=True))
    outputs = engine.run()
    return {rid: [s.logits_sha256 for s in out.steps] for rid, out in outputs.items()}


@pytest.mark.parametrize("name", DENSE)
@settings(max_examples=15, deadline=None)
@given(batch=prompts, mode=st.sampled_from(["invariant", "fast"]), seats=st.integers(1, 6),
       budget=st.sampled_from([1, 7, 16, 64]))
def test_fused_layers_give_the_layer_by_layer_bits(name, batch, mode, seats, budget):
    model = tiny_model(name)
    assert model_runner.PackedModel.of(model).stacked is not None, "a tiny dense model is stacked"
    assert _rows(model, mode, batch, seats, budget, True) == _rows(model, mode, batch, seats, budget, False)


def test_the_fused_path_is_taken_and_only_where_it_may_be(monkeypatch):
    """Invariant-mode steps of a tiny model go through fused.forward; a fast-mode prefill chunk of
    several tokens (attend_fast) does not, its layers go in halves around it; an MoE model is never
    stacked."""
    calls = []
    real = fused.forward
    monkeypatch.setattr(fused, "forward", lambda ids, *rest: calls.append(ids.shape[0]) or real(ids, *rest))
    model = tiny_model()
    _rows(model, "invariant", [[1, 2, 3, 4, 5]], 1, 64, True)
    assert calls[0] == 5 and len(calls) == 6  # the prefill and every decode step
    calls.clear()
    halves = []
    after = fused.after_attention
    monkeypatch.setattr(fused, "after_attention", lambda x, *rest: halves.append(x.shape[0]) or after(x, *rest))
    _rows(model, "fast", [[1, 2, 3, 4, 5]], 1, 64, True)
    assert calls == [1] * 5  # decode steps only
    assert halves == [5] * model.config.num_layers  # the prefill: each layer in two calls around attend_fast
    assert model_runner.PackedModel.of(tiny_model("qwen3moe-e4k2")).stacked is None


def test_only_small_alike_layers_are_stacked():
    """Where a product would run threaded the layer-by-layer path stays (a cached compiled caller of
    a parallel kernel is loaded broken, jit.py), and so it does where layers differ in which biases
    they have."""
    def layer(hidden, intermediate):
        z = lambda *shape: np.zeros(shape, dtype=np.float32)  # noqa: E731
        return LayerWeights(z(hidden), z(hidden, hidden), z(hidden // 2, hidden), z(hidden // 2, hidden),
                            z(hidden, hidden), z(hidden), z(intermediate, hidden), z(intermediate, hidden),
                            z(hidden, intermediate))
    small, large = layer(64, 128), layer(256, 1024)  # gate_up of the large: 2048 x 256 float32 = 2 MiB
    assert 2 * 1024 * 256 * 4 > packed.THREADED_BYTES >= 2 * 128 * 64 * 4
    assert fused.stackable([small, small]) and not fused.stackable([small, large])
    biased = dataclasses.replace(small, o_bias=np.zeros(64, dtype=np.float32))
    assert fused.stackable([biased, biased]) and not fused.stackable([small, biased])  # stacked arrays need alike layers


@pytest.mark.parametrize("mode", ["invariant", "fast"])
def test_a_head_left_to_the_caller_gives_the_same_bits(mode):
    """Where the head is too large for the calling thread, the one call returns the normed rows and
    the runner multiplies them (threaded): the same logits as the head multiplied inside the call."""
    model = tiny_model()
    batch = [[1, 2, 3, 4, 5], [9, 8, 7], [3] * 20]

    def rows(head_inside):
        engine = LLMEngine(model, EngineConfig(mode=mode, max_num_seqs=3, max_num_batched_tokens=16))
        stacked = engine.runner.stacked
        assert stacked.head.shape[0] > 0, "the tiny model's head is multiplied inside the call"
        if not head_inside:
            engine.runner.stacked = dataclasses.replace(stacked, head=stacked.head[:0])
        for i, prompt in enumerate(batch):
            engine.add_request(f"r{i}", prompt, params=SamplingParams(max_tokens=6, ignore_eos=True))
        return {rid: [s.logits_sha256 for s in out.steps] for rid, out in engine.run().items()}

    assert rows(True) == rows(False)
