"""`refengine validate` with images: a golden file's image cases go to the chat API with every image as
a data URL, over real HTTP on 127.0.0.1 against `refengine serve` of the tiny Qwen3-VL model. The
board-style run, eight chats of which four show one or two noise images, every request in flight at
once (concurrency 8), passes the correct server and fails each served image fault with a divergence.

What the server's token budget does to image prompts: at 16 tokens a step, every image prompt longer
than 16 is split into chunks, at the same places alone and batched (the larger images' runs of image
tokens are cut), and every prefill chunk sits behind the decode rows of the requests before it; at 64,
a prompt fits one step whole and the next request's first chunk fills the rest of it, so two image
prompts share steps. The faults of where image tokens fall in a prompt (positions, chunk starts) show at
16 from the chunking alone; a fault that mixes two requests' images needs two in one step, which the
arrivals decide: at 64 with four rounds of the eight chats it showed in 100 of 100 runs (each with 1 to
6 divergences) when this test was written, and with two busy loops on the machine's two cores in 12 of
12 (2 to 6); it is sent in eight rounds (3 to 12 divergences in 12 runs under that load). On the correct server nothing depends on timing: every
answer is the golden one, however the requests were batched."""
from __future__ import annotations

import base64
import hashlib
import json

import pytest
from test_golden_images import (  # noqa: F401 (the fixtures)
    VL,
    image_part,
    png,
    vl_calibration,
    vl_model_dir,
    write_jsonl,
)
from test_serve_images import data_url
from test_validate import get_json, serving

from refengine.check.calibrate import load_calibration
from refengine.check.golden import load_prompts, read_golden, refresh
from refengine.cli import main
from refengine.engine import FAULTS
from refengine.errors import RefengineError
from refengine.model import load_model
from refengine.strategies.models import tiny_model_dir
from refengine.validate.margins import LocalMargins
from refengine.validate.plan import Planned, Settings, plan, request_body

SPLIT, SHARED = "16", "64"  # token budgets per step (the module's docstring says what each does to images)
# fault -> (the server's token budget, rounds of the eight chats)
IMAGE_FAULTS = {"image-positions-from-step-rows": (SPLIT, 4), "image-features-from-neighbour": (SHARED, 8),
                "deepstack-one-layer-late": (SPLIT, 4), "text-after-image-one-position": (SPLIT, 4),
                "image-features-restart-at-chunk": (SPLIT, 4)}
# (height, width, seed) of each image of the four image chats (the images of IMAGE_FIRST before their
# text, the others after it); the other four chats are text only
IMAGES = {"one": [(16, 16, 1)], "wide": [(24, 16, 2)], "pair": [(32, 32, 3), (8, 8, 4)], "big": [(32, 32, 5)]}
IMAGE_FIRST = {"one", "big"}
TEXTS = {"one": "What is in the picture?", "wide": "Describe it.", "pair": "Which is larger?", "big": "And this?",
         "hello": "Hello", "capital": "What is the capital of Japan?", "colour": "Name a colour.", "tea": "Tea?"}


@pytest.fixture(scope="module")
def board_golden(vl_model_dir, vl_calibration, tmp_path_factory):  # noqa: F811
    """The board's golden file: four image chats, then four text chats; a chat's first image is a file
    beside the prompts, its second a data URL."""
    folder = tmp_path_factory.mktemp("board")
    lines = []
    for case_id, text in TEXTS.items():
        parts = []
        for n, (height, width, seed) in enumerate(IMAGES.get(case_id, [])):
            if n == 0:
                (folder / f"{case_id}.png").write_bytes(png(height, width, seed))
                parts.append(image_part(f"{case_id}.png"))
            else:
                parts.append(image_part(data_url(png(height, width, seed))))
        content = [{"type": "text", "text": text}, *parts] if parts else text
        if case_id in IMAGE_FIRST:
            content = content[1:] + content[:1]
        lines.append({"id": case_id, "messages": [{"role": "user", "content": content}], "max_tokens": 16})
    prompts = write_jsonl(folder / "prompts.jsonl", lines)
    out = folder / "board.jsonl"
    refresh(load_model(vl_model_dir), prompts, load_prompts(prompts), out, load_calibration(vl_calibration))
    return out


@pytest.fixture
def serve_vl(vl_model_dir):  # noqa: F811
    yield from serving(vl_model_dir)


def validate(url: str, golden, tmp_path, *extra: str) -> tuple[int, dict]:
    """One board run: every request in flight at once (no timing decides whether they overlap)."""
    report = tmp_path / "report.json"
    code = main(["validate", "--url", url, "--golden", str(golden), "--concurrency", "8", "--seed", "1",
                 "--arrival-spread", "0", "--timeout", "60", "--report", str(report),
                 "--repro", str(tmp_path / "repro.json"), *extra])
    return code, json.loads(report.read_text(encoding="utf-8"))


def test_image_cases_go_to_chat_as_data_urls_without_sha256(board_golden):
    golden = read_golden(board_golden)
    pair = next(c for c in golden.cases if c.id == "pair")
    body = request_body(Planned("r0", pair, "chat", 0.0, False, None), "m")
    parts = body["messages"][0]["content"]
    assert [p["type"] for p in parts] == ["text", "image_url", "image_url"] and "sha256" not in json.dumps(body)
    for part, image in zip(parts[1:], pair.images):
        media, _, payload = part["image_url"]["url"].partition(",")
        assert media == "data:image/png;base64"
        assert hashlib.sha256(base64.b64decode(payload)).hexdigest() == image.sha256
    assert base64.b64decode(parts[1]["image_url"]["url"].partition(",")[2]) == \
        (board_golden.parent / "pair.png").read_bytes()  # a path is read and sent as it is
    with pytest.raises(RefengineError, match=r"case 'one' shows images; api completions would send its prompt ids "
                                             r"without them"):
        plan(golden.cases, Settings(api="completions"), 1.0, board_golden)


def test_local_margins_of_an_image_case_are_the_references_with_its_images(board_golden, vl_model_dir):  # noqa: F811
    margins, golden = LocalMargins(load_model(vl_model_dir)), read_golden(board_golden)
    for case in (c for c in golden.cases if c.images):
        measured = [margins.margin(case.prompt_ids, case.token_ids, i, images=case.images) for i in (0, 5)]
        assert measured == pytest.approx([case.margins[0], case.margins[5]], rel=1e-9, abs=1e-12)


def server(budget: str) -> tuple[str, ...]:
    return "--max-num-seqs", "8", "--max-num-batched-tokens", budget


@pytest.mark.parametrize("budget", [SPLIT, SHARED])
def test_validate_passes_image_cases_under_load(serve_vl, board_golden, tmp_path, budget, capsys):
    url = serve_vl(*server(budget))
    code, report = validate(url, board_golden, tmp_path, "--repeat", "2")
    assert code == 0, capsys.readouterr().out
    images = {c.id for c in read_golden(board_golden).cases if c.images}
    assert images <= {r["case"] for r in report["alone"] if r["verdict"] == "match"}  # each alone, as golden
    compared = [r for r in report["requests"] if r["verdict"] in ("match", "explained")
                and r["case"].split("+")[0] in images]  # loaded (a variant's id is <case>+<variant>)
    assert len({r["case"].split("+")[0] for r in compared}) >= 3 and {r["compared_by"] for r in compared} == \
        {"token_ids"}
    status = get_json(url, "/admin/api/status")[1]
    assert status["images_encoded"] > 0 and status["max_batch_active"] > 1

    # the same chats as a prompt set: the serial baseline, a divergence measured by the model with its images
    prompts = board_golden.parent / "prompts.jsonl"
    code = main(["validate", "--url", url, "--prompts", str(prompts), "--model", str(tiny_model_dir(VL)),
                 "--concurrency", "8", "--arrival-spread", "0", "--timeout", "60",
                 "--repro", str(tmp_path / "repro.json")])
    assert code == 0, capsys.readouterr().out


@pytest.mark.parametrize("fault", IMAGE_FAULTS)
def test_validate_fails_a_server_with_an_image_fault(serve_vl, board_golden, tmp_path, fault, capsys):
    assert fault in FAULTS, f"{fault} is not in the fault catalogue (refengine/engine/faults.py)"
    budget, rounds = IMAGE_FAULTS[fault]
    url = serve_vl(*server(budget), fault=fault)
    code, report = validate(url, board_golden, tmp_path, "--cancel-rate", "0", "--repeat", str(rounds))
    out = capsys.readouterr().out
    assert code == 1, out
    assert report["summary"]["diverged"] > 0 and "-> FAIL" in out


def test_the_serial_baseline_measures_an_image_cases_divergence_with_its_images(board_golden, vl_model_dir):  # noqa: F811
    """A server's answer that leaves its own alone answer at token 3 is judged at the float64 margin of the
    prompt with its images there: the golden file's margin, which the refresh measured with them."""
    from refengine.validate.baseline import SerialBaseline
    from refengine.validate.wire import Completion
    case = next(c for c in read_golden(board_golden).cases if c.id == "pair")
    alone = Completion(case.text, list(case.token_ids), list(case.prompt_ids), case.finish_reason, False)
    other = [*case.token_ids[:3], (case.token_ids[3] + 1) % 512, *case.token_ids[4:]]
    got = Completion("", other, list(case.prompt_ids), case.finish_reason, False)
    verdict = SerialBaseline({(case.id, "chat"): alone}, 0.0, margins=LocalMargins(load_model(vl_model_dir))).judge(
        Planned("r0", case, "chat", 0.0, False, None), got)
    assert (verdict["verdict"], verdict["step"], verdict["margin_from"]) == ("diverged", 3, "model")
    assert verdict["margin"] == pytest.approx(case.margins[3], rel=1e-9)
