"""Synthetic cellular-like Mahimahi traces, made here from a seed (nothing downloaded).

The model is a Markov-modulated Poisson process, the usual stand-in for a cellular downlink's capacity
(a few radio conditions, each held for a random time, the capacity wandering within each):

1. a continuous-time Markov chain over the kind's `states` (mean rate in bit/s and mean dwell in s):
   each dwell is exponential with that mean; the next state is drawn uniformly among the others;
2. within a state, every `STEP_MS` (100 ms) the rate is its mean times a log-normal factor following an
   AR(1) process in log space (``x <- rho x + sqrt(1 - rho^2) sigma e``, e ~ N(0, 1)), so it wanders
   smoothly around the state's mean;
3. in each millisecond, the number of delivery opportunities is Poisson with mean rate / (1500 x 8) /
   1000, as Mahimahi's traces count one 1500-byte packet per line.

``python -m harness.links.tracegen --kind walk --seed 1 --duration-s 30 > experiments/traces/walk-1.trace``
writes one trace; `KINDS` lists the models. The same seed and kind give the same file on any machine
(numpy's PCG64 generator).
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass

import numpy as np

from harness.links.trace import PACKET_BYTES

STEP_MS = 100


@dataclass(frozen=True)
class TraceKind:
    """One synthetic model: `states` as (mean rate bit/s, mean dwell s), the AR(1) coefficient `rho` per
    step and the log-normal spread `sigma` of the rate within a state."""

    states: tuple[tuple[float, float], ...]
    rho: float
    sigma: float


KINDS = {
    # a pedestrian: three conditions, each held for seconds, the rate wandering +-30 % within them
    "walk": TraceKind(states=((24e6, 6.0), (12e6, 5.0), (4e6, 3.0)), rho=0.9, sigma=0.3),
    # a car: faster changes, a wider spread and short outages (0.1 Mbit/s)
    "drive": TraceKind(states=((36e6, 3.0), (14e6, 3.0), (3e6, 2.0), (0.1e6, 0.6)), rho=0.8, sigma=0.5),
}


def rate_series_bps(kind: TraceKind, duration_s: float, rng: np.random.Generator) -> np.ndarray:
    """The capacity every `STEP_MS` over `duration_s` (float64 bit/s, shape (steps,)), per the model."""
    steps = int(round(duration_s * 1000 / STEP_MS))
    rates = np.empty(steps)
    state = int(rng.integers(len(kind.states)))
    left_s = rng.exponential(kind.states[state][1])
    x = 0.0
    for i in range(steps):
        while left_s <= 0:
            state = int(rng.choice([s for s in range(len(kind.states)) if s != state]))
            left_s += rng.exponential(kind.states[state][1])
        x = kind.rho * x + np.sqrt(1 - kind.rho ** 2) * kind.sigma * rng.standard_normal()
        rates[i] = kind.states[state][0] * np.exp(x - kind.sigma ** 2 / 2)  # mean-preserving log-normal
        left_s -= STEP_MS / 1000
    return rates


def generate(kind: str, seed: int, duration_s: float) -> list[int]:
    """The delivery opportunities (ms, non-decreasing, one per 1500-byte packet) of one synthetic trace
    of `kind` (a key of `KINDS`), `duration_s` long, from `seed`. The last line is at the trace's end, so
    its period is `duration_s` even when the last milliseconds have no opportunity.

    Raises:
        KeyError: an unknown kind. ValueError: `duration_s` under one step (0.1 s).
    """
    if duration_s * 1000 < STEP_MS:
        raise ValueError(f"duration {duration_s:g} s; allowed: at least {STEP_MS / 1000:g} s")
    rng = np.random.default_rng(seed)
    rates = rate_series_bps(KINDS[kind], duration_s, rng)
    per_ms = np.repeat(rates, STEP_MS) / (PACKET_BYTES * 8) / 1000  # mean opportunities per ms
    counts = rng.poisson(per_ms)
    opportunities = np.repeat(np.arange(1, len(counts) + 1), counts).tolist()
    if not opportunities or opportunities[-1] != len(counts):
        opportunities.append(len(counts))
    return opportunities


def main(argv: list[str] | None = None) -> int:
    """Write one trace to stdout (see the module doc). Returns the exit status."""
    parser = argparse.ArgumentParser(prog="python -m harness.links.tracegen", description=__doc__.split("\n")[0])
    parser.add_argument("--kind", choices=sorted(KINDS), required=True)
    parser.add_argument("--seed", type=int, required=True)
    parser.add_argument("--duration-s", type=float, default=30.0)
    args = parser.parse_args(argv)
    sys.stdout.write("".join(f"{ms}\n" for ms in generate(args.kind, args.seed, args.duration_s)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
