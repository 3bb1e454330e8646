"""Step time of the 25.5 M transformer with activation checkpointing off and on, in turns in one process.

A sweep's tokens/s compare runs that each met another load; here every step of one mode is followed by a
step of the other, in one process on one thread, so a load that changes during the run changes both
alike, and the ratio of the medians is the cost. A step: forward, the cross-entropy loss and backward of
one batch of `--batch` sequences of 128 bytes (the model of ckpt-25m.yaml: 8 x 512, 8 heads), the
gradients zeroed in between; no optimizer (it costs the same in both modes).

    python studies/training-memory/ckpt_cost.py --batch 8 --steps 12 --out results/ckpt-cost.json

Writes JSON: per mode the step times (s) and their median, tokens/s at the median, the ratio on/off, the
machine's load average before and after.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import torch

from wiiide.training.models.transformer import build_transformer


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=8, help="sequences a step (default 8)")
    ap.add_argument("--steps", type=int, default=12, help="timed steps a mode, after 2 untimed (default 12)")
    ap.add_argument("--out", default="results/ckpt-cost.json", help="where the JSON goes")
    args = ap.parse_args()
    torch.set_num_threads(1)
    context = 128
    model = build_transformer(8, 512, 8, context, seed=0)
    gen = torch.Generator().manual_seed(0)
    x = torch.randint(0, 256, (args.batch, context), generator=gen)
    y = torch.randint(0, 256, (args.batch, context), generator=gen)
    times: dict[str, list[float]] = {"off": [], "on": []}
    load_before = os.getloadavg()
    for i in range(args.steps + 2):
        for mode in ("off", "on"):
            model.activation_checkpointing = mode == "on"
            model.zero_grad(set_to_none=True)
            t0 = time.perf_counter()
            logits = model(x)
            loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))
            loss.backward()
            if i >= 2:
                times[mode].append(time.perf_counter() - t0)
    result = {"batch": args.batch, "context": context, "steps_per_mode": args.steps, "torch_threads": 1,
              "load_before": load_before, "load_after": os.getloadavg()}
    for mode, ts in times.items():
        med = statistics.median(ts)
        result[mode] = {"step_s": ts, "median_step_s": med, "tokens_per_s": args.batch * context / med}
    result["on_over_off_step_time"] = result["on"]["median_step_s"] / result["off"]["median_step_s"]
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    print(f"batch {args.batch}: off {result['off']['tokens_per_s']:.0f} tokens/s, on "
          f"{result['on']['tokens_per_s']:.0f} tokens/s, step time on/off {result['on_over_off_step_time']:.3f}; {args.out}")


if __name__ == "__main__":
    main()
