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


@pytest.mark.parametrize("params, finish", [
    (SamplingParams(max_tokens=10, stop_token_ids=(3,), min_tokens=3), (5, "stop")),  # the 3rd may not stop
    (SamplingParams(max_tokens=10, stop_token_ids=(3,), min_tokens=2), (3, "stop")),  # the 3rd may
    (SamplingParams(max_tokens=3, stop_token_ids=(3,), min_tokens=3), (3, "length")),
    (SamplingParams(max_tokens=10, stop=("bc",), min_tokens=2), (5, "stop")),  # "bc" ends in the 2nd token's text
    (SamplingParams(max_tokens=10, stop=("cd",), min_tokens=2), (3, "stop")),  # "cd" ends past it
])
def test_the_first_min_tokens_tokens_never_stop(params, finish):
    assert expected_finish([1, 2, 3, 4, 9, 1], decode, params, eos_token_ids=(9,)) == finish


@pytest.mark.parametrize("text, stops, after, cut", [
    ("abcdef", ["b"], 2, "abcdef"),    # ends at character 2, not past it
    ("abcdef", ["bc"], 2, "a"),        # begins before, ends past: counts, and the cut is where it begins
    ("abcabc", ["b"], 2, "abca"),      # the first occurrence that counts
])
def test_a_stop_string_counts_only_where_it_ends_past_the_min_tokens_text(text, stops, after, cut):
    assert stop_cut(text, stops, after) == cut


def test_log_probabilities_are_logits_minus_the_rows_logsumexp():
    row = np.array([3.0, 2.0, 1.0, -np.inf], np.float32)
    expected = [x - math.log(math.exp(3) + math.exp(2) + math.exp(1)) for x in (3.0, 2.0, 1.0)]
    got = log_softmax(row)
    assert got.dtype == np.float64 and np.allclose(got[:3], expected, rtol=0, atol=1e-15) and got[3] == -np.inf


def test_the_min_tokens_text_ends_where_its_settled_characters_do():
    """A character still incomplete after the min_tokens-th token (U+FFFD in a prefix's decode) is not
    part of their text: a stop string that begins with it ends past it, and counts."""
    def decode_utf8(ids):
        return b"".join({1: b"ab", 5: b"\xc3", 6: b"\xa9", 7: b"z"}[i] for i in ids).decode("utf-8", "replace")
    params = SamplingParams(max_tokens=10, min_tokens=2, stop=("\u00e9",))
    assert decode_utf8([1, 5]) == "ab\ufffd"
    assert expected_finish([1, 5, 6, 7], decode_utf8, params, eos_token_ids=()) == (3, "stop")
