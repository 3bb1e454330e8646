"""Cluster backends: where a WIIIIIDE run's coordinator and workers execute.

- `compose.ComposeBackend` (``docker``): one coordinator and N worker containers via Docker Compose.
- `local.LocalBackend` (``local``): the same nodes as processes on 127.0.0.1.

Both implement `base.Backend.run`, which runs one configured run to its end and returns a `RunResult`.
"""

from __future__ import annotations

from harness.cluster.base import Backend, RunResult, select_backend

__all__ = ["Backend", "RunResult", "select_backend"]
