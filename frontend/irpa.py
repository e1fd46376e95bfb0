"""A streaming writer for IREE parameter archives (.irpa), format v0.

Layout (iree/schemas/parameter_archive.h; everything little-endian and packed):
  header v0 (88 bytes) | entry table (16-aligned entries) | metadata (names, JSON) | storage (64-aligned)
Offsets in the header and entries are relative to the header (at file offset 0) or to the segment
they point into. The whole header is computed from the sizes alone, so each tensor's bytes are then
streamed into place one piece at a time: a terabyte checkpoint never has to fit in memory.
`iree.runtime.ParameterIndex.load` reads the result; tests check it against IREE's own writer.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import BinaryIO

MAGIC = 0x41505249          # "IRPA"
SCOPE = "model"             # the parameter scope our modules name: #flow.parameter.named<"model"::NAME>
HEADER_SIZE = 88            # prefix (magic, major, minor, header_size, next_header, flags) + v0 fields
ENTRY_ALIGNMENT = 16
DATA_ALIGNMENT = 64
FILE_ALIGNMENT = 4096
ENTRY_TYPE_DATA = 2
DATA_ENTRY_SIZE = 76        # entry header (60) + storage range (16)


def _align(n: int, a: int) -> int:
    return (n + a - 1) // a * a


@dataclass
class ArchiveEntry:
    """One parameter: its name, byte size, a JSON-able metadata dict, and a writer that streams
    exactly `nbytes` bytes to a file (called once, in order)."""

    name: str
    nbytes: int
    metadata: dict
    write: Callable[[BinaryIO], None]


def write_archive(path: str, entries: Iterable[ArchiveEntry], progress: Callable[[int], None] | None = None) -> None:
    entries = list(entries)
    names = [e.name.encode() for e in entries]
    metas = [json.dumps(e.metadata, separators=(",", ":")).encode() for e in entries]
    entry_offset = _align(HEADER_SIZE, ENTRY_ALIGNMENT)
    entry_stride = _align(DATA_ENTRY_SIZE, ENTRY_ALIGNMENT)
    entry_length = entry_stride * (len(entries) - 1) + DATA_ENTRY_SIZE if entries else 0
    metadata_offset = entry_offset + entry_length
    metadata = bytearray()
    refs = []
    for name, meta in zip(names, metas):
        refs.append(((len(metadata), len(name)), (len(metadata) + len(name), len(meta))))
        metadata += name + meta
    storage_offset = _align(metadata_offset + len(metadata), DATA_ALIGNMENT)
    placements, cursor = [], 0
    for e in entries:
        placements.append(cursor)
        cursor = _align(cursor + e.nbytes, DATA_ALIGNMENT)
    storage_length = placements[-1] + entries[-1].nbytes if entries else 0

    header = struct.pack("<IHHQQQ", MAGIC, 0, 0, HEADER_SIZE, 0, 0)
    header += struct.pack("<QQQQQQQ", len(entries), entry_offset, entry_length, metadata_offset, len(metadata),
                          storage_offset, storage_length)
    table = bytearray()
    for e, (name_ref, meta_ref), place in zip(entries, refs, placements):
        table += struct.pack("<QIQQQQQQQQ", DATA_ENTRY_SIZE, ENTRY_TYPE_DATA, 0, *name_ref, *meta_ref,
                             DATA_ALIGNMENT, place, e.nbytes)
        table += bytes(_align(len(table), ENTRY_ALIGNMENT) - len(table))
    with open(path, "wb") as f:
        f.write(header)
        f.write(bytes(entry_offset - HEADER_SIZE))
        f.write(table[:entry_length])
        f.write(metadata)
        f.write(bytes(storage_offset - f.tell()))
        for e, place in zip(entries, placements):
            f.write(bytes(storage_offset + place - f.tell()))
            start = f.tell()
            e.write(f)
            if f.tell() - start != e.nbytes:
                raise RuntimeError(f"parameter {e.name}: wrote {f.tell() - start} bytes, expected {e.nbytes}")
            if progress:
                progress(e.nbytes)
        f.write(bytes(_align(f.tell(), FILE_ALIGNMENT) - f.tell()))
