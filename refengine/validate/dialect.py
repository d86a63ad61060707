"""Server dialects, learned from what the server sends (no configuration).

Every request carries `"return_token_ids": true` (vLLM reports ids only then; refengine and llama.cpp
ignore it) and asks for the top TOP_LOGPROBS logprobs of every token (`logprobs: true,
top_logprobs: 2` for chat, `logprobs: 2` for completions; streamed, also
`stream_options.include_usage`, so ids a stream left out show as a count that differs from the
server's own: wire.checked). Logprobs are where llama.cpp reports generated ids, where the serial
baseline finds the server's own top-2 margins, and what the precision report compares with the
golden file. A server that refuses one of these fields by name (HF `transformers serve`: HTTP 422
"Unexpected keys") gets the request again without it, and no later request carries it.

Every request also carries vLLM's `cache_salt` (a server with prefix caching shares cached KV only
between requests of one salt), fresh each run, so nothing sent before the run shares its cache: the
alone answers and the `warm` loaded requests (validate.plan) share the run's salt, the `shared` ones
the load's, and a `cold` one has its own. A server that refuses the field by name gets none (every
request then shares one cache); one that ignores it shows in the cached tokens it reports for cold
requests (validate.cache).

Before the run, one probe per API in the plan (the case with the shortest prompt, `max_tokens: 1`,
whole) learns where the server reports generated ids, whether it reports prompt ids and logprobs.
An API whose answers carry no ids is judged by text.
"""
from __future__ import annotations

import re
import threading
import uuid

from .client import Completion, Endpoint, ServerError

PATHS = {"completions": "/v1/completions", "chat": "/v1/chat/completions"}
RETURN_TOKEN_IDS = "return_token_ids"
CACHE_SALT = "cache_salt"
LOGPROB_KEYS = ("logprobs", "top_logprobs", "stream_options")
TOP_LOGPROBS = 2  # the top-2 margin needs two
REFUSAL_STATUSES = (400, 404, 422)


class Dialect:
    """What validate learned about the server; shared by the request threads of one run."""

    def __init__(self):
        self._lock = threading.Lock()
        self.return_token_ids_refused = False
        self.logprobs_refused: set[str] = set()     # apis whose requests go without logprobs
        self.ids_from: dict[str, str | None] = {}   # api -> where the probe found generated ids
        self.prompt_ids: dict[str, bool] = {}       # api -> the probe's answer reported prompt ids
        self.logprobs_reported: dict[str, bool] = {}  # api -> the probe's answer carried logprobs
        self.probe_errors: dict[str, str] = {}
        self.probe_requests = 0
        self.surface_requests = 0                   # sent by validate.surface's probe
        self.resent = 0                             # run requests sent again without a refused field
        self.streams_without_done = 0
        self.streams_with_done = 0
        self.salt = f"refengine-validate-{uuid.uuid4().hex}"  # this run's: nothing before it shares its cache
        self.cache_salt_refused = False

    def cache_salt(self, group: str = "warm", request_id: str = "") -> str:
        """The salt of a request of cache `group` (validate.plan.CACHE): the run's (warm), the load's
        (shared), or a cold request's own (its id added)."""
        return {"warm": self.salt, "shared": f"{self.salt}:load"}.get(group, f"{self.salt}:cold:{request_id}")

    def body(self, api: str, body: dict, salt: str | None = None) -> dict:
        body = dict(body)
        if not self.return_token_ids_refused:
            body[RETURN_TOKEN_IDS] = True
        if not self.cache_salt_refused:
            body[CACHE_SALT] = salt or self.salt
        if api not in self.logprobs_refused:
            if api == "chat":
                body |= {"logprobs": True, "top_logprobs": TOP_LOGPROBS}
            else:
                body["logprobs"] = TOP_LOGPROBS
            if body.get("stream"):
                body["stream_options"] = {**body.get("stream_options", {}), "include_usage": True}
        return body

    def refused(self, api: str, error: ServerError, sent: dict, base: dict) -> bool:
        """Whether `error` refuses a field validate added (and stop adding it): it names the field as a
        word of its own (a refusal of `prompt_logprobs` is not one of `logprobs`)."""
        if error.status not in REFUSAL_STATUSES:
            return False
        message = str(error)
        with self._lock:
            if RETURN_TOKEN_IDS in sent and RETURN_TOKEN_IDS not in base and names(message, RETURN_TOKEN_IDS):
                self.return_token_ids_refused = True
                return True
            if CACHE_SALT in sent and CACHE_SALT not in base and names(message, CACHE_SALT):
                self.cache_salt_refused = True
                return True
            if api not in self.logprobs_refused and any(names(message, k) for k in LOGPROB_KEYS
                                                         if k in sent and k not in base):
                self.logprobs_refused.add(api)
                return True
        return False

    def saw(self, completion: Completion) -> None:
        with self._lock:
            if completion.done_marker is False:
                self.streams_without_done += 1
            elif completion.done_marker:
                self.streams_with_done += 1

    def report(self) -> dict:
        """The report's `dialect` object."""
        apis = {api: {"token_ids_from": self.ids_from.get(api), "logprobs_requested": api not in self.logprobs_refused,
                      "logprobs": self.logprobs_reported.get(api, False),
                      "prompt_token_ids": self.prompt_ids.get(api, False)}
                for api in sorted(set(self.ids_from) | set(self.probe_errors))}
        out = {"return_token_ids": "refused" if self.return_token_ids_refused else "sent",
               "cache_salt": "refused" if self.cache_salt_refused else "sent",
               "no_done_marker": self.streams_without_done > 0 and self.streams_with_done == 0,
               "streams_without_done": self.streams_without_done, "apis": apis,
               "probe_requests": self.probe_requests, "surface_requests": self.surface_requests,
               "resent": self.resent}
        if self.probe_errors:
            out["probe_errors"] = self.probe_errors
        return out


def names(message: str, field: str) -> bool:
    """Whether `message` names `field` as a word of its own, not inside a longer field name."""
    return re.search(rf"(?<![A-Za-z0-9_]){re.escape(field)}(?![A-Za-z0-9_])", message) is not None


def send(endpoint: Endpoint, api: str, base: dict, cancel_after: int | None, dialect: Dialect,
         probe: bool = False, salt: str | None = None) -> Completion:
    """POST `base` with the fields the dialect adds (`salt`: the cache_salt, default the run's); refused
    by name, again without them."""
    while True:
        sent = dialect.body(api, base, salt)
        with dialect._lock:
            if probe:
                dialect.probe_requests += 1
        try:
            completion = endpoint.complete(PATHS[api], sent, cancel_after)
        except ServerError as e:
            if not dialect.refused(api, e, sent, base):
                raise
            if not probe:
                with dialect._lock:
                    dialect.resent += 1
            continue
        dialect.saw(completion)
        return completion


def probe(endpoint: Endpoint, bodies: dict[str, dict], dialect: Dialect) -> None:
    """Learn, per API, what the server reports (see the module docstring). `bodies`: api -> a whole
    request body of one case."""
    for api, body in bodies.items():
        try:
            answer = send(endpoint, api, {**body, "stream": False, "max_tokens": 1}, None, dialect, probe=True,
                          salt=dialect.cache_salt("cold", "probe"))  # leaves the run's cache cold
        except (ServerError, OSError) as e:
            dialect.probe_errors[api] = str(e) or type(e).__name__
            continue
        dialect.ids_from[api] = answer.ids_from
        dialect.prompt_ids[api] = answer.prompt_token_ids is not None
        dialect.logprobs_reported[api] = answer.logprobs is not None


def accepts_id_prompts(endpoint: Endpoint, served_name: str, prompt_ids: list[int]) -> bool:
    """Whether /v1/completions takes a prompt given as token ids: HF `transformers serve` refuses
    one (HTTP 400 "prompt must be a string"), so a chat case can reach it only as chat."""
    body = {"model": served_name, "prompt": prompt_ids, "max_tokens": 1, "temperature": 0, "stream": False}
    try:
        endpoint.complete(PATHS["completions"], body)
    except ServerError as e:
        if e.status in REFUSAL_STATUSES:
            return False
        raise
    return True


def dialect_notes(dialect: dict | None) -> list[str]:
    """One line per way the server differs from refengine's own (report `dialect`)."""
    if not dialect:
        return []
    notes = []
    for api, d in dialect["apis"].items():
        if api in dialect.get("probe_errors", {}):
            continue
        if d["token_ids_from"] == "logprobs":
            notes.append(f"note: {api}: the server reports token ids only in logprobs")
        elif d["token_ids_from"] is None:
            notes.append(f"note: {api}: the server reports no token ids; answers compared by text")
        if not d.get("logprobs"):
            notes.append(f"note: {api}: the server reports no logprobs" + ("" if d["logprobs_requested"]
                                                                          else " (it refuses the fields)"))
    if dialect["return_token_ids"] == "refused":
        notes.append("note: the server refuses return_token_ids; requests were sent without it")
    if dialect.get("cache_salt") == "refused":
        notes.append("note: the server refuses cache_salt; requests were sent without it (no request could be "
                     "sent cold: each may take KV the others left in the prefix cache)")
    if dialect["streams_without_done"]:
        notes.append(f"note: {dialect['streams_without_done']} streams ended after their finish_reason without "
                     f"data: [DONE] (accepted as complete)")
    for api, error in dialect.get("probe_errors", {}).items():
        notes.append(f"note: {api}: dialect probe failed ({error})")
    return notes


def unstripped(golden_text: str, got_text: str) -> tuple[str, list[str]]:
    """A server may send text that is not what its own tokens decode to: HF `transformers serve` parses
    a chat answer through the model's response template, which strips the whitespace at its ends.
    Where the received text has no whitespace of its own at an end where the golden answer has some,
    it is given back, and the comparison goes on from there: (text to compare, the ends restored).
    Compared by text alone, which tokens carried that whitespace is not known; the batching effect
    (loaded vs alone, both stripped alike) still sees every change batching makes."""
    restored = []
    lead = golden_text[:len(golden_text) - len(golden_text.lstrip())]
    if lead and got_text and not got_text[0].isspace():
        got_text, restored = lead + got_text, ["leading"]
    trail = golden_text[len(golden_text.rstrip()):]
    if trail and golden_text.strip() and got_text == golden_text[:-len(trail)]:
        got_text, restored = got_text + trail, restored + ["trailing"]
    return got_text, restored
