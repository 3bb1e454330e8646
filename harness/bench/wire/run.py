"""One bench-wire run: the plan through a backend, into ``results/bench-wire-<UTC stamp>.json``.

The JSON (`SCHEMA_VERSION` 2) has ``machine_info`` and ``commit_info`` at the top as the sweep reports,
the ``plan``, the ``backend``, every raw trial value of the sections (``frames``, ``links``,
``codecs``), statistics from them, and the ``summary`` (`summarize`). Byte rates are
``*_bytes_per_s``, bit rates ``*_bps``, times ``*_s``.

Schema history: 1 spelled byte rates ``raw_Bps``, ``Bps``, ``encode_MBps`` (MB/s), ``goodput_Bps`` and
the plan's ``sizes`` / ``link_rates``; 2 spells them ``raw_bytes_per_s``, ``bytes_per_s``,
``encode_bytes_per_s`` (bytes/s), ``goodput_bytes_per_s``, ``sizes_bytes`` / ``link_rates_bps``.
"""

from __future__ import annotations

import shutil
from datetime import datetime, timezone
from pathlib import Path
from typing import Callable

from harness.bench.wire.backends import BACKENDS
from harness.bench.wire.plan import WirePlan
from harness.bench.wire.summary import summarize
from harness.errors import SpecError
from wiiide.metrics import write_json_atomic

SCHEMA_VERSION = 2
REPORT_NAME = "bench-wire"


def run_bench(plan: WirePlan, backend: str = "local", results_dir: Path | None = None,
              progress: Callable[[str], None] = print) -> Path:
    """Run `plan` on `backend` (``local`` or ``docker``); return the path of the JSON written.

    Args:
        plan: what to measure (checked when it was built).
        backend: ``local`` (two processes over 127.0.0.1) or ``docker`` (two containers).
        results_dir: where ``bench-wire-<stamp>.json`` goes (default ``results/`` of the repository).
        progress: receives one line of text per step.

    Raises:
        SpecError: unknown backend. ClusterError: (docker) no engine, image or container failure.
        OSError, ConnectionError, ProtocolError: the peers' connection failed.
    """
    from harness import REPO_ROOT
    from harness.run.machine import commit_info, machine_info

    if backend not in BACKENDS:
        raise SpecError(f"bench-wire: unknown backend {backend!r}; one of {sorted(BACKENDS)}")
    results_dir = Path(results_dir or REPO_ROOT / "results")
    stamp = datetime.now(timezone.utc).strftime("%Y%m%dT%H%M%SZ")
    path = results_dir / f"{REPORT_NAME}-{stamp}.json"
    started = datetime.now(timezone.utc).isoformat(timespec="seconds")
    scratch = results_dir / f".{REPORT_NAME}-{stamp}"
    try:
        result = BACKENDS[backend](plan, scratch, progress)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    report = {"schema_version": SCHEMA_VERSION, "name": REPORT_NAME, "created_at_utc": started,
              "finished_at_utc": datetime.now(timezone.utc).isoformat(timespec="seconds"),
              "machine_info": machine_info(), "commit_info": commit_info(), "plan": plan.as_dict(), **result}
    report["summary"] = summarize(report)
    write_json_atomic(path, report)
    return path
