"""Golden files: the float64 reference's answers to a prompt set, kept as JSONL next to the code.

A float32 engine or a device's server is judged against them without rerunning the reference
(format: FORMATS.md). Writing is deterministic (fixed key order, floats as repr) so an unchanged
model and prompt set refresh to the same bytes, and atomic so an interrupted refresh leaves the
old file in place.

A refresh too long for one machine is sharded: shard I of N takes the prompts at positions
I-1, I-1+N, ... (round robin, so long and short cases spread evenly) and writes them as a golden
file whose header says so (`shard`: index, count, the prompt set's sha256 and its case ids in
order). `merge_shards` checks that the shards are the N of one prompt set, made from one model with
one calibration, generation and BLAS, and writes the file an unsharded refresh writes, byte for byte.

A chat case may show images (check.case_images: data URLs or paths, each pinned by its sha256): its
prompt ids hold each image's widened run of placeholder tokens, and the float64 answer comes from
vision_reference.generate_with_images, one image case at a time (the text cases of its lockstep group
still decode together, so shards and whole refreshes give the same bytes).
"""
from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass, field, replace
from pathlib import Path

from tqdm import tqdm

from .. import __version__
from ..blas import blas_identity
from ..data import shipped
from ..errors import RefengineError
from ..jsonl import json_lines
from ..model import Model
from ..model.cache import DEFAULT_MODEL_NAME
from ..model.tiny import TINY_RECIPE, TRAINED_RECIPE
from ..reference import generate_lockstep
from ..sampling import SamplingParams
from ..vision_reference import generate_with_images
from .case_images import (
    CaseImage,
    check_content,
    encode_with_images,
    read_images,
    text_messages,
    written_messages,
)
from .margin_rule import tolerance

GOLDEN_FORMAT = 1
TOP_K_LOGPROBS = 5
# Cases decoded together in lockstep. Their rows share each product, and BLAS is not batch-invariant,
# so a case's last bits depend on its group: groups are fixed runs of the prompt file, shards are made
# of whole groups, and the header records the size, which is how sharded and whole refreshes give the
# same bytes.
LOCKSTEP_GROUP = 16
PROMPT_KEYS = {"id", "prompt", "messages", "chat_template_kwargs", "max_tokens"}
CASE_KEYS = ("prompt_ids", "max_tokens", "token_ids", "text", "finish_reason", "margins", "top_logprobs",
             "text_offsets")  # each case line: id, then prompt or messages, then these
OPTIONAL_CASE_KEYS = ("text_offsets",)  # our extension of FORMATS.md; without it text cannot be aligned
# Also ours: a chat case's template arguments (`enable_thinking`, ...), on the case line after `messages`
# only when the prompt gave them, so golden files without them keep their bytes.
TEMPLATE_KWARGS_KEY = "chat_template_kwargs"
RECIPES = {"tiny_model": TINY_RECIPE, "trained_model": TRAINED_RECIPE}  # header key -> the folder's file
NOISE_KEYS = ("f32_vs_f64", "safety_factor")


def default_golden_path() -> Path:
    """The shipped golden file of the embedded default model: what `golden check` and the suite's HTTP
    properties use without a file."""
    return shipped("golden", f"{DEFAULT_MODEL_NAME}.jsonl")


@dataclass(frozen=True)
class PromptCase:
    id: str
    max_tokens: int
    prompt: str | None = None
    messages: list | None = None
    chat_template_kwargs: dict | None = None  # template arguments for `messages` (enable_thinking, ...)
    images: tuple[CaseImage, ...] = ()  # the image parts of `messages`, in order (check.case_images)
    source: str = field(default="", compare=False)  # "FILE:LINE" of its line

    @property
    def where(self) -> str:
        return f"{self.source}: case {self.id!r}" if self.source else f"case {self.id!r}"

    def encode(self, model: Model) -> list[int]:
        if self.images:
            ids = encode_with_images(model, self.where, self.messages, self.images, self.chat_template_kwargs)
        elif self.messages:
            ids = model.tokenizer.encode_chat(text_messages(self.messages), **(self.chat_template_kwargs or {}))
        else:
            ids = model.tokenizer.encode(self.prompt)
        return model.check_prompt(ids, self.where)


@dataclass(frozen=True)
class GoldenCase:
    id: str
    prompt: str | None
    messages: list | None
    prompt_ids: list[int]
    max_tokens: int
    token_ids: list[int]
    text: str
    finish_reason: str
    margins: list[float]
    top_logprobs: list[list]
    text_offsets: list[int] | None  # len(text) once token i is detokenized: text[:text_offsets[i]] is settled
    chat_template_kwargs: dict | None = None  # the template arguments `messages` were rendered with
    images: tuple[CaseImage, ...] = ()  # the image parts of `messages`, in order, verified (check.case_images)

    def text_before(self, step: int) -> str:
        return self.text[:self.text_offsets[step - 1]] if step > 0 and self.text_offsets else ""

    def piece(self, step: int) -> str:
        """The text token `step` settles (empty while a multi-byte character is still incomplete)."""
        return self.text[len(self.text_before(step)):self.text_offsets[step]]

    def with_special_tokens(self, specials: dict[int, str]) -> GoldenCase:
        """This answer as a server that does not skip special tokens decodes it: each special token's
        text written where it stands (decoders split at added tokens, so the text around it is the
        same), the offsets after it moved on by that much."""
        text, offsets, moved = self.text, [], 0
        for step, token in enumerate(self.token_ids):
            if token in specials:
                at = (self.text_offsets[step - 1] if step else 0) + moved
                text = text[:at] + specials[token] + text[at:]
                moved += len(specials[token])
            offsets.append(self.text_offsets[step] + moved)
        return replace(self, text=text, text_offsets=offsets)


@dataclass(frozen=True)
class Golden:
    path: Path
    header: dict
    cases: list[GoldenCase]

    @property
    def fingerprint(self) -> str:
        return self.header["model_fingerprint"]

    @property
    def special_tokens(self) -> dict[int, str]:
        """The model's special tokens by id (header `special_tokens`; none in files made before it)."""
        return {int(i): content for i, content in self.header.get("special_tokens", {}).items()}

    @property
    def tolerance(self) -> float:
        """The largest top-2 margin float32-vs-float64 noise can flip: measured bound x safety factor."""
        return tolerance(self.header["noise"], "f32_vs_f64")

    def require_model(self, model: Model) -> None:
        if model.fingerprint != self.fingerprint:
            raise RefengineError(
                f"{self.path}: model fingerprint mismatch: the golden file was made from {self.fingerprint}, "
                f"{model.path} is {model.fingerprint}; use that model or refresh the golden file for this one")


def _check_template_kwargs(where: str, obj: dict) -> None:
    if TEMPLATE_KWARGS_KEY not in obj:
        return
    if not isinstance(obj[TEMPLATE_KWARGS_KEY], dict):
        raise RefengineError(f"{where}: '{TEMPLATE_KWARGS_KEY}' must be an object (template argument -> value)")
    if "messages" not in obj:
        raise RefengineError(f"{where}: '{TEMPLATE_KWARGS_KEY}' needs 'messages' (it is for the chat template)")


def load_prompts(path: str | Path) -> list[PromptCase]:
    """The cases of a prompt file; image parts' files are read (relative to its folder) and verified."""
    cases, seen = [], set()
    for where, obj in json_lines(Path(path)):
        unknown = set(obj) - PROMPT_KEYS
        if unknown:
            raise RefengineError(f"{where}: unknown key(s) {', '.join(sorted(unknown))}")
        case_id, max_tokens = obj.get("id"), obj.get("max_tokens")
        if not isinstance(case_id, str) or not case_id:
            raise RefengineError(f"{where}: 'id' must be a non-empty string")
        if case_id in seen:
            raise RefengineError(f"{where}: duplicate id {case_id!r}")
        if isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 1:
            raise RefengineError(f"{where}: 'max_tokens' must be a positive integer, got {max_tokens!r}")
        if ("prompt" in obj) == ("messages" in obj):
            raise RefengineError(f"{where}: give exactly one of 'prompt' (text) or 'messages' (chat)")
        if "prompt" in obj and not (isinstance(obj["prompt"], str) and obj["prompt"]):
            raise RefengineError(f"{where}: 'prompt' must be a non-empty string")
        if "messages" in obj:
            check_content(where, obj["messages"])
        _check_template_kwargs(where, obj)
        seen.add(case_id)
        images = read_images(f"{where}: case {case_id!r}", obj.get("messages"), Path(path).parent, False)
        cases.append(PromptCase(case_id, max_tokens, obj.get("prompt"), obj.get("messages"),
                                obj.get(TEMPLATE_KWARGS_KEY), images, where))
    if not cases:
        raise RefengineError(f"{path}: no prompts")
    return cases


def lockstep_groups(cases: list, size: int = LOCKSTEP_GROUP) -> list[list]:
    if size < 1:
        raise RefengineError(f"lockstep_group: expected at least 1, got {size}")
    return [cases[start:start + size] for start in range(0, len(cases), size)]


def reference_cases(model: Model, cases: list[PromptCase], desc: str = "golden",
                    group: int = LOCKSTEP_GROUP) -> list[GoldenCase]:
    """The float64 reference's answers to `cases`: the text cases of each lockstep group decoded together
    (reference.generate_lockstep: one pass over the weights per token for them, each answer its case's
    alone up to float64 rounding), its image cases one at a time (vision_reference.generate_with_images);
    progress in tokens."""
    prompt_ids = [case.encode(model) for case in cases]
    params = [SamplingParams(max_tokens=case.max_tokens) for case in cases]
    runs, results = lockstep_groups(list(range(len(cases))), group), {}
    with tqdm(total=sum(case.max_tokens for case in cases), desc=desc, unit="tok") as bar:
        for run in runs:
            text = [n for n in run if not cases[n].images]
            if text:
                answers = generate_lockstep(model, [prompt_ids[n] for n in text], [params[n] for n in text],
                                            top_k_logprobs=TOP_K_LOGPROBS, progress=bar.update)
                results.update(zip(text, answers))
            for n in run:
                if cases[n].images:
                    pixels = [image.pixels() for image in cases[n].images]
                    results[n] = generate_with_images(model, prompt_ids[n], pixels, params[n], TOP_K_LOGPROBS)
                    bar.update(len(results[n].token_ids))
        bar.update(bar.total - bar.n)  # answers that stopped before max_tokens
    return [golden_case(model, case, prompt_ids[n], results[n]) for n, case in enumerate(cases)]


def golden_case(model: Model, case: PromptCase, prompt_ids: list[int], result) -> GoldenCase:
    detok, offsets = model.tokenizer.detokenizer(), []
    for token in result.token_ids:
        detok.push(token)
        offsets.append(len(detok.text))
    detok.flush()
    offsets[-1] = len(detok.text)
    return GoldenCase(case.id, case.prompt, case.messages, prompt_ids, case.max_tokens, result.token_ids,
                      result.text, result.finish_reason, result.margins,
                      [[[i, lp] for i, lp in s.top_logprobs] for s in result.steps], offsets,
                      chat_template_kwargs=case.chat_template_kwargs, images=case.images)


def golden_header(model: Model, prompts_path: Path, noise: dict, group: int = LOCKSTEP_GROUP) -> dict:
    header = {"golden": GOLDEN_FORMAT, "model_fingerprint": model.fingerprint, "refengine": __version__,
              "precision": "f64", "noise": noise,
              "generation": {"decoding": "greedy", "temperature": 0, "top_logprobs": TOP_K_LOGPROBS,
                             "eos_token_ids": list(model.config.eos_token_ids)},
              "prompts": prompts_path.name, "architecture": model.config.arch,
              "numerics": blas_identity(),  # the BLAS the float64 reference ran on (margins differ in the last bits)
              "lockstep_group": group}
    if specials := model.tokenizer.special_tokens():  # what a server that renders them writes in its text
        header["special_tokens"] = {str(i): content for i, content in specials.items()}
    for key, name in RECIPES.items():  # how refengine made this model, so anyone can make it again
        if (recipe := model.path / name).exists():
            header[key] = json.loads(recipe.read_text(encoding="utf-8"))
    return header


def case_line(case: GoldenCase, folder: Path) -> dict:
    """The case's line in a golden file in `folder` (its image paths relative to it, each with its sha256)."""
    messages = written_messages(case.messages, case.images, folder) if case.images else case.messages
    source = {"messages": messages} if case.messages else {"prompt": case.prompt}
    if case.chat_template_kwargs is not None:
        source[TEMPLATE_KWARGS_KEY] = case.chat_template_kwargs
    return {"id": case.id, **source, **{key: getattr(case, key) for key in CASE_KEYS}}


def write_golden(path: Path, header: dict, cases: list[GoldenCase]) -> None:
    lines = [json.dumps(header, ensure_ascii=False)] + [json.dumps(case_line(c, path.parent), ensure_ascii=False)
                                                     for c in cases]
    path.parent.mkdir(parents=True, exist_ok=True)
    temp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        with open(temp, "w", encoding="utf-8", newline="\n") as f:
            f.write("\n".join(lines) + "\n")
            f.flush()
            os.fsync(f.fileno())
        os.replace(temp, path)
    except BaseException:
        temp.unlink(missing_ok=True)
        raise


def shard_of(prompts: list[PromptCase], shard: tuple[int, int], group: int = LOCKSTEP_GROUP) -> list[PromptCase]:
    """Shard `index` of `count` (1-based): every count-th lockstep group from the index-th."""
    index, count = shard
    if not 1 <= index <= count:
        raise RefengineError(f"shard: expected I/N with 1 <= I <= N, got {index}/{count}")
    groups = lockstep_groups(prompts, group)
    if count > len(groups):
        raise RefengineError(f"shard: {count} shards of {len(prompts)} prompts in {len(groups)} lockstep group(s) "
                             f"of {group}: at most {len(groups)} shards (smaller lockstep groups make more)")
    return [case for g in groups[index - 1::count] for case in g]


def refresh(model: Model, prompts_path: str | Path, prompts: list[PromptCase], out: str | Path,
            noise: dict, shard: tuple[int, int] | None = None, group: int = LOCKSTEP_GROUP) -> Golden:
    """Run the float64 reference on every prompt (loaded from `prompts_path`), or on one shard of them,
    `group` prompts in lockstep at a time, and atomically write the golden file; `noise` is the model's
    calibration (refengine.calibrate), kept for the margin rule."""
    out, prompts_path = Path(out), Path(prompts_path)
    todo = shard_of(prompts, shard, group) if shard else prompts
    cases = reference_cases(model, todo, desc=f"golden {out.name}", group=group)
    header = golden_header(model, prompts_path, noise, group)
    if shard:
        header["shard"] = {"index": shard[0], "count": shard[1], "prompts_sha256": _sha256(prompts_path),
                           "case_ids": [p.id for p in prompts]}
    write_golden(out, header, cases)
    return Golden(out, header, cases)


def _sha256(path: Path) -> str:
    try:
        return "sha256:" + hashlib.sha256(path.read_bytes()).hexdigest()
    except OSError as e:
        raise RefengineError(f"{path}: cannot read ({e.strerror})") from None


def merge_shards(paths: list[str | Path], out: str | Path) -> Golden:
    """Join the N shard files of one refresh into the golden file the unsharded refresh writes."""
    shards = [read_golden(p) for p in paths]
    for g in shards:
        if "shard" not in g.header:
            raise RefengineError(f"{g.path}: not a shard (its header has no 'shard'; it is a whole golden file)")
    first = shards[0]
    common = {k: v for k, v in first.header.items() if k != "shard"}
    for g in shards[1:]:
        for key in sorted(set(common) | set(g.header) - {"shard"}):
            if g.header.get(key) != common.get(key):
                raise RefengineError(f"{g.path}: header field {key!r} differs from {first.path}'s: shards of "
                                     f"different models, prompt sets or settings cannot be merged")
        for key in ("count", "prompts_sha256", "case_ids"):
            if g.header["shard"][key] != first.header["shard"][key]:
                raise RefengineError(f"{g.path}: shard.{key} differs from {first.path}'s: not shards of one "
                                     f"prompt set")
    count, order = first.header["shard"]["count"], first.header["shard"]["case_ids"]
    indices = sorted(g.header["shard"]["index"] for g in shards)
    if indices != list(range(1, count + 1)):
        missing = sorted(set(range(1, count + 1)) - set(indices))
        twice = sorted({i for i in indices if indices.count(i) > 1})
        raise RefengineError(f"shards: need each of 1..{count} once; missing {missing or 'none'}, "
                             f"given twice {twice or 'none'}")
    by_id = {c.id: c for g in shards for c in g.cases}
    if sorted(by_id) != sorted(order) or sum(len(g.cases) for g in shards) != len(order):
        raise RefengineError(f"shards: their cases are not the {len(order)} cases of the prompt set "
                             f"(a shard was edited or cut short)")
    cases = [by_id[case_id] for case_id in order]
    out = Path(out)
    write_golden(out, common, cases)
    return Golden(out, common, cases)


def _parse_case(where: str, obj: dict, folder: Path) -> GoldenCase:
    missing = [k for k in ("id",) + CASE_KEYS if k not in obj and k not in OPTIONAL_CASE_KEYS]
    if missing:
        raise RefengineError(f"{where}: missing key(s) {', '.join(missing)}")
    n = len(obj["token_ids"])
    if not n or any(len(obj[k]) != n for k in ("margins", "top_logprobs", "text_offsets") if k in obj):
        raise RefengineError(f"{where}: token_ids, margins, top_logprobs and text_offsets must have one "
                             f"entry per generated token")
    _check_template_kwargs(where, obj)
    if obj.get("messages") is not None:
        check_content(where, obj["messages"])
    images = read_images(f"{where}: case {obj['id']!r}", obj.get("messages"), folder, True)
    return GoldenCase(obj["id"], obj.get("prompt"), obj.get("messages"), **{k: obj.get(k) for k in CASE_KEYS},
                      chat_template_kwargs=obj.get(TEMPLATE_KWARGS_KEY), images=images)


def read_golden(path: str | Path) -> Golden:
    path = Path(path)
    lines = list(json_lines(path))
    if not lines:
        raise RefengineError(f"{path}: empty golden file")
    where, header = lines[0]
    if header.get("golden") != GOLDEN_FORMAT:
        raise RefengineError(f"{where}: not a golden file header (expected \"golden\": {GOLDEN_FORMAT})")
    noise = header.get("noise")
    if not isinstance(header.get("model_fingerprint"), str) or not isinstance(noise, dict) or \
            any(not isinstance(noise.get(k), (int, float)) for k in NOISE_KEYS):
        raise RefengineError(f"{where}: header needs model_fingerprint and noise.{'/'.join(NOISE_KEYS)}")
    specials = header.get("special_tokens", {})
    if not isinstance(specials, dict) or any(not k.isdigit() or not isinstance(v, str) or not v
                                             for k, v in specials.items()):
        raise RefengineError(f"{where}: header special_tokens: expected an object of token id -> its text")
    cases = [_parse_case(w, obj, path.parent) for w, obj in lines[1:]]
    if not cases:
        raise RefengineError(f"{path}: no cases")
    return Golden(path, header, cases)
