"""info, logits, generate, margins, make-tiny, train-tiny-chat: the foundation commands."""
from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np

from .. import blas as blas_info
from ..check.margins import measure_margins
from ..engine import numerics
from ..errors import RefengineError
from ..model import load_model
from ..model.tiny import ARCHITECTURES, PRESETS, TRAINED_RECIPE, TinySpec, make_tiny
from ..model.train import TrainSpec, train_tiny_chat
from ..reference import generate, prompt_logits
from ..sampling import SamplingParams
from .common import add_model_argument, open_model, parse_ids, print_json

PRECISIONS = {"f64": np.float64, "f32": np.float32}


def run_info(args) -> int:
    model = open_model(args)
    cfg = model.config
    rows = {
        "path": str(model.path), "architecture": cfg.arch, "layers": cfg.num_layers, "hidden": cfg.hidden_size,
        "heads": f"{cfg.num_heads} (kv {cfg.num_kv_heads}), head_dim {cfg.head_dim}",
        "intermediate": cfg.intermediate_size, "vocab": cfg.vocab_size, "tied": cfg.tie_word_embeddings,
        "rope_theta": cfg.rope_theta, "parameters": f"{cfg.num_parameters:,}",
        "stored dtype": ",".join(model.checkpoint.stored_dtypes), "eos ids": list(cfg.eos_token_ids),
        "fingerprint": model.fingerprint,
    }
    if cfg.num_experts:
        rows["experts"] = (f"{cfg.num_experts}, {cfg.num_experts_per_tok} per token, width {cfg.moe_intermediate_size}; "
                           f"sparse layers {list(cfg.sparse_layers)}")
    blas = blas_info.blas_identity()
    rows.update({
        "blas": f"{blas['internal_api']} {blas['version']} ({blas['name']})", "blas kernel": blas["architecture"],
        "blas threads": blas["threads"],
        "invariant mode": "available (the compiled kernels' rows are bit-exact alone and batched here)"
        if numerics.invariant_kernels_hold() else "refused: the compiled kernels' rows differ alone and batched "
                                                  "on this machine (fast mode works)",
    })
    width = max(map(len, rows))
    for key, value in rows.items():
        print(f"{key:<{width}}  {value}")
    return 0


def run_logits(args) -> int:
    model = open_model(args)
    ids = model.check_prompt(parse_ids(args.ids), "--ids")
    logits = prompt_logits(model, ids, PRECISIONS[args.precision])
    np.save(args.out, logits)
    print(f"wrote {args.out}: logits {list(logits.shape)} {logits.dtype}")
    return 0


def prompt_ids_from_args(model, args) -> list[int]:
    if args.ids is not None:
        return model.check_prompt(parse_ids(args.ids), "--ids")
    if args.chat is not None:
        return model.check_prompt(model.tokenizer.encode_chat([{"role": "user", "content": args.chat}]), "--chat")
    return model.check_prompt(model.tokenizer.encode(args.prompt), "--prompt")


def run_generate(args) -> int:
    model = open_model(args)
    ids = prompt_ids_from_args(model, args)
    params = SamplingParams(max_tokens=args.max_tokens, stop=tuple(args.stop or ()))
    result = generate(model, ids, params, PRECISIONS[args.precision])
    if args.json:
        print_json({"prompt_ids": ids, "token_ids": result.token_ids, "text": result.text,
                    "finish_reason": result.finish_reason, "margins": result.margins,
                    "top_logprobs": [s.top_logprobs for s in result.steps]})
        return 0
    print(result.text)
    print(f"-- {len(result.token_ids)} tokens, finish_reason={result.finish_reason}, precision={args.precision}")
    print("ids:     " + ",".join(map(str, result.token_ids)))
    print("margins: " + " ".join(f"{m:.3f}" for m in result.margins))
    return 0


def run_margins(args) -> int:
    stats = measure_margins(open_model(args), args.prompts, args.max_tokens, args.seed)
    if args.json:
        print_json(stats.as_dict())
    else:
        print(stats.table())
    return 0


def _int_tuple(text: str) -> tuple[int, ...]:
    try:
        return tuple(int(v) for v in text.split(",") if v.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated layer numbers, got {text!r}") from None


def run_make_tiny(args) -> int:
    base = PRESETS[args.preset]
    overrides = {field: getattr(args, field) for field in
                 ("arch", "layers", "hidden", "heads", "kv_heads", "head_dim", "intermediate", "vocab", "tie",
                  "experts", "experts_per_tok", "moe_intermediate", "mlp_only_layers")
                 if getattr(args, field) is not None}
    spec = TinySpec(**{**base.__dict__, **overrides})
    for field in ("layers", "hidden", "heads", "kv_heads", "head_dim", "intermediate"):
        if getattr(spec, field) < 1:
            raise RefengineError(f"--{field.replace('_', '-')}: must be >= 1, got {getattr(spec, field)}")
    out = make_tiny(Path(args.out_dir), spec, seed=args.seed, dtype=args.dtype.upper(), shards=args.shards)
    print(f"wrote {out} ({args.preset} preset, {spec.arch}, seed {args.seed})")
    return 0


def run_train_tiny_chat(args) -> int:
    if args.steps < 1:
        raise RefengineError(f"steps: must be >= 1, got {args.steps}")
    out = train_tiny_chat(Path(args.out_dir), TrainSpec(seed=args.seed, steps=args.steps), data=args.data)
    recipe = json.loads((out / TRAINED_RECIPE).read_text(encoding="utf-8"))
    print(f"wrote {out} (tiny-chat, {recipe['steps']} steps, seed {recipe['seed']}, final loss {recipe['final_loss']}, "
          f"{load_model(out).fingerprint})")
    return 0


def register(subparsers) -> None:
    p = subparsers.add_parser("info", help="architecture, sizes, parameter count, dtype, fingerprint")
    add_model_argument(p)
    p.set_defaults(func=run_info)

    p = subparsers.add_parser("logits", help="float64 (or float32) reference logits at every position")
    add_model_argument(p)
    p.add_argument("--ids", required=True, help="comma-separated token ids")
    p.add_argument("--precision", choices=PRECISIONS, default="f64")
    p.add_argument("--out", required=True, help="output .npy file, shape [len, vocab]")
    p.set_defaults(func=run_logits)

    p = subparsers.add_parser("generate", help="greedy generation with the serial reference forward")
    add_model_argument(p)
    source = p.add_mutually_exclusive_group(required=True)
    source.add_argument("--prompt", help="raw text prompt")
    source.add_argument("--chat", help="one user message, rendered with the model's chat template")
    source.add_argument("--ids", help="comma-separated prompt token ids")
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--stop", action="append", help="stop string (repeatable)")
    p.add_argument("--precision", choices=PRECISIONS, default="f64")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=run_generate)

    p = subparsers.add_parser("margins", help="distribution of greedy top-2 logit margins (float64 reference)")
    add_model_argument(p)
    p.add_argument("--prompts", type=int, default=32, help="number of random prompts")
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=run_margins)

    p = subparsers.add_parser("make-tiny", help="write a random HF-format test model folder")
    p.add_argument("out_dir")
    p.add_argument("--preset", choices=PRESETS, default="tiny")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--arch", choices=ARCHITECTURES)
    for flag in ("layers", "hidden", "heads", "kv-heads", "head-dim", "intermediate", "vocab",
                 "experts", "experts-per-tok", "moe-intermediate"):
        p.add_argument(f"--{flag}", type=int)
    p.add_argument("--mlp-only-layers", type=_int_tuple, help="qwen3_moe: comma-separated dense layers")
    p.add_argument("--dtype", choices=["f32", "bf16", "f16"], default="f32")
    p.add_argument("--shards", type=int, default=1)
    p.add_argument("--tie", action=argparse.BooleanOptionalAction, default=None)
    p.set_defaults(func=run_make_tiny)

    p = subparsers.add_parser("train-tiny-chat", help="train the embedded default model, tiny-chat, with transformers "
                              "(needs the parity extra); the defaults reproduce the shipped folder")
    p.add_argument("out_dir")
    p.add_argument("--seed", type=int, default=TrainSpec.seed)
    p.add_argument("--steps", type=int, default=TrainSpec.steps)
    p.add_argument("--data", metavar="FILE", help="training examples, JSONL (default: the shipped "
                   "training/tiny-chat.jsonl; the format: docs/formats.md, Training examples)")
    p.set_defaults(func=run_train_tiny_chat)
