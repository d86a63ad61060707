"""validate.cache, the prefix cache's part of the report, and where its figures come from: the cached
tokens an answer reports (validate.wire), the status counters and the pool's size (validate.drain)."""
from __future__ import annotations

import pytest
from test_drain import FakeServer, not_supported, vllm_metrics

from refengine.engine import EngineConfig
from refengine.serve import OpenAIServer
from refengine.validate.cache import cache_report, format_cache
from refengine.validate.client import Endpoint
from refengine.validate.drain import State, pool_tokens, server_state
from refengine.validate.wire import Stream, cached_tokens, whole


def record(rid, verdict, cache="warm", cached=None, batching=None):
    r = {"id": rid, "verdict": verdict, "cache": cache}
    if cached is not None:
        r["cached_tokens"] = cached
    if batching is not None:
        r["batching"] = {"verdict": batching}
    return r


def state(hits, queries, source="/metrics (vLLM)") -> State:
    return State(0, 0, 0.0, source, cache_hits=hits, cache_queries=queries)


REQUESTS = [record("a", "match", cache="cold", cached=0, batching="match"),
            record("b", "diverged", cache="cold", cached=8, batching="diverged"),
            record("c", "explained", cached=16, batching="explained"),
            record("d", "match", cached=0, batching="match"),
            record("e", "cancelled", cache="cold"),
            record("f", "match"),
            record("g", "explained", cache="shared", cached=5),
            record("h", "match", cache="shared", cached=0)]
ALONE = [record("a", "match", cached=0), record("c", "match", cached=4), record("d", "match")]


def test_the_groups_are_kept_apart_with_what_the_server_says_it_cached():
    report = cache_report(REQUESTS, ALONE, True, state(5, 50), state(9, 100), state(33, 220))
    assert report["cache_salt"] == "sent"
    assert report["cold"] == {"requests": 3, "match": 1, "explained": 0, "diverged": 1,
                              "batching": {"match": 1, "explained": 0, "diverged": 1},
                              "reporting": 2, "cached_tokens": 8, "hits": 1}
    assert report["warm"] == {"requests": 3, "match": 2, "explained": 1, "diverged": 0,
                              "batching": {"match": 1, "explained": 1, "diverged": 0},
                              "reporting": 2, "cached_tokens": 16, "hits": 1}
    assert report["shared"] == {"requests": 2, "match": 1, "explained": 1, "diverged": 0,
                                "reporting": 2, "cached_tokens": 5, "hits": 1}
    assert report["alone_cached_tokens"] == 4
    assert report["counters"] == {"source": "/metrics (vLLM)", "alone": {"hits": 4, "queries": 50},
                                  "load": {"hits": 24, "queries": 120}}
    assert report["cold_with_cached_tokens"] == ["b"]  # a shared request's hit is no leak


def test_without_salts_nothing_went_cold_and_nothing_is_blamed_on_one():
    report = cache_report(REQUESTS, ALONE, False, None, None, None)
    assert report["cache_salt"] == "refused" and report["cold"]["requests"] == report["shared"]["requests"] == 0
    assert report["warm"]["requests"] == len(REQUESTS) and report["warm"]["cached_tokens"] == 29
    assert report["cold_with_cached_tokens"] == [] and report["counters"] is None
    lines = format_cache(report)
    assert lines[0] == "prefix cache: cache_salt refused, all 8 (4 match, 2 explained, 1 diverged) shared one cache"


def test_unreported_figures_stay_unknown():
    bare = [record("a", "match", cache="cold"), record("b", "match")]
    report = cache_report(bare, [record("a", "match")], True, state(1, 2), state(None, 2), state(3, 4))
    assert report["cold"]["cached_tokens"] is None and report["cold"]["reporting"] == report["cold"]["hits"] == 0
    assert report["alone_cached_tokens"] is None and report["counters"] is None
    assert "batching" not in report["cold"]
    assert format_cache(report) == [
        "prefix cache: cold (a cache_salt of their own) 1 (1 match), shared (the load's salt) 0 (none compared), "
        "warm (the alone answers' salt) 1 (1 match)",
        "prefix cache: the answers report no cached tokens (no usage.prompt_tokens_details, no timings)"]
    counted = cache_report(bare, [], True, None, state(1, 2), state(3, 7))
    assert counted["counters"] == {"source": "/metrics (vLLM)", "alone": None, "load": {"hits": 2, "queries": 5}}


def test_the_report_lines():
    lines = format_cache(cache_report(REQUESTS, ALONE, True, state(5, 50), state(9, 100), state(33, 220)))
    assert lines == [
        "prefix cache: cold (a cache_salt of their own) 3 (1 match, 1 diverged), shared (the load's salt) 2 (1 match, "
        "1 explained), warm (the alone answers' salt) 3 (2 match, 1 explained)",
        "prefix cache: the server reported cached prompt tokens: alone 4, cold 8 (1 of 2 with a hit), "
        "shared 5 (1 of 2 with a hit), warm 16 (1 of 2 with a hit)",
        "prefix cache: counters from /metrics (vLLM): load 24 of 120 queried tokens hit; alone phase 4 of 50",
        "note: 1 requests sent cold (a cache_salt no other request had) reported cached tokens (b): the server "
        "ignores cache_salt, or its prefix cache leaks across salts"]
    many = [record(f"r{n}", "match", cache="cold", cached=1) for n in range(7)]
    assert format_cache(cache_report(many, [], True, None, None, None))[-1].startswith(
        "note: 7 requests sent cold (a cache_salt no other request had) reported cached tokens (r0, r1, r2, r3, r4, "
        "...)")


@pytest.mark.parametrize("answer, cached", [
    ({"usage": {"prompt_tokens": 40, "prompt_tokens_details": {"cached_tokens": 32}}}, 32),  # OpenAI, vLLM
    ({"timings": {"cache_n": 12, "prompt_n": 3}}, 12),                                        # llama.cpp
    ({"usage": {"prompt_tokens_details": None}, "timings": {"cache_n": 0}}, 0),
    ({"usage": {"prompt_tokens_details": {"cached_tokens": True}}}, None),
    ({"usage": {"prompt_tokens": 40}}, None),
])
def test_cached_tokens_are_read_where_each_dialect_puts_them(answer, cached):
    assert cached_tokens(answer) == cached
    choice = {"text": "x", "finish_reason": "stop"}
    assert whole({"choices": [choice], **answer}).cached_tokens == cached
    stream = Stream()
    stream.add({"choices": [choice]})
    stream.add({"choices": [], **answer})  # the usage chunk comes last
    stream.add({"choices": []})            # a later chunk without it keeps what was read
    assert stream.completion(cancelled=False, done_marker=True).cached_tokens == cached


def test_the_pool_and_the_cache_counters_from_vllm_metrics():
    server = FakeServer({"/metrics": lambda: vllm_metrics({"running": 0, "waiting": 0, "kv": 0.0, "cache_hits": 48,
                                                           "cache_queries": 200}),
                         "/admin/api/status": not_supported})
    try:
        assert pool_tokens(server.endpoint) == 16 * 2048
        got = server_state(server.endpoint)
        assert (got.cache_hits, got.cache_queries) == (48, 200)
    finally:
        server.shutdown()
    bare = FakeServer({})
    try:
        assert pool_tokens(bare.endpoint) is None
    finally:
        bare.shutdown()


def test_the_pool_and_the_cache_counters_from_refengine_serve(tiny_model):
    server = OpenAIServer(tiny_model, EngineConfig(block_size=8, num_blocks=40, enable_prefix_caching=True),
                          host="127.0.0.1")
    server.start()
    try:
        endpoint = Endpoint(server.url, 30)
        assert pool_tokens(endpoint) == 8 * 40
        body = {"prompt": list(range(1, 20)), "max_tokens": 1, "cache_salt": "s"}
        first, again = (endpoint.complete("/v1/completions", body) for _ in range(2))
        assert (first.cached_tokens, again.cached_tokens) == (0, 16)  # two full 8-token blocks of 19 tokens
        got = server_state(endpoint)
        assert (got.cache_hits, got.cache_queries) == (16, 38)
        other = endpoint.complete("/v1/completions", {**body, "cache_salt": "t"})
        assert other.cached_tokens == 0  # another salt shares nothing
    finally:
        server.close()


def test_a_third_of_the_load_goes_to_each_cache_group_with_its_own_salt(tmp_path):
    from refengine.check.golden import read_golden
    from refengine.data import shipped
    from refengine.validate.dialect import Dialect
    from refengine.validate.plan import CACHE, Settings, plan
    from refengine.validate.repro import planned_from, repro

    cases = read_golden(shipped("golden", "tiny-chat.jsonl")).cases
    planned = plan(cases, Settings(seed=3, repeat=2), 1.0)
    assert [sum(p.cache == g for p in planned) for g in CACHE] == [len(planned) // 3] * 3
    again = plan(cases, Settings(seed=3, repeat=2, cancel_rate=0.5), 1.0)  # drawn apart from the schedule
    assert {p.id: p.cache for p in again} == {p.id: p.cache for p in planned}

    dialect, other = Dialect(), Dialect()
    salts = {dialect.cache_salt(p.cache, p.id) for p in planned}
    assert dialect.cache_salt() == dialect.cache_salt("warm", "r0") == dialect.salt
    assert dialect.cache_salt("shared", "r0") == dialect.cache_salt("shared", "r1") != dialect.salt
    assert dialect.cache_salt("cold", "r0") != dialect.cache_salt("cold", "r1")
    assert len(salts) == sum(p.cache == "cold" for p in planned) + 2  # each cold its own; shared; warm
    assert dialect.salt != other.salt  # fresh each run: nothing before it shares its cache

    records = [{"id": p.id, "case": p.case.id, "api": p.api, "streamed": p.stream, "arrival_s": p.arrival_s,
                "cancel_after": p.cancel_after, "verdict": "match", "cache": p.cache} for p in planned]
    data = repro(records, found_by="validate", url="u", server={}, baseline="golden", source="s",
                 fingerprint=None, settings={})
    assert [r.get("cache", "warm") for r in data["requests"]] == [p.cache for p in planned]
    assert not any(r.get("cache") == "warm" for r in data["requests"])  # the default is left out
    assert [p.cache for p in planned_from(data, cases, "repro.json")] == [p.cache for p in planned]
