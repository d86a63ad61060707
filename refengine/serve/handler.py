"""One HTTP connection's worker: routes a request, parses it (serve.protocol), submits it to the
engine thread and writes the answer, whole or as SSE, noticing when the client hangs up."""
from __future__ import annotations

import json
import os
import select
import socket
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler
from typing import TYPE_CHECKING
from urllib.parse import urlsplit

from ..engine import TokenEvent
from ..errors import RefengineError
from . import metrics
from .engine_thread import EngineStopped, Overloaded, RequestStream
from .protocol import (
    ApiError,
    Generated,
    GenerationRequest,
    engine_error,
    parse_request,
)
from .responses import ResponseBuilder

if TYPE_CHECKING:
    from .server import OpenAIServer

MAX_BODY_BYTES = 1 << 20
DISCONNECT_POLL_SECONDS = 0.2
LINGER_BYTES = 16 << 20  # after refusing an oversize body, read this much of it so the client sees the reply
ENDPOINTS = ("/health", "/v1/models", "/admin/api/status", "/metrics", "/v1/completions", "/v1/chat/completions")


class ClientGone(Exception):
    pass


class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server_version = "refengine"
    timeout = 60  # an idle or stalled connection is dropped (a stalled stream is then aborted)
    server: OpenAIServer

    def log_message(self, format, *args):  # per-request access lines would drown the CLI's one line
        pass

    def do_GET(self):
        self._route({"/health": self._health, "/v1/models": self._models, "/admin/api/status": self._status,
                     "/metrics": self._metrics})

    def do_POST(self):
        self._route({"/v1/completions": lambda: self._generate("completion"),
                     "/v1/chat/completions": lambda: self._generate("chat")})

    def do_PUT(self):
        self._route({})

    do_DELETE = do_PATCH = do_PUT

    def send_error(self, code, message=None, explain=None):
        """http.server's own refusals (bad request line, header too long) in the JSON error shape."""
        self.close_connection = True
        self._send_json(code, ApiError(code, message or HTTPStatus(code).phrase, code="bad_http").body())

    def _route(self, routes: dict) -> None:
        path = urlsplit(self.path).path
        try:
            if path not in routes:
                if path in ENDPOINTS:
                    raise ApiError(405, f"{self.command} {path}: method not allowed", code="method_not_allowed")
                raise ApiError(404, f"{self.command} {path}: no such endpoint", code="not_found")
            routes[path]()
        except ApiError as e:
            self.close_connection = True  # the body may be unread; never parse it as the next request
            self._send_json(e.status, e.body())
            if e.status == 413:
                self._linger()

    # --- GET ------------------------------------------------------------------------------
    def _health(self) -> None:
        thread = self.server.engine_thread
        if thread.healthy:
            self._send_json(200, {"status": "ok"})
        else:
            self._send_json(503, {"status": "error", "message": thread.why_stopped()})

    def _models(self) -> None:
        s = self.server
        self._send_json(200, {"object": "list", "data": [{
            "id": s.served_name, "object": "model", "created": s.created, "owned_by": "refengine",
            "root": str(s.model.path), "max_model_len": s.engine.config.max_model_len,
            "fingerprint": s.fingerprint}]})

    def _status(self) -> None:
        self._send_json(200, self._status_dict())

    def _metrics(self) -> None:
        data = metrics.render(self._status_dict()).encode()
        self.send_response(200)
        self.send_header("Content-Type", metrics.CONTENT_TYPE)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def _status_dict(self) -> dict:
        s = self.server
        config = s.engine.config
        return {**s.engine_thread.status(), "model": s.served_name, "fingerprint": s.fingerprint,
                "mode": config.mode, "max_num_seqs": config.max_num_seqs,
                "max_waiting": s.engine_thread.max_waiting, "queue_timeout": s.engine_thread.queue_timeout}

    # --- POST ------------------------------------------------------------------------------
    def _read_json(self):
        if "chunked" in self.headers.get("Transfer-Encoding", ""):
            raise ApiError(411, "chunked request bodies are not supported; send Content-Length",
                           code="length_required")
        length = self.headers.get("Content-Length")
        if length is None or not length.strip().isdigit():
            raise ApiError(411, f"Content-Length: required as a non-negative integer, got {length!r}",
                           code="length_required")
        if int(length) > self.server.max_body_bytes:
            raise ApiError(413, f"request body: {int(length)} bytes exceeds the limit of "
                                f"{self.server.max_body_bytes}", code="body_too_large")
        raw = self.rfile.read(int(length))
        try:
            return json.loads(raw)
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise ApiError(400, f"request body: invalid JSON ({e})", code="invalid_json") from None

    def _generate(self, kind: str) -> None:
        s = self.server
        request = parse_request(kind, self._read_json(), s.model, s.served_name, s.context_tokens)
        if not s.echoes:  # Fault.ECHO_IGNORED
            request.echo = None
        try:
            stream = s.engine_thread.submit(request.request_id, request.prompt_ids, request.params,
                                            client_gone=self._client_gone, cache_salt=request.cache_salt,
                                            images=request.images)
        except Overloaded as e:
            raise ApiError(503, str(e), code="queue_timeout", type="server_overloaded") from None
        except RefengineError as e:
            raise engine_error(e) from None
        except EngineStopped as e:
            raise ApiError(503, str(e), code="engine_stopped", type="server_error") from None
        builder = ResponseBuilder(request, s.served_name, s.model.tokenizer)
        try:
            if request.stream:
                self._send_stream(request, stream, builder)
            else:
                self._send_whole(stream, builder)
        except BaseException as e:  # whatever ends this worker early frees the request (a finished one ignores it)
            if s.engine_thread.abort_on_hang_up or not isinstance(e, (ClientGone, OSError)):
                s.engine_thread.abort(request.request_id)
            self.close_connection = True
            if not isinstance(e, (ClientGone, OSError)):
                raise

    def _send_whole(self, stream: RequestStream, builder: ResponseBuilder) -> None:
        tokens, finish_reasons = [[] for _ in stream.children], [None] * len(stream.children)
        scored = None
        try:
            for event in self._events(stream):
                index = stream.children.index(event.request_id)
                tokens[index].extend(generated(event, builder.request.logprobs))
                finish_reasons[index] = event.finish_reason
                scored = event.prompt_logprobs if event.prompt_logprobs is not None else scored
        except EngineStopped as e:
            raise ApiError(500, str(e), code="engine_stopped", type="server_error") from None
        self._send_json(200, builder.response(tokens, finish_reasons, self._cached(stream), scored))

    def _send_stream(self, request: GenerationRequest, stream: RequestStream, builder: ResponseBuilder) -> None:
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Cache-Control", "no-cache")
        self.send_header("Connection", "close")  # the stream's end is the connection's end
        self.end_headers()
        self.close_connection = True
        num_generated, started = 0, set()
        try:
            for event in self._events(stream):
                tokens = generated(event, request.logprobs)
                num_generated += len(tokens)
                index = stream.children.index(event.request_id)
                self._send_event(builder.chunk(tokens, event.finish_reason, first=index not in started,
                                               scored=event.prompt_logprobs, index=index))
                started.add(index)
        except EngineStopped as e:
            self._send_event(ApiError(500, str(e), code="engine_stopped", type="server_error").body())
            return
        if request.include_usage:
            self._send_event(builder.usage_chunk(num_generated, self._cached(stream)))
        self._send_event("[DONE]")

    def _events(self, stream: RequestStream):
        """The request's token events until every answer has finished; raises ClientGone if the client hangs up.
        The socket is looked at before every event, not on a clock: a stream whose client has gone is
        aborted at its next token however far the engine has run ahead of this thread (a 0.2 s poll let
        a fast engine finish a hung-up answer first, so the hang-up counted as a finish:
        tests/test_invariants_http.py's slot-leak hunts), and every DISCONNECT_POLL_SECONDS while the
        request waits with no events."""
        unfinished = len(stream.children)
        while True:
            event = self.server.engine_thread.next_event(stream, DISCONNECT_POLL_SECONDS)
            if self._client_gone():
                raise ClientGone(stream.request_id)
            if event is not None:
                yield event
                unfinished -= event.finish_reason is not None
                if not unfinished:
                    return

    def _cached(self, stream: RequestStream) -> int | None:
        """usage.prompt_tokens_details.cached_tokens, on a server with prefix caching (as vLLM reports it)."""
        return stream.num_cached_tokens if self.server.engine.config.enable_prefix_caching else None

    def _client_gone(self) -> bool:
        """Called by the engine thread too (EngineThread._abort_hung_up), also once this worker has
        closed the socket: a closed socket (descriptor -1, ValueError) is gone."""
        try:
            return peer_closed(self.connection)
        except (OSError, ValueError):
            return True

    # --- writing ---------------------------------------------------------------------------
    def _send_json(self, status: int, body: dict) -> None:
        data = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        if status == 503:
            self.send_header("Retry-After", "1")
        if self.close_connection:
            self.send_header("Connection", "close")
        self.end_headers()
        self.wfile.write(data)

    def _send_event(self, payload) -> None:
        data = payload if isinstance(payload, str) else json.dumps(payload)
        self.wfile.write(f"data: {data}\n\n".encode())
        self.wfile.flush()

    def _linger(self) -> None:
        """Half-close, then swallow the unread body: closing with unread data would reset the
        connection and could destroy the error reply before the client reads it."""
        try:
            self.wfile.flush()
            self.connection.shutdown(socket.SHUT_WR)
            self.connection.settimeout(1.0)
            drained = 0
            while drained < LINGER_BYTES and (chunk := self.connection.recv(1 << 16)):
                drained += len(chunk)
        except OSError:
            pass


def generated(event: TokenEvent, num_logprobs: int | None) -> list[Generated]:
    """The token a TokenEvent carries (none for an abort)."""
    if event.token_id is None:
        return []
    return [Generated(event.token_id, event.text_delta, event.logprob, event.top_logprobs[:num_logprobs or 0])]


def peer_closed(connection: socket.socket) -> bool:
    """A closed peer makes the socket readable with nothing to read. The peek never waits: what made the
    socket readable may have been read by the worker before the engine thread peeks, and the
    connection's own recv waits for data up to its timeout whatever the flags say (CPython polls before
    it reads on a socket with a timeout), which held the engine thread, and every request, that long.
    So the peek goes through a duplicate of the descriptor without a timeout, its flags untouched
    (tests/test_server.py: test_a_peek_at_a_socket_whose_data_was_read_never_waits)."""
    poller = select.poll()  # not select(): it fails on descriptors above 1023
    poller.register(connection, select.POLLIN)
    return bool(poller.poll(0)) and peek_empty(connection)


def peek_empty(connection: socket.socket) -> bool:
    """Whether the peer has closed a readable socket (nothing to read): at once, data or none."""
    descriptor = os.dup(connection.fileno())
    try:
        peek = socket.socket(fileno=descriptor)  # no timeout: its recv does not poll first
    except OSError:
        os.close(descriptor)
        raise
    with peek:
        try:
            return peek.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT) == b""
        except BlockingIOError:
            return False
