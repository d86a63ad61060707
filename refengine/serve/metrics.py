"""GET /metrics: the /admin/api/status facts in the Prometheus text exposition format (0.0.4), under
vLLM's metric names where vLLM has one (so dashboards and `refengine validate` read refengine and
vLLM alike) and `refengine_`-prefixed names for the rest.

Rendered here by hand, not with prometheus_client: the server stays standard-library only (docs/contributing.md,
"What refengine writes itself"), and the output is a dozen fixed lines; the tests parse it with
prometheus_client's parser, which is what a scraper does.
"""
from __future__ import annotations

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

# (metric name, status key, help); gauges first, then counters (their samples carry `_total`)
GAUGES = (
    ("vllm:num_requests_running", "running", "Number of requests in the engine's running batch."),
    ("vllm:num_requests_waiting", "waiting", "Number of requests waiting in the engine queue."),
    ("refengine_requests_in_flight", "in_flight", "Requests admitted and not finished."),
    ("refengine_slot_waiters", "slot_waiters", "Requests waiting for an admission slot."),
    ("refengine_slots_used", "slots_used", "Admission slots taken (max_num_seqs + max_waiting in all)."),
    ("refengine_slots_total", "slots_total", "Admission slots in all (max_num_seqs + max_waiting)."),
    ("refengine_batch_active", "batch_active", "Requests in the current step's batch (0 when idle)."),
    ("refengine_kv_blocks_used", "kv_blocks_used", "KV-cache blocks in use."),
    ("refengine_kv_blocks_free", "kv_blocks_free", "KV-cache blocks free."),
    ("refengine_logits_processor_rows", "logits_processor_rows",
     "Batch rows holding a running request's penalty counts, logit bias and min_tokens."),
)
COUNTERS = (
    ("vllm:num_preemptions", "preemptions", "Cumulative number of preemptions from the engine."),
    ("refengine_requests", "requests_total", "Requests admitted to the engine."),
    ("refengine_requests_aborted", "requests_aborted", "Requests aborted (the client hung up)."),
    ("refengine_requests_rejected_busy", "requests_rejected_busy", "Requests refused with 503 (queue timeout)."),
    ("refengine_engine_steps", "steps", "Engine steps run."),
    ("vllm:prefix_cache_queries", "prefix_cache_queries", "Prefix cache queries, in terms of number of queried tokens."),
    ("vllm:prefix_cache_hits", "prefix_cache_hits", "Prefix cache hits, in terms of number of cached tokens."),
    ("refengine_requests_with_logits_processors", "requests_with_logits_processors",
     "Requests that asked for penalties, logit_bias or min_tokens."),
    ("refengine_prompt_logprob_tokens", "prompt_logprob_tokens",
     "Prompt tokens scored for prompt logprobs (prompt_logprobs, echo with logprobs)."),
    ("refengine_forks", "forks", "Answers of an n > 1 request admitted by forking a sibling's prompt KV."),
    ("refengine_images_encoded", "images_encoded", "Images run through the vision tower (once per request)."),
    ("vllm:spec_decode_num_drafts", "spec_decode_drafts", "Number of spec decoding drafts."),
    ("vllm:spec_decode_num_draft_tokens", "spec_decode_draft_tokens", "Number of draft tokens."),
    ("vllm:spec_decode_num_accepted_tokens", "spec_decode_accepted_tokens", "Number of accepted tokens."),
)
FINISH_REASONS = ("stop", "length")  # vllm:request_success_total{finished_reason}; aborts are counted apart


def kv_usage(status: dict) -> float:
    """Used KV blocks / all KV blocks, 0..1 (vLLM's kv_cache_usage_perc)."""
    total = status["kv_blocks_used"] + status["kv_blocks_free"]
    return status["kv_blocks_used"] / total if total else 0.0


def render(status: dict) -> str:
    """The exposition text for one /admin/api/status dict."""
    labels = _labels({"model_name": status.get("model", "")})
    lines: list[str] = []

    def family(name: str, kind: str, help_text: str, samples: list[tuple[str, float]]) -> None:
        lines.extend([f"# HELP {name} {help_text}", f"# TYPE {name} {kind}"])
        lines.extend(f"{name}{sample_labels} {_number(value)}" for sample_labels, value in samples)

    for name, key, help_text in GAUGES:
        family(name, "gauge", help_text, [(labels, status[key])])
    family("vllm:kv_cache_usage_perc", "gauge", "KV-cache usage. 1 means 100 percent usage.",
           [(labels, kv_usage(status))])
    for name, key, help_text in COUNTERS:
        family(f"{name}_total", "counter", help_text, [(labels, status[key])])
    family("vllm:spec_decode_num_accepted_tokens_per_pos_total", "counter", "Accepted tokens per draft position.",
           [(_labels({"model_name": status.get("model", ""), "position": str(position)}), count)
            for position, count in enumerate(status["spec_decode_accepted_per_position"])])
    family("vllm:request_success_total", "counter", "Count of successfully processed requests.",
           [(_labels({"model_name": status.get("model", ""), "finished_reason": reason}),
             status[f"requests_finished_{reason}"]) for reason in FINISH_REASONS])
    return "\n".join(lines) + "\n"


def _labels(labels: dict[str, str]) -> str:
    return "{" + ",".join(f'{k}="{_escape(v)}"' for k, v in labels.items()) + "}"


def _escape(value) -> str:
    return str(value).replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def _number(value) -> str:
    return repr(float(value)) if isinstance(value, float) else str(int(value))
