"""The throughput model of a decode step, and the two machine figures it needs, measured now.

A decode step over B sequences reads every streamed weight once and each sequence's KV prefix,
and does 2 flops per weight per sequence, so

    T(B) ~= max(2 * N * B / FLOPS, (bytes_per_param * N + KV(B)) / BW)

with N the parameters a step multiplies by (the embedding is gathered, not streamed, unless it is
also the tied lm_head). Both machine figures are measured in the same process as the benchmark,
because on a shared machine they drift: BW by a numpy streaming read (a max, the cheapest reduction
per byte) of an array far larger than the caches, on one thread and then one slice per core on a
thread pool (numpy's reductions release the GIL); FLOPS by a large square float32 gemm through
numpy's BLAS.
"""
from __future__ import annotations

import os
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass

import numpy as np

from ..model import ModelConfig

STREAM_BYTES = 512 << 20   # 16x the L3 of the machines this was written on
GEMM_SIZE = 2048


def _best_seconds(fn, repeats: int) -> float:
    fn()
    best = float("inf")
    for _ in range(repeats):
        started = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - started)
    return best


def streaming_bandwidth(threads: int, repeats: int = 5) -> float:
    """Bytes per second a numpy reduction reads from DRAM with `threads` threads."""
    data = np.ones(STREAM_BYTES // 4, dtype=np.float32)
    slices = np.array_split(data, threads)
    if threads == 1:
        seconds = _best_seconds(data.max, repeats)
    else:
        with ThreadPoolExecutor(threads) as pool:
            seconds = _best_seconds(lambda: list(pool.map(np.max, slices)), repeats)
    return data.nbytes / seconds


class MatvecRead:
    """A float32 matrix-vector product over STREAM_BYTES through numpy's BLAS: the read a batch-1
    decode step makes, on the same BLAS threads. Between engine steps this is the bandwidth probe
    that measures the machine rather than itself: a numpy thread pool there competes with OpenBLAS's
    threads, which spin for a while after each call, so a read right after a burst of products
    measures less than the memory gives (docs/performance/history.md has the figures)."""
    name = "matrix-vector read"

    def __init__(self, width: int = 1024):
        self.matrix = np.ones((STREAM_BYTES // 4 // width, width), dtype=np.float32)
        self.vector = np.ones(width, dtype=np.float32)

    def measure(self, repeats: int = 1) -> float:
        """Bytes per second of the fastest of `repeats` products (after one to warm up)."""
        return self.matrix.nbytes / _best_seconds(lambda: self.matrix @ self.vector, repeats)


class GemmRate:
    """A large square float32 gemm through numpy's BLAS (all its threads): the compute probe, in the
    machine's figures and between engine steps."""
    name = "sgemm"

    def __init__(self, size: int = GEMM_SIZE):
        rng = np.random.default_rng(0)
        self.a = rng.standard_normal((size, size), dtype=np.float32)
        self.b = rng.standard_normal((size, size), dtype=np.float32)

    def measure(self, repeats: int = 1) -> float:
        """Flop/s of the fastest of `repeats` products (after one to warm up)."""
        return 2 * self.a.shape[0] ** 3 / _best_seconds(lambda: self.a @ self.b, repeats)


def foreign_cpu_seconds() -> float | None:
    """CPU time the machine has spent on other processes since boot (Linux /proc; None elsewhere).
    The difference over a step tells whether a neighbour competed for the cores during it."""
    try:
        with open("/proc/stat") as f:
            fields = [int(v) for v in f.readline().split()[1:9]]
        with open("/proc/self/stat") as f:
            own = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return None
    busy = sum(fields) - fields[3] - fields[4]   # all time but idle and iowait, every core
    return (busy - int(own[11]) - int(own[12])) / os.sysconf("SC_CLK_TCK")  # minus our utime + stime


@dataclass(frozen=True)
class Machine:
    bandwidth_1thread: float   # bytes/s
    bandwidth_all: float       # bytes/s, one numpy slice per core
    threads: int
    sgemm_flops: float         # flop/s
    load_average: float        # 1-minute load when measured: other work on the machine skews every figure

    @property
    def bandwidth(self) -> float:
        """The best streaming rate the machine showed: what a memory-bound step can hope for."""
        return max(self.bandwidth_1thread, self.bandwidth_all)

    def to_json(self) -> dict:
        return asdict(self) | {"bandwidth": self.bandwidth}

    def best(self, other: Machine) -> Machine:
        """Both measurements' best figures (and this one's load average). Other work -- on this machine
        or, unseen from inside a VM, on its host -- only ever lowers them, so a benchmark measures
        before and after its runs."""
        return Machine(max(self.bandwidth_1thread, other.bandwidth_1thread),
                       max(self.bandwidth_all, other.bandwidth_all), self.threads,
                       max(self.sgemm_flops, other.sgemm_flops), self.load_average)


def measure_machine() -> Machine:
    threads = os.cpu_count() or 1
    return Machine(bandwidth_1thread=streaming_bandwidth(1), bandwidth_all=streaming_bandwidth(threads),
                   threads=threads, sgemm_flops=GemmRate().measure(repeats=3), load_average=os.getloadavg()[0])


def streamed_parameters(cfg: ModelConfig) -> int:
    """Parameters one forward token multiplies by: every layer, the final norm and the lm_head."""
    untied_embedding = 0 if cfg.tie_word_embeddings else cfg.vocab_size * cfg.hidden_size
    return cfg.num_parameters - untied_embedding


def kv_bytes_per_token(cfg: ModelConfig, itemsize: int = 4) -> int:
    """Cache bytes one context position occupies (keys and values, every layer)."""
    return 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * itemsize


@dataclass(frozen=True)
class Roofline:
    """T for one model on one machine. The lm_head multiplies only the rows that sample a token."""
    parameters: int
    head_parameters: int
    bytes_per_param: int
    kv_bytes_per_token: int
    bandwidth: float
    flops: float

    @classmethod
    def of(cls, cfg: ModelConfig, machine: Machine, bytes_per_param: int = 4) -> Roofline:
        return cls(streamed_parameters(cfg), cfg.vocab_size * cfg.hidden_size, bytes_per_param,
                   kv_bytes_per_token(cfg, bytes_per_param), machine.bandwidth, machine.sgemm_flops)

    @property
    def weight_bytes(self) -> int:
        return self.parameters * self.bytes_per_param

    def forward_seconds(self, tokens: int, sampled: int, context_tokens: float) -> float:
        """One step over `tokens` rows, `sampled` of them through the lm_head, reading
        `context_tokens` cached positions in total."""
        flops = 2 * (self.parameters - self.head_parameters) * tokens + 2 * self.head_parameters * sampled
        memory = self.weight_bytes + context_tokens * self.kv_bytes_per_token
        return max(flops / self.flops, memory / self.bandwidth)

    def compute_seconds(self, batch: int) -> float:
        return 2 * self.parameters * batch / self.flops

    def memory_seconds(self, batch: int, context: float) -> float:
        return (self.weight_bytes + batch * context * self.kv_bytes_per_token) / self.bandwidth

    def step_seconds(self, batch: int, context: float) -> float:
        """A decode step of `batch` sequences, each attending over `context` positions."""
        return max(self.compute_seconds(batch), self.memory_seconds(batch, context))

    def crossover_batch(self, context: float) -> float:
        """The batch size where the compute line meets the memory line."""
        per_seq_compute = 2 * self.parameters / self.flops
        per_seq_memory = context * self.kv_bytes_per_token / self.bandwidth
        return self.weight_bytes / self.bandwidth / max(per_seq_compute - per_seq_memory, 1e-30)
