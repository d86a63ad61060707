"""A small client for any OpenAI-compatible server, on http.client: one request per connection,
whole or streamed (SSE), and a streamed request can be abandoned mid-way by closing its connection,
which is how a real user leaves.
"""
from __future__ import annotations

import http.client
import json
import socket
from dataclasses import dataclass
from urllib.parse import urlsplit

from ..errors import RefengineError


class ServerError(Exception):
    """The server answered with an error, or broke the response off."""


@dataclass(frozen=True)
class Completion:
    text: str
    token_ids: list[int] | None         # None: the server does not report generated ids
    prompt_token_ids: list[int] | None  # None: not reported
    finish_reason: str | None
    cancelled: bool                     # we hung up before the answer was complete


class Endpoint:
    def __init__(self, url: str, timeout: float):
        parts = urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise RefengineError(f"url: expected http://HOST[:PORT], got {url!r}")
        self.url = url
        self.scheme, self.host, self.timeout = parts.scheme, parts.hostname, timeout
        try:
            self.port = parts.port
        except ValueError:
            raise RefengineError(f"url: bad port in {url!r}") from None
        self.base = parts.path.rstrip("/").removesuffix("/v1")  # both http://h:p and http://h:p/v1 work

    def _connect(self) -> http.client.HTTPConnection:
        kind = http.client.HTTPSConnection if self.scheme == "https" else http.client.HTTPConnection
        return kind(self.host, self.port, timeout=self.timeout)

    def get_json(self, path: str) -> dict:
        conn = self._connect()
        try:
            conn.request("GET", self.base + path)
            resp = conn.getresponse()
            return _json_body(resp, path)
        except http.client.HTTPException as e:
            raise ServerError(f"{path}: broken HTTP response ({type(e).__name__}: {e})") from None
        finally:
            conn.close()

    def complete(self, path: str, body: dict, cancel_after: int | None = None) -> Completion:
        """POST `body`; when streaming, hang up after `cancel_after` chunks that carry tokens."""
        conn = self._connect()
        try:
            conn.request("POST", self.base + path, json.dumps(body), {"Content-Type": "application/json"})
            sock = conn.sock  # getresponse() drops conn.sock when the server will close the connection
            resp = conn.getresponse()
            if not body.get("stream"):
                return _whole(_json_body(resp, path))
            if resp.status != 200:
                _json_body(resp, path)
            return _streamed(resp, cancel_after, sock)
        except (http.client.HTTPException, UnicodeDecodeError) as e:
            raise ServerError(f"{path}: broken HTTP response ({type(e).__name__}: {e})") from None
        finally:
            conn.close()


def _json_body(resp: http.client.HTTPResponse, path: str) -> dict:
    raw = resp.read()
    try:
        data = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError):
        raise ServerError(f"{path}: HTTP {resp.status}, body is not JSON: {raw[:120]!r}") from None
    if resp.status != 200:
        error = data.get("error") if isinstance(data, dict) else None
        message = error.get("message") if isinstance(error, dict) else data
        raise ServerError(f"{path}: HTTP {resp.status}: {message}")
    if not isinstance(data, dict):
        raise ServerError(f"{path}: expected a JSON object, got {raw[:120]!r}")
    return data


def _choice_text(choice: dict) -> str:
    if "text" in choice:
        return choice["text"] or ""
    return (choice.get("message") or choice.get("delta") or {}).get("content") or ""


def _whole(data: dict) -> Completion:
    try:
        choice = data["choices"][0]
    except (KeyError, IndexError, TypeError):
        raise ServerError(f"response without choices: {str(data)[:120]}") from None
    return Completion(_choice_text(choice), choice.get("token_ids"), choice.get("prompt_token_ids"),
                      choice.get("finish_reason"), cancelled=False)


def _events(resp: http.client.HTTPResponse):
    """SSE `data:` payloads; an event's data lines join with newlines, a blank line ends it."""
    data = []
    while line := resp.readline():
        line = line.decode("utf-8").rstrip("\r\n")
        if line.startswith("data:"):
            data.append(line[5:].removeprefix(" "))
        elif not line and data:
            yield "\n".join(data)
            data = []
    if data:
        yield "\n".join(data)


def _streamed(resp: http.client.HTTPResponse, cancel_after: int | None, sock: socket.socket) -> Completion:
    pieces, ids, prompt_ids, finish_reason, chunks, ids_reported = [], [], None, None, 0, True
    for payload in _events(resp):
        if payload == "[DONE]":
            return Completion("".join(pieces), ids if ids_reported else None, prompt_ids, finish_reason, False)
        try:
            chunk = json.loads(payload)
        except json.JSONDecodeError:
            raise ServerError(f"stream: data is not JSON: {payload[:200]!r}") from None
        if "error" in chunk:
            raise ServerError(f"stream: error event: {chunk['error']}")
        for choice in chunk.get("choices") or ():
            text, chunk_ids = _choice_text(choice), choice.get("token_ids")
            pieces.append(text)
            ids_reported = ids_reported and chunk_ids is not None
            ids += chunk_ids or []
            prompt_ids = prompt_ids or choice.get("prompt_token_ids")
            finish_reason = choice.get("finish_reason") or finish_reason
            chunks += bool(text or chunk_ids)
        if cancel_after is not None and chunks >= cancel_after and finish_reason is None:
            sock.shutdown(socket.SHUT_RDWR)  # the server sees the hang-up at once, not at the next write
            return Completion("".join(pieces), ids if ids_reported else None, prompt_ids, None, True)
    raise ServerError("stream: ended without data: [DONE]")
