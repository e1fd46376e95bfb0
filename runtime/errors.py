"""The runtime's user-facing error, and the JSON reading both sides share."""

from __future__ import annotations

import json
from pathlib import Path


class RuntimeUsageError(Exception):
    """A module, manifest, device or request this runtime cannot serve; `kimi-run` prints it as one
    line and exits with code 2."""


def read_json(file: Path, error: type[Exception], missing: str) -> object:
    """The JSON in `file`; `error` with the file's name and `missing` (or the parse error) when it cannot be read."""
    try:
        return json.loads(file.read_text())
    except FileNotFoundError:
        raise error(f"{file}: {missing}") from None
    except json.JSONDecodeError as e:
        raise error(f"{file}: not valid JSON ({e})") from None
