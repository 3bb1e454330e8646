"""``bench-link --measure reorder,duplicate,gemodel,loss-correlation,duplicate-correlation``: fidelity of
netem's per-packet impairments applied without netem (the delay line's reorder, Gilbert-Elliott loss,
correlated loss and correlated duplicate, iptables TEE's duplicate),
between the coordinator and worker containers of `harness.bench.link_loss`'s pair.

Each trial applies one profile on the coordinator (its arriving packets, netem taken as absent), the
worker sends numbered UDP datagrams (64 bytes: one packet each, no GRO) and the coordinator returns the
numbers in the order they arrived; `harness.links.fidelity.arrival_stats` reads them (duplicates,
losses and their runs, packets that overtook earlier ones) and the trial keeps, beside them, the model
value (`harness.links.fidelity`) and the mechanism's own count (the delay line's stats, the TEE
chain's counters).
"""

from __future__ import annotations

import dataclasses
import json
import threading
from typing import Any, Callable

from harness.bench.link_udp import PORT, RECEIVE_ORDER, SEND

# the trials of each measure: (YAML profile keys, what the model says)
TRIALS: dict[str, list[dict[str, Any]]] = {
    "reorder": [{"delay": "5ms", "reorder": "25%"}, {"delay": "5ms", "reorder": "25%", "gap": 5}],
    "duplicate": [{"duplicate": "1%"}, {"duplicate": "5%"}],
    "gemodel": [{"loss_gemodel": {"p": "1%", "r": "30%"}},
                {"loss_gemodel": {"p": "2%", "r": "50%", "1-h": "70%", "1-k": "0.1%"}}],
    # netem's correlated draw loses far fewer packets than asked (harness.links.fidelity): these two lose
    # enough to count (about 5.5 % and 12.9 %); 1 % at 25 % correlation would lose about 2 in a million
    "loss-correlation": [{"loss": "10%", "loss_correlation": "10%"}, {"loss": "30%", "loss_correlation": "50%"}],
    "duplicate-correlation": [{"duplicate": "30%", "duplicate_correlation": "50%"}],  # about 12.9 %
}


def model_of(profile) -> dict[str, Any]:
    """The model values a trial's `profile` (a `LinkProfile`) asks for, in percent and packets:
    ``reorder_model_pct`` (`reorder_fraction`), ``duplicate_model_pct``, ``loss_model_pct`` and
    ``mean_burst_model_packets`` (`gemodel_stationary`, or `correlated_draw_model` for a random loss with
    a correlation; a duplicate with one takes the same draw's share). Raises nothing."""
    from harness.links.fidelity import correlated_draw_model, gemodel_stationary, reorder_fraction

    out: dict[str, Any] = {}
    if profile.reorder_pct:
        out["reorder_model_pct"] = round(100 * reorder_fraction(profile.reorder_pct / 100, profile.reorder_gap or 1), 6)
    if profile.duplicate_pct:
        out["duplicate_model_pct"] = profile.duplicate_pct
        if profile.duplicate_corr_pct:
            draw = correlated_draw_model(profile.duplicate_pct / 100, profile.duplicate_corr_pct / 100)
            out["duplicate_model_pct"] = round(100 * draw["loss_rate"], 6)
    if profile.loss_gemodel_pct is not None:
        model = gemodel_stationary(*(v / 100 for v in profile.loss_gemodel_pct))
        out["loss_model_pct"] = round(100 * model["loss_rate"], 6)
        out["mean_burst_model_packets"] = round(model["mean_burst_packets"], 4)
    if profile.loss_pct and profile.loss_corr_pct:
        model = correlated_draw_model(profile.loss_pct / 100, profile.loss_corr_pct / 100)
        out["loss_model_pct"] = round(100 * model["loss_rate"], 6)
        if model["mean_burst_packets"] is not None:
            out["mean_burst_model_packets"] = round(model["mean_burst_packets"], 4)
    return out


def measure_impairment(coordinator, worker, keys: dict[str, Any], datagrams: int, caps,
                       progress: Callable[[str], None]) -> dict[str, Any]:
    """One trial: apply the profile of YAML `keys` on the coordinator through the fallback, send
    `datagrams` numbered datagrams from the worker, read the arrival order and the mechanism's counts,
    reset. Returns the trial's record (asked, model, measured, counted).

    Raises:
        RuntimeError: the UDP exchange failed. LinkShapingError: a command or a read-back failed.
    """
    from harness.links.fallback import fallback_chains
    from harness.links.fidelity import arrival_stats
    from harness.links.plan import plan_shaping
    from harness.run.tc_exec import ContainerExec, apply_plan, read_delay_line_stats, read_fallback_counters, reset_links
    from harness.spec.links import LinkProfile

    profile = LinkProfile.from_mapping(keys, "bench")
    runner = ContainerExec(coordinator)
    reset_links(runner)
    plan = plan_shaping(profile, dataclasses.replace(caps, netem=False))
    apply_plan(runner, plan)
    try:
        result: dict[str, Any] = {}
        thread = threading.Thread(target=lambda: result.update(
            exec=coordinator.exec_run(["python", "-c", RECEIVE_ORDER, str(PORT)], demux=True)))
        thread.start()
        code, out = worker.exec_run(["python", "-c", "import time; time.sleep(0.5)\n" + SEND, "coordinator",
                                     str(PORT), str(datagrams)])
        thread.join(timeout=180)
        if code != 0 or "exec" not in result or result["exec"][0] != 0:
            raise RuntimeError(f"bench-link: the UDP trial {keys} failed: {out!r} {str(result.get('exec'))[:300]}")
        arrivals = json.loads(result["exec"][1][0])
        chain, dup_chain = fallback_chains(plan.mechanisms)
        counters = read_fallback_counters(runner, chain, dup_chain) if chain or dup_chain else None
        line = read_delay_line_stats(runner) if "delay-line" in plan.mechanisms.values() else None
    finally:
        reset_links(runner)
    trial = {"asked": keys, "mechanisms": plan.mechanisms, **model_of(profile), **arrival_stats(arrivals, datagrams)}
    if line is not None:
        trial["delay_line_counts"] = {k: line[k] for k in ("queued_packets", "reordered_packets",
                                                         "loss_dropped_packets", "loss_bursts", "ge_bad_entries",
                                                         "duplicated_packets")}
    if counters is not None and "duplicate" in counters:
        trial["tee_counts"] = counters["duplicate"]
    shown = [(m, x) for m, x in (("reorder_model_pct", "early_pct"), ("duplicate_model_pct", "duplicate_pct"),
                                 ("loss_model_pct", "loss_pct"), ("mean_burst_model_packets", "mean_burst_packets"))
             if m in trial]
    progress(f"[bench-link] {keys}: " + ", ".join(f"{x} model {trial[m]} measured {trial[x]}" for m, x in shown))
    return trial
