"""harness.analysis: the synchronous-round model of a sharded step (round_model), against a report's points
(point_model), and its table (round_table)."""

from __future__ import annotations

import json

import pytest

from harness.analysis.point_model import ModelRow, _link_burst_bytes, _report_partitions, model_rows, point_model, report_cores
from harness.analysis.round_model import sharded_link_s, sharded_round_s
from harness.analysis.round_table import main, render, render_markdown
from harness.cli import main as cli_main
from wiiide.server.ps.partition import (
    egress_shard_weights,
    partition_flat,
    pipeline_shard_weights,
    plan_partitions,
    shard_loads_bytes,
)

DIGITS_MLP_NUMEL = 64 * 512 + 512 + 512 * 512 + 512 + 512 * 10 + 10
RATE_BPS = 95.6e6


@pytest.mark.parametrize("workers, numel, partition_bytes", [
    (3, DIGITS_MLP_NUMEL, 64 * 1024), (4, DIGITS_MLP_NUMEL, 64 * 1024), (8, DIGITS_MLP_NUMEL, 64 * 1024),
    (8, DIGITS_MLP_NUMEL, 4 * 1024 * 1024), (4, 6_500_000, 4 * 1024 * 1024), (16, DIGITS_MLP_NUMEL, 64 * 1024)])
def test_pipeline_shares_are_the_simulated_links_best(workers, numel, partition_bytes):
    """The pipeline shares' closed form (the coordinator's first partition in after a fair share of every
    worker's link) gives the shortest simulated round of any coordinator weight on a grid of 0.05, to 1 %,
    and with a shard on every node the coordinator is done with the workers."""
    def round_s(weights):
        parts = partition_flat(numel, workers + 1, partition_bytes, weights, [*range(1, workers + 1), 0])
        return sharded_round_s([(p.shard, (p.stop - p.start) * 4.0) for p in parts], workers, RATE_BPS)

    weights = pipeline_shard_weights(workers + 1, workers, numel * 4, partition_bytes)
    grid = min(round_s([x / 20] + [1.0] * workers) for x in range(2, 60))
    assert round_s(weights) <= 1.01 * grid
    old = [(2 * workers - 2) / workers] + [1.0] * workers  # (k + W - 3) / W: pushes one shard after another
    assert round_s(weights) <= round_s(old)


def test_the_busiest_nodes_bytes_bound_the_simulated_round():
    """Egress shares level every node's bytes (1.6 M at 8 workers): the simulated round is never below
    the busiest node's bytes, and the egress layout (the coordinator's range at the head, pushed last)
    waits longer for its pushes than the pipeline layout."""
    workers = 8
    model_bytes = DIGITS_MLP_NUMEL * 4

    def both(weights, order=None):
        parts = partition_flat(DIGITS_MLP_NUMEL, workers + 1, 64 * 1024, weights, order)
        simulated = sharded_round_s([(p.shard, (p.stop - p.start) * 4.0) for p in parts], workers, RATE_BPS)
        return simulated, sharded_link_s(shard_loads_bytes(parts, workers + 1), workers, RATE_BPS)

    egress, egress_bytes = both(egress_shard_weights(9, workers))
    assert 1.59 * model_bytes * 8 / RATE_BPS < egress_bytes < 1.61 * model_bytes * 8 / RATE_BPS  # 2WM / (W + 2)
    pipeline, pipeline_bytes = both(pipeline_shard_weights(9, workers, model_bytes, 64 * 1024), [*range(1, 9), 0])
    assert egress >= egress_bytes and pipeline >= pipeline_bytes * 0.999
    assert egress > 1.15 * pipeline


def test_compression_scales_the_link_time_and_bad_input_is_refused():
    loads = [200.0, 100.0, 100.0]
    assert sharded_link_s(loads, 2, 1e6, 2.0, 2.0) == pytest.approx(sharded_link_s(loads, 2, 1e6) / 2)
    for bad in (([], 2, 1e6), (loads, 0, 1e6), (loads, 2, 0.0)):
        with pytest.raises(ValueError):
            sharded_link_s(*bad)


def test_round_of_a_central_server_is_pushes_then_every_pull_through_its_link():
    """One shard on the coordinator (ps_shards 1's topology): the workers push M at once, each on its
    own link (M / R), then the coordinator sends M to each of W workers through its one link (W M / R):
    (W + 1) M / R with one partition. With several, its pulls start after the first partition is in."""
    model_bytes, rate_bps = 1e6, 8e6  # 1 s a model
    assert sharded_round_s([(0, model_bytes)], 2, rate_bps) == pytest.approx(3.0)
    assert sharded_round_s([(0, model_bytes)], 4, rate_bps) == pytest.approx(5.0)
    quarters = [(0, model_bytes / 4)] * 4
    assert sharded_round_s(quarters, 4, rate_bps) == pytest.approx(0.25 + 4.0)


def test_round_shares_a_nodes_link_among_its_busy_connections_and_pulls_wait_for_pushes():
    """Two workers, a shard on every node, one partition of b bytes each. Each worker pushes to the two
    other shards at once, R / 2 each: both in at 2b / R. Then each worker sends its one pull alone (b / R,
    done at 3b / R) and the coordinator its two pulls, sharing its link (2b / R): the step is 4b / R."""
    b, rate_bps = 1e6, 8e6
    parts = [(1, b), (2, b), (0, b)]
    assert sharded_round_s(parts, 2, rate_bps) == pytest.approx(4.0)
    assert sharded_round_s(parts, 2, rate_bps, worker_ratio=2.0, coordinator_ratio=2.0) == pytest.approx(2.0)
    assert sharded_round_s(parts, 2, rate_bps, coordinator_ratio=1e9) == pytest.approx(3.0)  # workers alone
    for bad in (([], 2, 1e6), (parts, 0, 1e6), (parts, 2, 0.0), ([(3, b)], 2, 1e6)):
        with pytest.raises(ValueError):
            sharded_round_s(*bad)


def test_ordered_pushes_join_the_link_one_after_another_within_their_window():
    """Two workers, partition p0 (b bytes) on worker 1's shard, p1 (b) on the coordinator's; backward
    pushes p1 first. Concurrent: worker 2 pushes p1 and p0 at R / 2 each (both in at 2b / R), then the
    coordinator sends p1 to both workers sharing its link: 4b / R. Ordered, window 0: worker 2 sends p1
    alone (in at b / R, as worker 1's), the coordinator's two pulls take 2b / R: done at 3b / R, and p0
    (in at 2b / R) reaches worker 2 at 3b / R too. A window of a push's size is the concurrent schedule."""
    b, rate_bps = 1e6, 8e6
    parts = [(1, b), (0, b)]
    assert sharded_round_s(parts, 2, rate_bps) == pytest.approx(4.0)
    assert sharded_round_s(parts, 2, rate_bps, push_window_bytes=0.0) == pytest.approx(3.0)
    assert sharded_round_s(parts, 2, rate_bps, push_window_bytes=b) == pytest.approx(4.0)
    between = sharded_round_s(parts, 2, rate_bps, push_window_bytes=b / 2)
    assert 3.0 < between < 4.0
    with pytest.raises(ValueError):
        sharded_round_s(parts, 2, rate_bps, push_window_bytes=-1.0)


def test_ordered_pushes_of_large_pieces_run_one_shard_at_a_time_and_interleaving_spreads_their_pulls():
    """The 26 MB model at 4 workers in 20 pieces of 1.2 MB: with a window below a piece, ordered pushes
    in contiguous ranges queue every worker's pushes to one shard, whose link alone then sends the pulls;
    interleaved, the next pieces go to other shards: the round is shorter, and with an unbounded window
    the placement makes no difference to the concurrent schedule."""
    workers, numel = 4, 6_500_000
    rounds = {}
    for placement in ("contiguous", "interleaved"):
        parts = [(p.shard, float(p.nbytes)) for p in
                 plan_partitions(numel, workers + 1, workers, 4 * 1024 * 1024, "pipeline", 4, placement)]
        rounds[placement] = (sharded_round_s(parts, workers, RATE_BPS, push_window_bytes=256 * 1024),
                             sharded_round_s(parts, workers, RATE_BPS))
    assert rounds["interleaved"][0] < 0.9 * rounds["contiguous"][0]
    assert rounds["interleaved"][1] == pytest.approx(rounds["contiguous"][1])


def test_ordered_pushes_end_on_one_shards_piece_whose_pulls_finer_pieces_shorten():
    """The 26 MB model at 8 workers, interleaved, with the ~540 KB window its pushes started with
    (studies/ordered-tail/ordered-tail.yaml): every worker's last push is the same piece, and once it is in, that
    shard's link alone sends 7 pulls of it. In 4 pieces per shard (~0.68 MB on a worker's shard, above
    the window) that tail puts the round well above the busiest link's bytes; in 8 (~0.34 MB, under the
    window) the round is the bytes."""
    workers, numel, window_bytes = 8, 6_500_000, 540e3
    rounds, bounds = {}, {}
    for per_shard in (4, 8):
        plan = plan_partitions(numel, workers + 1, workers, 4 * 1024 * 1024, "pipeline", per_shard, "interleaved")
        parts = [(p.shard, float(p.nbytes)) for p in plan]
        rounds[per_shard] = sharded_round_s(parts, workers, RATE_BPS, push_window_bytes=window_bytes)
        bounds[per_shard] = sharded_link_s(shard_loads_bytes(plan, workers + 1), workers, RATE_BPS)
    assert bounds[4] == pytest.approx(bounds[8], rel=0.01)  # about the same bytes on every link
    assert rounds[4] > 1.08 * bounds[4]
    assert rounds[8] == pytest.approx(bounds[8], rel=0.01)


def test_round_at_eight_workers_with_the_old_pipeline_shares_waits_for_the_coordinator():
    """The first pipeline shares, (k + W - 3) / W, assumed the coordinator's partitions in after s_0 / R:
    at 8 workers its first partition is in only after a fair share of every worker's link, so the round
    is well above the busiest node's bytes; at 4 workers the workers' own bytes set it."""
    def both(workers):
        old = [(2 * workers - 2) / workers] + [1.0] * workers
        parts = partition_flat(DIGITS_MLP_NUMEL, workers + 1, 64 * 1024, old, [*range(1, workers + 1), 0])
        simulated = sharded_round_s([(p.shard, (p.stop - p.start) * 4.0) for p in parts], workers, RATE_BPS)
        return simulated, sharded_link_s(shard_loads_bytes(parts, workers + 1), workers, RATE_BPS)

    simulated, busiest = both(8)
    assert simulated > 1.05 * busiest
    simulated, busiest = both(4)
    assert simulated == pytest.approx(busiest, rel=0.01)


_NUMEL = 100_000  # 400 KB: 7 partitions of at most 64 KiB over 3 shards


def _point(engine: str = "wiiide", rate_bps: int | None = 100_000_000, status: str = "ok",
           compression: str = "none", ratio: float = 1.0, loads: list[int] | None = None,
           balance: str = "pipeline", schedule: str = "concurrent", cwnd_bytes: list[int] | None = None) -> dict:
    node = {"steps": 10, "compute_time_s": 0.05, "compression_ratio": ratio}
    workers = {f"worker-{w}": {**node, "ps": {"push_cwnd": {"median_bytes": c, "samples": 40} if c else None}}
               for w, c in ((1, (cwnd_bytes or [0, 0])[0]), (2, (cwnd_bytes or [0, 0])[1]))}
    if loads is None:
        loads = shard_loads_bytes(plan_partitions(_NUMEL, 3, 2, 64 * 1024, "pipeline"), 3)
    coordinator = {"ps": {"shard_loads_bytes": loads, "partition_balance": balance, "partition_bytes": 64 * 1024},
                   "compression_ratio": ratio, "steps": 10}
    return {"params": {"engine": engine}, "config": {"num_workers": 2, "engine": engine, "compression": compression,
                                                     "lossy_warmup_steps": 5, "push_schedule": schedule},
            "cluster": {"link": {"profiles": {"all": {"rate_bps": rate_bps}}}},
            "repeats": [{"status": status, "totals": {"step_time_median_s": s},
                         "nodes": {"coordinator": coordinator, **workers}}
                        for s in (0.1, 0.3, 0.2)]}


def test_point_model_uses_the_ok_repeats_median_and_skips_what_it_cannot_model():
    row = point_model(_point())
    assert isinstance(row, ModelRow) and row.measured_step_s == 0.2
    assert row.model_step_s > 0.005  # compute (5 ms a step) plus the link
    assert point_model(_point(rate_bps=None)) is None  # unshaped: no link model
    assert point_model(_point(status="failed")) is None
    assert point_model(_point(engine="fsdp")) is None
    assert model_rows({"points": [_point(), _point(rate_bps=None)]}) == [row]
    assert "engine=wiiide" in render([row])
    # pipeline shares: one range per shard of its reported load, whatever the weights were
    assert point_model(_point(loads=[200_000, 100_000, 100_000])) is not None
    assert point_model(_point(loads=[200_000, 100_000, 100_000], balance="bytes")) is None  # not what LPT cuts
    assert row.bytes_model_step_s is not None and row.bytes_model_step_s > 0.005


def test_an_ordered_run_is_simulated_with_its_workers_measured_congestion_window():
    """push_schedule ordered: the window is the median of the workers' ``ps.push_cwnd.median_bytes``;
    one above every push gives the concurrent model, a small one a longer round; a report without the
    figure (an older report) is simulated as concurrent."""
    loads = shard_loads_bytes(plan_partitions(_NUMEL, 3, 2, 64 * 1024, "egress"), 3)  # the coordinator's last

    def model_s(**kw):
        return point_model(_point(loads=loads, balance="egress", **kw)).model_step_s
    concurrent = model_s()
    assert model_s(schedule="ordered") == pytest.approx(concurrent)
    assert model_s(schedule="ordered", cwnd_bytes=[4_000_000, 4_000_000]) == pytest.approx(concurrent)
    assert model_s(schedule="ordered", cwnd_bytes=[1, 3]) > 1.1 * concurrent
    assert model_s(cwnd_bytes=[1, 3]) == pytest.approx(concurrent)


def test_a_lossy_codecs_ratio_is_the_codecs_own_on_the_partitions_not_the_runs():
    """int4 sends 4 bits an element plus a scale per block: between 7.5x and 8x fewer bytes in every
    compressed step, whatever ratio the run reports over its dense warm-up and its dense plan (the 26
    MB model's 12 steps gave the workers 3.6); a lossless codec's link time follows the nodes' ratio."""
    compute_s = 0.005
    dense_link_s = point_model(_point()).model_step_s - compute_s
    int4 = [point_model(_point(compression="fixed:int4", ratio=r)).model_step_s - compute_s for r in (1.78, 3.6)]
    assert int4[0] == pytest.approx(int4[1])
    assert dense_link_s / 8 < int4[0] < dense_link_s / 7.5
    topk = point_model(_point(compression="fixed:topk-0.01", ratio=2.0)).model_step_s - compute_s
    assert dense_link_s / 51 < topk < dense_link_s / 45  # a value and an index per kept element: 2 %
    zstd = point_model(_point(compression="fixed:shuffle-zstd", ratio=1.6)).model_step_s - compute_s
    assert zstd == pytest.approx(dense_link_s / 1.6)


def test_a_lossy_codecs_ratio_is_what_the_nodes_sent_with_it_when_they_recorded_it():
    """int3z entropy-codes its values, so its bytes depend on the gradients: the model takes the ratio of
    the frames the nodes sent with it (``codec_bytes_sent``), not the Gaussian estimate, and leaves the
    dense frames of the warm-up (``none``) out of it; a report without the figure keeps the estimate."""
    compute_s = 0.005
    dense_link_s = point_model(_point()).model_step_s - compute_s

    def int3z_link_s(sent: dict | None) -> float:
        point = _point(compression="fixed:int3z", ratio=3.0)
        if sent is not None:
            for rep in point["repeats"]:
                for node in rep["nodes"].values():
                    node["codec_bytes_sent"] = sent
        return point_model(point).model_step_s - compute_s

    estimate = int3z_link_s(None)
    assert dense_link_s / 16 < estimate < dense_link_s / 12  # about 14x on Gaussian values
    measured = int3z_link_s({"int3z": {"raw_bytes": 2_000_000, "payload_bytes": 100_000},
                             "none": {"raw_bytes": 5_000_000, "payload_bytes": 5_000_000}})
    assert measured == pytest.approx(dense_link_s / 20, rel=0.02)
    assert int3z_link_s({"none": {"raw_bytes": 5_000_000, "payload_bytes": 5_000_000}}) == pytest.approx(estimate)


@pytest.mark.parametrize("balance", ["pipeline", "egress"])
@pytest.mark.parametrize("placement", ["contiguous", "interleaved"])
def test_a_reports_partitions_are_rebuilt_with_their_placement(balance, placement):
    """The model rebuilds a run's partitions from its reported loads, balance, pieces per shard and
    placement: the same (shard, bytes) in the same order as the run cut them, so an interleaved run is
    not modelled as contiguous ranges."""
    workers = 4
    parts = plan_partitions(6_500_000, workers + 1, workers, 4 * 1024 * 1024, balance, 4, placement)
    rebuilt = _report_partitions(shard_loads_bytes(parts, workers + 1), workers, 4 * 1024 * 1024, balance, 4,
                                 placement)
    assert rebuilt == [(p.shard, float(p.nbytes)) for p in parts]
    other = "contiguous" if placement == "interleaved" else "interleaved"
    assert _report_partitions(shard_loads_bytes(parts, workers + 1), workers, 4 * 1024 * 1024, balance, 4,
                              other) != rebuilt


def _with_step_cpu(point: dict, per_node_s: list[float] | None) -> dict:
    """`point` with each node of every repeat given a median CPU per step (None: the figure left out of worker-2)."""
    for rep in point["repeats"]:
        nodes = rep["nodes"] = {name: dict(node) for name, node in rep["nodes"].items()}
        for name, cpu_s in zip(nodes, per_node_s or [0.1, 0.1, None]):
            if cpu_s is not None:
                nodes[name]["step_cpu_s"] = {"median": cpu_s, "count": 10}
    return point


def test_the_cores_bound_is_the_nodes_cpu_per_step_over_the_machines_cores():
    links_only = point_model(_point())
    assert links_only.cpu_step_s is None and links_only.link_model_step_s == links_only.model_step_s
    # 3 nodes needing 0.25 + 0.25 + 0.2 s of CPU a step on 2 cores: at least 0.35 s a step, above the links' round
    row = point_model(_with_step_cpu(_point(), [0.25, 0.25, 0.2]), cores=2)
    assert row.cpu_step_s == pytest.approx(0.35)
    assert row.model_step_s == pytest.approx(0.35) and row.link_model_step_s == links_only.model_step_s
    assert row.error == pytest.approx(0.35 / 0.2 - 1)
    # little CPU: the links' round stands; no cores given, or a node without the figure: no cores' bound
    assert point_model(_with_step_cpu(_point(), [0.001] * 3), cores=2).model_step_s == links_only.model_step_s
    assert point_model(_with_step_cpu(_point(), [0.25, 0.25, 0.2])).cpu_step_s is None
    assert point_model(_with_step_cpu(_point(), None), cores=2).cpu_step_s is None
    # the cores come from a single-host report's machine; a swarm's nodes ran on several machines
    report = {"backend": {"name": "docker"}, "machine_info": {"cpu_count_logical": 2},
              "points": [_with_step_cpu(_point(), [0.25, 0.25, 0.2])]}
    assert report_cores(report) == 2 and model_rows(report)[0].cpu_step_s == pytest.approx(0.35)
    assert report_cores({**report, "backend": {"name": "swarm"}}) is None
    assert model_rows({**report, "backend": {"name": "swarm"}})[0].cpu_step_s is None
    text = render([row, links_only])
    assert "cores ms" in text and "350.0" in text


def _with_compute_cpu(point: dict, per_worker_s: float | None) -> dict:
    """`point` with every worker's forward and backward given `per_worker_s` CPU seconds a step (None: left
    out of worker-2, as in older reports)."""
    for rep in point["repeats"]:
        for name, node in rep["nodes"].items():
            if name.startswith("worker") and not (per_worker_s is None and name == "worker-2"):
                node["compute_cpu_s"] = (per_worker_s or 0.01) * node["steps"]
    return point


def test_a_sharded_step_is_a_compute_phase_then_a_round_each_bound_by_links_or_cores():
    """Two workers whose forward and backward need 0.1 s of CPU each on 2 cores can not finish it in
    under 0.1 s however short their wall time (5 ms here); the round after it still takes the links'
    round. The roofline took the larger of the two bounds and missed the compute phase."""
    roofline = point_model(_with_step_cpu(_point(), [0.03, 0.11, 0.11]), cores=2)
    round_s = roofline.link_model_step_s - 0.005  # the links' round (33 ms), compute (5 ms a step) taken off
    assert roofline.compute_phase_s is None and roofline.model_step_s == pytest.approx(max(0.005 + round_s, 0.125))
    row = point_model(_with_compute_cpu(_with_step_cpu(_point(), [0.03, 0.11, 0.11]), 0.1), cores=2)
    assert row.compute_phase_s == pytest.approx(0.1)  # 2 x 0.1 s over 2 cores, above the 5 ms of wall
    assert (0.25 - 0.2) / 2 < round_s and row.model_step_s == pytest.approx(0.1 + round_s)  # the round: links
    assert row.model_step_s > max(roofline.link_model_step_s, roofline.cpu_step_s)
    # little compute CPU: the compute phase is its wall time and the step the links' model, as before
    light = point_model(_with_compute_cpu(_with_step_cpu(_point(), [0.001] * 3), 0.0001), cores=2)
    assert light.compute_phase_s == pytest.approx(0.005) and light.model_step_s == pytest.approx(roofline.link_model_step_s)
    # a CPU-bound round: the round's CPU (every node's step less the compute) over the cores
    busy = point_model(_with_compute_cpu(_with_step_cpu(_point(), [2.0, 2.0, 2.0]), 0.1), cores=2)
    assert busy.model_step_s == pytest.approx(0.1 + (6.0 - 0.2) / 2)
    # a worker without the figure, or no cores: the roofline
    assert point_model(_with_compute_cpu(_with_step_cpu(_point(), [0.03, 0.11, 0.11]), None), cores=2) == roofline
    assert point_model(_with_compute_cpu(_point(), 0.1)).compute_phase_s is None
    assert "compute ms" in render([row, roofline]) and "100.0" in render([row])


def _with_host_cpu(point: dict, user_s: float, softirq_s: float, steal_s: float = 0.0) -> dict:
    """`point` whose coordinator saw the machine spend `user_s` of user time, `softirq_s` of softirq and
    `steal_s` of steal over a 10 s window of its 10 timed steps; each node's timed CPU is its median x 10."""
    for rep in point["repeats"]:
        for node in rep["nodes"].values():
            node["step_cpu_s"] = {**node["step_cpu_s"], "mean": node["step_cpu_s"]["median"]}
        rep["nodes"]["coordinator"] = {**rep["nodes"]["coordinator"], "host_cpu_s": {
            "window_s": 10.0, "steps": 10, "cpu_count": 2, "user": user_s, "nice": 0.0, "system": 0.0,
            "softirq": softirq_s, "irq": 0.0, "steal": steal_s, "idle": 20.0 - user_s - softirq_s - steal_s}}
    return point


def test_the_cores_bound_adds_the_kernels_work_and_leaves_out_the_cores_other_processes_take():
    """The nodes need 0.7 s of CPU a step (7 s over the 10 steps). The machine's user time was 10 s: the
    other 3 s (the engine, the harness) held 0.3 of a core all along; softirq took 1 s, 0.1 s a step.
    So a step needs 0.8 s of the 1.7 cores left: 0.47 s, not the 0.35 s the nodes' CPU over 2 cores gives."""
    plain = point_model(_with_step_cpu(_point(), [0.25, 0.25, 0.2]), cores=2)
    row = point_model(_with_host_cpu(_with_step_cpu(_point(), [0.25, 0.25, 0.2]), user_s=10.0, softirq_s=1.0), cores=2)
    assert plain.cpu_step_s == pytest.approx(0.35) and row.cpu_step_s == pytest.approx(0.8 / 1.7)
    assert row.model_step_s == pytest.approx(0.8 / 1.7)  # above the links' round
    stolen = point_model(_with_host_cpu(_with_step_cpu(_point(), [0.25, 0.25, 0.2]), 10.0, 1.0, steal_s=2.0), cores=2)
    assert stolen.cpu_step_s == pytest.approx(0.8 / 1.5)  # the hypervisor's 0.2 of a core is not the nodes'
    # less busy time than the nodes' own CPU (ticks against process clocks): no core taken by others
    assert point_model(_with_host_cpu(_with_step_cpu(_point(), [0.25, 0.25, 0.2]), 6.5, 0.0), cores=2).cpu_step_s \
        == pytest.approx(0.35)
    # a machine held by others: the nodes keep at least a quarter of it
    crowded = point_model(_with_host_cpu(_with_step_cpu(_point(), [0.25, 0.25, 0.2]), 25.0, 0.0), cores=2)
    assert crowded.cpu_step_s == pytest.approx(0.7 / 0.5)


def test_the_measured_step_is_the_median_of_the_timed_steps_not_of_the_dense_warm_up_too():
    """A lossy run's warm-up steps go dense and slow; the coordinator's Training Summary leaves them out,
    and so does the measured step the model is held against. A report without that summary keeps the
    median of every step."""
    point = _point()
    for rep, timed_s in zip(point["repeats"], (0.05, 0.15, 0.12)):
        rep["nodes"]["coordinator"]["training_summary"] = {"median_step_time_s": timed_s, "warmup_steps": 5}
    assert point_model(point).measured_step_s == 0.12  # not 0.2, the median of every step's medians
    assert point_model(_point()).measured_step_s == 0.2


def test_a_shapers_burst_leaves_at_once_and_refills_only_while_the_link_is_idle():
    """One partition of 100 kB on worker 1's shard, 2 workers: worker 2 pushes it, worker 1 pulls it back
    to worker 2 (its own push and pull are loopback). At 8 Mbit/s (1 MB/s) each crossing takes 0.1 s.
    A bucket of 30 kB on each egress sends its first 30 kB at once: 0.07 s a crossing. Worker 1's link
    idled through the push, so its bucket was full again for the pull, even from empty."""
    parts, rate = [(1, 100_000.0)], 8e6
    assert sharded_round_s(parts, 2, rate) == pytest.approx(0.2)
    assert sharded_round_s(parts, 2, rate, burst_bytes=30_000) == pytest.approx(0.14)
    # no tokens at the start: the push takes 0.1 s, and worker 1's bucket refills to 30 kB meanwhile
    assert sharded_round_s(parts, 2, rate, burst_bytes=30_000, start_tokens_bytes=0) == pytest.approx(0.17)
    # 10 ms of idle link refill 10 kB: a bucket that starts with that
    assert sharded_round_s(parts, 2, rate, burst_bytes=30_000, start_tokens_bytes=10_000) == pytest.approx(0.16)
    # a bucket larger than the message: it crosses at once
    assert sharded_round_s(parts, 2, rate, burst_bytes=200_000) == pytest.approx(0.0)
    # a busy link does not refill: worker 2 pushes two such partitions back to back, the second (tail
    # first) done at 0.07 s on the bucket, the first at 0.17 s at the rate alone. Worker 1 pulls the second
    # back at 0.07-0.14 s on its bucket, which refills 30 kB while its link idles at 0.14-0.17 s: the
    # first's pull ends at 0.24 s
    two = [(1, 100_000.0), (1, 100_000.0)]
    assert sharded_round_s(two, 2, rate, burst_bytes=30_000) == pytest.approx(0.24)
    # ordered pushes (window 0) join as soon as the bucket has carried the push before them: with p1
    # (1 MB, the coordinator's) and p0 (1 MB, worker 1's) and buckets of 1.5 MB, both p1 pushes and the
    # coordinator's first pull cross at once; its second pull and worker 2's p0 each have 0.5 MB left
    # at 1 MB/s, and worker 1's bucket, refilled while it idled, carries p0's pull at 0.5 s
    ordered = [(1, 1e6), (0, 1e6)]
    assert sharded_round_s(ordered, 2, rate, push_window_bytes=0.0, burst_bytes=1.5e6) == pytest.approx(0.5)
    assert sharded_round_s(ordered, 2, rate, push_window_bytes=0.0, burst_bytes=4e6) == pytest.approx(0.0)
    with pytest.raises(ValueError):
        sharded_round_s(parts, 2, rate, burst_bytes=-1)
    with pytest.raises(ValueError):
        sharded_round_s(parts, 2, rate, burst_bytes=10, start_tokens_bytes=20)


def _with_links(point: dict, burst_bytes: int, cburst_bytes: int | None = None) -> dict:
    """`point` whose repeats read back an htb class on every node's eth0 with that burst and cburst."""
    for rep in point["repeats"]:
        rep["links"] = {"containers": {f"wiiide_{name}_1": {"applied": {"eth0": [
            {"type": "qdisc", "kind": "htb", "handle": "1:"},
            {"type": "class", "kind": "htb", "handle": "1:1", "rate_bps": 100_000_000,
             "burst_bytes": burst_bytes, "cburst_bytes": burst_bytes if cburst_bytes is None else cburst_bytes}]}}
            for name in rep["nodes"]}}
    return point


def test_the_model_takes_the_burst_the_harness_read_back_from_the_links():
    assert _link_burst_bytes(_with_links(_point(), 50_000)["repeats"]) == 50_000
    assert _link_burst_bytes(_with_links(_point(), 50_000, 20_000)["repeats"]) == 20_000  # the smaller bucket
    assert _link_burst_bytes(_point()["repeats"]) == 0.0  # nothing read back: no burst
    plain, burst = point_model(_point()), point_model(_with_links(_point(), 50_000))
    # 7 partitions of at most 64 KiB over 3 shards: every egress saves up to 50 kB of its 100 Mbit/s
    assert plain.link_model_step_s - 0.005 > burst.link_model_step_s - 0.005 > 0
    assert plain.link_model_step_s - burst.link_model_step_s <= 2 * 50_000 * 8 / (100e6 * 0.956) + 1e-9


def test_a_step_waits_for_the_slowest_workers_compute_then_the_links_round():
    """A step waits for its slowest worker's pushes: with the per-step maximum recorded (40 ms, the median
    over the repeats, against a median worker's 5 ms), the step is at least that and the links' round
    after it. Where the cores bind, the two phases stay the larger."""
    def with_max(point: dict, seconds: list[float | None]) -> dict:
        for rep, s in zip(point["repeats"], seconds):
            rep["nodes"]["coordinator"]["compute_max_s"] = None if s is None else {"median": s, "count": 10}
        return point

    def light(seconds=None) -> dict:  # little CPU: the links bind
        point = _with_compute_cpu(_with_step_cpu(_point(), [0.001] * 3), 0.0001)
        return with_max(point, seconds) if seconds else point

    plain = point_model(light(), cores=2)
    round_s = plain.link_model_step_s - 0.005  # the links' round, compute (5 ms a step) taken off
    assert plain.slowest_path_s is None and plain.model_step_s == pytest.approx(0.005 + round_s)
    slow = point_model(light([0.03, 0.05, 0.04]), cores=2)
    assert slow.slowest_path_s == pytest.approx(0.04 + round_s) and slow.model_step_s == pytest.approx(0.04 + round_s)
    assert slow.compute_phase_s == pytest.approx(0.005)  # the two phases' compute phase: the median worker's
    # CPU-bound: the round's CPU over the cores (2.9 s) outlasts the slowest worker's path
    busy = point_model(with_max(_with_compute_cpu(_with_step_cpu(_point(), [2.0, 2.0, 2.0]), 0.1),
                                [0.03, 0.05, 0.04]), cores=2)
    assert busy.model_step_s == pytest.approx(0.1 + (6.0 - 0.2) / 2) and busy.slowest_path_s < busy.model_step_s
    # one repeat without the figure: not recorded
    assert point_model(light([0.03, None, 0.04]), cores=2).slowest_path_s is None
    assert "slowest ms" in render([slow, plain]) and f"{(0.04 + round_s) * 1e3:9.1f}" in render([slow])


def test_the_compute_of_a_step_is_the_timed_steps_median_worker_when_recorded():
    """A worker's compute_time_s / steps counts the warm-up steps (5 ms a step in `_point`); the
    coordinator's per-step median worker over the timed steps (2 ms) replaces it when every repeat has it."""
    def with_median(point: dict, seconds: list[float | None]) -> dict:
        for rep, s in zip(point["repeats"], seconds):  # each repeat its own coordinator
            rep["nodes"] = {**rep["nodes"], "coordinator": {
                **rep["nodes"]["coordinator"], "compute_median_s": None if s is None else {"median": s, "count": 10}}}
        return point

    plain = point_model(_point())
    timed = point_model(with_median(_point(), [0.003, 0.002, 0.001]))
    assert timed.link_model_step_s == pytest.approx(plain.link_model_step_s - 0.005 + 0.002)
    assert point_model(with_median(_point(), [0.003, None, 0.001])).link_model_step_s == plain.link_model_step_s


def _with_stages(point: dict, per_stage_s: float, pull_decode_s: float | None = None, eight: bool = True) -> dict:
    """`point` with every node's ``stage_cpu_s`` (`per_stage_s` a stage a step; the four stages of the
    reports before 2026-11-28 when not `eight`) and each timed step's slowest and median worker (5 ms)."""
    stages = (("push_encode", "push_send", "push_receive", "push_decode", "update", "pull_send", "pull_receive",
               "pull_decode") if eight else ("push_encode", "push_receive", "update", "pull_receive"))
    for rep in point["repeats"]:
        for name, node in rep["nodes"].items():
            node["stage_cpu_s"] = {stage: {"median": per_stage_s, "count": 10} for stage in stages}
            if pull_decode_s is not None and name.startswith("worker"):
                node["stage_cpu_s"]["pull_decode"] = {"median": pull_decode_s, "count": 10}
        rep["nodes"]["coordinator"].update(compute_max_s={"median": 0.005}, compute_median_s={"median": 0.005})
    return point


def test_the_model_is_at_least_the_schedule_of_the_timed_stages_when_the_nodes_recorded_all_eight():
    """With little CPU the simulated schedule is the compute (5 ms) and the links' round, as the closed
    forms have it. A decode of 0.2 s a step on each worker's pulls (two workers, two cores), which the
    nodes' ``step_cpu_s`` of 1 ms does not show to the cores' bound, comes after the links in the
    schedule, and the model is that schedule. Reports whose nodes timed four stages (before 2026-11-28),
    or a model without one machine's cores, have none, and the closed forms stand alone."""
    def point(**stages) -> dict:
        return _with_stages(_with_compute_cpu(_with_step_cpu(_point(), [0.001, 0.001, 0.001]), 0.0001), **stages)

    light = point_model(point(per_stage_s=1e-6), cores=2)
    assert light.simulated_step_s == pytest.approx(light.link_model_step_s, rel=0.02)
    assert light.model_step_s == pytest.approx(light.link_model_step_s, rel=0.02)
    decoding = point_model(point(per_stage_s=1e-6, pull_decode_s=0.2), cores=2)
    assert decoding.simulated_step_s > light.simulated_step_s + 0.15
    assert decoding.model_step_s == decoding.simulated_step_s
    assert max(decoding.slowest_path_s, decoding.cpu_step_s) < light.simulated_step_s * 1.02  # the closed forms miss it
    four = point_model(point(per_stage_s=1e-6, pull_decode_s=0.2, eight=False), cores=2)
    assert four.simulated_step_s is None and four.model_step_s == pytest.approx(light.link_model_step_s, rel=0.02)
    assert point_model(point(per_stage_s=1e-6, pull_decode_s=0.2)).simulated_step_s is None  # no machine's cores
    assert "simulated ms" in render([light])


def _with_sched(point: dict, lost_cores: list[float | None]) -> dict:
    """`point` whose repeats' scheduler traces found `lost_cores` (None: a repeat not traced)."""
    for rep, lost in zip(point["repeats"], lost_cores):
        rep["sched"] = None if lost is None else {"window_s": 10.0, "cpus": 2, "lost_cores": lost}
    return point


def test_the_cores_the_scheduler_lost_while_threads_waited_are_not_the_nodes():
    """As above the nodes need 0.8 s of CPU a step with the other processes' 0.3 of a core taken; a trace
    found the scheduler idle 0.2 of a core while threads waited (the median of the repeats' 0.1, 0.2 and
    0.3): a step needs 0.8 s of 1.5 cores. The model had it lost none stays the 1.7 cores' figure."""
    def host(point: dict) -> dict:
        return _with_host_cpu(_with_step_cpu(point, [0.25, 0.25, 0.2]), user_s=10.0, softirq_s=1.0)

    row = point_model(_with_sched(host(_point()), [0.1, 0.3, 0.2]), cores=2)
    assert row.lost_cores == pytest.approx(0.2)
    assert row.cpu_step_s == pytest.approx(0.8 / 1.5) and row.model_step_s == pytest.approx(0.8 / 1.5)
    assert row.work_conserving_step_s == pytest.approx(0.8 / 1.7)
    text = render([row])
    assert "lost cores" in text and "0.20" in text
    assert f"{(0.8 / 1.7 / row.measured_step_s - 1) * 100:+.1f}%" in text
    # a repeat not traced: no loss is taken off, and none is shown
    partly = point_model(_with_sched(host(_point()), [0.1, None, 0.2]), cores=2)
    assert partly.lost_cores is None and partly.work_conserving_step_s is None
    assert partly.cpu_step_s == pytest.approx(0.8 / 1.7)
    # the two phases (the workers' forward and backward 0.1 s of CPU each): both on the 1.5 cores
    phases = point_model(_with_sched(_with_compute_cpu(host(_point()), 0.1), [0.2] * 3), cores=2)
    assert phases.compute_phase_s == pytest.approx(0.2 / 1.5) and phases.model_step_s == pytest.approx(0.8 / 1.5)
    assert phases.work_conserving_step_s == pytest.approx(0.8 / 1.7)


def test_markdown_table_bolds_the_errors_within_the_target_and_counts_them():
    """One line per engine, one column per other setting; an error of -10 % is within the target and
    bold, -12 % is not; a traced row adds the error had no core been lost and the lost cores."""
    rows = [ModelRow({"link": "rate-100m", "workers": 4, "engine": "a"}, 0.90, 1.0),
            ModelRow({"link": "rate-100m", "workers": 8, "engine": "a"}, 0.88, 1.0),
            ModelRow({"link": "rate-100m", "workers": 4, "engine": "b"}, 1.05, 1.0, lost_cores=0.25,
                     work_conserving_step_s=0.8)]
    text = render_markdown(rows)
    lines = text.splitlines()
    assert lines[0] == "| engine | rate-100m 4 | rate-100m 8 | within 10 % |"
    assert lines[2] == "| a | **-10.0** | -12.0 | 1 of 2 |"
    assert lines[3] == "| b | **+5.0** / -20.0 (0.25) |  | 1 of 1 |"
    assert lines[-1] == "Within 10 % of the measured step: 2 of 3 points."


def test_per_repeat_rows_take_each_repeat_alone():
    """The point's repeats measured 0.1, 0.3 and 0.2 s: one row each, with that step and the repeat's
    index, beside the point's row whose measured step is their median."""
    rows = model_rows({"points": [_point()]}, per_repeat=True)
    assert [row.measured_step_s for row in rows] == [0.1, 0.3, 0.2]
    assert [row.params for row in rows] == [{"engine": "wiiide", "repeat": i} for i in range(3)]
    assert model_rows({"points": [_point()]})[0].measured_step_s == 0.2
    failed = _point()
    failed["repeats"][1]["status"] = "failed"
    assert [row.params["repeat"] for row in model_rows({"points": [failed]}, per_repeat=True)] == [0, 2]


def test_the_command_models_a_reports_points_and_each_passes_its_progress(tmp_path, capsys):
    """``wiiide-lab round-model REPORT``: the rows of the points the model covers (the
    unshaped one has none); `model_rows` hands every point to `progress` (the terminal's display) once."""
    report = {"points": [_point(), _point(rate_bps=None)]}
    seen: list[dict] = []
    rows = model_rows(report, progress=lambda points: seen.extend(points) or points)
    assert seen == report["points"] and len(rows) == 1
    path = tmp_path / "report.json"
    path.write_text(json.dumps(report))
    assert main([str(path)]) == 0
    assert "engine=wiiide" in capsys.readouterr().out
    assert cli_main(["round-model", str(path), "--markdown"]) == 0
    assert capsys.readouterr().out.startswith("| engine |")
    path.write_text("{}")
    assert main([str(path)]) == 2 and "not a sweep report" in capsys.readouterr().err
    assert cli_main(["round-model", str(path)]) == 2
