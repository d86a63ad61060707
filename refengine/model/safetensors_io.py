"""Read and write safetensors files, BF16 included.

safetensors' numpy backend cannot read BF16 (numpy has no such dtype), and real Qwen3
checkpoints are BF16, so reading parses the documented layout itself — an 8-byte little-endian
header length, a JSON header, then the raw data — and memory-maps each tensor. Writing emits
the same layout; the tests check both directions against the safetensors library itself.
"""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from ..errors import RefengineError

_NUMPY_DTYPES = {"F64": np.float64, "F32": np.float32, "F16": np.float16, "BF16": np.uint16,
                 "I64": np.int64, "I32": np.int32, "U8": np.uint8}
_WRITE_DTYPES = {"F32": "<f4", "F16": "<f2", "BF16": "<u2"}
MAX_HEADER_BYTES = 100 * 1024 * 1024


def bf16_bits_to_f32(bits: np.ndarray) -> np.ndarray:
    """bf16 is the top half of an IEEE float32, so widening is an exact shift."""
    return (bits.astype(np.uint32) << 16).view(np.float32)


def f32_to_bf16_bits(x: np.ndarray) -> np.ndarray:
    """Round-to-nearest-even float32 -> bf16 bit patterns (as torch does)."""
    x = np.ascontiguousarray(x, dtype=np.float32)
    bits = x.view(np.uint32)
    rounding = ((bits >> 16) & 1) + 0x7FFF
    rounded = ((bits + rounding) >> 16).astype(np.uint16)
    # Rounding would carry a NaN's payload into infinity (or wrap it to -0): keep it a quiet NaN.
    return np.where(np.isnan(x), np.uint16(0x7FC0), rounded)


class SafetensorsFile:
    """One opened file: `tensors` maps name -> (dtype string, shape); `get` memory-maps one."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        try:
            size = self.path.stat().st_size
            with open(self.path, "rb") as f:
                prefix = f.read(8)
                if len(prefix) < 8:
                    raise RefengineError(f"{self.path}: truncated safetensors file ({size} bytes, no header)")
                header_len = int.from_bytes(prefix, "little")
                if header_len > min(MAX_HEADER_BYTES, size - 8):
                    raise RefengineError(
                        f"{self.path}: corrupt safetensors header (header length {header_len} exceeds file size {size})")
                raw = f.read(header_len)
        except FileNotFoundError:
            raise RefengineError(f"{self.path}: file not found") from None
        try:
            header = json.loads(raw.decode("utf-8"))
            if not isinstance(header, dict):
                raise ValueError("header is not a JSON object")
        except (UnicodeDecodeError, ValueError) as e:
            raise RefengineError(f"{self.path}: corrupt safetensors header ({e})") from None
        self.metadata = header.pop("__metadata__", None) or {}
        self.data_start = 8 + header_len
        self.tensors: dict[str, tuple[str, tuple[int, ...]]] = {}
        self._offsets: dict[str, tuple[int, int]] = {}
        data_size = size - self.data_start
        for name, info in header.items():
            try:
                dtype, shape, (begin, end) = info["dtype"], tuple(int(d) for d in info["shape"]), info["data_offsets"]
            except (KeyError, TypeError, ValueError):
                raise RefengineError(f"{self.path}: corrupt safetensors header entry for tensor {name!r}") from None
            if dtype not in _NUMPY_DTYPES:
                raise RefengineError(f"{self.path}: tensor {name!r} has unsupported dtype {dtype}")
            expected = int(np.prod(shape, dtype=np.int64)) * np.dtype(_NUMPY_DTYPES[dtype]).itemsize
            if end - begin != expected or begin < 0:
                raise RefengineError(
                    f"{self.path}: corrupt safetensors header: tensor {name!r} offsets {begin}..{end} "
                    f"do not match shape {list(shape)} {dtype}")
            if end > data_size:
                raise RefengineError(
                    f"{self.path}: truncated safetensors file: tensor {name!r} ends at byte {end} "
                    f"of a {data_size}-byte data section")
            self.tensors[name] = (dtype, shape)
            self._offsets[name] = (begin, end)

    def get(self, name: str) -> np.ndarray:
        """The tensor as stored (BF16 as uint16 bit patterns), memory-mapped, read-only."""
        dtype, shape = self.tensors[name]
        begin, _ = self._offsets[name]
        if int(np.prod(shape)) == 0:
            return np.zeros(shape, dtype=_NUMPY_DTYPES[dtype])
        return np.memmap(self.path, dtype=np.dtype(_NUMPY_DTYPES[dtype]).newbyteorder("<"), mode="r",
                         offset=self.data_start + begin, shape=shape)

    def get_float(self, name: str, dtype=np.float32) -> np.ndarray:
        stored_dtype = self.tensors[name][0]
        array = self.get(name)
        if stored_dtype == "BF16":
            array = bf16_bits_to_f32(array)
        return np.asarray(array, dtype=dtype)


def save_file(tensors: dict[str, np.ndarray], path: str | Path, dtype: str = "F32",
              metadata: dict[str, str] | None = None) -> None:
    """Write float tensors as `dtype` (F32, F16 or BF16); same input => same bytes."""
    if dtype not in _WRITE_DTYPES:
        raise RefengineError(f"cannot write dtype {dtype!r} (choose F32, F16 or BF16)")
    header: dict = {"__metadata__": metadata or {"format": "pt"}}
    blobs, offset = [], 0
    for name in sorted(tensors):
        array = np.asarray(tensors[name])
        if dtype == "BF16":
            array = f32_to_bf16_bits(array.astype(np.float32))
        data = np.ascontiguousarray(array, dtype=_WRITE_DTYPES[dtype]).tobytes()
        header[name] = {"dtype": dtype, "shape": list(array.shape), "data_offsets": [offset, offset + len(data)]}
        blobs.append(data)
        offset += len(data)
    raw = json.dumps(header, separators=(",", ":")).encode("utf-8")
    raw += b" " * (-len(raw) % 8)  # the format aligns the data section to 8 bytes
    with open(path, "wb") as f:
        f.write(len(raw).to_bytes(8, "little"))
        f.write(raw)
        for data in blobs:
            f.write(data)
