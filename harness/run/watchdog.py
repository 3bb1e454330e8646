"""The run's watchdog: a ddp/fsdp point fails as soon as a rank dies or every rank stops making
progress, with the cause, instead of at the harness's timeout.

Two rules, checked at every poll of `harness.run.loop.run_point`:

- **a rank exited with an error**: in DDP and FSDP every rank takes part in every collective, so one
  rank that exits non-zero while others still run leaves them waiting in gloo (or failing later with
  a less clear message). The point fails at once: ``rank 2 (worker-2) exited with code -9``.
- **no rank made progress**: each rank writes a progress file about once a second while it trains
  (`wiiide.engines.progress`); when none of the files of ranks still in ``setup``/``train`` changed for
  `stall_timeout_s` seconds (by the harness's own clock), the point fails:
  ``no rank made progress for 60 s (last: rank 0 step 5, ...): a collective stalled?``. Before
  the first progress file (rendezvous, the start gate) the connect timeout and the harness's
  timeout apply as before.

The WIIIIIDE engine is left alone: a worker that dies there is the coordinator's to handle (faults
rely on that), and its nodes write no progress files.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Callable, Optional

from wiiide.wire.node import EXIT_PEER_LOST
from wiiide.engines.progress import PROGRESS_DIR

WATCHED_ENGINES = ("ddp", "fsdp")
STALLABLE_PHASES = ("setup", "train")

ExitCode = Callable[[str], Optional[int]]


def node_key(name: str) -> str:
    """``wiiide_worker_2`` / ``wiiide-worker-2`` / ``local-worker-2`` / ``worker-2`` -> ``worker-2``;
    anything with ``coordinator`` in it -> ``coordinator``; other names unchanged."""
    parts = name.replace("_", "-").split("-")
    if "coordinator" in parts:
        return "coordinator"
    return f"worker-{parts[-1]}" if "worker" in parts else name


class RankWatchdog:
    """Watches one run's ranks (see the module's docstring).

    Args:
        engine: the point's engine; only `WATCHED_ENGINES` are watched (`check` returns None otherwise).
        nodes_dir: the run's node metrics folder (progress files in its ``progress/``).
        stall_timeout_s: seconds without progress before a stall is declared; 0 turns that rule off.
        exit_code: node name -> its exit code now (None while it runs or when unknown); None: the
            backend cannot tell, and the dead-rank rule is off.
        expected_dead: node names (``worker-N``) a fault injection stops on purpose: their exit is
            reported as the fault's, not as a failure of the rank.
    """

    def __init__(self, engine: str, nodes_dir: Path, stall_timeout_s: float,
                 exit_code: ExitCode | None = None,
                 expected_dead: Callable[[], frozenset[str]] = frozenset) -> None:
        self.active = engine in WATCHED_ENGINES
        self.progress_dir = Path(nodes_dir) / PROGRESS_DIR
        self.stall_timeout_s = stall_timeout_s
        self.exit_code = exit_code
        self.expected_dead = expected_dead
        self._seen: dict[str, tuple[str, float]] = {}  # file name -> (its text, harness time it last changed)
        self._records: dict[str, dict[str, Any]] = {}

    def _read_progress(self, now_s: float) -> None:
        try:
            paths = sorted(self.progress_dir.glob("*.json"))
        except OSError:
            return
        for path in paths:
            try:
                text = path.read_text()
                record = json.loads(text)
            except (OSError, ValueError):
                continue  # being replaced, or not ours: next poll
            if not isinstance(record, dict):
                continue
            seen = self._seen.get(path.name)
            if seen is None or seen[0] != text:
                self._seen[path.name] = (text, now_s)
            self._records[path.name] = record

    def _rank_of(self, name: str) -> str:
        key = node_key(name)
        for record in self._records.values():
            if node_key(str(record.get("node_id", ""))) == key and record.get("rank") is not None:
                return f"rank {record['rank']} ({name})"
        return name

    def check(self, states: dict[str, str], now_s: float) -> str | None:
        """The failure to report now, or None. `states`: node name -> ``running``/``exited``/...
        (`Backend.poll`); `now_s`: seconds since the run started (the harness's clock)."""
        if not self.active:
            return None
        self._read_progress(now_s)
        running = [n for n, s in states.items() if s not in ("exited", "dead")]
        if self.exit_code is not None:
            failed = {name: code for name in sorted(states) if states[name] in ("exited", "dead")
                      and (code := self.exit_code(name)) not in (None, 0)}
            if failed:
                # the first cause: a rank that did not exit for a lost peer (EXIT_PEER_LOST) if any
                name = next((n for n, c in failed.items() if c != EXIT_PEER_LOST), next(iter(failed)))
                by_fault = " (a fault injection stopped it)" if node_key(name) in self.expected_dead() else ""
                others = "".join(f"; {self._rank_of(n)} exited with code {c}" for n, c in failed.items() if n != name)
                still = f" while {len(running)} other node(s) still ran" if running else ""
                return (f"{self._rank_of(name)} exited with code {failed[name]}{by_fault}{still}: "
                        f"a DDP/FSDP run needs every rank{others}")
        if not running or self.stall_timeout_s <= 0 or not self._seen:
            return None
        live = {f: self._records[f] for f in self._seen if self._records[f].get("phase") in STALLABLE_PHASES}
        if not live:
            return None
        last_change_s = max(self._seen[f][1] for f in live)
        idle_s = now_s - last_change_s
        if idle_s < self.stall_timeout_s:
            return None
        last = ", ".join(f"rank {r.get('rank')} {r.get('phase')} step {r.get('step')}"
                         for r in sorted(live.values(), key=lambda r: (r.get("rank") is None, r.get("rank") or 0)))
        return (f"no rank made progress for {idle_s:.0f} s (stall_timeout_s={self.stall_timeout_s:g}; last: {last}; "
                f"{len(running)} node(s) still running): a collective stalled? see each rank's log")
