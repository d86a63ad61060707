"""check.output_oracle, the checks' own definitions of finish, stop cuts and log-probabilities, on
hand-made cases (values derived by hand, not by refengine/sampling.py)."""
from __future__ import annotations

import math

import numpy as np
import pytest

from refengine.check.output_oracle import expected_finish, log_softmax, stop_cut
from refengine.sampling import SamplingParams

PIECES = {1: "ab", 2: "c", 3: "de", 4: "f", 9: "<eos>"}


def decode(ids: list[int]) -> str:
    return "".join(PIECES[i] for i in ids)


@pytest.mark.parametrize("text, stops, cut", [
    ("abcdef", ["cd", "b"], "a"),      # the earliest stop wins, whichever is listed first
    ("abcdef", ["x"], "abcdef"),
    ("abcdef", ["", "f"], "abcde"),    # an empty stop string stops nothing
    ("abab", ["ab"], ""),
])
def test_the_text_is_cut_before_the_earliest_stop_string(text, stops, cut):
    assert stop_cut(text, stops) == cut


@pytest.mark.parametrize("params, finish", [
    (SamplingParams(max_tokens=10), (5, "stop")),                       # eos is the 5th token
    (SamplingParams(max_tokens=10, ignore_eos=True), (6, None)),        # runs out of tokens first
    (SamplingParams(max_tokens=3), (3, "length")),
    (SamplingParams(max_tokens=10, stop_token_ids=(3,)), (3, "stop")),  # the stop id is kept
    (SamplingParams(max_tokens=10, stop=("bc",)), (2, "stop")),         # completed across two tokens
    (SamplingParams(max_tokens=10, stop=("e",)), (3, "stop")),          # inside a token's text, not at its end
    (SamplingParams(max_tokens=2, stop=("e",)), (2, "length")),
])
def test_a_request_ends_at_the_first_token_that_ends_it(params, finish):
    assert expected_finish([1, 2, 3, 4, 9, 1], decode, params, eos_token_ids=(9,)) == finish


def test_log_probabilities_are_logits_minus_the_rows_logsumexp():
    row = np.array([3.0, 2.0, 1.0, -np.inf], np.float32)
    expected = [x - math.log(math.exp(3) + math.exp(2) + math.exp(1)) for x in (3.0, 2.0, 1.0)]
    got = log_softmax(row)
    assert got.dtype == np.float64 and np.allclose(got[:3], expected, rtol=0, atol=1e-15) and got[3] == -np.inf
