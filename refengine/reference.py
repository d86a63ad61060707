"""The float64 serial reference forward: the oracle every other result is judged against.

One sequence at a time, a contiguous KV cache, float64 throughout. Written to be read.

The same math runs in the precision of the weights it is given: with `model.weights(np.float32)`
every operation stays float32 (the RoPE angles are computed in float64, as the engine's tables are,
and rounded to the working precision). That float32 reference -- no scheduler, no paging, no
batching -- is what refengine.check.calibrate holds against the float64 one to bound float32 noise.

A model whose float64 copy would not fit in memory is streamed (Model.reference_weights: each layer widened
when the forward reaches it and dropped after), so the oracle of an 8B model needs about one layer
of float64 memory plus its KV cache, at the price of widening the weights again on every pass.
A golden refresh decodes its cases in lockstep groups (generate_lockstep): each still its own
sequence and cache, their rows stacked into each product, so a pass reads the model once per group.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from .model import Model, ModelConfig
from .model.routing import top_k
from .model.weights import LayerWeights, StreamedWeights, Weights, row_blocks
from .sampling import (
    PromptLogprob,
    SamplingParams,
    StepRecord,
    cut_at_stop_string,
    finish_reason,
    greedy_token,
    log_softmax,
    token_logprobs,
    token_rank,
    top2_margin,
)


def rms_norm(x, weight, eps):  # x [..., dim], weight [dim]
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * weight


def silu(x):
    return x / (1.0 + np.exp(-x))


def rope_angles(positions, head_dim, theta):  # -> [seq, head_dim]
    inv_freq = 1.0 / theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)  # [head_dim/2]
    angles = np.outer(positions, inv_freq)                                               # [seq, head_dim/2]
    return np.concatenate([angles, angles], axis=-1)                                     # [seq, head_dim]


def mrope_stream(head_dim: int, section) -> np.ndarray:
    """Which position stream (0 t, 1 h, 2 w) drives each of the head_dim / 2 rotary frequencies, in
    Qwen3-VL's interleaved layout: frequency j is h's if j % 3 == 1 and j < 3 * section[1], w's if
    j % 3 == 2 and j < 3 * section[2], else t's."""
    j = np.arange(head_dim // 2)
    return np.where((j % 3 == 1) & (j < 3 * section[1]), 1, np.where((j % 3 == 2) & (j < 3 * section[2]), 2, 0))


def mrope_angles(positions, head_dim, theta, section):  # positions [3, seq] (t, h, w) -> [seq, head_dim]
    """Qwen3-VL's multimodal RoPE: each frequency turns by the position of one stream (mrope_stream's
    interleaved layout). With the three streams equal (text) these are rope_angles exactly."""
    inv_freq = 1.0 / theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)  # [head_dim/2]
    stream = mrope_stream(head_dim, section)                                             # [head_dim/2]
    angles = np.asarray(positions)[stream].T * inv_freq                                  # [seq, head_dim/2]
    return np.concatenate([angles, angles], axis=-1)                                     # [seq, head_dim]


def apply_rotary(x, angles):  # x [seq, heads, head_dim], angles [seq, head_dim]
    angles = angles[:, None, :]                                                # [seq, 1, head_dim]
    cos, sin = np.cos(angles).astype(x.dtype), np.sin(angles).astype(x.dtype)  # in x's precision
    half = x.shape[-1] // 2
    rotated = np.concatenate([-x[..., half:], x[..., :half]], axis=-1)  # rotate_half: [seq, heads, head_dim]
    return x * cos + rotated * sin


def apply_rope(x, positions, theta):  # x [seq, heads, head_dim]
    return apply_rotary(x, rope_angles(positions, x.shape[-1], theta))


def linear(x, weight, bias=None):  # x [seq, in], weight [out, in] -> [seq, out]
    y = x @ weight.T
    return y if bias is None else y + bias


def softmax(x):  # x [..., n]
    e = np.exp(x - x.max(axis=-1, keepdims=True))
    return e / e.sum(axis=-1, keepdims=True)


def causal_attention(q, k, v, q_positions):
    """q [seq, n_heads, hd]; k, v [total, n_kv_heads, hd] hold every key up to the last query."""
    n_heads, n_kv_heads, head_dim = q.shape[1], k.shape[1], q.shape[2]
    group = n_heads // n_kv_heads
    k = np.repeat(k, group, axis=1)                                      # [total, n_heads, hd]
    v = np.repeat(v, group, axis=1)                                      # [total, n_heads, hd]
    scores = np.einsum("shd,thd->hst", q, k) / np.sqrt(head_dim, dtype=q.dtype)  # [n_heads, seq, total]
    key_positions = np.arange(k.shape[0])
    future = key_positions[None, :] > np.asarray(q_positions)[:, None]   # [seq, total]
    scores = np.where(future[None], -np.inf, scores)
    return np.einsum("hst,thd->shd", softmax(scores), v)                 # [seq, n_heads, hd]


@dataclass
class KVCache:
    """Per layer, keys and values of every position so far: [positions, n_kv_heads, head_dim]."""
    keys: list = field(default_factory=list)
    values: list = field(default_factory=list)

    @property
    def length(self) -> int:
        return self.keys[0].shape[0] if self.keys else 0

    def extend(self, layer: int, k, v):  # k, v [seq, n_kv_heads, hd] -> every key and value so far [total, ...]
        if layer == len(self.keys):
            self.keys.append(k)
            self.values.append(v)
        else:
            self.keys[layer] = np.concatenate([self.keys[layer], k])      # [total, n_kv_heads, hd]
            self.values[layer] = np.concatenate([self.values[layer], v])  # [total, n_kv_heads, hd]
        return self.keys[layer], self.values[layer]


def attention_block(x, w: LayerWeights, cfg: ModelConfig, layer: int, caches: list[KVCache], positions,
                    angles=None):
    """x [tokens, hidden]: the rows of every sequence of `caches` in turn, positions[i] [seq_i] the
    i-th's. The projections take every row in one product; attention is each sequence's own.
    `angles` [tokens, head_dim], where given, are the RoPE angles in place of the positions' own
    (multimodal RoPE: the rotation and the causal order then no longer follow the same numbers)."""
    tokens = x.shape[0]
    q = linear(x, w.q_proj, w.q_bias).reshape(tokens, cfg.num_heads, cfg.head_dim)     # [tokens, n_heads, hd]
    k = linear(x, w.k_proj, w.k_bias).reshape(tokens, cfg.num_kv_heads, cfg.head_dim)  # [tokens, n_kv_heads, hd]
    v = linear(x, w.v_proj, w.v_bias).reshape(tokens, cfg.num_kv_heads, cfg.head_dim)  # [tokens, n_kv_heads, hd]
    if cfg.qk_norm:
        q = rms_norm(q, w.q_norm, cfg.rms_norm_eps)
        k = rms_norm(k, w.k_norm, cfg.rms_norm_eps)
    if angles is None:
        angles = rope_angles(np.concatenate(positions), cfg.head_dim, cfg.rope_theta)  # [tokens, head_dim]
    q = apply_rotary(q, angles)
    k = apply_rotary(k, angles)
    bounds = np.cumsum([0] + [len(p) for p in positions])
    out = [causal_attention(q[lo:hi], *cache.extend(layer, k[lo:hi], v[lo:hi]), pos)    # [seq_i, n_heads, hd]
           for cache, pos, lo, hi in zip(caches, positions, bounds[:-1], bounds[1:])]
    return linear(np.concatenate(out).reshape(tokens, cfg.q_size), w.o_proj, w.o_bias)  # [tokens, hidden]


def mlp_block(x, w: LayerWeights):  # x [tokens, hidden]
    gate = silu(linear(x, w.gate_proj, w.gate_bias))  # [tokens, intermediate]
    up = linear(x, w.up_proj, w.up_bias)              # [tokens, intermediate]
    return linear(gate * up, w.down_proj, w.down_bias)  # [tokens, hidden]


def moe_block(x, w: LayerWeights, cfg: ModelConfig):  # x [tokens, hidden]
    """Qwen3-MoE: each token goes to the num_experts_per_tok experts its router rates highest (ties as
    torch.topk breaks them: model.routing), their SwiGLU outputs weighted by the router probabilities
    (renormalized over the chosen ones with norm_topk_prob) and summed."""
    probs = softmax(linear(x, w.router))                                     # [tokens, experts]
    chosen = top_k(probs, cfg.num_experts_per_tok)                           # [tokens, k]
    weights = np.take_along_axis(probs, chosen, axis=-1)                     # [tokens, k]
    if cfg.norm_topk_prob:
        weights = weights / weights.sum(axis=-1, keepdims=True)
    out = np.zeros_like(x)                                                   # [tokens, hidden]
    for e in np.unique(chosen):
        token, rank = np.nonzero(chosen == e)                                # the tokens that chose expert e
        gate = silu(linear(x[token], w.expert_gate[e]))                      # [n, moe_intermediate]
        up = linear(x[token], w.expert_up[e])                                # [n, moe_intermediate]
        out[token] += weights[token, rank, None] * linear(gate * up, w.expert_down[e])  # [n, hidden]
    return out


def decoder_layer(x, w: LayerWeights, cfg: ModelConfig, layer: int, caches: list[KVCache], positions,
                  angles=None):
    """x [tokens, hidden]: the rows of every sequence of `caches` in turn (attention_block)."""
    x = x + attention_block(rms_norm(x, w.input_norm, cfg.rms_norm_eps), w, cfg, layer, caches, positions, angles)
    h = rms_norm(x, w.post_norm, cfg.rms_norm_eps)                                      # [tokens, hidden]
    return x + (moe_block(h, w, cfg) if layer in cfg.sparse_layers else mlp_block(h, w))  # [tokens, hidden]


def final_hidden_lockstep(weights: Weights | StreamedWeights, cfg: ModelConfig, batch):
    """Per (ids, cache) of `batch`, the final-normed hidden states [len(ids), hidden] for `ids`
    following that cache's positions; extends each cache. One pass over the weights serves every
    sequence: each weight multiplies all their rows at once (read, and streamed widened, once), and
    each sequence attends over its own cache only. A sequence's results therefore depend on the
    batch in the last bits (BLAS is not batch-invariant), never beyond float64 rounding
    (tests/test_streamed_reference.py); alone, a batch of one, they are the plain serial forward's."""
    caches = [cache for _, cache in batch]
    positions = [cache.length + np.arange(len(ids)) for ids, cache in batch]  # per sequence [seq_i]
    x = weights.embed[np.concatenate([np.asarray(ids) for ids, _ in batch])]  # [tokens, hidden]
    for layer, w in enumerate(weights.layers):
        x = decoder_layer(x, w, cfg, layer, caches, positions)
    x = rms_norm(x, weights.norm, cfg.rms_norm_eps)                           # [tokens, hidden]
    return np.split(x, np.cumsum([len(ids) for ids, _ in batch])[:-1])        # per sequence [seq_i, hidden]


def final_hidden(weights: Weights | StreamedWeights, cfg: ModelConfig, ids, cache: KVCache):
    """The final-normed hidden states [len(ids), hidden] for `ids` following the cache's positions;
    extends the cache."""
    return final_hidden_lockstep(weights, cfg, [(ids, cache)])[0]


def final_hidden_with_images(weights: Weights | StreamedWeights, cfg: ModelConfig, x, cache: KVCache, angles,
                             image_rows, deepstack):
    """Qwen3-VL's language model on input embeddings x [seq, hidden] (the image rows already the
    tower's embeddings) following the cache: RoPE by `angles` [seq, head_dim] (mrope_angles), and
    after decoder layer n < len(deepstack) the image rows get deepstack[n] [images' tokens, hidden]
    added (DeepStack: the tower's earlier blocks fed into the first layers). Final-normed hidden
    states [seq, hidden]; extends the cache."""
    positions = [cache.length + np.arange(len(x))]  # the causal order: cache indices, not RoPE positions
    for layer, w in enumerate(weights.layers):
        x = decoder_layer(x, w, cfg, layer, [cache], positions, angles)   # [seq, hidden]
        if layer < len(deepstack):
            x[image_rows] += deepstack[layer]
    return rms_norm(x, weights.norm, cfg.rms_norm_eps)                     # [seq, hidden]


def output_head(weights: Weights | StreamedWeights, h):  # h [rows, hidden] -> logits [rows, vocab]
    return np.concatenate([h @ block.T for block in row_blocks(weights.lm_head)], axis=-1)


def next_logits_lockstep(weights: Weights | StreamedWeights, cfg: ModelConfig, batch):
    """Per (ids, cache) of `batch`, the logits [vocab] after its last id (what greedy decoding takes);
    extends each cache. Only those rows meet the output head, which is read once for all of them."""
    last = np.stack([h[-1] for h in final_hidden_lockstep(weights, cfg, batch)])  # [sequences, hidden]
    return output_head(weights, last)                                             # [sequences, vocab]


def forward(weights: Weights | StreamedWeights, cfg: ModelConfig, ids, cache: KVCache):
    """Logits [len(ids), vocab] for `ids` following the cache's positions; extends the cache."""
    return output_head(weights, final_hidden(weights, cfg, ids, cache))


def prompt_logits(model: Model, ids, dtype=np.float64):
    """Logits at every position of `ids`: [len(ids), vocab], computed in `dtype` (float64: the oracle)."""
    ids = model.check_prompt(ids)
    return forward(model.reference_weights(dtype), model.config, ids, KVCache())


def prompt_logprobs(model: Model, prompt_ids, k: int, dtype=np.float64, keep_logits: bool = False):
    """vLLM's prompt_logprobs: for each prompt token after the first, its log-probability given the
    tokens before it -- read from the row of the position before it -- with its rank and the k most
    likely ids there. The first token has none (nothing comes before it)."""
    return prompt_logprobs_of(prompt_logits(model, prompt_ids, dtype), prompt_ids, k, keep_logits)


def prompt_logprobs_of(logits, prompt_ids, k: int, keep_logits: bool = False):
    """prompt_logprobs read from the prompt's logits [len(prompt), vocab]."""
    out = []
    for position in range(1, len(prompt_ids)):
        row = logits[position - 1]                                   # [vocab]: predicts prompt_ids[position]
        token = prompt_ids[position]
        logprob, top = token_logprobs(row, token, k)
        out.append(PromptLogprob(position, token, logprob, token_rank(log_softmax(row), token), top,
                                 logits=row if keep_logits else None))
    return out


def adjusted_logits(logits, prompt_ids, output_ids, params: SamplingParams, eos_token_ids):
    """The row a request's next token is chosen from (vLLM's logits processors, in vLLM's order), in
    float64: while fewer than min_tokens tokens are out, its stop ids (eos unless ignore_eos, and
    stop_token_ids) are impossible; then logit_bias is added; then every id seen in the prompt or the
    output is pulled towards zero by the repetition penalty r (a positive logit divided by r, a
    negative one multiplied); then each output id loses frequency_penalty per occurrence and
    presence_penalty once. The model's own logits (and the logprobs reported from them) are untouched."""
    x = np.array(logits, dtype=np.float64)                                  # [vocab]
    vocab = len(x)
    if len(output_ids) < params.min_tokens:
        stops = set(params.stop_token_ids) | (set() if params.ignore_eos else set(eos_token_ids))
        x[[t for t in sorted(stops) if t < vocab]] = -np.inf
    for token, bias in params.logit_bias:
        x[token] += bias
    counts = np.bincount(np.asarray(output_ids, dtype=np.int64), minlength=vocab)  # [vocab]
    seen = counts > 0                                                        # [vocab]
    seen_anywhere = seen | np.isin(np.arange(vocab), prompt_ids)             # [vocab]
    r = params.repetition_penalty
    x = np.where(seen_anywhere, np.where(x > 0, x / r, x * r), x)
    return x - params.frequency_penalty * counts - params.presence_penalty * seen


@dataclass
class GenerationResult:
    prompt_ids: list[int]
    token_ids: list[int]
    text: str
    finish_reason: str
    steps: list[StepRecord]
    prompt_logprobs: list[PromptLogprob] | None = None  # where params.prompt_logprobs asked for them

    @property
    def margins(self) -> list[float]:
        return [s.top2_margin for s in self.steps]


class Greedy:
    """One sequence of a greedy decode: its cache, its tokens, and when it stops."""

    def __init__(self, model: Model, prompt_ids, params: SamplingParams, top_k_logprobs: int, keep_logits: bool):
        if not params.greedy:
            raise ValueError("the reference decodes greedily; seeded requests have no float64 baseline")
        self.prompt_ids, self.params, self.cfg = model.check_prompt(prompt_ids), params, model.config
        self.top_k, self.keep_logits = top_k_logprobs, keep_logits
        self.detok, self.cache = model.tokenizer.detokenizer(), KVCache()
        self.token_ids, self.steps, self.result = [], [], None
        self.stop_from = 0  # stop strings count where they end past this (sampling.finish_reason)
        self.next_ids = self.prompt_ids  # what the next forward feeds: the prompt, then each new token

    def take(self, logits) -> None:  # logits [vocab]: the next token's
        chosen_from = adjusted_logits(logits, self.prompt_ids, self.token_ids, self.params, self.cfg.eos_token_ids) \
            if self.params.processes_logits else logits
        token = greedy_token(chosen_from)
        logprob, top = token_logprobs(logits, token, self.top_k)
        self.token_ids.append(token)
        kept = self.keep_logits
        self.steps.append(StepRecord(token, top2_margin(chosen_from), top, logprob, logits=logits if kept else None,
                                     adjusted=chosen_from if kept and self.params.processes_logits else None))
        self.detok.push(token)
        if len(self.token_ids) <= self.params.min_tokens:
            self.stop_from = len(self.detok.text)
        reason = finish_reason(token, len(self.token_ids), self.detok.text, self.params, self.cfg.eos_token_ids,
                               self.stop_from)
        if reason is None and len(self.prompt_ids) + len(self.token_ids) >= self.cfg.max_position_embeddings:
            reason = "length"
        if reason:
            self.detok.flush()
            text = cut_at_stop_string(self.detok.text, self.params.stop, self.stop_from)
            self.result = GenerationResult(self.prompt_ids, self.token_ids, text, reason, self.steps)
        self.next_ids = [token]


def generate_lockstep(model: Model, prompts: list, params: list[SamplingParams], dtype=np.float64,
                      top_k_logprobs: int = 5, keep_logits: bool = False, progress=None) -> list[GenerationResult]:
    """Greedy decoding of every prompt at once, one token each per pass over the weights (each its
    own sequence: own KV cache, own attention; the products stacked), stopping as the engine stops.
    A pass reads (streamed: widens) the model once for all prompts instead of once per prompt, and
    multiplies each weight by all their rows in one product. Each result equals generate() of that
    prompt alone up to float64 rounding -- tokens identical, margins and logprobs within 1e-9
    relative, as between two CPUs (tests/test_streamed_reference.py) -- and the same prompts in the
    same order give the same bits every time. `progress(n)`: called with the tokens a pass made."""
    weights, cfg = model.reference_weights(dtype), model.config
    running = [Greedy(model, p, sp, top_k_logprobs, keep_logits) for p, sp in zip(prompts, params)]
    done = list(running)
    while running:
        logits = next_logits_lockstep(weights, cfg, [(g.next_ids, g.cache) for g in running])
        for g, row in zip(running, logits):
            g.take(row)
        if progress:
            progress(len(running))
        running = [g for g in running if g.result is None]
    for g in done:
        if g.params.prompt_logprobs is not None:
            g.result.prompt_logprobs = prompt_logprobs(model, g.prompt_ids, g.params.prompt_logprobs, dtype,
                                                       keep_logits)
    return [g.result for g in done]


def generate(model: Model, prompt_ids, params: SamplingParams, dtype=np.float64, top_k_logprobs: int = 5,
             keep_logits: bool = False) -> GenerationResult:
    """Greedy decoding, one token per forward, stopping as the engine stops. Each step records the
    token, the top-2 margin, the token's and the top-k log-probabilities, and with `keep_logits`
    the logits row (what the suite and the calibration compare the engine's rows with)."""
    return generate_lockstep(model, [prompt_ids], [params], dtype, top_k_logprobs, keep_logits)[0]
