"""The streamed float64 reference (model.weights.StreamedWeights: one layer widened at a time, the
output head in row blocks) gives the in-memory reference's results bit for bit, and a model whose
float64 weights exceed the streaming threshold and the memory to spare takes that path without
holding them."""
from __future__ import annotations

import numpy as np
import pytest

from refengine.model import load_model, loader, weights
from refengine.model.tiny import TinySpec, make_tiny
from refengine.reference import KVCache, forward, generate, generate_lockstep
from refengine.sampling import SamplingParams


@pytest.fixture(scope="module")
def bf16_model(tmp_path_factory):
    """Untied, bf16 and sharded: every read path (rows of the embedding, blocks of lm_head, layers
    across files, widening bf16)."""
    return load_model(make_tiny(tmp_path_factory.mktemp("bf16"), TinySpec(tie=False), dtype="BF16", shards=2))


def test_streamed_forward_is_bit_identical_to_the_in_memory_one(bf16_model, monkeypatch):
    monkeypatch.setattr(weights, "HEAD_BLOCK_ROWS", 100)  # several head blocks, the last one short
    ids = [5, 9, 13, 200, 7, 7]
    in_memory = forward(bf16_model.weights(np.float64), bf16_model.config, ids, KVCache())
    streamed_weights = weights.StreamedWeights.of(bf16_model.checkpoint, np.float64)
    cache = KVCache()
    streamed = forward(streamed_weights, bf16_model.config, ids[:4], cache)
    streamed = np.concatenate([streamed, forward(streamed_weights, bf16_model.config, ids[4:], cache)])
    assert streamed.dtype == np.float64 and np.array_equal(streamed, in_memory)


def _without_memory(monkeypatch, threshold: int = 0) -> None:
    monkeypatch.setattr(loader, "STREAM_ABOVE_BYTES", threshold)
    monkeypatch.setattr(loader, "available_memory", lambda: 0)


def test_a_model_over_the_threshold_is_in_memory_while_memory_allows(bf16_model, monkeypatch):
    size = bf16_model.config.num_parameters * 8  # 0.3 MB in float64
    monkeypatch.setattr(loader, "STREAM_ABOVE_BYTES", 0)
    monkeypatch.setattr(loader, "available_memory", lambda: 2 * size)  # exactly MEMORY_SHARE of it
    assert isinstance(load_model(bf16_model.path).reference_weights(np.float64), weights.Weights)
    monkeypatch.setattr(loader, "available_memory", lambda: 2 * size - 1)
    assert isinstance(load_model(bf16_model.path).reference_weights(np.float64), weights.StreamedWeights)


def test_weights_already_in_memory_are_used_whatever_the_memory_left(bf16_model, monkeypatch):
    held = bf16_model.weights(np.float64)
    _without_memory(monkeypatch)
    assert bf16_model.reference_weights(np.float64) is held


def test_a_model_over_the_threshold_is_streamed_by_generate(bf16_model, monkeypatch):
    params = SamplingParams(max_tokens=12)
    monkeypatch.setattr(weights, "HEAD_BLOCK_ROWS", 128)
    assert isinstance(bf16_model.reference_weights(np.float64), weights.Weights)
    whole = generate(bf16_model, [3, 1, 4, 1, 5], params)
    _without_memory(monkeypatch)
    fresh = load_model(bf16_model.path)  # holds no float64 weights yet
    assert isinstance(fresh.reference_weights(np.float64), weights.StreamedWeights)
    streamed = generate(fresh, [3, 1, 4, 1, 5], params)
    assert streamed.token_ids == whole.token_ids and streamed.margins == whole.margins
    assert [s.top_logprobs for s in streamed.steps] == [s.top_logprobs for s in whole.steps]


def _floats(result) -> list[float]:
    return result.margins + [s.logprob for s in result.steps] + [lp for s in result.steps for _, lp in s.top_logprobs]


def test_lockstep_answers_equal_each_prompt_alone_up_to_float64_rounding(bf16_model, monkeypatch):
    """Several prompts of different lengths and budgets in lockstep (one pass over the weights per
    token for all, their rows in one product), streamed or not: each answer is its prompt's answer
    alone -- the same tokens, ids of the alternatives and finish, margins and logprobs within the
    1e-9 relative that separates CPUs -- and lockstep is deterministic, streamed or in memory."""
    monkeypatch.setattr(weights, "HEAD_BLOCK_ROWS", 200)
    prompts = [[3, 1, 4, 1, 5], [9], [2, 7, 1, 8, 2, 8, 1, 8, 2, 8], [6, 6]]
    params = [SamplingParams(max_tokens=n) for n in (7, 3, 12, 1)]
    alone = [generate(bf16_model, p, sp) for p, sp in zip(prompts, params)]
    runs = []
    for threshold in (1 << 40, 0):  # in memory, then streamed
        _without_memory(monkeypatch, threshold)
        together = generate_lockstep(load_model(bf16_model.path), prompts, params)
        for a, b in zip(alone, together):
            assert (a.token_ids, a.finish_reason) == (b.token_ids, b.finish_reason)
            assert [[i for i, _ in s.top_logprobs] for s in a.steps] == [[i for i, _ in s.top_logprobs] for s in b.steps]
            assert _floats(b) == pytest.approx(_floats(a), rel=1e-9, abs=1e-12)
        runs.append([_floats(r) for r in together])
    assert runs[0] == runs[1]  # the same products, in memory or widened layer by layer: the same bits


@pytest.mark.parametrize("cgroup, files, headroom", [
    ("0::/ci/job\n", {"ci/job/memory.max": "8589934592\n", "ci/job/memory.current": "1073741824\n"}, 7 << 30),
    ("0::/ci/job\n", {"ci/job/memory.max": "max\n", "ci/job/memory.current": "1073741824\n"}, None),
    ("4:memory:/box\n3:cpu:/\n", {"memory/box/memory.limit_in_bytes": "2147483648\n",
                                  "memory/box/memory.usage_in_bytes": "3221225472\n"}, 0),  # over: nothing left
    ("4:memory:/box\n", {"memory/box/memory.limit_in_bytes": "9223372036854771712\n",
                         "memory/box/memory.usage_in_bytes": "5\n"}, None),  # v1's "no limit"
    ("3:cpu,cpuacct:/\n", {}, None),
])
def test_a_cgroup_limit_caps_the_memory_the_reference_counts_on(tmp_path, cgroup, files, headroom):
    """A container sees the host's MemAvailable: the limit of the process's cgroup (v2 or v1, laid out
    as the kernel mounts them) is what it may still use."""
    (tmp_path / "self_cgroup").write_text(cgroup)
    for name, text in files.items():
        (tmp_path / "fs" / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / "fs" / name).write_text(text)
    assert loader.cgroup_headroom(tmp_path / "self_cgroup", tmp_path / "fs") == headroom
    assert loader.cgroup_headroom(tmp_path / "absent", tmp_path / "fs") is None
