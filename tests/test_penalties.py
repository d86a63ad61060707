"""The engine's logits processors (engine/penalties.py: per-request rows of batch state) against their
float64 definition (reference.adjusted_logits, written apart), row by row; what a leave, a resume and
each catalogued fault do to the rows; and the parameters' validation, naming the field."""
from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
from hypothesis.extra.numpy import arrays

from refengine.engine.faults import Fault
from refengine.engine.penalties import PenaltyRows
from refengine.engine.sequence import Sequence
from refengine.errors import RefengineError
from refengine.reference import adjusted_logits
from refengine.sampling import SamplingParams, processor_params

VOCAB, EOS = 16, (2,)
ids = st.lists(st.integers(0, VOCAB - 1), max_size=6)
params = st.builds(
    lambda p, f, r, bias, m, stops, ignore: SamplingParams(
        max_tokens=8, presence_penalty=p, frequency_penalty=f, repetition_penalty=r, logit_bias=bias, min_tokens=m,
        stop_token_ids=stops, ignore_eos=ignore),
    st.sampled_from([0.0, 2.0, -1.5]), st.sampled_from([0.0, 2.0, -0.5]), st.sampled_from([1.0, 2.0, 0.5, 1.3]),
    st.dictionaries(st.integers(0, VOCAB - 1), st.sampled_from([100.0, -100.0, 5.0, -0.25]), max_size=3).map(
        lambda d: tuple(sorted(d.items()))),
    st.integers(0, 8), st.lists(st.integers(0, VOCAB - 1), max_size=2).map(tuple), st.booleans())
rows = arrays(np.float32, VOCAB, elements=st.floats(-30, 30, width=32))


class Tokenizer:  # Sequence only pushes ids into it here
    def push(self, token):
        return ""


def sequence(request_id: str, prompt: list[int], output: list[int], p: SamplingParams, preemptions: int = 0):
    seq = Sequence(request_id, prompt or [0], p, Tokenizer(), 0)
    seq.output_ids, seq.num_preemptions = list(output), preemptions
    return seq


def apply_one(rows_state: PenaltyRows, seq, row) -> np.ndarray:
    return rows_state.apply([seq], row[None])[0]


@given(rows, ids, ids, params)
def test_a_processed_row_is_the_float64_definition_bit_for_bit(row, prompt, output, p):
    seq = sequence("a", prompt, output, p)
    state = PenaltyRows(VOCAB, EOS, None)
    state.add(seq)
    want = adjusted_logits(row.astype(np.float64), seq.prompt_ids, output, p, EOS)
    assert np.array_equal(apply_one(state, seq, row), want)


@given(rows, rows, ids, ids, params, params, st.lists(st.integers(0, VOCAB - 1), max_size=4))
def test_a_row_moved_by_a_leave_keeps_its_own_state(row_a, row_b, prompt, output, pa, pb, generated):
    """b's row moves into a's place when a leaves; what it generates afterwards is counted to it."""
    a, b = sequence("a", prompt, output, pa), sequence("b", output, prompt, pb)
    state = PenaltyRows(VOCAB, EOS, None)
    state.add(a)
    state.add(b)
    state.remove("a")
    for token in generated:
        state.record("b", token)
        b.output_ids.append(token)
    want = adjusted_logits(row_b.astype(np.float64), b.prompt_ids, b.output_ids, pb, EOS)
    assert state.ids == ["b"] and np.array_equal(apply_one(state, b, row_b), want)


@pytest.mark.parametrize("fault", [Fault.PENALTY_COUNTS_BY_BATCH_ROW, Fault.LOGIT_BIAS_WRONG_ROW])
def test_a_condense_fault_gives_the_moved_request_the_departed_ones_state(fault):
    a = sequence("a", [1], [5, 5, 5], SamplingParams(max_tokens=8, frequency_penalty=2.0, logit_bias=((7, -100.0),)))
    b = sequence("b", [1], [], SamplingParams(max_tokens=8, frequency_penalty=2.0, logit_bias=((9, 5.0),)))
    row = np.zeros(VOCAB, np.float32)
    for faulty, equal in ((None, True), (fault, False)):
        state = PenaltyRows(VOCAB, EOS, faulty)
        state.add(a)
        state.add(b)
        state.remove("a")
        want = adjusted_logits(row.astype(np.float64), b.prompt_ids, [], b.params, EOS)
        assert np.array_equal(apply_one(state, b, row), want) is equal


def test_a_resumed_request_counts_what_it_generated_before_its_preemption():
    p = SamplingParams(max_tokens=8, frequency_penalty=2.0)
    row = np.zeros(VOCAB, np.float32)
    want = adjusted_logits(row.astype(np.float64), [1], [4, 4], p, EOS)
    for fault, equal in ((None, True), (Fault.PENALTY_COUNTS_LOST_ON_RESUME, False)):
        state = PenaltyRows(VOCAB, EOS, fault)
        seq = sequence("a", [1], [4, 4], p, preemptions=1)
        state.add(seq)
        assert np.array_equal(apply_one(state, seq, row), want) is equal


def test_min_tokens_masks_eos_and_stop_ids_until_it_is_reached():
    p = SamplingParams(max_tokens=8, min_tokens=2, stop_token_ids=(5,))
    row = np.zeros(VOCAB, np.float32)
    for output, masked in (([], True), ([3], True), ([3, 3], False)):
        got = adjusted_logits(row, [1], output, p, EOS)
        assert (np.isneginf(got[[2, 5]]).all() if masked else not np.isinf(got).any()), (output, got)
    assert not np.isinf(adjusted_logits(row, [1], [], SamplingParams(max_tokens=8, min_tokens=2, ignore_eos=True),
                                        EOS)[2])


def test_the_repetition_penalty_pulls_seen_logits_towards_zero():
    row = np.array([4.0, -4.0, 4.0, -4.0] + [0.0] * (VOCAB - 4))
    got = adjusted_logits(row, [0, 1], [], SamplingParams(max_tokens=8, repetition_penalty=2.0), EOS)
    assert got[:4].tolist() == [2.0, -8.0, 4.0, -4.0]  # seen: 0 and 1; unseen: 2 and 3


@pytest.mark.parametrize("fields, named", [
    ({"presence_penalty": 2.5}, "presence_penalty"),
    ({"frequency_penalty": -3}, "frequency_penalty"),
    ({"repetition_penalty": 0}, "repetition_penalty"),
    ({"repetition_penalty": 2.5}, "repetition_penalty"),
    ({"min_tokens": 9}, "min_tokens"),
    ({"min_tokens": -1}, "min_tokens"),
    ({"logit_bias": ((3, 101.0),)}, "logit_bias"),
    ({"logit_bias": ((3, 1.0), (3, 2.0))}, "logit_bias"),
])
def test_a_bad_value_is_refused_naming_its_field(fields, named):
    with pytest.raises(RefengineError, match=f"^{named}:"):
        SamplingParams(max_tokens=8, **fields)


@pytest.mark.parametrize("body, named", [
    ({"presence_penalty": "1"}, "presence_penalty"),
    ({"presence_penalty": True}, "presence_penalty"),
    ({"min_tokens": 1.5}, "min_tokens"),
    ({"logit_bias": [[3, 1.0]]}, "logit_bias"),
    ({"logit_bias": {"three": 1.0}}, "logit_bias"),
    ({"logit_bias": {"-3": 1.0}}, "logit_bias"),
    ({"logit_bias": {"3": "1"}}, "logit_bias"),
    ({"logit_bias": {"3": 1.0, 3: 2.0}}, "logit_bias"),
])
def test_a_badly_typed_field_is_refused_naming_it(body, named):
    with pytest.raises(RefengineError, match=f"^{named}:"):
        processor_params(body)


def test_logit_bias_arrives_as_sorted_id_pairs_and_is_held_to_the_vocabulary():
    assert processor_params({"logit_bias": {"7": 5, "3": -1.5}, "min_tokens": 2}) == \
        {"logit_bias": ((3, -1.5), (7, 5.0)), "min_tokens": 2}
    with pytest.raises(RefengineError, match="^logit_bias:.*outside the vocabulary"):
        SamplingParams(max_tokens=4, logit_bias=((VOCAB, 1.0),)).check_vocabulary(VOCAB)


def test_a_processed_row_that_differs_is_a_divergence_even_where_the_token_agrees():
    """check.comparison: bit-exact, any difference; by the margin rule, one above the tolerance (the
    processed rows' noise grows by the repetition penalty: check.margin_rule.processed_noise_gain)."""
    from refengine.check.comparison import compare_request
    from refengine.check.margin_rule import processed_noise_gain
    from refengine.engine.outputs import RequestOutput
    from refengine.sampling import StepRecord

    def run(adjusted):
        step = StepRecord(3, 1.0, logits=np.zeros(4, np.float32), adjusted=np.array(adjusted))
        return RequestOutput("r", [1], [3], "", "length", [step], 0, 0, 0, 0, 1, None, None, None)

    same = [0.0, -np.inf, 1.0, 2.0]
    assert compare_request("r", run(same), run(same), exact=True).kind == "match"
    assert compare_request("r", run([0.0, -np.inf, 1.0, 2.0 + 2 ** -40]), run(same), exact=True).kind == "diverged"
    assert compare_request("r", run([0.0, 0.0, 1.0, 2.0]), run(same), exact=False, margin_tolerance=1.0,
                           noise_tolerance=1.0).kind == "diverged"  # an id only one rules out
    assert compare_request("r", run([0.5, -np.inf, 1.0, 2.0]), run(same), exact=False, margin_tolerance=0.6,
                           noise_tolerance=0.6).kind == "match"
    assert compare_request("r", run([0.5, -np.inf, 1.0, 2.0]), run(same), exact=False, margin_tolerance=0.4,
                           noise_tolerance=0.4).kind == "diverged"
    assert processed_noise_gain(SamplingParams(repetition_penalty=0.5)) == 2.0
    assert processed_noise_gain(SamplingParams(repetition_penalty=1.5)) == 1.5
    assert processed_noise_gain(SamplingParams()) == 1.0


def test_replay_holds_a_processed_request_to_the_tolerance_times_its_repetition_gain(tiny_model):
    from refengine.check.calibrate import calibration_for
    from refengine.check.replay import replay
    from refengine.check.schedule import parse_schedule
    schedule = parse_schedule({"engine": {"mode": "fast", "max_num_seqs": 2}, "requests": [
        {"id": "plain", "prompt_ids": [5, 9, 13], "max_tokens": 3},
        {"id": "penalized", "prompt_ids": [5, 9, 13], "max_tokens": 3, "repetition_penalty": 0.5}]})
    result = replay(tiny_model, schedule, against="reference", calibration=calibration_for(tiny_model))
    assert result.verdicts["plain"].tolerance == result.tolerance > 0
    assert result.verdicts["penalized"].tolerance == 2 * result.tolerance
