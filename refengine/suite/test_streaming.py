"""Property 6: streaming. What a client receives token by token is exactly the final text, which is
the full decode of the generated ids cut at the earliest stop string — identically when the request
runs batched or alone. Stop strings are drawn from the text each request really produces."""
import pytest
from hypothesis import given
from hypothesis import strategies as st

from ..strategies import schedules, tiny_model_names
from ..strategies.models import VOCAB_SIZE
from .harness import check_streaming

pytestmark = pytest.mark.invariants

NEVER_GENERATED = "\x00never\x00"
REPLACEMENT_CHARACTER = "\ufffd"


def stop_strings(data, text: str) -> list[str]:
    """None, a piece of the text the request produces (1-4 characters), or a string that never occurs.
    Pieces never contain U+FFFD: that is how an unfinished UTF-8 character decodes, and stop strings
    are matched against settled text (a client cannot meaningfully stop on it)."""
    pieces = sorted({text[i:j] for i in range(len(text)) for j in range(i + 1, min(len(text), i + 4) + 1)
                     if REPLACEMENT_CHARACTER not in text[i:j]})
    return data.draw(st.lists(st.sampled_from(pieces + [NEVER_GENERATED]), max_size=2))


@given(model=tiny_model_names(), schedule=schedules(VOCAB_SIZE), data=st.data())
def test_streamed_text_is_the_full_decode_and_stops_cut_identically(model, schedule, data):
    check_streaming("streaming", model, schedule, lambda text: stop_strings(data, text))
