"""Writing files the user asked for (plans, reports) so that a reader never sees half of one."""

from __future__ import annotations

import contextlib
import os
import tempfile
from pathlib import Path

from orchestrator.core.errors import RpcfleetError


def write_atomic(path: str | Path, text: str, *, parents: bool = False) -> None:
    """Write `text` to `path` through a uniquely named temporary file in the same folder and a rename.

    `parents`: create missing folders first. The temporary file never stays behind; a failure is an
    RpcfleetError naming `path`.
    """
    path = Path(path)
    directory = path.parent if str(path.parent) else Path()
    try:
        if parents:
            directory.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=directory, prefix=f".{path.name}.", suffix=".tmp")
    except OSError as exc:
        raise RpcfleetError(f"cannot write {path}: {exc.strerror or exc}") from None
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as out:
            out.write(text)
            out.flush()
            os.fsync(out.fileno())
        Path(tmp).chmod(0o644)
        Path(tmp).replace(path)
    except OSError as exc:
        with contextlib.suppress(OSError):
            Path(tmp).unlink()
        raise RpcfleetError(f"cannot write {path}: {exc.strerror or exc}") from None
