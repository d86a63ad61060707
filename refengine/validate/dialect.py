"""Server dialects, learned from what the server sends (no configuration).

Every request carries `"return_token_ids": true` (vLLM reports ids only then; refengine and llama.cpp
ignore it). A server that refuses it by name (HF `transformers serve`: HTTP 422 "Unexpected keys")
gets the request again without it, and no later request carries it.

Logprobs change nothing validate judges, so they are asked for only where they are the one place a
server reports generated ids (llama.cpp). Before the run, one probe per API in the plan (the case with
the shortest prompt, `max_tokens: 1`, whole): an answer with ids settles it; one without is probed
again with logprobs (`logprobs: true, top_logprobs: 1` for chat, `logprobs: 1` for completions). When
ids come back only then, every request of that API asks for logprobs — and, streamed, for
`stream_options.include_usage`, so ids a stream left out show as a count that differs from the
server's own (wire.checked). Otherwise that API is judged by text.
"""
from __future__ import annotations

import threading

from .client import Completion, Endpoint, ServerError

PATHS = {"completions": "/v1/completions", "chat": "/v1/chat/completions"}
RETURN_TOKEN_IDS = "return_token_ids"
LOGPROB_KEYS = ("logprobs", "top_logprobs", "stream_options")
REFUSAL_STATUSES = (400, 404, 422)


class Dialect:
    """What validate learned about the server; shared by the request threads of one run."""

    def __init__(self):
        self._lock = threading.Lock()
        self.return_token_ids_refused = False
        self.logprobs: dict[str, bool] = {}         # api -> ask for logprobs (probed: ids only there)
        self.ids_from: dict[str, str | None] = {}   # api -> where the probe found generated ids
        self.prompt_ids: dict[str, bool] = {}       # api -> the probe's answer reported prompt ids
        self.probe_errors: dict[str, str] = {}
        self.probe_requests = 0
        self.resent = 0                             # run requests sent again without a refused field
        self.streams_without_done = 0
        self.streams_with_done = 0

    def body(self, api: str, body: dict) -> dict:
        body = dict(body)
        if not self.return_token_ids_refused:
            body[RETURN_TOKEN_IDS] = True
        if self.logprobs.get(api):
            if api == "chat":
                body |= {"logprobs": True, "top_logprobs": 1}
            else:
                body["logprobs"] = 1
            if body.get("stream"):
                body["stream_options"] = {**body.get("stream_options", {}), "include_usage": True}
        return body

    def refused(self, api: str, error: ServerError, sent: dict, base: dict) -> bool:
        """Whether `error` refuses a field validate added (and stop adding it)."""
        if error.status not in REFUSAL_STATUSES:
            return False
        message = str(error)
        with self._lock:
            if RETURN_TOKEN_IDS in sent and RETURN_TOKEN_IDS not in base and RETURN_TOKEN_IDS in message:
                self.return_token_ids_refused = True
                return True
            if self.logprobs.get(api) and any(k in message for k in LOGPROB_KEYS if k in sent and k not in base):
                self.logprobs[api] = False
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
        apis = {api: {"token_ids_from": self.ids_from.get(api), "logprobs_requested": self.logprobs.get(api, False),
                      "prompt_token_ids": self.prompt_ids.get(api, False)}
                for api in sorted(set(self.ids_from) | set(self.probe_errors))}
        out = {"return_token_ids": "refused" if self.return_token_ids_refused else "sent",
               "no_done_marker": self.streams_without_done > 0 and self.streams_with_done == 0,
               "streams_without_done": self.streams_without_done, "apis": apis,
               "probe_requests": self.probe_requests, "resent": self.resent}
        if self.probe_errors:
            out["probe_errors"] = self.probe_errors
        return out


def send(endpoint: Endpoint, api: str, base: dict, cancel_after: int | None, dialect: Dialect,
         probe: bool = False) -> Completion:
    """POST `base` with the fields the dialect adds; refused by name, again without them."""
    while True:
        sent = dialect.body(api, base)
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
    """Learn, per API, where the server reports generated ids (see the module docstring). `bodies`:
    api -> a whole request body of one golden case."""
    for api, body in bodies.items():
        body = {**body, "stream": False, "max_tokens": 1}
        try:
            answer = send(endpoint, api, body, None, dialect, probe=True)
            if answer.token_ids is None:
                dialect.logprobs[api] = True
                answer = send(endpoint, api, body, None, dialect, probe=True)
                dialect.logprobs[api] = answer.token_ids is not None
        except (ServerError, OSError) as e:
            dialect.logprobs[api] = False
            dialect.probe_errors[api] = str(e) or type(e).__name__
            continue
        dialect.ids_from[api] = answer.ids_from
        dialect.prompt_ids[api] = answer.prompt_token_ids is not None


def dialect_notes(dialect: dict | None) -> list[str]:
    """One line per way the server differs from refengine's own (report `dialect`)."""
    if not dialect:
        return []
    notes = []
    for api, d in dialect["apis"].items():
        if d["logprobs_requested"]:
            notes.append(f"note: {api}: the server reports token ids only in logprobs; they were requested")
        elif d["token_ids_from"] is None and api not in dialect.get("probe_errors", {}):
            notes.append(f"note: {api}: the server reports no token ids; answers compared by text")
    if dialect["return_token_ids"] == "refused":
        notes.append("note: the server refuses return_token_ids; requests were sent without it")
    if dialect["streams_without_done"]:
        notes.append(f"note: {dialect['streams_without_done']} streams ended after their finish_reason without "
                     f"data: [DONE] (accepted as complete)")
    for api, error in dialect.get("probe_errors", {}).items():
        notes.append(f"note: {api}: dialect probe failed ({error})")
    return notes
