"""Read safetensors with the safetensors library; write them ourselves, byte for byte reproducibly.

Opening goes through `safetensors.safe_open(path, framework="np")`, which validates the header
(names, dtypes, shapes, byte ranges), and so does `get` (a tensor as stored). ml_dtypes is imported
before `get` returns a BF16 tensor, because it registers `bfloat16` with numpy: with it, safetensors
(>= 0.4.1) returns BF16 tensors as `ml_dtypes.bfloat16` arrays. Only then: importing it takes about a
second, which every refengine process (each CLI call, each test worker) would pay. The library's own
exceptions are translated into RefengineError naming the file (and the tensor, where the library or
we know it).

`get_float`, which every weight goes through, widens from a read-only mapping of the validated byte
range instead: the library would first copy the stored bytes out (for a streamed float64 reference,
every tensor on every pass), and its copy holds the GIL. Widening is exact either way (bf16 is the
top half of a float32: tests/test_loading_errors.py checks every bf16 bit pattern against torch), and
it runs in WIDEN_CHUNK pieces on every core, numpy's casts releasing the GIL. The mapping is dropped
when the call returns, so no file stays mapped beyond the tensor being read.
"""
from __future__ import annotations

import json
import math
import mmap
import os
import re
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from functools import cache
from pathlib import Path

import numpy as np
from safetensors import SafetensorError, safe_open

from ..errors import RefengineError

READABLE_DTYPES = ("F64", "F32", "F16", "BF16", "I64", "I32", "U8")
_WRITE_DTYPES = {"F32": "<f4", "F16": "<f2", "BF16": "<u2"}

# The library's header errors, worded as in safetensors >= 0.6 and (Debug names) in 0.4.x / 0.5.x.
_HEADER_ERRORS = [
    (("header too small", "HeaderTooSmall"), "truncated safetensors file (no complete header)"),
    (("invalid header length", "InvalidHeaderLength"),
     "corrupt safetensors header (header length exceeds the file size)"),
    (("header too large", "HeaderTooLarge"), "corrupt safetensors header (header length too large)"),
    (("incomplete metadata", "MetadataIncompleteBuffer"),
     "truncated safetensors file (or trailing bytes): the data section does not end where the header's "
     "last tensor ends"),
    (("invalid shape, data type, or offset", "TensorInvalidInfo"),
     "corrupt safetensors header: a tensor's offsets do not match its shape and dtype"),
    (("invalid offset", "InvalidOffset"),
     "corrupt safetensors header: tensor byte ranges overlap or leave a gap"),
    (("invalid JSON", "invalid UTF-8", "InvalidHeader"), "corrupt safetensors header"),
]
_NAMED_TENSOR = re.compile(r"tensor `([^`]*)`|InvalidOffset\(\"(.*)\"\)")


_ITEMSIZE = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2, "U8": 1, "I8": 1, "BOOL": 1}


def _culprit(path: Path) -> str | None:
    """The tensor a header error the library does not attribute is about -- the first whose byte range
    does not match its shape and dtype or runs past the data -- read for the message only."""
    try:
        with open(path, "rb") as f:
            length = int.from_bytes(f.read(8), "little")
            header = json.loads(f.read(length))
        data_size = path.stat().st_size - 8 - length
        for name, info in header.items():
            begin, end = info["data_offsets"] if name != "__metadata__" else (0, 0)
            size = int(np.prod(info["shape"])) * _ITEMSIZE[info["dtype"]] if name != "__metadata__" else 0
            if end - begin != size or end > data_size:
                return name
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        pass
    return None


def _translate(path: Path, error: Exception, tensor: str | None = None) -> RefengineError:
    """One RefengineError naming the file (and the tensor, if known) with the library's own words."""
    text = str(error)
    named = _NAMED_TENSOR.search(text)
    tensor = tensor or (named and (named.group(1) or named.group(2))) or _culprit(path)
    what = next((meaning for keys, meaning in _HEADER_ERRORS if any(k in text for k in keys)),
                "cannot read safetensors file")
    where = f": tensor {tensor!r}" if tensor else ""
    return RefengineError(f"{path}: {what}{where} (safetensors: {text})")


WIDEN_CHUNK = 1 << 16  # values widened per piece: a bf16 piece's float32 stays in cache
PARALLEL_VALUES = 1 << 20  # a tensor this large is widened on every core
_READ_ONLY = ({"flags": mmap.MAP_SHARED | mmap.MAP_POPULATE, "prot": mmap.PROT_READ}
              if hasattr(mmap, "MAP_POPULATE") else {"access": mmap.ACCESS_READ})  # Linux; elsewhere, plain
_STORED = {"F64": "<f8", "F32": "<f4", "F16": "<f2", "BF16": "<u2", "I64": "<i8", "I32": "<i4", "U8": "u1"}


@cache
def _cores() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


@cache
def _workers(pid: int) -> ThreadPoolExecutor:  # per process: a forked child has none of its parent's threads
    return ThreadPoolExecutor(_cores(), thread_name_prefix="refengine-widen")


def _widen(stored: np.ndarray, bf16: bool, out: np.ndarray, start: int, stop: int) -> None:
    """out[start:stop] = stored[start:stop] widened (both flat), WIDEN_CHUNK values at a time."""
    for lo in range(start, stop, WIDEN_CHUNK):
        hi = min(lo + WIDEN_CHUNK, stop)
        piece = stored[lo:hi]
        out[lo:hi] = (piece.astype(np.uint32) << 16).view(np.float32) if bf16 else piece  # exact


class SafetensorsFile:
    """One file, read by the safetensors library: `tensors` maps name -> (dtype string, shape);
    `get` reads one tensor. No file handle or mapping is kept between calls."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        with self._open() as f:
            self.metadata = f.metadata() or {}
            self.tensors: dict[str, tuple[str, tuple[int, ...]]] = {}
            for name in f.keys():
                info = f.get_slice(name)
                dtype, shape = info.get_dtype(), tuple(int(d) for d in info.get_shape())
                if dtype not in READABLE_DTYPES:
                    raise RefengineError(f"{self.path}: tensor {name!r} has unsupported dtype {dtype}")
                self.tensors[name] = (dtype, shape)
        with open(self.path, "rb") as f:  # the byte ranges the library has just validated
            length = int.from_bytes(f.read(8), "little")
            header = json.loads(f.read(length))
        self._offsets = {name: 8 + length + header[name]["data_offsets"][0] for name in self.tensors}

    @contextmanager
    def _open(self, tensor: str | None = None):
        try:
            handle = safe_open(self.path, framework="np")
        except FileNotFoundError:
            raise RefengineError(f"{self.path}: file not found") from None
        except OSError as e:
            raise RefengineError(f"{self.path}: cannot open ({e.strerror or e})") from None
        except SafetensorError as e:
            raise _translate(self.path, e, tensor) from None
        with handle as f:
            yield f

    def _readable(self, name: str) -> None:
        if self.tensors[name][0] == "BF16":
            import ml_dtypes  # noqa: F401  (registers numpy's bfloat16, which safe_open(framework="np") needs)

    def get(self, name: str) -> np.ndarray:
        """The tensor as stored (BF16 as ml_dtypes.bfloat16), copied out of the file."""
        self._readable(name)
        with self._open(name) as f:
            try:
                return f.get_tensor(name)
            except SafetensorError as e:
                raise _translate(self.path, e, name) from None

    def rows_shape(self, name: str, rows: slice | None = None) -> tuple[int, tuple[int, ...]]:
        """(first row, shape) of tensor `name`, or of its contiguous `rows`."""
        shape = self.tensors[name][1]
        if rows is None:
            return 0, shape
        first, stop, step = rows.indices(shape[0])
        if step != 1:
            raise ValueError(f"rows: a contiguous slice, got {rows}")
        return first, (max(stop - first, 0), *shape[1:])

    def _mapped(self, name: str, stored: str, first: int, shape: tuple) -> np.ndarray:
        """Rows first.. of tensor `name` (`shape`: theirs), read-only, straight from the file: mapped
        with MAP_POPULATE where the system has it, one call faulting every page in rather than a fault
        per page as the widening first touches it."""
        itemsize = np.dtype(stored).itemsize
        start = self._offsets[name] + first * math.prod(shape[1:]) * itemsize
        aligned = start // mmap.ALLOCATIONGRANULARITY * mmap.ALLOCATIONGRANULARITY
        try:
            with open(self.path, "rb") as f:
                mapping = mmap.mmap(f.fileno(), start - aligned + math.prod(shape) * itemsize, offset=aligned,
                                    **_READ_ONLY)
        except (OSError, ValueError) as e:  # the file changed since it was opened
            raise RefengineError(f"{self.path}: cannot map tensor {name!r} ({e})") from None
        return np.frombuffer(mapping, dtype=stored, count=math.prod(shape), offset=start - aligned).reshape(shape)

    def get_float(self, name: str, dtype=np.float32, rows: slice | None = None,
                  out: np.ndarray | None = None) -> np.ndarray:
        """The tensor (or the rows `rows` of it: only they are read) widened to `dtype`, into `out`
        (C-contiguous, of that shape and dtype) when given."""
        stored = self.tensors[name][0]
        first, shape = self.rows_shape(name, rows)
        if not math.prod(shape):  # nothing to map
            return np.empty(shape, dtype) if out is None else out
        source = self._mapped(name, _STORED[stored], first, shape)
        out = np.empty(shape, dtype) if out is None else out
        flat, into, bf16 = source.reshape(-1), out.reshape(-1), stored == "BF16"
        if flat.size < PARALLEL_VALUES:
            _widen(flat, bf16, into, 0, flat.size)
            return out
        parts = _cores()
        bounds = [flat.size * i // parts // WIDEN_CHUNK * WIDEN_CHUNK for i in range(parts)] + [flat.size]
        for job in [_workers(os.getpid()).submit(_widen, flat, bf16, into, lo, hi) for lo, hi in zip(bounds, bounds[1:])]:
            job.result()
        return out


# Writing. safetensors.numpy.save_file would do, but `refengine make-tiny` promises byte-identical
# files (its fingerprints and the shipped golden files depend on them): this writer's exact bytes
# (sorted names, compact JSON, space padding to 8 bytes, round-to-nearest-even BF16) are what keeps
# that promise across safetensors versions, so it stays ours. The tests check the library reads it.

def f32_to_bf16_bits(x: np.ndarray) -> np.ndarray:
    """Round-to-nearest-even float32 -> bf16 bit patterns (as torch does)."""
    x = np.ascontiguousarray(x, dtype=np.float32)
    bits = x.view(np.uint32)
    rounding = ((bits >> 16) & 1) + 0x7FFF
    rounded = ((bits + rounding) >> 16).astype(np.uint16)
    # Rounding would carry a NaN's payload into infinity (or wrap it to -0): keep it a quiet NaN.
    return np.where(np.isnan(x), np.uint16(0x7FC0), rounded)


def bf16_bits_to_f32(bits: np.ndarray) -> np.ndarray:
    """bf16 bit patterns -> float32, an exact shift; the reader does not need it (tests use it)."""
    return (bits.astype(np.uint32) << 16).view(np.float32)


ENCODE_BLOCK = 1 << 24  # elements encoded at a time: the bf16 rounding's temporaries are a few times this


def _encoded(array: np.ndarray, dtype: str) -> bytes:
    if dtype == "BF16":
        array = f32_to_bf16_bits(np.asarray(array).astype(np.float32))
    return np.ascontiguousarray(array, dtype=_WRITE_DTYPES[dtype]).tobytes()


def _layout(shapes: dict[str, tuple[int, ...]], dtype: str, metadata: dict[str, str] | None) -> tuple[bytes, dict]:
    """The file's bytes before its data (length, header, padding) and each tensor's data offset within the
    data section: names sorted, each tensor's data right after the one before."""
    if dtype not in _WRITE_DTYPES:
        raise RefengineError(f"cannot write dtype {dtype!r} (choose F32, F16 or BF16)")
    itemsize = np.dtype(_WRITE_DTYPES[dtype]).itemsize
    header: dict = {"__metadata__": metadata or {"format": "pt"}}
    offsets, offset = {}, 0
    for name in sorted(shapes):
        size = math.prod(shapes[name]) * itemsize
        header[name] = {"dtype": dtype, "shape": list(shapes[name]), "data_offsets": [offset, offset + size]}
        offsets[name] = offset
        offset += size
    raw = json.dumps(header, separators=(",", ":")).encode("utf-8")
    raw += b" " * (-len(raw) % 8)  # the format aligns the data section to 8 bytes
    return len(raw).to_bytes(8, "little") + raw, offsets


def save_file(tensors: dict[str, np.ndarray], path: str | Path, dtype: str = "F32",
              metadata: dict[str, str] | None = None) -> None:
    """Write float tensors as `dtype` (F32, F16 or BF16); same input => same bytes.

    Kept (instead of safetensors.numpy.save_file) only because `refengine make-tiny` must give
    byte-identical files for its fingerprints."""
    with streamed_file(path, {name: np.shape(t) for name, t in tensors.items()}, dtype, metadata) as put:
        for name in sorted(tensors):
            put(name, tensors[name])


@contextmanager
def streamed_file(path: str | Path, shapes: dict[str, tuple[int, ...]], dtype: str = "F32",
                  metadata: dict[str, str] | None = None):
    """save_file's bytes, written a tensor at a time in any order: yields `put(name, array)`, which writes
    the array where the layout puts it, so a model larger than memory is written holding one tensor."""
    prefix, offsets = _layout(shapes, dtype, metadata)
    written = set()
    with open(path, "wb") as f:
        f.write(prefix)

        def put(name: str, array: np.ndarray) -> None:
            array = np.asarray(array)
            if array.shape != tuple(shapes[name]):
                raise RefengineError(f"{path}: tensor {name!r} has shape {list(array.shape)}, the layout "
                                     f"{list(shapes[name])}")
            f.seek(len(prefix) + offsets[name])
            flat = array.reshape(-1)
            for start in range(0, flat.size, ENCODE_BLOCK):  # elementwise, so the same bytes a block at a time,
                f.write(_encoded(flat[start:start + ENCODE_BLOCK], dtype))  # and only a block's temporaries
            written.add(name)
        yield put
    if written != set(shapes):
        raise RefengineError(f"{path}: tensors {sorted(set(shapes) - written)} never written")
