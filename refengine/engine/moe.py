"""The batched float32 mixture-of-experts MLP (Qwen3-MoE), in both engine modes.

Why it is batch-invariant in invariant mode: every step of a token's computation depends on that
token's row alone. The router is one packed product (engine/packed.py: a row's result never depends on the
other rows), its softmax and top-k are row-wise (ties as torch.topk breaks them, model.routing, which
looks at the row only). Each expert then multiplies the rows gathered for it with the same product,
so a token's expert output is the same whether 1 or 100 other tokens chose that expert. Last, a
token's k weighted expert outputs are added in its own top-k rank order (rank 0 + rank 1 + ...),
elementwise, never in the order experts or tokens happen to be visited in the batch. Both engine
modes run these steps.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..model.routing import top_k
from .kernels import silu_mul, softmax_rows
from .packed import PackedWeight, matmul, pack


@dataclass(frozen=True)
class MoeWeights:
    """One sparse layer's router and experts, each projection packed (engine/packed.py)."""
    router: PackedWeight          # [experts, hidden]
    gate_up: list[PackedWeight]   # per expert [2 * moe_intermediate, hidden]
    down: list[PackedWeight]      # per expert [hidden, moe_intermediate]
    top_k: int
    norm_topk_prob: bool


def moe_weights(w, cfg) -> MoeWeights:
    """From a reference LayerWeights (stacked experts) to the runner's."""
    return MoeWeights(router=pack(w.router),
                      gate_up=[pack(np.concatenate([g, u])) for g, u in zip(w.expert_gate, w.expert_up)],
                      down=[pack(d) for d in w.expert_down],
                      top_k=cfg.num_experts_per_tok, norm_topk_prob=cfg.norm_topk_prob)


def moe_mlp(x, moe: MoeWeights) -> np.ndarray:
    """x [tokens, hidden] (normed) -> [tokens, hidden]: the sum of each token's chosen experts' SwiGLU
    outputs, weighted by its router probabilities."""
    probs = softmax_rows(matmul(x, moe.router))                                         # [tokens, experts]
    chosen = top_k(probs, moe.top_k)                                                    # [tokens, k]
    weights = np.take_along_axis(probs, chosen, axis=-1)                                # [tokens, k]
    if moe.norm_topk_prob:
        weights = weights / weights.sum(axis=-1, keepdims=True)
    flat = chosen.ravel()
    order = np.argsort(flat, kind="stable")                # (token, rank) pairs grouped by expert
    ends = np.cumsum(np.bincount(flat, minlength=len(moe.down)))
    contributions = np.empty((x.shape[0], moe.top_k, x.shape[1]), dtype=np.float32)   # [tokens, k, hidden]
    for expert, (lo, hi) in enumerate(zip(np.concatenate([[0], ends[:-1]]), ends)):
        if lo == hi:
            continue
        token, rank = np.divmod(order[lo:hi], moe.top_k)
        gate_up = matmul(x[token], moe.gate_up[expert])                                # [n, 2 * moe_inter]
        out = matmul(silu_mul(gate_up), moe.down[expert])    # [n, hidden]
        contributions[token, rank] = out * weights[token, rank, None]
    total = contributions[:, 0].copy()
    for rank in range(1, moe.top_k):  # the token's own rank order: never the batch's
        total += contributions[:, rank]
    return total
