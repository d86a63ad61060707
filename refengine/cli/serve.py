"""serve: the OpenAI-compatible HTTP server (refengine/server.py) on one model."""
from __future__ import annotations

import argparse

from ..engine import MODES, EngineConfig
from ..engine.config import SCHEDULING_POLICIES
from ..errors import RefengineError
from ..serve.server import MAX_BODY_BYTES, OpenAIServer
from .common import FAULT_ENV, add_model_argument, fault_from, open_model


def run_serve(args) -> int:
    if not 0 <= args.port <= 65535:
        raise RefengineError(f"--port: must be 0..65535 (0 picks a free port), got {args.port}")
    if args.max_waiting < 0:
        raise RefengineError(f"--max-waiting: must be >= 0, got {args.max_waiting}")
    if not args.queue_timeout > 0:
        raise RefengineError(f"--queue-timeout: must be > 0 seconds, got {args.queue_timeout}")
    config = EngineConfig(mode=args.mode, max_num_seqs=args.max_num_seqs,
                          max_num_batched_tokens=args.max_num_batched_tokens, block_size=args.block_size,
                          num_blocks=args.num_blocks, max_model_len=args.max_model_len,
                          scheduling_policy=args.scheduling_policy,
                          enable_prefix_caching=args.enable_prefix_caching,
                          **_speculation(args.speculative), fault=fault_from(args))
    try:
        server = OpenAIServer(open_model(args), config, args.host, args.port, max_waiting=args.max_waiting,
                              queue_timeout=args.queue_timeout, served_name=args.served_model_name,
                              max_body_bytes=args.max_body_bytes)
    except OSError as e:
        raise RefengineError(f"--host/--port: cannot listen on {args.host}:{args.port} ({e.strerror})") from None
    print(f"serving {server.url}", flush=True)
    try:
        server.serve_forever()
    finally:
        server.server_close()
    return 0


def _speculation(spec: str | None) -> dict:
    """--speculative ngram:K (K draft tokens by prompt lookup) or draft:DIR:K (by the model in DIR) ->
    EngineConfig's speculation fields; none -> off."""
    if spec is None:
        return {}
    method, _, rest = spec.partition(":")
    folder, _, k = rest.rpartition(":") if method == "draft" else ("", "", rest)
    if method not in ("ngram", "draft") or not k.isdigit() or int(k) < 1 or (method == "draft") != bool(folder):
        raise RefengineError(f"--speculative: expected ngram:K or draft:DIR:K with K >= 1 draft tokens, got {spec!r}")
    return {"num_speculative_tokens": int(k), **({"speculative_model": folder} if folder else {})}


def register(subparsers) -> None:
    p = subparsers.add_parser("serve", help="OpenAI-compatible HTTP server (completions, chat, SSE, admin status)")
    add_model_argument(p)
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=8000, help="0 picks a free port (the bound URL is printed)")
    p.add_argument("--served-model-name", help="the `model` name clients send (default: the folder name)")
    p.add_argument("--mode", choices=MODES, default="fast")
    p.add_argument("--max-num-seqs", type=int, default=8)
    p.add_argument("--max-num-batched-tokens", type=int, default=512)
    p.add_argument("--num-blocks", type=int)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--max-model-len", type=int)
    p.add_argument("--scheduling-policy", choices=SCHEDULING_POLICIES, default="fcfs",
                   help="the order of each step's chunks (outputs must not depend on it)")
    p.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=True,
                   help="share computed KV blocks between requests with a common prompt prefix (and the same "
                        "cache_salt), as vLLM, SGLang and llama.cpp do by default")
    p.add_argument("--speculative", metavar="ngram:K|draft:DIR:K",
                   help="speculative decoding: up to K draft tokens per decode, verified in the batched forward, "
                        "by prompt lookup (n-grams of the request's own tokens) or by the draft model in DIR (the "
                        "same vocabulary)")
    p.add_argument("--max-waiting", type=int, default=64,
                   help="requests that may queue beyond the running batch before new ones wait for a slot")
    p.add_argument("--queue-timeout", type=float, default=30.0,
                   help="seconds a request waits for a slot before it gets 503")
    p.add_argument("--max-body-bytes", type=int, default=MAX_BODY_BYTES)
    p.add_argument("--fault", help=f"inject a catalogued bug (default: ${FAULT_ENV}; see `refengine faults`)")
    p.set_defaults(func=run_serve)
