"""The precision report (validate.precision) on real data: `validate()` against an in-process
`refengine serve` on 127.0.0.1 with the tiny model, healthy (a float32 engine: its logprobs differ
from the float64 golden ones, within the golden float32 bound) and faulty (real divergences); then
the same records with every logprob shifted by a known amount, as a less precise server would send."""
from __future__ import annotations

import copy
import json

import pytest

from refengine.check.golden import read_golden
from refengine.data import shipped
from refengine.engine import EngineConfig
from refengine.model import load_model
from refengine.model.tiny import make_tiny
from refengine.serve import OpenAIServer
from refengine.validate.board import Cases, validate
from refengine.validate.plan import Settings
from refengine.validate.precision import (
    MAX_KEPT_DELTAS,
    agreeing_deltas,
    format_precision,
    plot_precision,
    precision,
)

SHIFT = 0.03  # about what a float16 server's logprobs are off by
FAULT = "kv-write-block-boundary-off-by-one"  # corrupts every answer past one KV block


@pytest.fixture(scope="module")
def golden():
    return read_golden(shipped("golden", "tiny-random.jsonl"))


def run_validate(tiny_model, golden, engine: EngineConfig, **settings) -> dict:
    server = OpenAIServer(tiny_model, engine, host="127.0.0.1")
    server.start()
    try:
        return validate(server.url, Cases.of_golden(golden), Settings(**{"variant_rate": 0.0, **settings}))
    finally:
        server.close()


@pytest.fixture(scope="module")
def healthy(tiny_model, golden):
    report = run_validate(tiny_model, golden, EngineConfig(max_num_seqs=4), concurrency=4, seed=1, cancel_rate=0.3)
    assert report["summary"]["passed"], report["summary"]
    return report


@pytest.fixture(scope="module")
def faulty(tiny_model, golden):
    report = run_validate(tiny_model, golden, EngineConfig(max_num_seqs=4, fault=FAULT), concurrency=4, seed=1)
    assert report["summary"]["diverged"] > 0, report["summary"]
    return report


@pytest.fixture(scope="module")
def bf16(tmp_path_factory, golden):
    """The same tiny weights stored as bf16, served at the tolerance docs/guides/board-validation.md uses for bf16."""
    model = load_model(make_tiny(tmp_path_factory.mktemp("tiny-bf16"), dtype="BF16"))
    return run_validate(model, golden, EngineConfig(max_num_seqs=8), concurrency=8, seed=1, cancel_rate=0.25,
                        margin_tolerance=0.1)


def expected_steps(records: list[dict], golden) -> int:
    """Agreeing steps, counted from the verdicts alone: a match agrees on every golden token, an
    explained or diverged answer on those before its first divergence."""
    cases = {c.id: c for c in golden.cases}
    return sum(len(cases[r["case"]].token_ids) if r["verdict"] == "match" else r["step"]
               for r in records if r["verdict"] in ("match", "explained", "diverged") and not r.get("variant"))


def test_golden_top1_is_the_golden_token(golden):
    """What precision() relies on to read the golden logprob of each agreeing token."""
    for case in golden.cases:
        assert [top[0][0] for top in case.top_logprobs] == case.token_ids


def test_a_float32_server_is_within_the_float32_bound_but_not_bit_equal(healthy, golden):
    records = healthy["requests"]
    assert all("logprobs" in r for r in records if r["verdict"] == "match")
    p = precision(records, golden)
    noise = golden.header["noise"]
    assert 0 < p["max"] < noise["f32_vs_f64"] * noise["safety_factor"]
    assert p["p50"] <= p["p99"] <= p["max"]
    assert p["steps"] == expected_steps(records, golden) > 0
    assert p["records"] == sum(r["verdict"] in ("match", "explained", "diverged") for r in records)
    assert (p["by_text"], p["without_logprobs"], p["divergences"]) == (0, 0, [])
    assert (p["float32_bound"], p["safety_factor"]) == (noise["f32_vs_f64"], noise["safety_factor"])
    assert p["tolerance_called_for"] == pytest.approx(p["max"] * noise["safety_factor"])
    assert p["tolerance_called_for"] <= golden.tolerance
    assert len(p["deltas"]) == p["steps"] < MAX_KEPT_DELTAS and max(p["deltas"]) == p["max"]
    json.dumps(p)  # goes into the JSON report as it is


def test_logprobs_shifted_as_by_a_float16_server_call_for_a_wider_tolerance(healthy, golden):
    records = copy.deepcopy(healthy["requests"])
    for r in records:
        if r.get("logprobs") is not None:
            r["logprobs"] = [lp + SHIFT for lp in r["logprobs"]]
    p = precision(records, golden)
    assert p["max"] == pytest.approx(SHIFT, abs=1e-4) and p["p50"] == pytest.approx(SHIFT, abs=1e-4)
    assert p["tolerance_called_for"] == pytest.approx(SHIFT * golden.header["noise"]["safety_factor"], rel=1e-2)
    assert p["tolerance_called_for"] > golden.tolerance
    assert p["steps"] == expected_steps(records, golden)
    assert any("less precise than float32" in line for line in format_precision(p))


def test_the_error_is_set_against_the_runs_own_16_bit_tolerance(healthy, golden):
    records = copy.deepcopy(healthy["requests"])
    for r in records:
        if r.get("logprobs") is not None:
            r["logprobs"] = [lp + SHIFT for lp in r["logprobs"]]
    called_for = precision(records, golden)["tolerance_called_for"]

    def row(run: str, tolerance: float | None) -> str | None:
        p = precision(records, golden, run, tolerance)
        assert (p["run_precision"], p["run_tolerance"]) == (run, tolerance)
        return next((line.split(None, 3)[-1] for line in format_precision(p) if line.strip().startswith("vs ")
                     and f"vs {run} tolerance" in line), None)

    assert row("fp16", called_for * 2).startswith("within it")
    assert row("fp16", called_for / 2).startswith("2x wider")
    assert row("bf16", None) is None and row("f32", called_for / 2) is None  # float32: the golden row says it


def test_a_bf16_server_calls_for_a_tolerance_that_explains_its_divergences(bf16, golden):
    """bf16 weights move logprobs by ~1e-2: far past the float32 bound, and the tolerance that error
    calls for covers the near-ties where its answers part from the float64 ones."""
    p = precision(bf16["requests"], golden)
    assert p["max"] > golden.tolerance and p["tolerance_called_for"] > 0.1
    assert p["steps"] == expected_steps(bf16["requests"], golden)
    assert p["divergences"] and all(d["inside"] for d in p["divergences"])
    assert any("less precise than float32" in line for line in format_precision(p))


def test_divergences_are_set_against_the_tolerance_called_for(faulty, golden):
    records = faulty["requests"]
    p = precision(records, golden)
    diverging = [r for r in records if r["verdict"] in ("explained", "diverged")]
    assert [d["id"] for d in p["divergences"]] == [r["id"] for r in diverging]
    for d, r in zip(p["divergences"], diverging):
        assert (d["step"], d["margin"]) == (r["step"], r["margin"])
        assert d["inside"] is (r["margin"] is not None and r["margin"] <= p["tolerance_called_for"])
    assert p["steps"] == expected_steps(records, golden)
    lines = format_precision(p)
    assert sum(line.strip().startswith(f"divergence {r['id']} ") for r in diverging for line in lines) == len(diverging)


def test_records_without_ids_are_skipped_and_counted(healthy, golden):
    records = copy.deepcopy(healthy["requests"])
    by_text = [r for r in records if r["verdict"] == "match"][:3]
    for r in by_text:  # as from a server that reports logprobs but no token ids
        r["token_ids"], r["compared_by"] = None, "text"
    p = precision(records, golden)
    assert p["by_text"] == 3
    assert p["steps"] == expected_steps([r for r in records if r not in by_text], golden)


def test_no_logprobs_no_precision_report(healthy, golden):
    records = copy.deepcopy(healthy["requests"])
    for r in records:
        r.pop("logprobs", None)
    assert precision(records, golden) is None
    assert agreeing_deltas(records, golden)[1]["without_logprobs"] == healthy["overlap"]["compared"]


def test_the_text_table_is_aligned(healthy, golden):
    p = precision(healthy["requests"], golden)
    lines = format_precision(p)
    rows = lines[1:]
    assert len({line.index(value) for line, value in zip(rows, (f"{p['max']:.3g}", f"{p['p50']:.3g}"))}) == 1
    text = "\n".join(lines)
    for expected in (f"{p['max']:.3g}", f"{p['p99']:.3g}", f"{p['steps']} agreeing steps",
                     f"{p['float32_bound']:.3g}", f"{p['tolerance_called_for']:.3g}", "float32-grade"):
        assert expected in text


def test_the_plot_writes_a_png(healthy, golden, tmp_path):
    pytest.importorskip("matplotlib")
    p = precision(healthy["requests"], golden)
    path = plot_precision(p, None, tmp_path / "precision.png")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    deltas, _ = agreeing_deltas(healthy["requests"], golden)
    other = plot_precision({k: v for k, v in p.items() if k != "deltas"}, deltas, tmp_path / "again.png")
    assert other.stat().st_size > 0


def test_a_variants_divergence_is_not_a_precision_one():
    """A variant (validate.variants) was judged against its own alone answer: the golden file has no answer
    to its fields, so its divergence says nothing of the server's precision."""
    from refengine.validate.precision import precision
    golden = read_golden(shipped("golden/tiny-random.jsonl"))
    case = golden.cases[0]
    logprobs = [top[0][1] for top in case.top_logprobs]
    plain = {"id": "a", "case": case.id, "verdict": "explained", "step": 1, "margin": 0.01,
             "token_ids": case.token_ids, "logprobs": logprobs}
    variant = {**plain, "id": "b", "case": f"{case.id}+n", "variant": "n"}
    report = precision([plain, variant], golden)
    assert [d["id"] for d in report["divergences"]] == ["a"] and report["records"] == 1
