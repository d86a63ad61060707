"""A small client for any OpenAI-compatible server, on http.client: one request per connection,
whole or streamed (SSE), and a streamed request can be abandoned mid-way by closing its connection,
which is how a real user leaves.
"""
from __future__ import annotations

import http.client
import json
import socket
from urllib.parse import urlsplit

from ..errors import RefengineError
from .wire import Completion, Stream, whole

__all__ = ["Completion", "Endpoint", "ServerError"]


class ServerError(Exception):
    """The server answered with an error, or broke the response off."""

    def __init__(self, message: str, status: int | None = None):
        super().__init__(message)
        self.status = status  # the HTTP status of a refusal; None: broken or malformed response


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

    def get(self, path: str) -> tuple[int, bytes]:
        """(HTTP status, body) of a plain GET, whatever the content type."""
        conn = self._connect()
        try:
            conn.request("GET", self.base + path)
            resp = conn.getresponse()
            return resp.status, resp.read()
        except http.client.HTTPException as e:
            raise ServerError(f"{path}: broken HTTP response ({type(e).__name__}: {e})") from None
        finally:
            conn.close()

    def get_json(self, path: str) -> dict:
        return _json_body(*self.get(path), path)

    def complete(self, path: str, body: dict, cancel_after: int | None = None) -> Completion:
        """POST `body`; when streaming, hang up after `cancel_after` chunks that carry tokens."""
        conn = self._connect()
        try:
            conn.request("POST", self.base + path, json.dumps(body), {"Content-Type": "application/json"})
            sock = conn.sock  # getresponse() drops conn.sock when the server will close the connection
            resp = conn.getresponse()
            if not body.get("stream"):
                return _whole(_json_body(resp.status, resp.read(), path))
            if resp.status != 200:
                _json_body(resp.status, resp.read(), path)
            return _streamed(resp, cancel_after, sock)
        except (http.client.HTTPException, UnicodeDecodeError) as e:
            raise ServerError(f"{path}: broken HTTP response ({type(e).__name__}: {e})") from None
        finally:
            conn.close()


def _json_body(status: int, raw: bytes, path: str) -> dict:
    try:
        data = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError):
        raise ServerError(f"{path}: HTTP {status}, body is not JSON: {raw[:120]!r}", status) from None
    if status != 200:
        error = data.get("error") if isinstance(data, dict) else None
        message = error.get("message") if isinstance(error, dict) else data
        raise ServerError(f"{path}: HTTP {status}: {message}", status)
    if not isinstance(data, dict):
        raise ServerError(f"{path}: expected a JSON object, got {raw[:120]!r}")
    return data


def _whole(data: dict) -> Completion:
    try:
        return whole(data)
    except ValueError as e:
        raise ServerError(str(e)) from None


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
    """A stream is complete at `data: [DONE]`, or when the server closes it after a chunk carrying a
    finish_reason (HF `transformers serve` sends no [DONE]); closed before any finish_reason, it is broken."""
    stream = Stream()
    for payload in _events(resp):
        if payload == "[DONE]":
            return stream.completion(cancelled=False, done_marker=True)
        try:
            chunk = json.loads(payload)
        except json.JSONDecodeError:
            raise ServerError(f"stream: data is not JSON: {payload[:200]!r}") from None
        if not isinstance(chunk, dict):
            raise ServerError(f"stream: expected a JSON object, got {payload[:200]!r}")
        if chunk.get("error"):
            raise ServerError(f"stream: error event: {chunk['error']}")
        stream.add(chunk)
        if cancel_after is not None and stream.chunks >= cancel_after and stream.finish_reason is None:
            unread = _unread(resp, sock)
            if sock.fileno() != -1:  # (a part of a chunk there makes http.client close the socket itself)
                sock.shutdown(socket.SHUT_RDWR)  # the server sees the hang-up at once, not at the next write
            return stream.completion(cancelled=True, done_marker=None, unread=unread)
    if stream.finish_reason is None:
        raise ServerError(f"stream: closed after {stream.chunks} token chunks without a finish_reason "
                          f"(and without data: [DONE])")
    return stream.completion(cancelled=False, done_marker=False)


def _unread(resp: http.client.HTTPResponse, sock: socket.socket) -> tuple[int, bool]:
    """What the server had sent by the time we hang up that we had not read: its token chunks, and
    whether the answer's end was among them. A server writes ahead of a slow reader (the socket
    buffers hold hundreds of tokens), so a client that hangs up after reading k tokens may do so
    after the server sent every token: the server had finished, and there was nothing to abort.
    Reads only what has arrived, without waiting (a part of a chunk ends the count)."""
    sock.setblocking(False)
    ahead = Stream()
    try:
        for payload in _events(resp):
            chunk = None if payload == "[DONE]" else json.loads(payload)
            if not isinstance(chunk, dict):
                return ahead.chunks, payload == "[DONE]"
            ahead.add(chunk)
            if ahead.finish_reason is not None:
                return ahead.chunks, True
    except (OSError, ValueError, http.client.HTTPException):  # nothing more has arrived yet
        pass
    return ahead.chunks, False
