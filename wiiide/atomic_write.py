"""Atomic file writes: a reader sees the old file or the new one, never half of one.

`write_bytes_atomic` writes to a temporary file in the same folder and renames it over the target
(POSIX ``rename`` is atomic within a file system); with ``durable`` it also fsyncs the file and the
folder. Every node's metrics file, checkpoint and the harness's reports are written this way.
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path
from typing import Any


def write_json_atomic(path: Path, payload: dict[str, Any]) -> None:
    """Write JSON to `path` via a temporary file in the same folder and an atomic rename."""
    write_text_atomic(path, json.dumps(payload, indent=2, sort_keys=False, allow_nan=True, default=str) + "\n")


def write_text_atomic(path: Path, text: str) -> None:
    """Write `text` (UTF-8) to `path` via a temporary file in the same folder and an atomic rename, so
    a reader sees the old file or the new one, never half of one. Raises OSError if it cannot."""
    write_bytes_atomic(path, text.encode("utf-8"))


def write_bytes_atomic(path: Path, data: bytes, durable: bool = False) -> None:
    """Write `data` to `path` via a temporary file in the same folder (``.<name>.<random>``) and an
    atomic rename; `durable`: fsync the file before the rename and the folder after it, so the new
    file survives a power cut too (POSIX: the rename is a change to the folder). Raises OSError if it
    cannot; the temporary file is removed then."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as fh:
            fh.write(data)
            if durable:
                fh.flush()
                os.fsync(fh.fileno())
        os.replace(tmp, path)
        if durable:
            _fsync_dir(path.parent)
    except BaseException:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise


def _fsync_dir(directory: Path) -> None:
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)
