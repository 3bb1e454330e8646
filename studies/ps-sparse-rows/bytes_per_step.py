"""Bytes per step on links and samples/s of each point of a `sharded-emb.yaml` report, as JSON.

Sharded points: the pushes every shard took in and the pulls it sent out on links (each node's
``ps.shard.link_wire_bytes``; a worker's pushes to its own shard are on loopback and left out), summed
over the shards and divided by the steps; the start (the plan's parameters, the link probe, the stop)
is not in them. The central point: the workers' sends (pushes) and the coordinator's sends (pulls and
batches), whole frames, over the run (its first step's full table included). Samples/s: the report's
``throughput_samples_per_s`` (warm-up steps excluded).

    python studies/ps-sparse-rows/bytes_per_step.py results/ps-sparse-rows-emb-<timestamp>
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from harness.results.report import load_report_json


def figures(report_dir: Path) -> dict:
    """{point label: {push_bytes_per_step, pull_bytes_per_step, steps, samples_per_s, test_accuracy}}."""
    report = load_report_json(report_dir / "report.json")
    out = {}
    for point in report["points"]:
        repeat = point["repeats"][0]
        nodes = repeat["nodes"]
        coord = nodes["coordinator"]
        steps = coord["steps"]
        shards = [n["ps"]["shard"]["link_wire_bytes"] for n in nodes.values() if "shard" in (n.get("ps") or {})]
        if shards:
            push = sum(s["pushes_received"] for s in shards)
            pull = sum(s["pulls_sent"] for s in shards)
        else:
            push = sum(n["wire_bytes_sent"] for name, n in nodes.items() if name.startswith("worker"))
            pull = coord["wire_bytes_sent"]
        out[" ".join(str(v) for v in point["params"].values())] = {  # the axis' label
            "push_bytes_per_step": push / steps, "pull_bytes_per_step": pull / steps, "steps": steps,
            "samples_per_s": repeat["totals"]["throughput_samples_per_s"],
            "test_accuracy": coord.get("test_accuracy")}
    return out


if __name__ == "__main__":
    print(json.dumps(figures(Path(sys.argv[1])), indent=2))
