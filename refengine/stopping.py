"""When a request stops, and what text it returns; shared by the reference and the engine."""
from __future__ import annotations

from .sampling import SamplingParams


def finish_reason(token_id: int, num_generated: int, text: str, params: SamplingParams,
                  eos_token_ids) -> str | None:
    """'stop' on an eos id, a stop token id or a stop string; 'length' at max_tokens; else None."""
    if not params.ignore_eos and token_id in eos_token_ids:
        return "stop"
    if token_id in params.stop_token_ids:
        return "stop"
    if any(s and s in text for s in params.stop):
        return "stop"
    if num_generated >= params.max_tokens:
        return "length"
    return None


def cut_at_stop_string(text: str, stops) -> str:
    """The text up to (not including) the earliest stop string, as OpenAI servers return it."""
    cuts = [text.find(s) for s in stops if s and s in text]
    return text[:min(cuts)] if cuts else text
