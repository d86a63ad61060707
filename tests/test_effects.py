"""Precision and batching apart (validate.bounds, validate.effects, check.rounded): the bound a 16-bit
server is held to comes from refengine's reference rounded as such an engine rounds, never from the
server; against a golden file each case is sent alone first (the precision effect) and every loaded
answer is held to its alone answer (the batching effect). Servers are real `refengine serve` on
127.0.0.1 serving the embedded default model; assertions are on report fields, never on wording."""
from __future__ import annotations

import json
import shutil
import xml.etree.ElementTree as ET

import numpy as np
import pytest
from safetensors.numpy import load_file

from refengine.check.calibrate import load_calibration
from refengine.check.golden import read_golden
from refengine.check.margin_rule import SAFETY_FACTOR
from refengine.check.rounded import BOUND_KEYS, forward, precision_noise, rounded_weights, rounding
from refengine.data import shipped
from refengine.engine import EngineConfig
from refengine.errors import RefengineError
from refengine.model import load_model
from refengine.model.safetensors_io import save_file
from refengine.model.tiny import make_tiny
from refengine.model.weights import SINGLE_FILE
from refengine.reference import prompt_logits
from refengine.serve import OpenAIServer
from refengine.validate.board import Cases, validate
from refengine.validate.bounds import tolerances
from refengine.validate.dialect import unstripped
from refengine.validate.effects import divergences, effect_counts, plot_effects
from refengine.validate.junit import junit
from refengine.validate.plan import Settings

GOLDEN = ("golden", "tiny-chat.jsonl")
CORRUPTS_ALONE = "kv-write-block-boundary-off-by-one"  # every answer past one KV block, alone or batched
CORRUPTS_JOINS = "position-off-by-one-on-join"          # only a request that joins a running batch


@pytest.fixture(scope="module")
def golden():
    return read_golden(shipped(*GOLDEN))


def run(model, golden, fault=None, **settings) -> dict:
    server = OpenAIServer(model, EngineConfig(max_num_seqs=4, fault=fault), host="127.0.0.1")
    server.start()
    try:
        return validate(server.url, Cases.of_golden(golden),
                        Settings(concurrency=4, seed=1, variant_rate=0.0, **settings))
    finally:
        server.close()


def test_the_rounded_forward_is_off_float64_by_what_torch_in_that_precision_is(tiny_model_dir, tiny_model):
    """The bound is a model of a 16-bit engine: torch's own bf16 / fp16 forward of the same weights must
    deviate from float64 by the same order (a rounding left out, or rounding to the wrong type, moves
    it by orders of magnitude: float32 is 1e4 times closer)."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    ids = list(range(3, 40, 3))
    want = prompt_logits(tiny_model, ids)                                              # [seq, vocab] float64
    for precision, dtype in (("bf16", torch.bfloat16), ("fp16", torch.float16)):
        hf = transformers.AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=dtype, attn_implementation="eager")
        with torch.no_grad():
            theirs = np.abs(hf(torch.tensor([ids])).logits[0].double().numpy() - want).max()
        r = rounding(precision)
        ours = np.abs(forward(rounded_weights(tiny_model.weights(np.float32), r), tiny_model.config, ids, r)
                      - want).max()
        assert 1 / 3 < ours / theirs < 3, (precision, ours, theirs)
    r = rounding("f32")
    f32 = np.abs(forward(rounded_weights(tiny_model.weights(np.float32), r), tiny_model.config, ids, r) - want).max()
    assert f32 < ours / 1e3


def test_committed_16_bit_bounds_are_the_rounded_reference_and_ordered_by_precision(tiny_model, golden):
    stored = load_calibration(shipped("golden", "tiny-random.calibration.json"))
    for precision in ("bf16", "fp16"):
        assert precision_noise(tiny_model, precision)["max"] == pytest.approx(stored[BOUND_KEYS[precision]], rel=1e-3)
    for path in shipped("golden").glob("*.calibration.json"):
        c = load_calibration(path)
        assert c["f32_vs_f64"] < c["fp16_vs_f64"] < c["bf16_vs_f64"], path.name
    assert golden.header["noise"]["bf16_vs_f64"] == load_calibration(
        shipped("golden", "tiny-chat.calibration.json"))["bf16_vs_f64"]


def test_tolerances_come_from_the_golden_header_or_the_local_model_never_the_server(golden, tmp_path):
    noise = golden.header["noise"]
    t = tolerances("bf16", None, False, golden)
    assert (t.bound, t.bound_from, t.precision_from) == (noise["bf16_vs_f64"], "golden", "settings")
    assert t.precision_tolerance == t.batching == noise["bf16_vs_f64"] * SAFETY_FACTOR
    assert tolerances("bf16", None, True, golden).batching == 0.0
    assert tolerances("bf16", 0.5, False, golden).batching == tolerances("bf16", 0.5, False, golden).precision_tolerance == 0.5
    none = tolerances("f32", None, False)
    assert (none.bound, none.precision_tolerance, none.batching, none.batching_from) == (None, None, 0.0, "no bound")
    bf16_model = load_model(make_tiny(tmp_path / "bf16", dtype="BF16"))
    auto = tolerances("auto", None, False, model=bf16_model)
    assert (auto.precision, auto.precision_from, auto.bound_from) == ("bf16", "the model's config.json", "model")
    assert auto.bound == precision_noise(bf16_model, "bf16")["max"]
    old = tmp_path / "old.jsonl"  # a golden file made before 16-bit bounds
    lines = shipped(*GOLDEN).read_text(encoding="utf-8").split("\n")
    header = json.loads(lines[0])
    del header["noise"]["bf16_vs_f64"]
    old.write_text("\n".join([json.dumps(header)] + lines[1:]), encoding="utf-8")
    with pytest.raises(RefengineError, match="bf16_vs_f64"):
        tolerances("bf16", None, False, read_golden(old))
    assert tolerances("bf16", None, False, read_golden(old), bf16_model).bound_from == "model"


@pytest.fixture(scope="module")
def bf16_default(default_model, tmp_path_factory):
    """The default model with its weights stored as bf16 (what a converted device checkpoint holds),
    config.json saying so."""
    out = tmp_path_factory.mktemp("bf16") / "tiny-chat-bf16"
    shutil.copytree(default_model.path, out)
    save_file(load_file(str(default_model.path / SINGLE_FILE)), out / SINGLE_FILE, "BF16")
    config = json.loads((out / "config.json").read_text(encoding="utf-8"))
    (out / "config.json").write_text(json.dumps({**config, "torch_dtype": "bfloat16"}), encoding="utf-8")
    return load_model(out)


def test_a_clean_server_passes_at_every_precision_with_both_effects_matching(default_model, bf16_default, golden):
    for model, precision in ((default_model, "f32"), (bf16_default, "bf16")):
        report = run(model, golden, precision=precision)
        assert report["summary"]["verdict"] == "PASS", (precision, report["summary"])
        assert report["bounds"]["precision"] == precision and report["bounds"]["bound_from"] == "golden"
        assert report["settings"]["tolerance"] == golden.header["noise"][BOUND_KEYS[precision]] * SAFETY_FACTOR
        assert report["effects"]["precision"]["diverged"] == report["effects"]["batching"]["diverged"] == 0
        assert len(report["alone"]) == len(golden.cases)  # every case alone, once
        assert report["effects"]["precision"]["match"] == len(golden.cases)
        compared = [r for r in report["requests"] if r["verdict"] in ("match", "explained", "diverged")]
        assert report["effects"]["batching"]["match"] == len(compared) > 0


def test_a_batch_invariant_claim_holds_loaded_answers_to_zero(default_model, golden):
    report = run(default_model, golden, precision="bf16", batch_invariant=True)
    assert report["bounds"]["batching"] == 0.0 and report["bounds"]["batching_from"] == "batch_invariant"
    assert report["summary"]["verdict"] == "PASS"


def test_a_bug_in_every_answer_is_a_precision_effect_far_above_the_bf16_bound(bf16_default, golden):
    """A catalogued fault in a server of bf16 weights, judged at the bf16 bound: still a FAIL, every
    divergence far above the line."""
    report = run(bf16_default, golden, CORRUPTS_ALONE, precision="bf16")
    assert report["summary"]["verdict"] == "FAIL"
    tolerance = report["bounds"]["precision_tolerance"]
    diverged = [r for r in report["alone"] if r["verdict"] == "diverged"]
    assert diverged and report["effects"]["precision"]["diverged"] == len(diverged)
    assert all(r["margin"] > 4 * tolerance and r["margin_from"] == "golden" for r in diverged)


def test_a_bug_only_under_batching_is_a_batching_effect(default_model, golden):
    report = run(default_model, golden, CORRUPTS_JOINS, precision="f32", cancel_rate=0.0, repeat=2)
    assert report["summary"]["verdict"] == "FAIL"
    assert report["effects"]["precision"]["diverged"] == 0  # alone, the fault never fires
    bad = [r for r in report["requests"] if r["batching"]["verdict"] == "diverged"]
    assert bad and report["effects"]["batching"]["diverged"] == len(bad)
    assert all(r["batching"]["margin"] is not None and r["batching"]["margin"] > report["bounds"]["batching"]
               for r in bad)


@pytest.mark.parametrize("fault, settings, effect", [
    (CORRUPTS_ALONE, {"precision": "bf16"}, "precision"),
    (CORRUPTS_JOINS, {"precision": "f32", "cancel_rate": 0.0, "repeat": 2}, "batching")])
def test_junit_xml_has_a_testcase_per_request_and_a_failure_per_divergence(default_model, golden, fault, settings,
                                                                             effect):
    report = run(default_model, golden, fault, **settings)
    assert report["effects"][effect]["diverged"] > 0
    suite = ET.fromstring(ET.tostring(junit(report).getroot()))
    cases = suite.findall("testcase")
    assert len(cases) == len(report["alone"]) + len(report["requests"]) + 1
    failed = {(c.get("classname").split(".")[0], c.get("name")) for c in cases if c.find("failure") is not None}
    want = {("alone", r["id"]) for r in report["alone"] if r["verdict"] in ("diverged", "error")}
    want |= {("loaded", r["id"]) for r in report["requests"]
             if r["verdict"] in ("diverged", "error") or r.get("batching", {}).get("verdict") in ("diverged", "error")}
    assert failed == want and want
    bad = ("diverged", "error")  # a loaded answer may fail twice: against golden and against its alone answer
    failures = sum(r["verdict"] in bad for r in report["alone"] + report["requests"])
    failures += sum(r.get("batching", {}).get("verdict") in bad for r in report["requests"])
    assert sum(len(c.findall("failure")) for c in cases) == int(suite.get("failures")) == failures
    assert int(suite.get("skipped")) == sum(r["verdict"] == "cancelled" for r in report["requests"])
    assert int(suite.get("tests")) == len(cases)


def test_junit_fails_the_drain_testcase_for_a_leak_or_a_hang_up_not_aborted(default_model, golden):
    report = run(default_model, golden, precision="f32")
    assert report["summary"]["verdict"] == "PASS"

    def drain_failure(changed: dict):
        [drain] = [c for c in ET.fromstring(ET.tostring(junit(changed).getroot())).findall("testcase")
                   if (c.get("classname"), c.get("name")) == ("server", "drain")]
        failure = drain.find("failure")
        return None if failure is None else failure.get("message")

    accounting = {"counted": 0, "must": ["r"], "unproven": [], "may": 1, "ok": False, "note": "missing abort"}
    alone_ok = {**accounting, "ok": True, "note": "alone fine", "id": "x"}
    drain = {"checked": True, "drained": True, "note": "drained"}
    assert drain_failure({**report, "drain": drain}) is None
    assert drain_failure({**report, "drain": {**drain, "checked": False, "drained": False}}) is None
    assert drain_failure({**report, "drain": {**drain, "drained": False, "note": "leaked"}}) == "leaked"
    assert drain_failure({**report, "drain": {**drain, "aborts": accounting}}) == "missing abort"
    fine = {**accounting, "ok": True, "note": "fine"}
    assert drain_failure({**report, "drain": {**drain, "aborts": {**fine, "alone": alone_ok}}}) is None
    lone = {**alone_ok, "ok": False, "note": "alone missing"}
    assert drain_failure({**report, "drain": {**drain, "aborts": {**fine, "alone": lone}}}) == "alone hang-up: alone missing"


def test_divergences_are_the_explained_and_diverged_records_of_each_effect():
    report = {"alone": [{"id": "a", "verdict": "match", "margin": None},
                        {"id": "b", "verdict": "explained", "margin": 1e-5},
                        {"id": "c", "verdict": "diverged", "margin": 0.7}],
              "requests": [{"id": "r0", "verdict": "match", "batching": {"verdict": "match", "margin": None}},
                           {"id": "r1", "verdict": "match", "batching": {"verdict": "explained", "margin": 2e-5}},
                           {"id": "r2", "verdict": "diverged", "batching": {"verdict": "diverged", "margin": None}},
                           {"id": "r3", "verdict": "cancelled"}]}
    assert divergences(report) == {"precision": [("b", 1e-5), ("c", 0.7)], "batching": [("r1", 2e-5), ("r2", None)]}
    assert effect_counts(report["requests"], report["alone"]) == {
        "precision": {"match": 1, "explained": 1, "diverged": 1},
        "batching": {"match": 1, "explained": 1, "diverged": 1}}


def test_the_effects_plot_writes_a_png(default_model, golden, tmp_path):
    pytest.importorskip("matplotlib")
    report = run(default_model, golden, CORRUPTS_ALONE, precision="bf16")
    assert plot_effects(report, tmp_path / "effects.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize("golden_text, got, want, restored", [
    (" jumps over.", "jumps over.", " jumps over.", ["leading"]),
    ("Blue.\n", "Blue.", "Blue.\n", ["trailing"]),
    (" Blue.\n", "Blue.", " Blue.\n", ["leading", "trailing"]),
    (" Blue.", " Red.", " Red.", []),       # whitespace of its own: nothing given back
    ("Blue.", "Blue. And", "Blue. And", []),  # nothing stripped where the golden text has no whitespace
    ("Blue. ", "Red.", "Red.", []),          # trailing given back only to the golden text itself
])
def test_whitespace_a_server_stripped_is_given_back_only_where_it_has_none(golden_text, got, want, restored):
    assert unstripped(golden_text, got) == (want, restored)


def test_a_stripped_text_only_answer_matches_and_says_so(golden):
    from refengine.validate.baseline import GoldenBaseline
    from refengine.validate.plan import Planned
    from refengine.validate.wire import Completion
    case = next(c for c in golden.cases if c.text.startswith(" "))
    judged = GoldenBaseline(golden, golden.tolerance).judge(
        Planned("x", case, "completions", 0.0, False, None),
        Completion(case.text.lstrip(), None, None, case.finish_reason, False))
    assert judged["verdict"] == "match" and judged["whitespace_restored"] == ["leading"]
    changed = GoldenBaseline(golden, golden.tolerance).judge(
        Planned("x", case, "completions", 0.0, False, None),
        Completion("X" + case.text.lstrip()[1:], None, None, case.finish_reason, False))
    assert changed["verdict"] == "diverged"


def test_an_answer_with_its_special_tokens_written_matches_the_golden_one_decoded_alike(tiny_model_dir):
    """transformers serve decodes without skipping special tokens: tiny-random's another-drink generates
    <|im_start|>, which the golden text skips and its text shows. The expected text is the tokenizer's
    own decode of the golden tokens, specials kept."""
    from dataclasses import replace

    from refengine.model.tokenizer import Tokenizer
    from refengine.validate.baseline import GoldenBaseline
    from refengine.validate.plan import Planned
    from refengine.validate.wire import Completion
    golden = read_golden(shipped("golden", "tiny-random.jsonl"))
    tokenizer = Tokenizer(tiny_model_dir)
    case = next(c for c in golden.cases if any(t in golden.special_tokens for t in c.token_ids))
    written = tokenizer.decode(case.token_ids, skip_special_tokens=False)
    assert written != case.text and golden.special_tokens == tokenizer.special_tokens()
    rendered = case.with_special_tokens(golden.special_tokens)
    assert rendered.text == written
    for step in range(len(case.token_ids)):  # each offset: the text settled once that token is decoded
        assert rendered.text_offsets[step] == len(
            tokenizer.decode(case.token_ids[:step + 1], skip_special_tokens=False).rstrip("\ufffd"))

    def judge(golden, text):
        return GoldenBaseline(golden, golden.tolerance).judge(Planned("x", case, "chat", 0.0, False, None),
                                                              Completion(text, None, None, case.finish_reason, False))
    judged = judge(golden, written)
    assert judged["verdict"] == "match" and judged["special_tokens_rendered"] == ["<|im_start|>"]
    assert "special_tokens_rendered" not in judge(golden, case.text)  # skipped, as the golden text has it
    at = written.index("<|im_start|>") + len("<|im_start|>")
    changed = judge(golden, written[:at] + "Z" + written[at + 1:])
    assert changed["verdict"] == "diverged" and changed["step"] > 2  # the text after the special still judged
    unknown = replace(golden, header={k: v for k, v in golden.header.items() if k != "special_tokens"})
    assert judge(unknown, written)["verdict"] == "diverged"  # a golden file made before the header key


def test_a_golden_header_with_malformed_special_tokens_is_refused(tmp_path):
    lines = shipped("golden", "tiny-random.jsonl").read_text().splitlines()
    header = json.loads(lines[0])
    header["special_tokens"] = {"<|im_start|>": 1}
    path = tmp_path / "bad.jsonl"
    path.write_text("\n".join([json.dumps(header)] + lines[1:]) + "\n")
    with pytest.raises(RefengineError, match="special_tokens") as excinfo:
        read_golden(path)
    assert str(path) in str(excinfo.value)


def test_a_bound_measured_on_the_model_is_kept_by_fingerprint_and_precision(tmp_path, monkeypatch):
    from refengine.validate.bounds import measured_bound
    monkeypatch.setenv("REFENGINE_CACHE", str(tmp_path / "cache"))
    model = load_model(make_tiny(tmp_path / "m"))
    bound = measured_bound(model, "bf16")
    assert bound == precision_noise(model, "bf16")["max"]
    [kept] = (tmp_path / "cache" / "bounds").iterdir()
    record = json.loads(kept.read_text(encoding="utf-8"))
    assert (record["model_fingerprint"], record["precision"], record["max"]) == (model.fingerprint, "bf16", bound)
    kept.write_text(json.dumps({**record, "max": 123.0}), encoding="utf-8")  # what is kept is what is read
    assert measured_bound(model, "bf16") == 123.0
    assert measured_bound(model, "fp16") == precision_noise(model, "fp16")["max"]  # another precision: measured
    kept.write_text("{", encoding="utf-8")  # a torn file is measured again
    assert measured_bound(model, "bf16") == bound
