"""Applies a point's per-container settings (links, CPU and memory limits) to a running Compose cluster.

Order, for the docker backend (`harness.run.compose.ComposeBackend`):

1. `ClusterConditions.plan`, before any container starts: probe once which qdiscs the kernel has
   (`harness.run.tc_exec.probe_capabilities`) and plan every container's shaping. A profile the kernel cannot
   apply fails the point here with `LinkShapingError`, unless its link setting allows partial shaping.
2. Compose starts the cluster with the coordinator's start gate set (`START_GATE_FILE`): the workers
   connect, and the coordinator waits before its first step.
3. `ClusterConditions.apply`: per-worker CPU/memory limits through the Engine API, the tc commands in
   each container (with the fallback's iptables rules and delay line where the kernel has no netem), a
   read-back of ``tc -j -s qdisc/class show`` per interface, and, when a profile asks for a delay, a TCP
   round-trip probe from worker 1 to the coordinator (`harness.links.rtt`, ``links.rtt_probe``); then
   `open_gate` touches the gate file in the coordinator: training traffic only ever sees the shaped links.
4. While the run goes on, the qdisc counters are read every `COUNTER_INTERVAL_S` seconds; the last
   reading before each container exits is its end counters (a container's qdiscs go with its network
   namespace when it exits, so they cannot be read after the run). Where the engine runs on this host
   and the harness is root, they are read from the host in the container's network namespace
   (`harness.run.tc_exec.HostNetnsExec`, once its first reading matched the exec's read-back), not by an
   Engine API exec each time; the report's ``counter_reader`` says which (``host-netns`` or ``exec``).

Teardown is Compose's: qdiscs, the ifb device, the fallback's rules and the delay line live in the
containers' network namespaces (and process trees) and go with them.
"""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable

from harness.errors import ClusterError, LinkShapingError
from harness.links import rtt, window
from harness.links.fallback import DELAY_LINE_MECHANISM, fallback_chains
from harness.links.pairs import PairPlan, node_name, plan_pairs
from harness.links.plan import Capabilities, ShapingPlan
from harness.links.readback import rate_in_force_bps
from harness.links.schedule import plan_timed_shaping
from harness.run.backend import PhaseClock, Sampler
from harness.run.link_timeline import LinkTimeline
from harness.run.pair_shaping import (
    node_ips,
    probe_pair_rtts,
    read_pair_fallback,
    shape_pairs,
    timeline_targets,
    update_pair_counters,
)
from harness.run.tc_exec import (
    ContainerExec,
    HostNetnsExec,
    apply_plan,
    host_netns_runner,
    read_back,
    read_delay_line_stats,
    read_fallback_counters,
)
from harness.spec.cluster import ClusterSettings
from wiiide.config import RunConfig

START_GATE_FILE = "/tmp/wiiide-go"
COUNTER_INTERVAL_S = 2.0
PARALLEL_CONTAINERS = 8  # containers shaped at once (Engine API exec calls in flight)
SERVICE_LABEL = "com.docker.compose.service"
NUMBER_LABEL = "com.docker.compose.container-number"

Progress = Callable[[str], None]


def container_identity(container) -> tuple[str, int | None]:
    """(role, worker index): ``("coordinator", None)`` or ``("worker", n)``, n = Compose's container number."""
    role = container.labels.get(SERVICE_LABEL, "?")
    if role != "worker":
        return role, None
    return role, int(container.labels.get(NUMBER_LABEL, "0"))


def limits_of(container) -> dict[str, Any]:
    """CPU and memory limits in force, from the Engine API (cpus from NanoCpus or quota/period;
    ``cpu_period_s``: the CFS period of a quota, None for NanoCpus, whose period is the kernel's 100 ms)."""
    host = container.attrs.get("HostConfig", {})
    nano, quota, period = host.get("NanoCpus") or 0, host.get("CpuQuota") or 0, host.get("CpuPeriod") or 0
    cpus = nano / 1e9 if nano else (quota / period if quota > 0 and period else None)
    return {"cpus": cpus, "cpu_period_s": period / 1e6 if quota > 0 and period and not nano else None,
            "mem_limit_bytes": host.get("Memory") or None,
            "memswap_limit_bytes": host.get("MemorySwap") or None}


class ClusterConditions:
    """One run's link shaping and limits. `links` and `limits` are what the report records."""

    def __init__(self, settings: ClusterSettings, probe: Callable[[], Capabilities],
                 gate_file: str = START_GATE_FILE) -> None:
        self.settings = settings
        self.gate_file = gate_file  # the coordinator's start gate (a path inside its container)
        self._probe = probe
        self.caps: Capabilities | None = None
        self.plans: dict[tuple[str, int | None], ShapingPlan] = {}
        self.links: dict[str, Any] = {}
        self.limits: dict[str, Any] = {}
        self._shaped: dict[str, tuple[ContainerExec | HostNetnsExec, tuple[str, ...]]] = {}
        self._sampler: Sampler | None = None
        self.pair_plans: dict[tuple[str, int | None], PairPlan] = {}
        self._ips: dict[str, str] = {}
        self.timeline = LinkTimeline()  # profiles that change while training (harness.spec.timeline)
        self.buffers_bytes = (0, 0)  # the point's SO_SNDBUF / SO_RCVBUF request, for the window probe

    @property
    def gated(self) -> bool:
        """Whether the coordinator must wait for `apply` (anything to set up in the containers)."""
        return not self.settings.is_empty

    def plan(self, num_workers: int) -> None:
        """Probe the kernel (cached) and plan every container's shaping. Raises LinkShapingError."""
        link = self.settings.link
        if link is None:
            return
        self.caps = self._probe()
        self.links = {"label": link.label, "allow_partial": link.allow_partial, "capabilities": self.caps.to_dict(),
                      "containers": {}}
        for key in [("coordinator", None)] + [("worker", i) for i in range(1, num_workers + 1)]:
            self.plans[key] = plan_timed_shaping(link.profiles.for_container(*key), self.caps, link.allow_partial)
            if link.topology is not None:  # links by pair (harness.links.pairs): checked here, built in apply
                self.pair_plans[key] = plan_pairs(link.topology, node_name(*key), num_workers, self.caps,
                                                  link.allow_partial)
        if link.topology is not None:
            self.links["pairs"] = {}

    def apply(self, containers: list, t0: float, progress: Progress) -> None:
        """Limits, shaping and read-back in every container (`t0`: the run's start, time.monotonic);
        then start reading the qdisc counters every `COUNTER_INTERVAL_S` seconds. `open_gate` follows.

        Raises:
            LinkShapingError: a tc command failed (with the command and tc's message).
            ClusterError: a limit could not be set.
        """
        def one(c) -> None:
            role, index = container_identity(c)
            update = self.settings.worker_updates(index) if role == "worker" else {}
            if update:
                try:
                    c.update(**update)
                except Exception as exc:  # docker.errors.APIError: the engine refused the limit
                    raise ClusterError(f"{c.name}: cannot set {update}: {exc}") from None
            c.reload()
            self.limits[c.name] = {"role": role, "worker_index": index, **limits_of(c)}
            if self.settings.link is not None:
                self._shape(c, role, index, t0)

        if self.pair_plans:  # the pair filters match on the peers' addresses
            self._ips = node_ips(containers, container_identity)
        # every container at once (each is a few `docker exec`s): 1+8 in the time of about two, not nine
        with ThreadPoolExecutor(max_workers=max(1, min(PARALLEL_CONTAINERS, len(containers)))) as pool:
            for future in [pool.submit(one, c) for c in containers]:
                future.result()  # the first error, in container order
        order = {c.name: i for i, c in enumerate(containers)}
        self.limits = dict(sorted(self.limits.items(), key=lambda kv: order[kv[0]]))
        if "containers" in self.links:
            self.links["containers"] = dict(sorted(self.links["containers"].items(), key=lambda kv: order[kv[0]]))
        shaped = [f"{name}: {rec['summary']}" for name, rec in self.links.get("containers", {}).items()]
        for line in shaped:
            progress(f"    link {line}")
        for rec in self.links.get("containers", {}).values():
            for item in rec["unsupported"]:
                progress(f"    link NOT APPLIED ({rec['role']}): {item}")
        self._probe_rtt(containers, progress)
        if self.pair_plans:
            by_node = {node_name(*container_identity(c)): c for c in containers}
            probe_pair_rtts(by_node, self.pair_plans.values(), self._ips, self.links["pairs"], progress)
        if self._shaped:
            self._sampler = Sampler(lambda t_s: self._read_counters(t0), COUNTER_INTERVAL_S).start()

    def bring_up(self, cfg: RunConfig, clock: PhaseClock, create: Callable[[RunConfig], list], progress: Progress,
                 before_shape: Callable[[list], None] | None = None) -> list:
        """One cluster's start, as every container backend does it, each step timed on `clock`:
        ``plan`` the shaping (before anything starts), ``create`` the containers with `create(cfg)`
        (`cfg` carrying the start gate when anything is to be set up), then ``shape`` (`before_shape`
        first, then `apply`) and ``gate`` (`open_gate`). Returns what `create` returned.

        Raises:
            LinkShapingError: a profile cannot be applied (in ``plan`` before anything starts, or a tc
                command failed).
            ClusterError: from `create`, or a limit or the gate could not be set.
        """
        self.buffers_bytes = (cfg.sndbuf_bytes, cfg.rcvbuf_bytes)
        with clock.phase("plan"):
            self.plan(cfg.num_workers)  # before any container starts: a profile the kernel cannot apply fails here
        if self.gated:  # the coordinator waits until links and limits are in force
            cfg = cfg.replace(start_gate_file=self.gate_file)
        with clock.phase("create"):
            containers = create(cfg)
        if self.gated:
            with clock.phase("shape"):
                if before_shape is not None:
                    before_shape(containers)
                self.apply(containers, clock.t0, progress)
            with clock.phase("gate"):
                self.open_gate(containers, clock.t0)
        return containers

    def open_gate(self, containers: list, t0: float) -> None:
        """Create the start gate file (`gate_file`) in the coordinator container: training starts now.

        Raises:
            ClusterError: no coordinator among `containers`, or the file could not be created.
        """
        coordinator = next((c for c in containers if container_identity(c)[0] == "coordinator"), None)
        if coordinator is None:
            raise ClusterError("no coordinator container to open the start gate in")
        try:
            ContainerExec(coordinator).run(["touch", self.gate_file])
        except LinkShapingError as exc:
            raise ClusterError(f"cannot open the start gate: {exc}") from None
        gate_s = time.monotonic()
        if self.links:
            self.links["gate_opened_at_s"] = round(gate_s - t0, 3)
        self.timeline.start(gate_s)  # step times count from the gate's opening: training starts now

    def _shape(self, c, role: str, index: int | None, t0: float) -> None:
        plan = self.plans[(role, index)]
        runner = ContainerExec(c)
        applied = apply_plan(runner, plan)
        counters = _host_counter_reader(c, plan.devices, applied)
        self.links["containers"][c.name] = {
            "role": role, "worker_index": index, "hostname": c.attrs.get("Config", {}).get("Hostname"),
            **plan.to_dict(), "devices": list(plan.devices), "applied": applied,
            "applied_rate_bps": rate_in_force_bps(applied.get(plan.devices[0], [])),
            "applied_at_s": round(time.monotonic() - t0, 3), "end_counters": None, "end_counters_at_s": None,
            "counter_reads": 0, "counter_reader": "exec" if counters is None else "host-netns",
            "fallback_counters": read_fallback_counters(runner, *fallback_chains(plan.mechanisms))
            if _uses_rules(plan) else None,
            "delay_line": read_delay_line_stats(runner) if _uses_delay_line(plan) else None,
        }
        self._shaped[c.name] = (counters or runner, plan.devices)
        pair_plan = self.pair_plans.get((role, index))
        if pair_plan is not None:
            shape_pairs(runner, pair_plan, self._ips, self.links["containers"][c.name], self.links["pairs"])
        for target in timeline_targets(c.name, counters or runner, plan, pair_plan, self.links["containers"][c.name],
                                       self.links.get("pairs", {})):
            self.timeline.add(target)

    def _probe_rtt(self, containers: list, progress: Progress) -> None:
        """The measured read-back of the delay (`harness.links.rtt`): TCP round trips from worker 1 to
        the coordinator, recorded as ``links.rtt_probe`` (median and p99 beside the round trip asked),
        when either's profile asks for a delay. A probe that fails is recorded with its ``error``."""
        first = {container_identity(c): c for c in containers}
        server, client = first.get(("coordinator", None)), first.get(("worker", 1))
        profiles = [self.plans.get(key) for key in (("coordinator", None), ("worker", 1))]
        if server is None or client is None or not any(p and p.applied and p.applied.delay_ms for p in profiles):
            return
        asked = rtt.asked_rtt_ms(*(p.applied if p else None for p in profiles))
        host = server.attrs.get("Config", {}).get("Hostname") or "coordinator"
        record: dict[str, Any] = {"between": [client.name, server.name], "asked_rtt_ms": asked,
                                  "message_bytes": rtt.MESSAGE_BYTES}
        try:
            record.update(rtt.summarize(rtt.measure_rtt(server, client, host, rtt.probe_count(asked)), asked))
            progress(f"    link round trip {client.name} -> {server.name}: median {record['median_rtt_ms']:.3f} ms, "
                     f"p99 {record['p99_rtt_ms']:.3f} ms (asked {asked:g} ms)")
        except (RuntimeError, ValueError) as exc:
            record["error"] = str(exc)
            progress(f"    link round trip NOT MEASURED: {exc}")
        self.links["rtt_probe"] = record
        self._probe_window(server, client, host, progress)

    def _probe_window(self, server, client, host: str, progress: Progress) -> None:
        """What the point's socket buffers let one bulk TCP flow carry from worker 1 to the coordinator
        (`harness.links.window`), recorded as ``links.window_probe``; a probe that fails is recorded with
        its ``error``."""
        record: dict[str, Any] = {"between": [client.name, server.name]}
        try:
            record.update(window.measure_window(server, client, host, *self.buffers_bytes))
            progress(f"    link window {client.name} -> {server.name}: {record['throughput_bps'] / 1e6:.1f} Mbit/s "
                     f"with SO_SNDBUF {record['sndbuf_bytes']} / SO_RCVBUF {record['rcvbuf_bytes']} bytes")
        except RuntimeError as exc:
            record["error"] = str(exc)
            progress(f"    link window NOT MEASURED: {exc}")
        self.links["window_probe"] = record

    def _read_counters(self, t0: float) -> None:
        for name, (runner, devices) in list(self._shaped.items()):
            try:
                counters = read_back(runner, devices)
            except LinkShapingError:
                continue  # the container has exited: its last reading stands
            record = self.links["containers"][name]
            if record.get("fallback_counters") is not None:
                try:
                    record["fallback_counters"] = read_fallback_counters(
                        runner, *fallback_chains(record.get("mechanisms", {})))
                except LinkShapingError:
                    continue
            if record.get("delay_line") is not None:
                try:
                    record["delay_line"] = read_delay_line_stats(runner)
                except LinkShapingError:
                    continue
            record.update(end_counters=counters, end_counters_at_s=round(time.monotonic() - t0, 3),
                          counter_reads=record["counter_reads"] + 1)
            if "pairs" in self.links and record.get("role") is not None:
                update_pair_counters(self.links["pairs"], node_name(record["role"], record["worker_index"]), counters)
                pair_plan = self.pair_plans.get((record["role"], record["worker_index"]))
                if pair_plan is not None:
                    read_pair_fallback(runner, pair_plan, self.links["pairs"])

    def stop(self) -> None:
        """Stop the link timelines and the counter reads; the last reading stands as each container's
        end counters."""
        self.timeline.stop()
        if self._sampler is not None:
            self._sampler.stop()
            self._sampler = None


def _uses_rules(plan: ShapingPlan) -> bool:
    """Whether the plan installs the fallback's iptables rules (a key applied without netem)."""
    return any(how != "netem" for how in plan.mechanisms.values())


def _uses_delay_line(plan: ShapingPlan) -> bool:
    """Whether the plan starts the delay line (delay or jitter applied without netem)."""
    return DELAY_LINE_MECHANISM in plan.mechanisms.values()


def _engine_is_local(container) -> bool:
    """Whether `container`'s engine is reached through a local socket (the docker SDK's ``http+docker``
    base URL), so that its processes are this host's; False for ``tcp://`` and ``ssh://`` engines."""
    api = getattr(getattr(container, "client", None), "api", None)
    return str(getattr(api, "base_url", "")).startswith("http+docker://")


def _shape_of(records: dict[str, list[dict[str, Any]]]) -> dict[str, list[tuple[Any, ...]]]:
    """The qdiscs and classes of a read-back without their counters: what two readers must agree on."""
    return {dev: [(r.get("type"), r.get("kind"), r.get("handle"), r.get("parent")) for r in recs]
            for dev, recs in records.items()}


def _host_counter_reader(container, devices: tuple[str, ...],
                         applied: dict[str, list[dict[str, Any]]]) -> HostNetnsExec | None:
    """A `HostNetnsExec` for the counter reads of `container` when one can be made and its first
    read-back shows the very qdiscs and classes the exec read back (`applied`); None: read by exec."""
    runner = host_netns_runner(container, _engine_is_local(container))
    if runner is None:
        return None
    try:
        seen = read_back(runner, devices)
    except LinkShapingError:
        return None
    return runner if _shape_of(seen) == _shape_of(applied) else None
