"""The batched float32 forward: one pass per step over every scheduled token of every sequence.

Tokens of all scheduled chunks are flattened into one [num_tokens, hidden] activation, so each
weight matrix is read once per step (engine/packed.py). Keys and values go into a paged cache
through the slot mapping; each query row then attends over its own sequence's blocks, all rows of a
layer in one call (engine/paged_attention.py). Logits are computed only for the rows that sample a
token.
"""
from __future__ import annotations

import threading
import weakref
from dataclasses import dataclass
from typing import Callable

import numpy as np

from ..model import Model
from . import numerics, packed, paged_attention
from .block_manager import BlockManager
from .config import EngineConfig
from .faults import Fault
from .kernels import apply_rope, attention, rms_norm, rope_tables, silu_mul
from .moe import MoeWeights, moe_mlp, moe_weights
from .packed import PackedWeight, pack
from .scheduler import ScheduledChunk


def _lookup(table):
    return lambda ids: table[ids]


def _concat(*parts):
    present = [p for p in parts if p is not None]
    return np.ascontiguousarray(np.concatenate(present)) if present else None


@dataclass(frozen=True)
class RunnerLayer:
    """One decoder layer with q/k/v and gate/up fused, so each is one product per step. Projections
    are packed for the step's product (engine/packed.py). A mixture-of-experts layer has `moe`
    instead of the dense MLP."""
    input_norm: np.ndarray
    qkv: PackedWeight              # [q_size + 2 * kv_size, hidden]
    qkv_bias: np.ndarray | None
    q_norm: np.ndarray | None
    k_norm: np.ndarray | None
    o_proj: PackedWeight           # [hidden, q_size]
    o_bias: np.ndarray | None
    post_norm: np.ndarray
    gate_up: PackedWeight | None   # [2 * intermediate, hidden]
    gate_up_bias: np.ndarray | None
    down: PackedWeight | None      # [hidden, intermediate]
    down_bias: np.ndarray | None
    moe: MoeWeights | None = None


@dataclass(frozen=True)
class PackedModel:
    """A model's float32 weights as the runner multiplies them: read-only, shared by every engine on
    the model (packing the 0.6B shape takes seconds, and a test run builds engines by the hundred)."""
    layers: list[RunnerLayer]
    norm: np.ndarray
    lm_head: PackedWeight
    embed: Callable                # token ids -> rows [n, hidden]

    @staticmethod
    def of(model: Model) -> PackedModel:
        with _PACKING:
            if model not in _PACKED:
                _PACKED[model] = PackedModel._pack(model)
            return _PACKED[model]

    @staticmethod
    def _pack(model: Model) -> PackedModel:
        weights, cfg = model.weights(np.float32), model.config
        layers = [RunnerLayer(
            input_norm=w.input_norm, qkv=pack(_concat(w.q_proj, w.k_proj, w.v_proj)),
            qkv_bias=_concat(w.q_bias, w.k_bias, w.v_bias),
            q_norm=w.q_norm, k_norm=w.k_norm, o_proj=pack(w.o_proj), o_bias=w.o_bias, post_norm=w.post_norm,
            gate_up=None if w.router is not None else pack(_concat(w.gate_proj, w.up_proj)),
            gate_up_bias=_concat(w.gate_bias, w.up_bias),
            down=None if w.router is not None else pack(w.down_proj), down_bias=w.down_bias,
            moe=None if w.router is None else moe_weights(w, cfg)) for w in weights.layers]
        lm_head = pack(weights.lm_head)
        # A tied embedding is looked up in the packed head: one copy of the largest matrix, not two.
        embed = lm_head.rows if weights.lm_head is weights.embed else _lookup(np.array(weights.embed))
        return PackedModel(layers, weights.norm, lm_head, embed)


_PACKED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_PACKING = threading.Lock()


@dataclass(frozen=True)
class AttentionPlan:
    """Where a step's query rows read their keys: each chunk's block table (a row of `tables`), and per
    row its chunk and how many keys it sees. In fast mode, the prefill chunks attend_fast takes whole,
    (chunk, lo, hi, past, end), and the rows left to the paged kernel (None: every row)."""
    tables: np.ndarray             # [chunks, max blocks]
    row_seq: np.ndarray            # [tokens]
    row_keys: np.ndarray           # [tokens]
    whole_chunks: list[tuple[int, int, int, int, int]]
    paged_rows: np.ndarray | None


class ModelRunner:
    def __init__(self, model: Model, config: EngineConfig):
        cfg = model.config
        self.cfg = cfg
        self.invariant = config.mode == "invariant"
        if self.invariant:  # before any weight is copied: refuse rather than silently lose bit-exactness
            numerics.require_invariant_kernels()
        weights = PackedModel.of(model)
        self.layers, self.norm, self.lm_head, self.embed = weights.layers, weights.norm, weights.lm_head, weights.embed
        # Fast mode attends a prefill chunk's queries in one masked product (kernels.attend_fast), as
        # serving engines' prefill kernels do: a row's bits then depend on how its prompt was chunked.
        self.flatten, self.attend_chunk = attention(self.invariant, config.injected)
        self.block_size = config.block_size
        self.shift_on_join = config.injected is Fault.POSITION_OFF_BY_ONE_ON_JOIN
        self.misplace_block_starts = config.injected is Fault.KV_WRITE_BLOCK_BOUNDARY_OFF_BY_ONE
        self.short_chunk_past = config.injected is Fault.CHUNKED_PREFILL_PAST_OFF_BY_ONE
        self.row_past_next_chunk = config.injected is Fault.CHUNK_ORDER_DEPENDENT_LOGITS_ROW
        self.short_decode_after_prefill = config.injected is Fault.DECODE_CONTEXT_AFTER_PREFILL
        self.cos, self.sin = rope_tables(config.max_model_len, cfg.head_dim, cfg.rope_theta)
        # Laid out for paged_attention. The whole pool is written now, as a serving engine reserves its
        # pool up front: left to fault in as blocks are first used, a step where 32 sequences cross into
        # new blocks (896 blocks of the 0.6B shape) took 260 ms longer on the VMs this was measured on.
        blocks = (cfg.num_layers, config.num_blocks, cfg.num_kv_heads)
        self.k_cache = np.empty(blocks + (cfg.head_dim, config.block_size), dtype=np.float32)
        self.v_cache = np.empty(blocks + (config.block_size, cfg.head_dim), dtype=np.float32)
        self.k_cache.fill(0)
        self.v_cache.fill(0)

    def _project(self, x, weight, bias):
        y = packed.matmul(x, weight)
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
        plan = self._plan_attention(chunks, offsets)
        cos, sin = self.cos[positions], self.sin[positions]
        scale = 1.0 / np.sqrt(cfg.head_dim)
        num_tokens, q_size, kv_size = len(ids), cfg.q_size, cfg.kv_size

        x = self.embed(ids)                                                       # [tokens, hidden]
        for layer, w in enumerate(self.layers):
            qkv = self._project(rms_norm(x, w.input_norm, cfg.rms_norm_eps), w.qkv, w.qkv_bias)
            q = qkv[:, :q_size].reshape(num_tokens, cfg.num_heads, cfg.head_dim)
            k = qkv[:, q_size:q_size + kv_size].reshape(num_tokens, cfg.num_kv_heads, cfg.head_dim)
            v = qkv[:, q_size + kv_size:].reshape(num_tokens, cfg.num_kv_heads, cfg.head_dim)
            if cfg.qk_norm:
                q = rms_norm(q, w.q_norm, cfg.rms_norm_eps)
                k = rms_norm(k, w.k_norm, cfg.rms_norm_eps)
            q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
            paged_attention.write(self.k_cache[layer], self.v_cache[layer], slots, k, v)
            attended = self._attend(layer, q, plan, scale)
            x = x + self._project(attended, w.o_proj, w.o_bias)
            if w.moe is not None:
                x = x + moe_mlp(rms_norm(x, w.post_norm, cfg.rms_norm_eps), w.moe)
                continue
            gate_up = self._project(rms_norm(x, w.post_norm, cfg.rms_norm_eps), w.gate_up, w.gate_up_bias)
            x = x + self._project(silu_mul(gate_up), w.down, w.down_bias)

        sampling_rows = [self._sampling_row(chunks, i, hi) for i, (chunk, hi) in enumerate(zip(chunks, offsets[1:]))
                         if chunk.samples]
        if not sampling_rows:
            return np.empty((0, cfg.vocab_size), dtype=np.float32)
        final = rms_norm(x[sampling_rows], self.norm, cfg.rms_norm_eps)
        return packed.matmul(final, self.lm_head)

    def _plan_attention(self, chunks: list[ScheduledChunk], offsets) -> AttentionPlan:
        tables = np.zeros((len(chunks), max(len(c.seq.block_table.block_ids) for c in chunks)), dtype=np.int64)
        for i, c in enumerate(chunks):
            tables[i, :len(c.seq.block_table.block_ids)] = c.seq.block_table.block_ids
        spans = [self._attended_span(chunks, i) for i in range(len(chunks))]
        # Row r of chunk i sits at position past_i + (r - lo_i) and sees that many keys and its own.
        row_seq = np.repeat(np.arange(len(chunks)), np.diff(offsets))
        row_keys = np.concatenate([np.arange(past, past + c.num_tokens) + 1 for c, (past, _) in zip(chunks, spans)])
        whole = [] if self.attend_chunk is None else [
            (i, lo, hi, *spans[i]) for i, (c, lo, hi) in enumerate(zip(chunks, offsets[:-1], offsets[1:]))
            if c.num_tokens > 1]
        paged = np.ones(len(row_seq), dtype=bool)
        for _, lo, hi, _, _ in whole:
            paged[lo:hi] = False
        return AttentionPlan(tables, row_seq, row_keys, whole, None if paged.all() else np.flatnonzero(paged))

    def _attend(self, layer: int, q, plan: AttentionPlan, scale: float) -> np.ndarray:
        """The step's attention in one layer, q [tokens, heads, head_dim] -> [tokens, heads * head_dim]."""
        k_cache, v_cache = self.k_cache[layer], self.v_cache[layer]
        if plan.paged_rows is None:
            return paged_attention.attend(q, k_cache, v_cache, plan.tables, plan.row_seq, plan.row_keys, scale,
                                          self.flatten)
        rows = plan.paged_rows
        attended = np.empty((q.shape[0], q.shape[1] * q.shape[2]), dtype=np.float32)
        if len(rows):
            attended[rows] = paged_attention.attend(q[rows], k_cache, v_cache, plan.tables, plan.row_seq[rows],
                                                    plan.row_keys[rows], scale, self.flatten)
        for i, lo, hi, past, end in plan.whole_chunks:
            keys, values = paged_attention.gather(k_cache, v_cache, plan.tables[i], end)
            attended[lo:hi] = self.attend_chunk(q[lo:hi], keys, values, past, scale)
        return attended

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
