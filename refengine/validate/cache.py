"""The prefix cache as validate saw it: the loaded answers in their three groups (validate.plan.CACHE:
cold, a cache_salt of their own, their whole prompt computed in the running batch; shared, the
load's salt, taking what the load computed; warm, the alone phase's salt, taking what their alone
answers left), how each group fared against its baseline, and how many prompt tokens the server says
it served from its cache — per dialect: the OpenAI usage field
(`prompt_tokens_details.cached_tokens`: vLLM, refengine), llama.cpp's `timings.cache_n`, and the
prefix cache counters of the status source (vLLM's `vllm:prefix_cache_hits_total` / `_queries_total`
on /metrics, refengine's status), over the alone phase and over the load.

A cold request that reports cached tokens took KV no request of its salt computed: the server
ignores cache_salt, or its cache leaks across salts (a note: a server need not know the field).
"""
from __future__ import annotations

from .drain import State
from .plan import CACHE

KINDS = ("match", "explained", "diverged")


def _group(records: list[dict]) -> dict:
    reported = [r["cached_tokens"] for r in records if "cached_tokens" in r]
    batching = [r["batching"]["verdict"] for r in records if "batching" in r]
    return {"requests": len(records), **{k: sum(r["verdict"] == k for r in records) for k in KINDS},
            **({"batching": {k: batching.count(k) for k in KINDS}} if batching else {}),
            "reporting": len(reported), "cached_tokens": sum(reported) if reported else None,
            "hits": sum(1 for c in reported if c > 0)}


def _counters(before: State | None, after: State | None) -> dict | None:
    if before is None or after is None or None in (before.cache_hits, before.cache_queries, after.cache_hits,
                                                   after.cache_queries):
        return None
    return {"hits": after.cache_hits - before.cache_hits, "queries": after.cache_queries - before.cache_queries}


def cache_report(requests: list[dict], alone: list[dict], salt_sent: bool, start: State | None,
                 before_load: State | None, end: State | None) -> dict:
    """The report's `cache` object. `start`, `before_load`, `end`: the status read before the alone
    phase, before the load and once drained (None where the server has none)."""
    def group(r: dict) -> str:  # without salts every request shared the one cache
        return r.get("cache", "warm") if salt_sent else "warm"

    groups = {name: [r for r in requests if group(r) == name] for name in CACHE}
    alone_reported = [r["cached_tokens"] for r in alone if "cached_tokens" in r]
    load = _counters(before_load, end)
    return {"cache_salt": "sent" if salt_sent else "refused", **{name: _group(rs) for name, rs in groups.items()},
            "alone_cached_tokens": sum(alone_reported) if alone_reported else None,
            "counters": None if load is None else
            {"source": end.source, "alone": _counters(start, before_load), "load": load},
            "cold_with_cached_tokens": [r["id"] for r in groups["cold"] if r.get("cached_tokens")]}


def format_cache(cache: dict) -> list[str]:
    def verdicts(g: dict) -> str:
        counts = ", ".join(f"{g[k]} {k}" for k in KINDS if g[k]) or "none compared"
        return f"{g['requests']} ({counts})"

    head = (f"prefix cache: cold (a cache_salt of their own) {verdicts(cache['cold'])}, shared (the load's salt) "
            f"{verdicts(cache['shared'])}, warm (the alone answers' salt) {verdicts(cache['warm'])}"
            if cache["cache_salt"] == "sent" else
            f"prefix cache: cache_salt refused, all {verdicts(cache['warm'])} shared one cache")
    lines = [head]
    if any(cache[name]["reporting"] for name in CACHE):
        lines.append(f"prefix cache: the server reported cached prompt tokens: alone {cache['alone_cached_tokens']}, "
                     + ", ".join(f"{name} {cache[name]['cached_tokens'] or 0} ({cache[name]['hits']} of "
                                 f"{cache[name]['reporting']} with a hit)" for name in CACHE))
    else:
        lines.append("prefix cache: the answers report no cached tokens (no usage.prompt_tokens_details, no timings)")
    counters = cache["counters"]
    if counters:
        alone = counters["alone"]
        lines.append(f"prefix cache: counters from {counters['source']}: load {counters['load']['hits']} of "
                     f"{counters['load']['queries']} queried tokens hit"
                     + (f"; alone phase {alone['hits']} of {alone['queries']}" if alone else ""))
    if cache["cold_with_cached_tokens"]:
        ids = cache["cold_with_cached_tokens"]
        lines.append(f"note: {len(ids)} requests sent cold (a cache_salt no other request had) reported cached tokens "
                     f"({', '.join(ids[:5])}{', ...' if len(ids) > 5 else ''}): the server ignores cache_salt, or its "
                     f"prefix cache leaks across salts")
    return lines
