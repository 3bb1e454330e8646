"""One repeat's steps as a Chrome trace: ``wiiide-lab timeline REPORT [--point P] [--repeat R]``.

A sweep run with ``trace_steps: N`` (a node knob, `wiiide.trace`) has each node keep the spans of N steps
after the warm-up. This module writes them in the Trace Event Format (the JSON object form: a
``traceEvents`` list of complete events, ``ph: "X"``, times in microseconds; Google's "Trace Event
Format" document), which Perfetto (ui.perfetto.dev, "Open trace file") and chrome://tracing open: one
process per node (the coordinator first, then the workers by rank), one track per thread of the node
(the training loop, each shard connection's sender and receiver, the shard's update thread), each span
named by what it was (``send ps_dense``, ``receive params``, ``compute``, ``update``, ``step``) with
its step, bytes on the wire and peer as arguments. Times start at the first span of the repeat.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any, Mapping

from harness.errors import HarnessError
from harness.results.report import load_report_json
from wiiide.metrics import write_text_atomic


def _node_order(name: str) -> tuple[int, int, str]:
    if name == "coordinator":
        return (0, 0, name)
    suffix = name.rsplit("-", 1)[-1]
    return (1, int(suffix), name) if suffix.isdigit() else (2, 0, name)


def has_trace(repeat: Mapping[str, Any]) -> bool:
    """Whether any node of `repeat` (a report repeat's JSON object) kept spans."""
    return any((node or {}).get("trace", {}).get("spans") for node in (repeat.get("nodes") or {}).values())


def chrome_trace(repeat: Mapping[str, Any], label: str = "") -> dict[str, Any]:
    """The Trace Event Format object of one repeat (its JSON object from a report).

    Raises:
        HarnessError: no node of the repeat kept spans (the sweep ran without ``trace_steps``).
    """
    nodes = {name: node for name, node in (repeat.get("nodes") or {}).items()
             if (node or {}).get("trace", {}).get("spans")}
    if not nodes:
        raise HarnessError("this repeat has no spans: run the sweep with trace_steps: N (e.g. --set trace_steps=20 "
                           "or in the spec's base) to record N steps after the warm-up")
    spans = {name: [dict(zip(node["trace"]["fields"], span)) for span in node["trace"]["spans"]]
             for name, node in nodes.items()}
    t0 = min(s["start_unix_s"] for per_node in spans.values() for s in per_node)
    events: list[dict[str, Any]] = []
    dropped = 0
    for pid, name in enumerate(sorted(spans, key=_node_order), start=1):
        dropped += int(nodes[name]["trace"].get("dropped") or 0)
        events += [{"ph": "M", "name": "process_name", "pid": pid, "args": {"name": name}},
                   {"ph": "M", "name": "process_sort_index", "pid": pid, "args": {"sort_index": pid}}]
        threads: dict[str, int] = {}
        for span in spans[name]:
            tid = threads.setdefault(str(span["thread"]), len(threads) + 1)
            title = span["name"] if span["cat"] in ("compute", "update", "step", "comm") else f"{span['cat']} {span['name']}"
            events.append({"name": title, "cat": span["cat"], "ph": "X", "pid": pid, "tid": tid,
                           "ts": round((span["start_unix_s"] - t0) * 1e6, 1), "dur": round(span["dur_s"] * 1e6, 1),
                           "args": {"step": span["step"], **(span.get("args") or {})}})
        events += [{"ph": "M", "name": "thread_name", "pid": pid, "tid": tid, "args": {"name": thread}}
                   for thread, tid in threads.items()]
    return {"traceEvents": events, "displayTimeUnit": "ms",
            "otherData": {"source": label, "start_unix_s": t0, "spans_dropped": dropped}}


def timeline_name(point_index: int, repeat: int) -> str:
    """The file name of a repeat's timeline beside its report: ``timeline-p<point>-r<repeat>.json``."""
    return f"timeline-p{point_index}-r{repeat}.json"


def write_timelines(report: Mapping[str, Any], folder: Path) -> dict[tuple[int, int], str]:
    """Write every traced repeat's timeline into `folder`; return {(point index, repeat): file name}."""
    written = {}
    for point in report.get("points") or []:
        for rep in point.get("repeats") or []:
            if has_trace(rep):
                name = timeline_name(point["index"], rep["repeat"])
                write_text_atomic(folder / name, json.dumps(chrome_trace(rep, f"{report.get('name')} point "
                                                                              f"{point['index']}")) + "\n")
                written[(point["index"], rep["repeat"])] = name
    return written


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The ``timeline`` verb's arguments."""
    parser.add_argument("report", help="a sweep's report.json (or its folder)")
    parser.add_argument("--point", type=int, help="the point's index (default: the first point with spans)")
    parser.add_argument("--repeat", type=int, default=None, help="the repeat (default: the point's first with spans)")
    parser.add_argument("--out", help="the trace file (default: timeline-p<point>-r<repeat>.json beside the report)")


def main_from_args(args: argparse.Namespace) -> int:
    """Write the trace; exit 0, or 2 with the error on stderr (unreadable report, no such point or
    repeat, no spans)."""
    try:
        report = load_report_json(args.report)
        candidates = [(p, r) for p in report["points"] for r in p.get("repeats") or []
                      if (args.point is None or p["index"] == args.point)
                      and (args.repeat is None or r["repeat"] == args.repeat)]
        if not candidates:
            raise HarnessError(f"{args.report}: no point {args.point} repeat {args.repeat}")
        point, rep = next(((p, r) for p, r in candidates if has_trace(r)), candidates[0])
        trace = chrome_trace(rep, f"{report.get('name')} point {point['index']}")
    except HarnessError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    source = Path(args.report)
    out = Path(args.out) if args.out else ((source if source.is_dir() else source.parent)
                                           / timeline_name(point["index"], rep["repeat"]))
    write_text_atomic(out, json.dumps(trace) + "\n")
    spans = sum(1 for e in trace["traceEvents"] if e["ph"] == "X")
    print(f"wrote {out}: {spans} spans of point {point['index']} repeat {rep['repeat']} "
          f"(open in ui.perfetto.dev or chrome://tracing)")
    return 0
