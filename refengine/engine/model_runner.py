"""The batched float32 forward: one pass per step over every scheduled token of every sequence.

Tokens of all scheduled chunks are flattened into one [num_tokens, hidden] activation, so each
weight matrix is read once per step (engine/packed.py). Keys and values go into a paged cache
through the slot mapping; each query row then attends over its own sequence's blocks, all rows of a
layer in one call (engine/paged_attention.py). Logits are computed only for the rows that sample a
token.
"""
from __future__ import annotations

import math
import threading
import weakref
from dataclasses import dataclass
from typing import Callable

import numpy as np

from ..model import Model
from ..model.config import VISION_LANGUAGE
from ..model.weights import LayerWeights
from . import fused as fused_layers
from . import numerics, packed, paged_attention
from .block_manager import BlockManager
from .config import EngineConfig
from .faults import Fault
from .fused import StackedLayers
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
    stacked: StackedLayers | None  # a small dense model's layers for engine/fused.py, else None

    @staticmethod
    def of(model: Model) -> PackedModel:
        with _PACKING:
            if model not in _PACKED:
                _PACKED[model] = PackedModel._pack(model)
            return _PACKED[model]

    @staticmethod
    def _pack(model: Model) -> PackedModel:
        weights, cfg = model.weights(np.float32), model.config
        # A small model's layers are concatenated all at once and stacked; a large one's a layer at a
        # time, so that its weights are never held twice.
        small = [_concatenated(w) for w in weights.layers] if fused_layers.stackable(weights.layers) else None
        lm_head = pack(weights.lm_head)
        tied = weights.lm_head is weights.embed
        table, block = (lm_head.blocks, packed.BLOCK) if tied else (np.ascontiguousarray(weights.embed)[:, :, None], 1)
        stacked = fused_layers.stack(small, table, block, weights.norm, lm_head.blocks) if small else None
        layers = []
        for i, w in enumerate(weights.layers):
            f = small[i] if small else _concatenated(w)
            if stacked is not None:  # the layer's products are views of the stacked weights
                qkv, o_proj, gate_up, down = (PackedWeight(getattr(stacked, name)[i], len(f[name]))
                                              for name in ("qkv", "o_proj", "gate_up", "down"))
            else:
                qkv, o_proj = pack(f["qkv"]), pack(f["o_proj"])
                gate_up, down = (None, None) if w.router is not None else (pack(f["gate_up"]), pack(f["down"]))
            layers.append(RunnerLayer(
                input_norm=w.input_norm, qkv=qkv, qkv_bias=f["qkv_bias"], q_norm=w.q_norm, k_norm=w.k_norm,
                o_proj=o_proj, o_bias=w.o_bias, post_norm=w.post_norm, gate_up=gate_up,
                gate_up_bias=f["gate_up_bias"], down=down, down_bias=w.down_bias,
                moe=None if w.router is None else moe_weights(w, cfg)))
        # A tied embedding is looked up in the packed head: one copy of the largest matrix, not two.
        embed = lm_head.rows if tied else _lookup(np.array(weights.embed))
        return PackedModel(layers, weights.norm, lm_head, embed, stacked)


def _concatenated(w: LayerWeights) -> dict:
    """A layer's weights as the runner multiplies them: q/k/v and gate/up concatenated ([out, in], None
    where absent: an MoE layer's gate_up and down)."""
    dense = w.router is None
    return dict(input_norm=w.input_norm, qkv=_concat(w.q_proj, w.k_proj, w.v_proj),
                qkv_bias=_concat(w.q_bias, w.k_bias, w.v_bias), q_norm=w.q_norm, k_norm=w.k_norm,
                o_proj=w.o_proj, o_bias=w.o_bias, post_norm=w.post_norm,
                gate_up=_concat(w.gate_proj, w.up_proj) if dense else None,
                gate_up_bias=_concat(w.gate_bias, w.up_bias), down=w.down_proj, down_bias=w.down_bias)


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
        self.stacked = weights.stacked
        # Fast mode attends a prefill chunk's queries in one masked product (kernels.attend_fast), as
        # serving engines' prefill kernels do: a row's bits then depend on how its prompt was chunked.
        self.flatten, self.attend_chunk = attention(self.invariant, config.injected)
        self.block_size = config.block_size
        self.shift_on_join = config.injected is Fault.POSITION_OFF_BY_ONE_ON_JOIN
        self.misplace_block_starts = config.injected is Fault.KV_WRITE_BLOCK_BOUNDARY_OFF_BY_ONE
        self.short_chunk_past = config.injected is Fault.CHUNKED_PREFILL_PAST_OFF_BY_ONE
        self.row_past_next_chunk = config.injected is Fault.CHUNK_ORDER_DEPENDENT_LOGITS_ROW
        self.short_decode_after_prefill = config.injected is Fault.DECODE_CONTEXT_AFTER_PREFILL
        self.moves_spans = self.short_chunk_past or self.short_decode_after_prefill
        self.scored_from_step_start = config.injected is Fault.PROMPT_LOGPROBS_ROWS_FROM_STEP_START
        self.draft_positions_off = config.injected is Fault.DRAFT_POSITIONS_OFF_ON_JOIN
        # an image request's chunk: the indices its angles are read at, given its tokens' and the rows before it
        self._turned_at = (lambda at, lo: at + lo) if config.injected is Fault.IMAGE_POSITIONS_FROM_STEP_ROWS \
            else (lambda at, lo: at)
        self._image_features = _step_first_features if config.injected is Fault.IMAGE_FEATURES_FROM_NEIGHBOUR \
            else _own_features
        self._feature_rows = _rows_from_chunk_start if config.injected is Fault.IMAGE_FEATURES_RESTART_AT_CHUNK \
            else (lambda feature: feature)
        self.deepstack_late = int(config.injected is Fault.DEEPSTACK_ONE_LAYER_LATE)  # layers after the right one
        self.scale = 1.0 / math.sqrt(cfg.head_dim)
        self.cos, self.sin = rope_tables(config.max_model_len, cfg.head_dim, cfg.rope_theta)
        self.takes_images = cfg.arch in VISION_LANGUAGE  # a text model's steps never look for images
        self.images_encoded = 0  # images this runner's steps ran through the vision tower
        self.inv_freq = 1.0 / cfg.rope_theta ** (np.arange(0, cfg.head_dim, 2, dtype=np.float64) / cfg.head_dim)
        # Laid out for paged_attention. The whole pool is written now, as a serving engine reserves its
        # pool up front: left to fault in as blocks are first used, a step where many sequences cross into
        # new blocks pays those page faults inside the step (docs/performance/history.md has the figure).
        blocks = (cfg.num_layers, config.num_blocks, cfg.num_kv_heads)
        self.k_cache = np.empty(blocks + (cfg.head_dim, config.block_size), dtype=np.float32)
        self.v_cache = np.empty(blocks + (config.block_size, cfg.head_dim), dtype=np.float32)
        self.k_cache.fill(0)
        self.v_cache.fill(0)

    def _project(self, x, weight, bias):
        y = packed.matmul(x, weight)
        return y if bias is None else y + bias

    def execute(self, chunks: list[ScheduledChunk], block_manager: BlockManager,
                scored: list[tuple[int, range]] = (), copies: list[tuple[int, int]] = ()) -> np.ndarray:
        """Run one forward over `chunks`; returns float32 logits [sampling rows + scored rows, vocab]: a row
        per sampling chunk (1 + its drafts for a verifying decode), then the rows of `scored`'s positions
        ((chunk index, positions) pairs:
        engine/prompt_logprobs.py), in order. `copies` ((source, destination) blocks: a fork's partial
        block) are made first, in every layer."""
        cfg = self.cfg
        for source, destination in copies:
            self.k_cache[:, destination] = self.k_cache[:, source]
            self.v_cache[:, destination] = self.v_cache[:, source]
        inputs, plan, sampling_rows, keys = self._prepare(chunks, block_manager, scored)
        ids, positions, slots = inputs
        if self.misplace_block_starts:
            slots = np.where((positions % self.block_size == 0) & (positions > 0), slots + self.block_size - 1, slots)
        images = self._multimodal(chunks, positions) \
            if self.takes_images and any(getattr(c.seq, "images", None) for c in chunks) else None
        # One compiled call for the whole forward where fused.py may run: every row paged, no threaded attention
        if images is not None:
            cos, sin, rows, embeds, deepstack = images
            x = self.embed(ids)
            x[rows] = embeds
            x = self._layers(x, cos, sin, slots, plan, self.scale, (rows, deepstack))
            out, head_done = rms_norm(x[sampling_rows], self.norm, cfg.rms_norm_eps), False
        elif self.stacked is not None and plan.paged_rows is None and \
                keys * cfg.num_heads * cfg.head_dim < paged_attention.THREADED_WORK:
            out = fused_layers.forward(ids, self.stacked, (cfg.num_heads, cfg.num_kv_heads, cfg.head_dim),
                                       cfg.rms_norm_eps, positions, self.cos, self.sin, self.k_cache, self.v_cache,
                                       slots, plan.tables, plan.row_seq, plan.row_keys, sampling_rows, self.scale,
                                       self.flatten)
            head_done = self.stacked.head.shape[0] > 0  # else `out` is the normed rows, the head threaded
        else:
            x = self._layers(self.embed(ids), self.cos[positions], self.sin[positions], slots, plan, self.scale)
            out, head_done = rms_norm(x[sampling_rows], self.norm, cfg.rms_norm_eps), False
        if not len(sampling_rows):
            return np.empty((0, cfg.vocab_size), dtype=np.float32)
        if not head_done:
            return packed.matmul(out, self.lm_head)
        return out if out.shape[1] == cfg.vocab_size else np.ascontiguousarray(out[:, :cfg.vocab_size])

    def _layers(self, x, cos, sin, slots, plan: AttentionPlan, scale: float, deepstack=None) -> np.ndarray:
        """x [tokens, hidden] through every layer: a call per operation, or for a stacked model two per
        layer around its attention (engine/fused.py, which also has the whole step in one call).
        `deepstack` (rows, features per level): after layer n, rows get level n's features added."""
        cfg = self.cfg
        rows, levels = deepstack if deepstack is not None else ((), ())
        if self.stacked is not None:  # each layer's work around its attention in two compiled calls
            heads = (cfg.num_heads, cfg.num_kv_heads, cfg.head_dim)
            x = np.ascontiguousarray(x, dtype=np.float32)
            for layer in range(len(self.layers)):
                q = fused_layers.before_attention(x, self.stacked, layer, heads, cfg.rms_norm_eps, cos, sin,
                                                  self.k_cache, self.v_cache, slots)
                x = fused_layers.after_attention(x, self._attend(layer, q, plan, scale), self.stacked, layer,
                                                 cfg.rms_norm_eps)
                if 0 <= layer - self.deepstack_late < len(levels):
                    x[rows] += levels[layer - self.deepstack_late]
            return x
        num_tokens, q_size, kv_size = x.shape[0], cfg.q_size, cfg.kv_size
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
            else:
                gate_up = self._project(rms_norm(x, w.post_norm, cfg.rms_norm_eps), w.gate_up, w.gate_up_bias)
                x = x + self._project(silu_mul(gate_up), w.down, w.down_bias)
            if 0 <= layer - self.deepstack_late < len(levels):
                x[rows] += levels[layer - self.deepstack_late]
        return x

    def _multimodal(self, chunks: list[ScheduledChunk], positions: np.ndarray):
        """A step holding a request with images (engine/multimodal.py): RoPE cos, sin [tokens, head_dim]
        per row (a text row's are the tables'; an image request's from its three position streams), the
        rows that are image tokens, their features [rows, hidden] and deepstack features per level."""
        cos, sin = self.cos[positions], self.sin[positions]  # copies: the tables stay as they are
        rows, embeds, levels, lo, first = [], [], [], 0, None
        for c in chunks:
            images, at = getattr(c.seq, "images", None), positions[lo:lo + c.num_tokens]
            if images is not None:
                angles = images.angles(self._turned_at(at, lo), self.inv_freq)  # [num_tokens, head_dim] float64
                cos[lo:lo + c.num_tokens], sin[lo:lo + c.num_tokens] = np.cos(angles), np.sin(angles)
                feature = self._feature_rows(images.rows(at))        # [num_tokens]
                if (feature >= 0).any():
                    self.images_encoded += images.encode()
                    first = first or images
                    rows.append(lo + np.flatnonzero(feature >= 0))
                    features, deepstack = self._image_features(images, first, feature[feature >= 0])
                    embeds.append(features)
                    levels.append(deepstack)
            lo += c.num_tokens
        hidden = self.cfg.hidden_size
        rows = np.concatenate(rows) if rows else np.empty(0, dtype=np.int64)
        embeds = np.concatenate(embeds) if embeds else np.empty((0, hidden), dtype=np.float32)
        levels = [np.concatenate(level) for level in zip(*levels)]
        return cos, sin, rows, embeds, levels

    def _prepare(self, chunks: list[ScheduledChunk], block_manager: BlockManager, scored=()):
        """The step's inputs in one pass over the chunks: (ids, positions, slots) [tokens] int64 each, the
        AttentionPlan, the rows that meet the head (one per sampling chunk, 1 + its drafts for a verifying
        decode, then `scored`'s) and the keys
        all rows attend to.
        Python lists, one array each at the end: a decode step has one token per chunk, and a numpy
        call per chunk cost more than the tiny models' whole forward."""
        width = max(len(c.seq.block_table.block_ids) for c in chunks)
        ids, positions, slots, row_seq, row_keys, tables, whole, sampling = [], [], [], [], [], [], [], []
        lo, firsts = 0, []
        for i, c in enumerate(chunks):
            firsts.append(lo)
            seq, start, end, n = c.seq, c.start, c.start + c.num_tokens, c.num_tokens
            ids += seq.token_ids[start:end - len(c.draft)]
            ids += c.draft
            shift = int(self.shift_on_join and i > 0 and start == 0)
            if self.draft_positions_off and i > 0 and c.draft:  # Fault.DRAFT_POSITIONS_OFF_ON_JOIN
                positions += [start, *range(start, end - 1)]
            else:
                positions += range(start + shift, end + shift)
            slots += block_manager.slot_mapping(seq.block_table, start, end)
            blocks = seq.block_table.block_ids
            tables.append(blocks + [0] * (width - len(blocks)))
            past, attended = self._attended_span(chunks, i) if self.moves_spans else (start, end)
            row_seq += [i] * n
            row_keys += range(past + 1, past + n + 1)  # row r sits at position past + r, sees its own key
            if self.attend_chunk is not None and n > 1 and not c.draft:  # a verifying decode's rows: as decodes
                whole.append((i, lo, lo + n, past, attended))
            lo += n
            if c.draft:  # a verifying decode: a row per draft token, then the bonus row
                sampling += range(lo - 1 - len(c.draft), lo)
            elif c.samples:
                sampling.append(self._sampling_row(chunks, i, lo) if self.row_past_next_chunk else lo - 1)
        for i, span in scored:  # row = the chunk's first row + (position - its start)
            first = 0 if self.scored_from_step_start else firsts[i]  # Fault.PROMPT_LOGPROBS_ROWS_FROM_STEP_START
            sampling += range(first + span.start - chunks[i].start, first + span.stop - chunks[i].start)
        paged = None
        if whole:
            keep = np.ones(lo, dtype=bool)
            for _, first, last, _, _ in whole:
                keep[first:last] = False
            paged = np.flatnonzero(keep)
        rows = np.array([ids, positions, slots, row_seq, row_keys], dtype=np.int64)  # [5, tokens]
        plan = AttentionPlan(np.array(tables, dtype=np.int64), rows[3], rows[4], whole, paged)
        return rows[:3], plan, np.array(sampling, dtype=np.int64), sum(row_keys)

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
        """Under Fault.CHUNK_ORDER_DEPENDENT_LOGITS_ROW, the row chunk i samples from (`end`: its rows end
        there; without the fault, its last row, end - 1)."""
        if chunks[i].phase == "prefill" and i + 1 < len(chunks) and chunks[i + 1].phase == "decode":
            return end - 1 + chunks[i + 1].num_tokens  # Fault.CHUNK_ORDER_DEPENDENT_LOGITS_ROW
        return end - 1


def _own_features(images, first, feature):  # -> features [rows, hidden], deepstack levels [rows, hidden] each
    features, deepstack = images.features
    return features[feature], [level[feature] for level in deepstack]


def _step_first_features(images, first, feature):  # Fault.IMAGE_FEATURES_FROM_NEIGHBOUR
    return _own_features(first, first, feature % len(first.features[0]))


def _rows_from_chunk_start(feature):  # Fault.IMAGE_FEATURES_RESTART_AT_CHUNK
    return np.where(feature >= 0, np.cumsum(feature >= 0) - 1, -1)
