"""The timeline of a run (check.timeline, `replay --plot`, `run-schedule --plot`) against what the
schedule file and the engine's outputs say independently: arrivals and the abort at the file's
steps, a chunked prefill adding up to the prompt, one decode per token after the first, the
preemption the pool forces, finishes as the outputs give them, and the first divergence of a faulty
run at the verdict's step and margin. And the pictures are written (or the bad path named)."""
from __future__ import annotations

import pytest

from refengine.check.driver import run_batched
from refengine.check.replay import replay
from refengine.check.schedule import load_schedule
from refengine.check.timeline import plot_timeline, timeline
from refengine.cli import main
from refengine.data import shipped

EXAMPLE = shipped("examples", "join_leave.json")
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(scope="module")
def run(default_model):
    schedule = load_schedule(EXAMPLE)
    engine, failure = run_batched(default_model, schedule, schedule.engine, keep_logits=False)
    assert failure is None
    return schedule, engine, timeline(engine.trace, engine.outputs())


def test_rows_follow_the_schedule_file(run, default_model):
    schedule, engine, rows = run
    requests = {r.id: r for r in schedule.requests}
    assert [row.id for row in rows] == [r.id for r in schedule.requests]
    outputs = engine.outputs()
    for row in rows:
        request, out = requests[row.id], outputs[row.id]
        assert row.arrival == request.arrival_step
        steps = [step for step, _, _ in row.work]
        assert steps == sorted(set(steps)) and steps[0] >= row.arrival
        if request.abort_step is not None:
            assert row.aborted == request.abort_step and row.finish is None and steps[-1] < row.aborted
        else:
            assert row.aborted is None and row.finish == (steps[-1], out.finish_reason)
            assert out.finish_reason == ("stop" if len(out.token_ids) < request.params.max_tokens else "length")
        if not row.preempted:  # each token after the first from its own decode, the first from the last chunk
            assert sum(phase == "decode" for _, phase, _ in row.work) == len(out.token_ids) - 1
            prompt = default_model.tokenizer.encode(request.prompt["prompt"]) if "prompt" in request.prompt \
                else request.prompt["prompt_ids"]
            assert sum(n for _, phase, n in row.work if phase == "prefill") == len(prompt)


def test_the_example_shows_a_chunked_prefill_a_preemption_and_no_divergence(run):
    _, _, rows = run
    by_id = {row.id: row for row in rows}
    assert sum(phase == "prefill" for _, phase, _ in by_id["story"].work) >= 2
    preempted = [row for row in rows if row.preempted]
    assert preempted, "the example's pool no longer forces a preemption"
    for row in preempted:  # recomputed after it: a prefill again, after the step that took its blocks
        assert any(phase == "prefill" and step > row.preempted[0] for step, phase, _ in row.work)
        assert row.preempted[0] not in [step for step, _, _ in row.work]
    assert all(row.divergence is None for row in rows)


def test_a_faulty_run_marks_each_first_divergence_at_the_verdicts_step_and_margin(default_model):
    result = replay(default_model, load_schedule(EXAMPLE), fault="position-off-by-one-on-join")
    rows = {row.id: row for row in timeline(result.trace, result.outputs, result.verdicts)}
    diverged = [v for v in result.verdicts.values() if v.kind == "diverged"]
    assert diverged and not result.passed
    for v in result.verdicts.values():
        d = rows[v.id].divergence
        if v.kind == "diverged":
            assert (d.step, d.kind, d.margin) == (v.engine_step, "diverged", v.margin)
            assert d.step in [step for step, _, _ in rows[v.id].work]
        else:
            assert d is None


def test_the_pictures_are_written_and_widen_with_the_run(run, tmp_path):
    pytest.importorskip("matplotlib")
    from matplotlib.image import imread
    _, engine, rows = run
    short = plot_timeline(rows, len(engine.trace), tmp_path / "short.png", "short")
    long = plot_timeline(rows, 3 * len(engine.trace), tmp_path / "long.png", "long")
    assert short.read_bytes()[:8] == PNG_MAGIC
    assert imread(long).shape[1] > imread(short).shape[1]


@pytest.mark.parametrize("command", [["replay"], ["replay", "--fault", "position-off-by-one-on-join"],
                                     ["run-schedule"], ["run-schedule", "--serial"]])
def test_the_commands_draw_their_run(command, tmp_path):
    pytest.importorskip("matplotlib")
    out = tmp_path / "timeline.png"
    code = main([*command, "--plot", str(out)])
    assert code == (1 if "--fault" in command else 0)
    assert out.read_bytes()[:8] == PNG_MAGIC


def test_a_plot_path_that_cannot_be_written_is_named(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    bad = tmp_path / "missing" / "timeline.png"
    assert main(["replay", "--plot", str(bad)]) == 2
    err = capsys.readouterr().err
    assert len(err.splitlines()) == 1 and "--plot" in err and str(bad) in err
