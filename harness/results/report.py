"""Sweep reports on disk: one ``results/<name>-<UTC timestamp>/report.json`` per sweep, rewritten
atomically after every repeat (`ReportWriter`), and read back typed (`load_report`), whatever
`schema_version` wrote it. The layout is `harness.results.models` (docs/reports.md); its
JSON Schema ships as ``harness/results/report.schema.json``.

Schema versions:
  1: the untyped reports written before the harness had stages. Some keys were written only when
     they had a value (a failed repeat's ``totals`` were ``{}``; ``cluster``, ``links``, ``limits``,
     ``faults``, ``logs_dir``, ``note`` could be missing).
  2: the typed report: every key of every model is written, None where a figure was not measured.
     Version 1 files load as version 2: the missing keys take their defaults. No key was renamed
     (the report's rates were already ``*_bytes_per_s`` and ``*_bps``); a renamed key would be mapped
     in `_upgrade_v1`.
"""

from __future__ import annotations

import json
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Mapping

from pydantic import ValidationError

from harness.errors import HarnessError
from harness.results.models import CommitInfo, Point, Repeat, Report
from harness.results.totals import point_summary
from wiiide.metrics import write_json_atomic

SCHEMA_VERSION = 2


def utc_now() -> str:
    """Now, in UTC, as ISO 8601 to the second (``2026-11-21T15:08:27+00:00``)."""
    return datetime.now(timezone.utc).isoformat(timespec="seconds")


def _upgrade_v1(data: dict[str, Any]) -> dict[str, Any]:
    """A version-1 report as version 2: the same keys; a repeat without its number (reports put
    together by hand) takes its position; the models fill in the keys version 1 left out."""
    points = []
    for point in data.get("points") or []:
        if isinstance(point, Mapping) and isinstance(point.get("repeats"), list):
            repeats = [{"repeat": i, **r} if isinstance(r, Mapping) else r for i, r in enumerate(point["repeats"])]
            point = {**point, "repeats": repeats}
        points.append(point)
    return {**data, "schema_version": 2, "points": points}


_UPGRADES = {1: _upgrade_v1}  # version -> the function that lifts it one version up


def parse_report(data: Mapping[str, Any], source: str = "report") -> Report:
    """A report's JSON object (any version up to `SCHEMA_VERSION`) as a typed `Report`.

    A file without ``schema_version`` is version 1. `source` names the file in errors.

    Raises:
        HarnessError: not a sweep report (no ``points``), written by a newer harness, or a field of
            the wrong type (the message has the field's path, e.g. ``points.0.repeats.1.status``).
    """
    if not isinstance(data, Mapping) or "points" not in data:
        raise HarnessError(f"{source}: not a WIIIIIDE sweep report (no 'points')")
    data = dict(data)
    version = data.get("schema_version", 1)
    if not isinstance(version, int) or version > SCHEMA_VERSION or version < 1:
        raise HarnessError(f"{source}: schema_version {version!r} is not one this harness reads "
                           f"(1 to {SCHEMA_VERSION}); a newer harness wrote it?")
    while version < SCHEMA_VERSION:
        data = _UPGRADES[version](data)
        version = data["schema_version"]
    try:
        return Report.model_validate(data)
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(p) for p in first["loc"])
        raise HarnessError(f"{source}: {where}: {first['msg']} (got {first.get('input')!r:.80}); "
                           f"{exc.error_count()} problem(s) in all") from None


def as_report(report: Report | Mapping[str, Any]) -> Report:
    """`report` typed: a `Report` as is, a report's JSON object through `parse_report` (any schema
    version). Raises HarnessError when the object is not a report."""
    return report if isinstance(report, Report) else parse_report(report)


def load_report(path: str | Path) -> Report:
    """Read a report (a report.json, or the folder holding it) as a typed `Report`, upgrading older
    schema versions.

    Raises:
        HarnessError: the file cannot be read, is not JSON, or is not a report (see `parse_report`).
    """
    path = Path(path)
    if path.is_dir():
        path = path / "report.json"
    try:
        data = json.loads(path.read_text())
    except OSError as exc:
        raise HarnessError(f"{path}: cannot read: {exc.strerror or exc}") from None
    except ValueError as exc:
        raise HarnessError(f"{path}: not valid JSON: {exc}") from None
    return parse_report(data, str(path))


def load_report_json(path: str | Path) -> dict[str, Any]:
    """`load_report` as the JSON object it would be written as (current schema version), for callers
    that read keys by name. Raises HarnessError as `load_report` does."""
    return load_report(path).to_json_dict()


def save_report(report: Report, path: Path) -> None:
    """Write `report` to `path` atomically (temporary file in the same folder, then rename:
    `wiiide.atomic_write.write_json_atomic`), so a reader never sees half a file.

    Raises:
        OSError: the folder cannot be created or written.
    """
    write_json_atomic(path, report.to_json_dict())


def _joined_errors(repeats: list[Repeat]) -> str:
    return "; ".join(f"repeat {r.repeat}: {r.error}" for r in repeats)


class ReportWriter:
    """Holds a sweep's `Report` and rewrites it atomically after every repeat, so nothing done is lost.

    `report`: the typed report being written (its points are added with `start_point`).
    """

    def __init__(self, path: Path, header: dict[str, Any]) -> None:
        """A new report at `path` (not written until `save`). `header`: name, machine_info, commit_info,
        backend, spec, param_names. Raises HarnessError if a header field has the wrong type."""
        self.path = Path(path)
        self.report = parse_report({"schema_version": SCHEMA_VERSION, **header, "created_at_utc": utc_now(),
                                    "complete": False, "points": []}, str(path))

    @classmethod
    def resume(cls, path: Path, commit: Mapping[str, Any] | None = None) -> "ReportWriter":
        """Continue an existing report (``sweep --resume``), noting when and, given `commit` (the
        `commit_info` of the code that resumes it), at which commit: the runs after a resume may be of
        another commit than ``commit_info``'s. Raises HarnessError if it cannot be read."""
        writer = cls.__new__(cls)
        writer.path = Path(path)
        writer.report = load_report(path)
        writer.report.resumed_at_utc.append(utc_now())
        if commit is not None:
            writer.report.resumed_commit_info.append(CommitInfo.model_validate(dict(commit)))
        return writer

    def finished_point(self, index: int, params: dict[str, Any], repeats: int | None = None) -> Point | None:
        """The point with this index and params if it finished ok with at least `repeats` repeats (None:
        any number), so a resumed sweep skips it; else None."""
        for point in self.report.points:
            if (point.index == index and point.params == params and point.status == "ok"
                    and (repeats is None or len(point.repeats) >= repeats)):
                return point
        return None

    def start_point(self, index: int, params: dict[str, Any], config: dict[str, Any],
                    cluster: dict[str, Any] | None = None, keep_repeats: bool = False) -> Point:
        """A running point, replacing an unfinished one of the same index (points kept in index order).
        `config`: the full run config; `cluster`: link profiles, cpus, mem_limit as asked.

        `keep_repeats` (a resumed sweep): when the point there has the same params and config and every
        repeat it has is ok (a sweep interrupted between its repeats), those repeats are kept and the
        caller runs only the rest; otherwise (a failed repeat, another config) it starts empty."""
        old = next((p for p in self.report.points if p.index == index), None)
        same_config = old is not None and _as_json(old.config) == _as_json(config)
        kept = (list(old.repeats) if keep_repeats and same_config and old.params == params
                and all(r.ok for r in old.repeats) else [])
        point = Point(index=index, params=params, config=config, cluster=cluster, status="running", repeats=kept)
        if kept:
            point.summary, point.unstable = point_summary(kept)
        self.report.points = sorted([p for p in self.report.points if p.index != index] + [point],
                                    key=lambda p: p.index)
        return point

    def add_repeat(self, point: Point, repeat: Repeat | Mapping[str, Any]) -> Repeat:
        """Add a finished repeat to `point`, recompute the point's statistics, save; return the repeat.

        Raises:
            pydantic.ValidationError: `repeat` is a mapping with a field of the wrong type.
            OSError: the report cannot be written.
        """
        record = repeat if isinstance(repeat, Repeat) else Repeat.model_validate(dict(repeat))
        point.repeats.append(record)
        point.summary, point.unstable = point_summary(point.repeats)
        self.save()
        return record

    def finish_point(self, point: Point, repeats: int | None = None) -> None:
        """Set the point's status from its repeats (ok / partial / failed, with their errors) and save.
        With fewer than `repeats` repeats (an interrupted point) it is ``partial`` at best, so a resumed
        sweep runs the rest (`finished_point`)."""
        ok = [r for r in point.repeats if r.ok]
        failed = [r for r in point.repeats if not r.ok]
        short = repeats is not None and len(point.repeats) < repeats
        if ok and not failed and not short:
            point.status, point.error = "ok", None
        elif ok:
            point.status = "partial"
            point.error = _joined_errors(failed) or f"interrupted after {len(point.repeats)} of {repeats} repeats"
        else:
            point.status, point.error = "failed", _joined_errors(point.repeats) or "not run"
        self.save()

    def finish(self, complete: bool, note: str | None = None) -> None:
        """Mark the sweep complete (or not, with a `note` saying why) and save."""
        self.report.complete = complete
        if note:
            self.report.note = note
        self.save()

    def save(self) -> None:
        """Stamp ``updated_at_utc`` and write the report atomically. Raises OSError if it cannot."""
        self.report.updated_at_utc = utc_now()
        save_report(self.report, self.path)


def newest_report(results_dir: Path) -> Path:
    """The most recently written report.json under `results_dir`. Raises HarnessError if none."""
    reports = sorted(results_dir.glob("*/report.json"), key=lambda p: p.stat().st_mtime)
    if not reports:
        raise HarnessError(f"no report.json under {results_dir}; run a sweep first (make demo)")
    return reports[-1]


def _as_json(value: Any) -> Any:
    """`value` as JSON would give it back (tuples as lists), so a config read from a report compares
    equal to the same config built by the spec."""
    return json.loads(json.dumps(value, default=str))
