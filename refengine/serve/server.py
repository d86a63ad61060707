"""OpenAI-compatible HTTP server: a ThreadingHTTPServer (one worker thread per connection, each
running serve.handler.Handler) in front of one EngineThread. Standard library only.

POST /v1/completions, POST /v1/chat/completions (stream: true -> SSE), GET /v1/models, GET /health,
GET /admin/api/status, GET /metrics. Every failure is a JSON `{"error": {message, type, param, code}}`.
"""
from __future__ import annotations

import threading
import time
from http.server import ThreadingHTTPServer

from ..engine import EngineConfig, Fault, LLMEngine
from ..model import Model
from .engine_thread import EngineThread
from .handler import MAX_BODY_BYTES, Handler

__all__ = ["MAX_BODY_BYTES", "OpenAIServer"]


class OpenAIServer(ThreadingHTTPServer):
    daemon_threads = True
    request_queue_size = 256  # 64+ clients connect at once; the default backlog of 5 drops SYNs

    def __init__(self, model: Model, config: EngineConfig, host: str = "127.0.0.1", port: int = 0,
                 max_waiting: int = 64, queue_timeout: float = 30.0, served_name: str | None = None,
                 max_body_bytes: int = MAX_BODY_BYTES):
        self.model = model
        self.engine = LLMEngine(model, config)
        self.engine_thread = EngineThread(self.engine, max_waiting, queue_timeout)
        self.served_name = served_name or model.path.name
        self.max_body_bytes = max_body_bytes
        resolved = self.engine.config
        self.context_tokens = min(resolved.max_model_len, resolved.num_blocks * resolved.block_size)
        self.created = int(time.time())
        self.fingerprint = model.fingerprint
        self.echoes = self.engine.config.injected is not Fault.ECHO_IGNORED  # the fault's code point: Handler._generate
        super().__init__((host, port), Handler)
        self.engine_thread.start()

    @property
    def url(self) -> str:
        host, port = self.server_address[:2]
        return f"http://{host}:{port}"

    def start(self) -> threading.Thread:
        """Serve from a background thread (for tests and embedding); close() stops it."""
        thread = threading.Thread(target=self.serve_forever, name="refengine-http", daemon=True)
        thread.start()
        return thread

    def close(self) -> None:
        self.shutdown()
        self.server_close()
        self.engine_thread.stop()
