"""Every schedule the invariants suite can produce, as Hypothesis strategies.

- models: tiny qwen3 / qwen2 / llama / qwen3_moe models (GQA 2:1 and 4:1, MQA, MHA; tied and untied
  heads) and a Qwen3-VL one, each built once into the refengine cache.
- prompts: token-id lists of edge lengths (1, block_size - 1, block_size, block_size + 1,
  two blocks, longer than the token budget) or any length up to 48.
- sampling: greedy, or seeded (temperature, top-k, top-p, seed).
- engine_settings: max_num_seqs 1-8, token budgets down to 1 (chunked prefill), block_size 1-32.
- schedules: 1-5 requests joining at steps 0-12, some aborted mid-flight, some leaving early with a
  small max_tokens, some asking for logprobs (the chosen token's, and 0-20 alternatives), prompt logprobs,
  logits processors, and (with `forks`) n answers, over a KV pool fitted tight (preemption) or roomy;
  some requests with one or two generated images (sides around the vision model's merge multiple).
- shared_prefixes: those schedules with prefix caching on and prompts sharing prefixes (cut at block
  edges and one token either side), so requests hit KV blocks other requests computed.
- http_schedules: for a server over HTTP, 1-6 concurrent requests for golden cases, completions or
  chat, streamed or whole, arriving 0-50 ms after the start, some hanging up after 1-8 streamed chunks.

Engine schedules are the JSON schedule dicts of FORMATS.md, so any example is also a repro file.
"""
from .engine_settings import MAX_MODEL_LEN, engine_settings
from .http_schedules import (
           MAX_HTTP_REQUESTS,
           HttpRequest,
           http_schedules,
           planned_requests,
)
from .models import (
           DEFAULT_MODEL,
           TINY_CONFIGS,
           tiny_model,
           tiny_model_dir,
           tiny_model_names,
)
from .prompts import MAX_PROMPT_LEN, edge_lengths, prompts
from .sampling import SAMPLERS, seeded
from .schedules import MAX_REQUESTS, MAX_TOKENS, requests, schedules
from .shared_prefixes import shared_prefix_schedules

__all__ = ["DEFAULT_MODEL", "HttpRequest", "MAX_HTTP_REQUESTS", "MAX_MODEL_LEN", "MAX_PROMPT_LEN", "MAX_REQUESTS",
           "MAX_TOKENS", "TINY_CONFIGS", "edge_lengths", "engine_settings", "http_schedules", "planned_requests",
           "prompts", "requests", "SAMPLERS", "seeded", "schedules", "shared_prefix_schedules", "tiny_model",
           "tiny_model_dir",
           "tiny_model_names"]
