"""The serving thread model (Kestrel-LLM's vllm_batch.c, in Python).

One engine thread is the only caller of `engine.step()`: it takes new requests and aborts from
the HTTP worker threads, runs one batched step for everything in flight, and hands each request's
token events to that request's own queue. Worker threads never touch the engine; they submit, then
wait on their queue. Admission is bounded: `max_num_seqs + max_waiting` requests may be in flight;
a further one waits for a slot up to `queue_timeout` seconds and is then refused. A slot is taken
before the request is handed over and returned when it ends (finished, aborted or refused by the
engine); `slots_used` on the status page counts the slots taken (Fault.SLOT_LEAK: a request that ends
by an abort or an error keeps its slot).

A hang-up is noticed by the engine thread itself: before every step it asks each live request whether
its client has gone (the worker hands over a probe of its socket), and aborts those that have, so a
hang-up is an abort within one engine step however long the worker thread waits for the CPU
(Fault.HANG_UP_WITHOUT_ABORT: never). And a request's end is counted before its final event is handed
to the worker: a client that has seen its answer end finds it counted on the status page
(validate.aborts proves from those counts that a hung-up request had not finished; tests/test_invariants_http.py's
loaded run guards both claims).
"""
from __future__ import annotations

import queue
import threading
from collections.abc import Callable
from dataclasses import dataclass, field, replace

from ..engine import Fault, LLMEngine
from ..errors import RefengineError
from ..sampling import SamplingParams


class Overloaded(Exception):
    """No slot freed within the queue timeout."""


class EngineStopped(Exception):
    """The engine thread is gone (shut down, or a step raised)."""


@dataclass
class RequestStream:
    """A worker thread's handle on one submitted request: its events arrive on `events`."""
    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    events: queue.Queue = field(default_factory=queue.Queue)
    accepted: threading.Event = field(default_factory=threading.Event)
    error: Exception | None = None  # set when the engine refused the request or is gone
    client_gone: Callable[[], bool] | None = None  # the worker's probe of its connection; None: never gone
    num_cached_tokens: int = 0  # prompt tokens its admission found in the prefix cache (set before its events)
    cache_salt: str | None = None
    images: list | None = None  # a chat's images, in order
    children: list[str] = field(default_factory=list)  # the engine ids it runs under: one per answer (n)


class EngineThread(threading.Thread):
    def __init__(self, engine: LLMEngine, max_waiting: int, queue_timeout: float):
        super().__init__(name="refengine-engine", daemon=True)
        self.engine = engine
        self.max_waiting = max_waiting
        self.queue_timeout = queue_timeout
        self.failure: BaseException | None = None
        self.num_slots = engine.config.max_num_seqs + max_waiting
        self._slots = threading.BoundedSemaphore(self.num_slots)
        self._leak_slots = engine.config.injected is Fault.SLOT_LEAK  # the fault's code point: _end_slot
        self.abort_on_hang_up = engine.config.injected is not Fault.HANG_UP_WITHOUT_ABORT  # _abort_hung_up, handler
        self._kept = (lambda params: replace(params, presence_penalty=0.0, frequency_penalty=0.0,
                                             repetition_penalty=1.0, logit_bias=(), min_tokens=0)) \
            if engine.config.injected is Fault.LOGITS_PROCESSORS_IGNORED else (lambda params: params)  # submit
        self._wakeup = threading.Condition()
        self._submitted: list[RequestStream] = []
        self._aborts: list[str] = []
        self._stopping = False
        self._streams: dict[str, RequestStream] = {}  # engine thread only: by request id
        self._by_child: dict[str, RequestStream] = {}  # engine thread only: by the engine id of each answer
        self._counters = {"requests_total": 0, "requests_finished": 0, "requests_aborted": 0,
                          "requests_finished_stop": 0, "requests_finished_length": 0,  # finished, by reason
                          "requests_rejected_busy": 0, "max_batch_active": 0,
                          "slot_waiters": 0, "slots_used": 0}
        self._snapshot: dict = {}
        self._publish()

    # --- worker-thread side -------------------------------------------------------------
    def submit(self, request_id: str, prompt_ids: list[int], params: SamplingParams,
               client_gone: Callable[[], bool] | None = None, cache_salt: str | None = None,
               images: list | None = None) -> RequestStream:
        """Wait for a slot, hand the request to the engine thread, and return once it is accepted.
        `client_gone`: whether the request's client has hung up (called from the engine thread).
        Raises Overloaded, RefengineError (the engine refused the request) or EngineStopped."""
        self._count("slot_waiters", +1)
        got_slot = self._slots.acquire(timeout=self.queue_timeout)
        self._count("slot_waiters", -1)
        if got_slot:
            self._count("slots_used", +1)
        else:
            self._count("requests_rejected_busy", +1)
            raise Overloaded(f"no batch slot freed within {self.queue_timeout:g}s "
                             f"(max_num_seqs {self.engine.config.max_num_seqs}, max_waiting {self.max_waiting})")
        stream = RequestStream(request_id, prompt_ids, self._kept(params), client_gone=client_gone,
                               cache_salt=cache_salt, images=images)
        with self._wakeup:
            if self._stopping or self.failure:
                self._release_slot()
                raise EngineStopped(self.why_stopped())
            self._submitted.append(stream)
            self._wakeup.notify()
        while not stream.accepted.wait(0.5):
            if not self.is_alive():
                raise EngineStopped(self.why_stopped())
        if stream.error:
            raise stream.error
        return stream

    def next_event(self, stream: RequestStream, timeout: float):
        """The request's next TokenEvent, or None after `timeout` seconds without one."""
        try:
            event = stream.events.get(timeout=timeout)
        except queue.Empty:
            if not self.is_alive():
                raise EngineStopped(self.why_stopped()) from None
            return None
        if isinstance(event, BaseException):
            raise EngineStopped(self.why_stopped())
        return event

    def abort(self, request_id: str) -> None:
        with self._wakeup:
            self._aborts.append(request_id)
            self._wakeup.notify()

    def status(self) -> dict:
        with self._wakeup:
            return {**self._snapshot, **self._counters, "slots_total": self.num_slots}

    def stop(self) -> None:
        with self._wakeup:
            self._stopping = True
            self._wakeup.notify()
        self.join()

    def _release_slot(self) -> None:
        self._count("slots_used", -1)
        self._slots.release()

    def _end_slot(self, ended_by_error_or_abort: bool) -> None:
        """A request ended: its slot goes back (not with Fault.SLOT_LEAK after an abort or an error)."""
        if not (self._leak_slots and ended_by_error_or_abort):
            self._release_slot()

    def _count(self, name: str, delta: int) -> None:
        with self._wakeup:
            self._counters[name] += delta

    @property
    def healthy(self) -> bool:
        return self.is_alive() and self.failure is None and not self._stopping

    def why_stopped(self) -> str:
        return f"engine failed: {self.failure!r}" if self.failure else "engine is shutting down"

    # --- engine-thread side -------------------------------------------------------------
    def run(self) -> None:
        try:
            while self._serve_once():
                pass
        except BaseException as e:  # a failed step leaves the engine unusable: fail every request
            self.failure = e
            for stream in self._streams.values():
                stream.events.put(e)
            raise
        finally:
            with self._wakeup:
                for stream in self._submitted:
                    stream.error = EngineStopped(self.why_stopped())
                    stream.accepted.set()
            self._publish()

    def _serve_once(self) -> bool:
        with self._wakeup:
            while not (self._submitted or self._aborts or self._stopping or self.engine.has_unfinished()):
                self._wakeup.wait()
            if self._stopping:
                return False
            submitted, self._submitted = self._submitted, []
            aborts, self._aborts = self._aborts, []
        for stream in submitted:
            self._admit(stream)
        for request_id in aborts:
            if request_id in self._streams:
                self.engine.abort(request_id)  # an n > 1 request's id: every answer
        if self.abort_on_hang_up:
            self._abort_hung_up()
        if self.engine.has_unfinished():
            self._dispatch(self.engine.step())
            self.engine.trace.clear()  # the per-step trace is for offline runs; a server would grow it forever
        self._publish()
        return True

    def _abort_hung_up(self) -> None:
        for request_id, stream in self._streams.items():
            if stream.client_gone is not None and stream.client_gone():
                self.engine.abort(request_id)  # False for one already aborted: its event is on its way

    def _admit(self, stream: RequestStream) -> None:
        try:
            self.engine.add_request(stream.request_id, stream.prompt_ids, params=stream.params,
                                    cache_salt=stream.cache_salt, images=stream.images)
        except RefengineError as e:
            stream.error = e
            self._end_slot(ended_by_error_or_abort=True)
        else:
            self._streams[stream.request_id] = stream
            stream.children = self.engine.request_ids(stream.request_id)
            self._by_child |= dict.fromkeys(stream.children, stream)
            self._count("requests_total", +1)
        stream.accepted.set()

    def _dispatch(self, events) -> None:
        for event in events:
            stream = self._by_child[event.request_id]
            if event.request_id == stream.children[0]:  # usage: the first answer's admission says
                stream.num_cached_tokens = self.engine.sequences[event.request_id].num_cached_tokens or 0
            if event.finish_reason is not None:
                del self._by_child[event.request_id]
                self.engine.release(event.request_id)
                if not any(child in self._by_child for child in stream.children):  # its last answer ended:
                    self._end(stream, event.finish_reason)  # counted before the worker can send the end
            stream.events.put(event)

    def _end(self, stream: RequestStream, finish_reason: str) -> None:
        del self._streams[stream.request_id]
        self._end_slot(ended_by_error_or_abort=finish_reason == "abort")
        self._count("requests_aborted" if finish_reason == "abort" else "requests_finished", +1)
        if finish_reason in ("stop", "length"):
            self._count(f"requests_finished_{finish_reason}", +1)

    def _publish(self) -> None:
        status = self.engine.status()
        last_step_batch = status["batch_active"]
        if not self.engine.has_unfinished():  # the last step's batch has left: nothing is active now
            status["batch_active"] = 0
        with self._wakeup:
            self._snapshot = {**status, "in_flight": len(self._streams)}
            self._counters["max_batch_active"] = max(self._counters["max_batch_active"], last_step_batch)
