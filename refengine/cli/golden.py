"""golden refresh, golden check: write golden files with the float64 reference, judge the engine by them."""
from __future__ import annotations

from ..check.calibrate import calibrate, load_calibration, stored_calibration
from ..check.golden import (
    LOCKSTEP_GROUP,
    default_golden_path,
    load_prompts,
    merge_shards,
    read_golden,
    refresh,
)
from ..check.golden_check import check
from ..engine import MODES
from ..errors import RefengineError
from .common import FAULT_ENV, add_model_argument, fault_from, open_model


def run_refresh(args) -> int:
    if args.ray is not None and args.shard:
        raise RefengineError("--ray: the cluster runs every lockstep group; give --shard to a refresh without it")
    model = open_model(args)
    prompts = load_prompts(args.prompts)
    if args.calibration:
        noise = load_calibration(args.calibration)
    else:
        noise = stored_calibration(model) or calibrate(model)
    if args.ray is not None:
        from ..check.golden_ray import refresh_on_ray
        golden = refresh_on_ray(model, args.prompts, prompts, args.out, noise, args.lockstep_group, args.ray)
    else:
        golden = refresh(model, args.prompts, prompts, args.out, noise, parse_shard(args.shard), args.lockstep_group)
    tokens = sum(len(c.token_ids) for c in golden.cases)
    print(f"wrote {args.out}: {len(golden.cases)} cases, {tokens} tokens, model {golden.fingerprint}, "
          f"tolerance {golden.tolerance:.6g}" + (f", shard {args.shard}" if args.shard else ""))
    return 0


def parse_shard(text: str | None) -> tuple[int, int] | None:
    if text is None:
        return None
    index, slash, count = text.partition("/")
    if not slash or not index.isdigit() or not count.isdigit():
        raise RefengineError(f"--shard: expected I/N (e.g. 2/4), got {text!r}")
    return int(index), int(count)


def run_merge(args) -> int:
    golden = merge_shards(args.shards, args.out)
    print(f"wrote {args.out}: {len(golden.cases)} cases from {len(args.shards)} shards, model {golden.fingerprint}")
    return 0


def run_check(args) -> int:
    golden = read_golden(args.golden or default_golden_path())
    model = open_model(args)
    result = check(golden, model, args.mode, args.seed, args.max_num_seqs, args.max_num_batched_tokens,
                   fault_from(args))
    print(result.report(decode=lambda i: model.tokenizer.decode([i], skip_special_tokens=False)))
    return 0 if result.passed else 1


def register(subparsers) -> None:
    golden = subparsers.add_parser("golden", help="golden files: float64 reference answers to a prompt set")
    commands = golden.add_subparsers(dest="golden_command", required=True, parser_class=type(golden))

    p = commands.add_parser("refresh", help="run the float64 reference on a prompt set, write the golden file")
    add_model_argument(p)
    p.add_argument("--prompts", required=True, help="prompts JSONL (FORMATS.md)")
    p.add_argument("--out", required=True, help="golden JSONL to write (replaced atomically)")
    p.add_argument("--calibration", metavar="FILE",
                   help="noise calibration to put in the header (default: golden/*.calibration.json for this model, "
                        "else calibrate the model now)")
    p.add_argument("--shard", metavar="I/N", help="refresh only shard I of N (every N-th lockstep group from the "
                                                 "I-th); `golden merge` joins the N shard files")
    p.add_argument("--lockstep-group", type=int, default=LOCKSTEP_GROUP, metavar="N",
                   help=f"prompts decoded together per pass over the weights (default {LOCKSTEP_GROUP}; recorded in "
                        "the header: shards and whole refreshes of one size give the same bytes)")
    p.add_argument("--ray", nargs="?", const="", metavar="ADDRESS",
                   help="run each lockstep group as a task on a Ray cluster: ADDRESS (auto: this node's running "
                        "cluster), else $RAY_ADDRESS or a new local cluster; writes the same bytes as a refresh "
                        "here (the ray extra)")
    p.set_defaults(func=run_refresh)

    p = commands.add_parser("merge", help="join the shard files of a sharded refresh into one golden file")
    p.add_argument("shards", nargs="+", help="the N shard files (refresh --shard I/N), in any order")
    p.add_argument("--out", required=True, help="golden JSONL to write (byte-identical to an unsharded refresh)")
    p.set_defaults(func=run_merge)

    p = commands.add_parser("check", help="run the float32 engine on every case as one random join/leave "
                                          "schedule and apply the margin rule")
    p.add_argument("golden", nargs="?", help="golden JSONL file (default: the shipped golden file of the "
                                             "embedded default model)")
    add_model_argument(p)
    p.add_argument("--mode", choices=MODES, default="fast")
    p.add_argument("--seed", type=int, default=0, help="arrival schedule seed")
    p.add_argument("--max-num-seqs", type=int, default=4)
    p.add_argument("--max-num-batched-tokens", type=int, default=32)
    p.add_argument("--fault", help=f"inject a catalogued bug (default: ${FAULT_ENV}; see `refengine faults`)")
    p.set_defaults(func=run_check)
