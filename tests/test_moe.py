"""The tiny Qwen3-MoE model of the suite: `refengine make-tiny` rebuilds it byte for byte, the streamed
reference gives the in-memory one's bits, and the engine's MoE MLP gives each token the same bits
whatever other tokens share the step (invariant mode) -- what the invariants suite relies on."""
from __future__ import annotations

import hashlib
import subprocess
import sys

import numpy as np
import pytest

from refengine.engine import EngineConfig, LLMEngine
from refengine.engine.moe import moe_mlp
from refengine.model import load_model
from refengine.model.routing import top_k
from refengine.model.weights import Checkpoint, StreamedWeights
from refengine.reference import KVCache, forward
from refengine.strategies.models import (
    TINY_CONFIGS,
    make_tiny_command,
    tiny_model,
    tiny_model_dir,
)

MOE = "qwen3moe-e4k2"


def test_make_tiny_writes_the_suite_moe_model_byte_identically(tmp_path):
    command = make_tiny_command(MOE).split()[3:]  # refengine make-tiny DIR <flags>
    digests = []
    for name in ("a", "b"):
        subprocess.run([sys.executable, "-m", "refengine", "make-tiny", str(tmp_path / name), *command],
                       check=True, capture_output=True)
        digests.append({p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted((tmp_path / name).iterdir())})
    assert digests[0] == digests[1]
    built = load_model(tmp_path / "a")
    cached = load_model(tiny_model_dir(MOE))
    assert built.fingerprint == cached.fingerprint  # the command line rebuilds the suite's model
    cfg, spec = built.config, TINY_CONFIGS[MOE]
    assert (cfg.num_experts, cfg.num_experts_per_tok, cfg.norm_topk_prob) == (spec.experts, spec.experts_per_tok, True)
    assert cfg.sparse_layers == (0, 2) and cfg.num_experts_per_tok >= 2  # layer 1 dense among sparse ones
    stored = {name: f.tensors[name][1] for name, f in built.checkpoint.sources.items()}
    assert cfg.num_parameters == sum(int(np.prod(shape)) for shape in stored.values())


def test_streamed_moe_reference_gives_the_in_memory_bits():
    model = load_model(tiny_model_dir(MOE))
    ids = [5, 17, 300, 2, 99, 41, 7]
    streamed = StreamedWeights.of(Checkpoint(model.path, model.config), np.float64)
    np.testing.assert_array_equal(forward(streamed, model.config, ids, KVCache()),
                                  forward(model.weights(np.float64), model.config, ids, KVCache()))


@pytest.mark.parametrize("rows", [1, 7, 16, 17, 40])
def test_invariant_moe_mlp_gives_each_row_its_alone_bits(rows):
    moe = LLMEngine(tiny_model(MOE), EngineConfig(mode="invariant", max_num_seqs=4)).runner.layers[0].moe
    x = np.random.default_rng(rows).standard_normal((rows, 64)).astype(np.float32)
    x[rows // 2] = x[0]  # two tokens with the same row: the same experts, gathered together
    batched = moe_mlp(x, moe)
    alone = np.concatenate([moe_mlp(x[i:i + 1], moe) for i in range(rows)])
    assert batched.tobytes() == alone.tobytes()
    chosen = {tuple(sorted(row)) for row in top_k(x @ moe.router.rows(np.arange(moe.router.out_features)).T, moe.top_k)}
    assert rows == 1 or len(chosen) > 1  # the rows went to different experts' gathers
