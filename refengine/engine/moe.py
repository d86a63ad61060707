"""The batched float32 mixture-of-experts MLP (Qwen3-MoE), in both engine modes.

Why it is batch-invariant in invariant mode: every step of a token's computation depends on that
token's row alone. The router is one `linear_invariant` product (a row's result never depends on the
other rows), its softmax and top-k are row-wise (ties as torch.topk breaks them, model.routing, which
looks at the row only). Each expert then multiplies the rows gathered for it with `linear_invariant`,
so a token's expert output is the same whether 1 or 100 other tokens chose that expert. Last, a
token's k weighted expert outputs are added in its own top-k rank order (rank 0 + rank 1 + ...),
elementwise, never in the order experts or tokens happen to be visited in the batch. Fast mode runs
the same steps with plain BLAS over each expert's gathered rows (a row's last bits then depend on
how many rows the expert got).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..model.routing import top_k
from .kernels import silu, softmax_rows


@dataclass(frozen=True)
class MoeWeights:
    """One sparse layer's router and experts; projections are [out, in] (kernels.fast_layout applies)."""
    router: np.ndarray          # [experts, hidden]
    gate_up: list[np.ndarray]   # per expert [2 * moe_intermediate, hidden]
    down: list[np.ndarray]      # per expert [hidden, moe_intermediate]
    top_k: int
    norm_topk_prob: bool


def moe_weights(w, cfg, project) -> MoeWeights:
    """From a reference LayerWeights (stacked experts) to the runner's, each matrix through `project`."""
    return MoeWeights(router=project(w.router),
                      gate_up=[project(np.concatenate([g, u])) for g, u in zip(w.expert_gate, w.expert_up)],
                      down=[project(d) for d in w.expert_down],
                      top_k=cfg.num_experts_per_tok, norm_topk_prob=cfg.norm_topk_prob)


def moe_mlp(x, moe: MoeWeights, linear) -> np.ndarray:
    """x [tokens, hidden] (normed) -> [tokens, hidden]: the sum of each token's chosen experts' SwiGLU
    outputs, weighted by its router probabilities. `linear`: kernels.linear_invariant or linear_fast."""
    probs = softmax_rows(np.ascontiguousarray(linear(x, moe.router)))                   # [tokens, experts]
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
        gate_up = linear(x[token], moe.gate_up[expert])                                # [n, 2 * moe_inter]
        half = gate_up.shape[1] // 2
        out = linear(silu(gate_up[:, :half]) * gate_up[:, half:], moe.down[expert])    # [n, hidden]
        contributions[token, rank] = out * weights[token, rank, None]
    total = contributions[:, 0].copy()
    for rank in range(1, moe.top_k):  # the token's own rank order: never the batch's
        total += contributions[:, rank]
    return total
