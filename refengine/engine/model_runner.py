"""The batched float32 forward: one pass per step over every scheduled token of every sequence.

Tokens of all scheduled chunks are flattened into one [num_tokens, hidden] activation, so each
weight matrix is read once per step. Keys and values go into a paged cache through the slot mapping;
each chunk then attends over its own sequence's blocks. Logits are computed only for the rows that
sample a token.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..model import Model
from . import numerics
from .block_manager import BlockManager
from .config import EngineConfig
from .faults import Fault
from .kernels import (
    apply_rope,
    attention,
    fast_layout,
    linear_fast,
    linear_invariant,
    rms_norm,
    rope_tables,
    silu,
)
from .moe import MoeWeights, moe_mlp, moe_weights
from .scheduler import ScheduledChunk


def _concat(*parts):
    present = [p for p in parts if p is not None]
    return np.ascontiguousarray(np.concatenate(present)) if present else None


def _owned(array):
    """The runner's own copy of a weight the checkpoint only memory-maps: anonymous memory (with huge
    pages where the kernel allows) streams faster than the page cache, and no step waits on a page fault."""
    return array if array is None or array.flags.owndata else np.array(array)


@dataclass(frozen=True)
class RunnerLayer:
    """One decoder layer with q/k/v and gate/up fused, so each is one product per step. Projection
    weights are [out, in] (column-major when batching in fast mode: kernels.fast_layout). A
    mixture-of-experts layer has `moe` instead of the dense MLP."""
    input_norm: np.ndarray
    qkv: np.ndarray                # [q_size + 2 * kv_size, hidden]
    qkv_bias: np.ndarray | None
    q_norm: np.ndarray | None
    k_norm: np.ndarray | None
    o_proj: np.ndarray             # [hidden, q_size]
    o_bias: np.ndarray | None
    post_norm: np.ndarray
    gate_up: np.ndarray | None     # [2 * intermediate, hidden]
    gate_up_bias: np.ndarray | None
    down: np.ndarray | None        # [hidden, intermediate]
    down_bias: np.ndarray | None
    moe: MoeWeights | None = None


class ModelRunner:
    def __init__(self, model: Model, config: EngineConfig):
        cfg = model.config
        self.cfg = cfg
        self.invariant = config.mode == "invariant"
        if self.invariant:  # before any weight is copied: refuse rather than silently lose bit-exactness
            numerics.require_tile_assumption()
        weights = model.weights(np.float32)
        self.linear = linear_invariant if self.invariant else linear_fast
        project = fast_layout if not self.invariant and config.max_num_seqs > 1 else _owned
        self.layers = [RunnerLayer(
            input_norm=w.input_norm, qkv=project(_concat(w.q_proj, w.k_proj, w.v_proj)),
            qkv_bias=_concat(w.q_bias, w.k_bias, w.v_bias),
            q_norm=w.q_norm, k_norm=w.k_norm, o_proj=project(w.o_proj), o_bias=w.o_bias, post_norm=w.post_norm,
            gate_up=None if w.router is not None else project(_concat(w.gate_proj, w.up_proj)),
            gate_up_bias=_concat(w.gate_bias, w.up_bias),
            down=None if w.router is not None else project(w.down_proj), down_bias=w.down_bias,
            moe=None if w.router is None else moe_weights(w, cfg, project)) for w in weights.layers]
        self.embed, self.norm = _owned(weights.embed), weights.norm
        self.lm_head = self.embed if weights.lm_head is weights.embed and project is _owned else project(weights.lm_head)
        self.attend = attention(self.invariant, config.injected)  # kernels.attention: the fault's code point
        self.block_size = config.block_size
        self.shift_on_join = config.injected is Fault.POSITION_OFF_BY_ONE_ON_JOIN
        self.misplace_block_starts = config.injected is Fault.KV_WRITE_BLOCK_BOUNDARY_OFF_BY_ONE
        self.short_chunk_past = config.injected is Fault.CHUNKED_PREFILL_PAST_OFF_BY_ONE
        self.row_past_next_chunk = config.injected is Fault.CHUNK_ORDER_DEPENDENT_LOGITS_ROW
        self.short_decode_after_prefill = config.injected is Fault.DECODE_CONTEXT_AFTER_PREFILL
        self.cos, self.sin = rope_tables(config.max_model_len, cfg.head_dim, cfg.rope_theta)
        # A token's key and value side by side, so a sequence's context is one gather of whole blocks.
        # The whole pool is written now, as a serving engine reserves its pool up front: left to fault in
        # as blocks are first used, a step where 32 sequences cross into new blocks (896 blocks of the
        # 0.6B shape) took 260 ms longer on the VMs this was measured on.
        self.kv_cache = np.empty((cfg.num_layers, config.num_blocks, config.block_size, 2, cfg.num_kv_heads,
                                  cfg.head_dim), dtype=np.float32)
        self.kv_cache.fill(0)

    def _project(self, x, weight, bias):
        y = self.linear(x, weight)
        return y if bias is None else y + bias

    def execute(self, chunks: list[ScheduledChunk], block_manager: BlockManager) -> np.ndarray:
        """Run one forward over `chunks`; returns float32 logits [num sampling chunks, vocab]."""
        cfg = self.cfg
        ids = np.concatenate([np.asarray(c.seq.token_ids[c.start:c.end], dtype=np.int64) for c in chunks])
        joined = [self.shift_on_join and i > 0 and c.start == 0 for i, c in enumerate(chunks)]
        positions = np.concatenate([np.arange(c.start, c.end) + shift for c, shift in zip(chunks, joined)])
        slots = np.concatenate([block_manager.slot_mapping(c.seq.block_table, c.start, c.end) for c in chunks])
        if self.misplace_block_starts:
            slots = np.where((positions % self.block_size == 0) & (positions > 0), slots + self.block_size - 1, slots)
        offsets = np.cumsum([0] + [c.num_tokens for c in chunks])
        contexts = [(c, np.asarray(c.seq.block_table.block_ids[:block_manager.blocks_for(c.end)]), lo, hi,
                     *self._attended_span(chunks, i)) for i, (c, lo, hi) in enumerate(zip(chunks, offsets[:-1], offsets[1:]))]
        cos, sin = self.cos[positions], self.sin[positions]
        scale = 1.0 / np.sqrt(cfg.head_dim)
        num_tokens, q_size, kv_size = len(ids), cfg.q_size, cfg.kv_size

        x = self.embed[ids]                                                       # [tokens, hidden]
        for layer, w in enumerate(self.layers):
            qkv = self._project(rms_norm(x, w.input_norm, cfg.rms_norm_eps), w.qkv, w.qkv_bias)
            q = qkv[:, :q_size].reshape(num_tokens, cfg.num_heads, cfg.head_dim)
            k = qkv[:, q_size:q_size + kv_size].reshape(num_tokens, cfg.num_kv_heads, cfg.head_dim)
            v = qkv[:, q_size + kv_size:].reshape(num_tokens, cfg.num_kv_heads, cfg.head_dim)
            if cfg.qk_norm:
                q = rms_norm(q, w.q_norm, cfg.rms_norm_eps)
                k = rms_norm(k, w.k_norm, cfg.rms_norm_eps)
            q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
            kv_slots = self.kv_cache[layer].reshape(-1, 2, cfg.num_kv_heads, cfg.head_dim)  # [slots, 2, KVH, D]
            kv_slots[slots, 0], kv_slots[slots, 1] = k, v
            attended = np.empty((num_tokens, q_size), dtype=np.float32)
            # One chunk at a time, decodes too: a sequence's gathered keys and values (1 MB for the
            # 0.6B shape at 128 tokens) stay in cache for both products, where stacking decodes into
            # one batched product (a copy of every sequence's prefix at once) ran 7% slower per step.
            for chunk, blocks, lo, hi, past, end in contexts:
                context = self.kv_cache[layer, blocks].reshape(-1, 2, cfg.num_kv_heads, cfg.head_dim)[:end]
                attended[lo:hi] = self.attend(q[lo:hi], context[:, 0], context[:, 1], past, scale)
            x = x + self._project(attended, w.o_proj, w.o_bias)
            if w.moe is not None:
                x = x + moe_mlp(rms_norm(x, w.post_norm, cfg.rms_norm_eps), w.moe, self.linear)
                continue
            gate_up = self._project(rms_norm(x, w.post_norm, cfg.rms_norm_eps), w.gate_up, w.gate_up_bias)
            half = cfg.intermediate_size
            x = x + self._project(silu(gate_up[:, :half]) * gate_up[:, half:], w.down, w.down_bias)

        sampling_rows = [self._sampling_row(chunks, i, hi) for i, (chunk, hi) in enumerate(zip(chunks, offsets[1:]))
                         if chunk.samples]
        if not sampling_rows:
            return np.empty((0, cfg.vocab_size), dtype=np.float32)
        final = rms_norm(x[sampling_rows], self.norm, cfg.rms_norm_eps)
        return np.ascontiguousarray(self.linear(final, self.lm_head))

    def _attended_span(self, chunks: list[ScheduledChunk], i: int) -> tuple[int, int]:
        """(past, end) of chunk i's attention: its queries sit at positions past.. and see keys [:end]."""
        chunk = chunks[i]
        if self.short_chunk_past and chunk.phase == "prefill" and chunk.start > 0:
            return chunk.start - 1, chunk.end
        if self.short_decode_after_prefill and chunk.phase == "decode" and \
                any(c.phase == "prefill" for c in chunks[:i]):
            return chunk.start - 1, chunk.end - 1  # Fault.DECODE_CONTEXT_AFTER_PREFILL: misses its own key
        return chunk.start, chunk.end

    def _sampling_row(self, chunks: list[ScheduledChunk], i: int, end: int) -> int:
        """The row of the step's activations that holds chunk i's last token (`end`: its rows end there)."""
        if self.row_past_next_chunk and chunks[i].phase == "prefill" and i + 1 < len(chunks) and \
                chunks[i + 1].phase == "decode":
            return end - 1 + chunks[i + 1].num_tokens  # Fault.CHUNK_ORDER_DEPENDENT_LOGITS_ROW
        return end - 1
