"""Precision bounds for servers that compute in bf16 or fp16: how far logits move when a correct
engine stores every tensor in 16 bits, measured on refengine's own reference, never on the server.

A GPU, NPU or board engine serving a model "in bf16" rounds the weights to bf16 once, and every
activation it writes to memory (each product's output, each norm's output, the residual stream,
the attention probabilities, the logits) to bf16, while each product and reduction accumulates in
float32 (tensor cores, transformers' eager and SDPA paths, llama.cpp's and RKNN's bf16/f16 kernels).
`forward` is the reference's math with exactly those roundings: float32 arithmetic, the rounding
`r` applied wherever such an engine stores a tensor. The float64 reference is the truth, so

    bf16_vs_f64 = max |logit of the rounded forward - float64 logit|

over the calibration prompts teacher-forced through the float64 greedy answers (check.calibrate's
prompts) is the deviation a correct bf16 engine shows. The margin rule's tolerance for such a
server is that bound times the safety factor, as for float32 (check.margin_rule.tolerance): a
server whose logits are right up to bf16 rounding can swap two tokens only where their float64
margin is within twice the deviation. The server under test cannot move this bound: it is
computed from the model's weights by refengine, and committed with every calibration
(refengine/data/golden/*.calibration.json) and every golden file's header.

Mixture-of-experts layers round the block's input and output only: the router and the experts'
products inside run in float32 (tests/test_effects.py holds the dense path to torch's bf16 and fp16).
"""
from __future__ import annotations

import ml_dtypes
import numpy as np

from .. import reference
from ..model import Model, ModelConfig
from ..model.weights import LayerWeights, Weights
from ..reference import apply_rope, rms_norm, silu, softmax
from ..sampling import SamplingParams

PRECISIONS = ("f32", "bf16", "fp16")
# the calibration's key of each precision's bound; f32's is check.calibrate's, measured as one prefill and token by token
BOUND_KEYS = {"f32": "f32_vs_f64", "bf16": "bf16_vs_f64", "fp16": "fp16_vs_f64"}
STORAGE = {"f32": np.float32, "bf16": ml_dtypes.bfloat16, "fp16": np.float16}
SEED = 0
PROMPT_LENGTHS = (1, 2, 3, 5, 8, 13, 16, 17, 24, 31, 33, 48)
MAX_TOKENS = 16


def calibration_prompts(vocab_size: int) -> list[list[int]]:
    """The prompts every bound of a model is measured on (here and in check.calibrate)."""
    rng = np.random.default_rng(SEED)
    return [rng.integers(0, vocab_size, size=length).tolist() for length in PROMPT_LENGTHS]


def rounding(precision: str):
    """The function that stores a float32 tensor at `precision` and reads it back as float32."""
    storage = STORAGE[precision]
    return lambda a: np.asarray(a, dtype=np.float32).astype(storage).astype(np.float32)


def rounded_weights(weights: Weights, r) -> Weights:
    def each(layer: LayerWeights) -> LayerWeights:
        return LayerWeights(**{k: None if v is None else r(v) for k, v in layer.__dict__.items()})
    return Weights(r(weights.embed), [each(layer) for layer in weights.layers], r(weights.norm), r(weights.lm_head))


def attention(q, k, v, r):  # q [seq, n_heads, hd]; k, v [seq, n_kv_heads, hd]: one prefill, every position
    group = q.shape[1] // k.shape[1]
    k, v = np.repeat(k, group, axis=1), np.repeat(v, group, axis=1)                   # [seq, n_heads, hd]
    scores = r(np.einsum("shd,thd->hst", q, k) / np.sqrt(q.shape[-1], dtype=np.float32))  # [n_heads, seq, seq]
    future = np.triu(np.ones((q.shape[0], q.shape[0]), dtype=bool), 1)               # [seq, seq]
    probs = r(softmax(np.where(future[None], -np.inf, scores)))                        # softmax in float32
    return r(np.einsum("hst,thd->shd", probs, v))                                     # [seq, n_heads, hd]


def linear(x, weight, bias, r):  # x [seq, in] -> [seq, out], accumulated in float32, stored rounded
    return r(reference.linear(x, weight, bias))


def layer(x, w: LayerWeights, cfg: ModelConfig, sparse: bool, r):  # x [seq, hidden], stored rounded
    seq, positions = x.shape[0], np.arange(x.shape[0])
    h = r(rms_norm(x, w.input_norm, cfg.rms_norm_eps))                                 # [seq, hidden]
    q = linear(h, w.q_proj, w.q_bias, r).reshape(seq, cfg.num_heads, cfg.head_dim)
    k = linear(h, w.k_proj, w.k_bias, r).reshape(seq, cfg.num_kv_heads, cfg.head_dim)
    v = linear(h, w.v_proj, w.v_bias, r).reshape(seq, cfg.num_kv_heads, cfg.head_dim)
    if cfg.qk_norm:
        q, k = r(rms_norm(q, w.q_norm, cfg.rms_norm_eps)), r(rms_norm(k, w.k_norm, cfg.rms_norm_eps))
    q, k = r(apply_rope(q, positions, cfg.rope_theta)), r(apply_rope(k, positions, cfg.rope_theta))
    x = r(x + linear(attention(q, k, v, r).reshape(seq, cfg.q_size), w.o_proj, w.o_bias, r))  # [seq, hidden]
    h = r(rms_norm(x, w.post_norm, cfg.rms_norm_eps))                                  # [seq, hidden]
    if sparse:
        return r(x + r(reference.moe_block(h, w, cfg)))
    gate = r(silu(linear(h, w.gate_proj, w.gate_bias, r)))                             # [seq, intermediate]
    up = linear(h, w.up_proj, w.up_bias, r)                                            # [seq, intermediate]
    return r(x + linear(r(gate * up), w.down_proj, w.down_bias, r))                    # [seq, hidden]


def forward(weights: Weights, cfg: ModelConfig, ids, r):
    """Logits [len(ids), vocab] of one prefill of `ids`, as an engine storing tensors through `r`
    computes them (`weights` already rounded: rounded_weights)."""
    x = weights.embed[np.asarray(ids)]                                                 # [seq, hidden]
    for n, w in enumerate(weights.layers):
        x = layer(x, w, cfg, n in cfg.sparse_layers, r)
    return r(r(rms_norm(x, weights.norm, cfg.rms_norm_eps)) @ weights.lm_head.T)       # [seq, vocab]


def teacher_forced(model: Model):
    """Per calibration prompt: (prompt, ids, rows, want): the prompt followed by its float64 greedy answer
    but the last token (every token the answer was chosen from), the rows of the positions that chose a
    token, and the float64 logits there [tokens, vocab]."""
    cfg, w64 = model.config, model.weights(np.float64)
    for prompt in calibration_prompts(cfg.vocab_size):
        answer = reference.generate(model, prompt, SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True),
                                    top_k_logprobs=0)
        ids = prompt + answer.token_ids[:-1]
        rows = slice(len(prompt) - 1, len(ids))
        yield prompt, answer.token_ids, ids, rows, reference.forward(w64, cfg, ids, reference.KVCache())[rows]


def precision_noise(model: Model, precision: str) -> dict:
    """The `precision` bound of `model`: the rounded forward against the float64 reference over the
    calibration prompts teacher-forced through their float64 greedy answers, at every position that
    chose a token. -> {"max": largest |logit difference|, "median": ..., "rows": rows compared}."""
    r = rounding(precision)
    weights, deviations = rounded_weights(model.weights(np.float32), r), []
    for _, _, ids, rows, want in teacher_forced(model):
        got = forward(weights, model.config, ids, r)[rows]  # [tokens, vocab]
        deviations += np.abs(got.astype(np.float64) - want).max(axis=-1).tolist()
    return {"max": float(max(deviations)), "median": float(np.median(deviations)), "rows": len(deviations)}
