"""A strict safetensors reader.

The format: 8 bytes little-endian header length N, N bytes of JSON {name: {dtype, shape,
data_offsets: [begin, end]}, "__metadata__": {...}}, then the data. We parse the header ourselves so
that a truncated file or a header that lies about offsets is caught before anything is written,
and so that tensors can be copied byte for byte without a framework in between. Bytes are read with
pread into bounded buffers rather than through a memory map: a mapped terabyte would count as
resident memory once touched. Nothing in the file is executed.
"""

from __future__ import annotations

import json
import math
import os
import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from .errors import CheckpointError

# safetensors dtype -> (torch dtype, bytes per element)
DTYPES: dict[str, tuple[torch.dtype, int]] = {
    "F64": (torch.float64, 8), "F32": (torch.float32, 4), "F16": (torch.float16, 2), "BF16": (torch.bfloat16, 2),
    "I64": (torch.int64, 8), "I32": (torch.int32, 4), "I16": (torch.int16, 2), "I8": (torch.int8, 1),
    "U8": (torch.uint8, 1), "BOOL": (torch.bool, 1),
    "F8_E4M3": (torch.float8_e4m3fn, 1), "F8_E5M2": (torch.float8_e5m2, 1),
}
TORCH_TO_SAFETENSORS = {t: name for name, (t, _) in DTYPES.items()}
MAX_HEADER_BYTES = 100 * 1024 * 1024


@dataclass(frozen=True)
class TensorInfo:
    name: str
    dtype: str            # safetensors spelling, e.g. "BF16"
    shape: tuple[int, ...]
    offset: int           # absolute byte offset in the file
    nbytes: int

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype][0]


class SafetensorsFile:
    def __init__(self, path: str | Path):
        self.path = Path(path)
        try:
            self._file = open(self.path, "rb")
        except OSError as e:
            raise CheckpointError(f"{self.path}: cannot open ({e.strerror})") from None
        size = self.path.stat().st_size
        if size < 8:
            raise CheckpointError(f"{self.path}: truncated (no safetensors header)")
        (header_len,) = struct.unpack("<Q", self._file.read(8))
        if header_len > min(size - 8, MAX_HEADER_BYTES):
            raise CheckpointError(f"{self.path}: header length {header_len} exceeds the file ({size} bytes): truncated?")
        try:
            header = json.loads(self._file.read(header_len))
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise CheckpointError(f"{self.path}: header is not valid JSON ({e})") from None
        if not isinstance(header, dict):
            raise CheckpointError(f"{self.path}: header is not a JSON object")
        self.metadata = header.pop("__metadata__", None) or {}
        base = 8 + header_len
        self.tensors: dict[str, TensorInfo] = {}
        for name, entry in header.items():
            try:
                dtype, shape, (begin, end) = entry["dtype"], tuple(entry["shape"]), entry["data_offsets"]
            except (KeyError, TypeError, ValueError):
                raise CheckpointError(f"{self.path}: tensor {name}: malformed header entry") from None
            if dtype not in DTYPES:
                raise CheckpointError(f"{self.path}: tensor {name}: unsupported dtype {dtype}")
            want = math.prod(shape) * DTYPES[dtype][1]
            if not (0 <= begin <= end) or end - begin != want:
                raise CheckpointError(f"{self.path}: tensor {name}: header offsets [{begin}, {end}] do not hold "
                                      f"{dtype}{list(shape)} ({want} bytes)")
            if base + end > size:
                raise CheckpointError(f"{self.path}: tensor {name} ends at byte {base + end} but the file has "
                                      f"{size}: truncated")
            self.tensors[name] = TensorInfo(name, dtype, shape, base + begin, want)

    def chunks(self, name: str, chunk_bytes: int = 64 << 20):
        """The tensor's bytes in pieces of at most `chunk_bytes`."""
        info = self.tensors[name]
        fd = self._file.fileno()
        for lo in range(0, info.nbytes, chunk_bytes):
            n = min(chunk_bytes, info.nbytes - lo)
            piece = os.pread(fd, n, info.offset + lo)
            if len(piece) != n:
                raise CheckpointError(f"{self.path}: tensor {name}: short read (file changed while reading?)")
            yield piece

    def tensor(self, name: str) -> torch.Tensor:
        """A torch tensor with the stored dtype and shape (read into memory)."""
        info = self.tensors[name]
        flat = np.empty(info.nbytes, dtype=np.uint8)
        view, pos = memoryview(flat), 0
        for piece in self.chunks(name):
            view[pos: pos + len(piece)] = piece
            pos += len(piece)
        return torch.from_numpy(flat).view(info.torch_dtype).reshape(info.shape)
