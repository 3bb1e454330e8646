"""Held-out loss of each engine of a `target.yaml` report at equal tokens, as JSON.

Each repeat's held-out curve (the report's ``evals`` table: loss in nats/byte against training
samples) is interpolated linearly at the same sample counts: eight points spread over the range every
repeat of every engine covers. Tokens = samples x the context (bytes per sample). Per engine the median
over its repeats; per point the difference of every engine from the baseline (``ddp``), and the
largest one.

    python studies/lm-sharded/equal_tokens.py results/lm-sharded-target-<stamp>/report.json [--baseline ddp]
"""

from __future__ import annotations

import argparse
import json

import numpy as np

from harness.results.frames import to_dataframe
from harness.results.report import load_report


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("report")
    parser.add_argument("--baseline", default="ddp")
    parser.add_argument("--points", type=int, default=8)
    args = parser.parse_args()
    report = load_report(args.report)
    evals = to_dataframe(report, "evals")
    evals = evals[~evals["final"].astype(bool)]
    context = int(report.points[0].config["transformer_context"])
    curves = {(str(e), int(r)): g.sort_values("samples")
              for (e, r), g in evals.groupby(["engine", "repeat"])}
    low = max(float(c["samples"].iloc[0]) for c in curves.values())
    high = min(float(c["samples"].iloc[-1]) for c in curves.values())
    if high <= low:
        raise SystemExit(f"the repeats' curves share no range of samples ({low:g} .. {high:g})")
    grid = np.linspace(low, high, args.points)
    by_engine: dict[str, list[np.ndarray]] = {}
    for (engine, _), c in curves.items():
        by_engine.setdefault(engine, []).append(np.interp(grid, c["samples"].astype(float), c["value"].astype(float)))
    median = {e: np.median(np.stack(v), axis=0) for e, v in by_engine.items()}
    base = median[args.baseline]
    out = {"tokens": [int(s * context) for s in grid],
           "loss_nats_per_byte": {e: [round(float(x), 4) for x in m] for e, m in median.items()},
           "repeats": {e: len(v) for e, v in by_engine.items()},
           "minus_baseline": {e: [round(float(x), 4) for x in m - base] for e, m in median.items() if e != args.baseline},
           "max_abs_minus_baseline": {e: round(float(np.max(np.abs(m - base))), 4)
                                      for e, m in median.items() if e != args.baseline}}
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
