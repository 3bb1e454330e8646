"""The Docker backend: one coordinator and N worker containers as ``compose.yaml`` describes them, run
by run, with links, limits, faults and warm containers.

The cluster itself (the Compose project, its environment, secret and TLS files, `cluster_up` and
`cluster_down` through the Engine API) is `harness.run.compose_project`. Container stats come from
the Engine API through the docker SDK (a one-shot read per container every few seconds,
`harness.run.stats.StatsReader`), turned into figures with docker's own CLI formulas.
"""

from __future__ import annotations

import shutil
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Sequence

from harness import REPO_ROOT
from harness.links.plan import Capabilities
from harness.run.backend import (
    ENGINE_POLL_INTERVAL_S,
    Collected,
    PhaseClock,
    Progress,
    refuse_overlay_encrypted,
)
from harness.run.compose_file import NUMBER_LABEL, PROJECT_LABEL, SERVICE_LABEL, load_project
from harness.run.compose_project import (
    COMPOSE_FILE,
    DEFAULT_IMAGE,
    PARALLEL_CALLS,
    PROJECT,
    cluster_down,
    cluster_up,
    compose_env,
    slot_name,
    write_cluster_secret,
    write_docker_tls,
)
from harness.run.docker_client import docker_client
from harness.run.faults import ContainerController, Controller
from harness.run.shaping import START_GATE_FILE, ClusterConditions
from harness.run.stats import (
    StatsReader,
    container_lifetime,
    since_baseline,
    start_readers,
    stop_readers,
    summarize_samples,
)
from harness.run.tc_exec import ContainerExec, probe_capabilities, reset_links
from harness.run.zygote_pool import ZygotePool, pool_key, results_root
from harness.spec.cluster import ClusterSettings
from harness.spec.faults import Fault
from wiiide.config import RunConfig

ZYGOTE_ROOT = REPO_ROOT / "build" / "zygote"  # control directories of warm pools, one per project


class ComposeBackend:
    """The ``docker`` `harness.run.backend.Backend`: a coordinator and N worker containers from
    ``compose.yaml`` under the Compose project `PROJECT`, with links, limits and every fault.

    `reuse`: keep warm containers between runs (`harness.run.zygote_pool`): the first run of a
    cluster creates containers whose nodes are `wiiide.zygote`s (torch imported once), each run forks
    fresh node processes in them, and a run that ended clean leaves them for the next run of the same
    cluster; `close` removes them. False (the default for library use and ``up``): fresh containers
    per run, each running ``python -m wiiide <role>`` as compose.yaml says.
    """

    name = "docker"
    poll_interval_s = ENGINE_POLL_INTERVAL_S

    def __init__(self, image_tag: str | None = None, reuse: bool = False) -> None:
        """Raises ClusterError when no Docker engine answers."""
        self.image = image_tag or DEFAULT_IMAGE
        self.client = docker_client()
        self.reuse = reuse
        self.last_run_reused = False  # whether the last `start` found warm containers to reuse
        self._pool = ZygotePool(ZYGOTE_ROOT / PROJECT) if reuse else None
        self._started = False
        self._containers: list = []
        self._readers: dict[str, StatsReader] = {}
        self._conditions: ClusterConditions | None = None

    def prepare(self, progress: Progress) -> None:
        """(Re)build the image: minutes the first time, seconds when cached, and never a stale copy of
        `wiiide/`.

        Raises:
            ClusterError: the image cannot be built.
        """
        from harness.run.image import build_image
        build_image(self.image, log=lambda line: progress(f"    image: {line}"))

    def describe(self) -> dict[str, Any]:
        """Engine and API versions, how containers are made, the image, the project, the storage driver,
        whether warm containers are reused between runs."""
        version = self.client.version()
        return {"name": self.name, "engine_version": version.get("Version"), "api_version": version.get("ApiVersion"),
                "compose": "compose.yaml through the Engine API (harness.run.compose_file)", "image": self.image,
                "project": PROJECT, "storage_driver": self.client.info().get("Driver"),
                "reuse_containers": self.reuse}

    @classmethod
    def check_cluster(cls, cluster: ClusterSettings | None) -> None:
        """Links, CPU and memory limits: all applied here (harness.run.shaping). Raises ClusterError
        for ``overlay_encrypted`` (a bridge network: swarm only)."""
        refuse_overlay_encrypted(cls.name, cluster)

    @classmethod
    def check_faults(cls, faults: Sequence[Fault]) -> None:
        """Every fault action works on containers; never raises."""

    def _probe(self) -> Capabilities:
        return probe_capabilities(self.client, self.image, {PROJECT_LABEL: PROJECT})

    def launch(self, cfg: RunConfig, out_dir: Path, cluster: ClusterSettings, progress: Progress,
               clock: PhaseClock | None = None) -> list:
        """Bring a cluster up as a sweep run does, without watching it: remove leftovers of the
        project, plan the link shaping (probing the kernel once), start the containers, then set
        limits, shape links and open the start gate (`ClusterConditions.bring_up`). Each step is timed
        on `clock` (if given). `wiiide-lab up` uses it for a long-running cluster; `start` for a
        sweep's run without `reuse`.

        Returns:
            The project's containers (docker SDK objects), coordinator and workers.

        Raises:
            ClusterError: Compose or the engine failed, or a limit could not be set.
            LinkShapingError: a link profile cannot be applied (before any container starts, when
                the kernel lacks a qdisc; else with the tc command and its message).
        """
        clock = clock or PhaseClock()
        conditions = self._conditions = ClusterConditions(cluster, self._probe)
        with clock.phase("clean"):
            cluster_down(progress)  # a clean slate: nothing left from an earlier, killed run
        self._started = True
        tls_dir = None
        if cfg.tls:  # a fresh CA and node certificates in the run folder, each container mounting its own
            cfg, tls_dir = write_docker_tls(cfg, out_dir)

        def create(cfg: RunConfig) -> list:
            self._containers = cluster_up(cfg, out_dir, self.image, conditions.settings.compose_env(),
                                          tls_dir=tls_dir)
            return self._containers

        return conditions.bring_up(cfg, clock, create, progress)

    def start(self, cfg: RunConfig, out_dir: Path, cluster: ClusterSettings, progress: Progress,
              clock: PhaseClock) -> Controller:
        """Start the run's nodes (fresh containers with `launch`, or forked in warm ones with `reuse`)
        and stream every container's Engine API stats until `stop`.

        Raises:
            ClusterError, LinkShapingError: as `launch`.
        """
        if self._pool is not None:
            return self._start_warm(cfg, Path(out_dir).resolve(), cluster, progress, clock)
        containers = self.launch(cfg, out_dir, cluster, progress, clock)
        self._readers = start_readers(containers, clock.t0)
        return ContainerController(containers)

    def _start_warm(self, cfg: RunConfig, out_dir: Path, cluster: ClusterSettings, progress: Progress,
                    clock: PhaseClock) -> Controller:
        """`start` with warm containers: reuse the pool when it was made for this cluster and all its
        containers run, else make a new one (``clean``, then ``create`` with zygotes); per run: a fresh
        secret, stats baselines, the request that forks every node, then shaping and the gate."""
        pool = self._pool
        assert pool is not None
        root = results_root(out_dir)
        route_congestion = cfg.tcp_congestion if cfg.engine in ("ddp", "fsdp") else ""  # on the routes: kept
        key = pool_key(self.image, cfg.num_workers, cluster, root, route_congestion)
        self.last_run_reused = pool.usable(key) and self._pool_running()
        if not self.last_run_reused:
            with clock.phase("clean"):
                cluster_down(progress)  # a pool made for another cluster, or leftovers of a killed run
                pool.reset()
            self._started = True
        run_id = pool.next_run_id()
        conditions = self._conditions = ClusterConditions(cluster, self._probe, gate_file=f"{START_GATE_FILE}-{run_id}")

        def create(run_cfg: RunConfig) -> list:
            if not self.last_run_reused:
                containers = cluster_up(run_cfg, root, self.image, conditions.settings.compose_env(),
                                        zygote_dir=pool.control_dir.resolve())
                pool.adopt(key, root, containers, {c.name: _slot_of(c) for c in containers})
                self._readers = start_readers(containers, clock.t0)
            else:
                write_cluster_secret()  # a fresh secret per run: the mounted file is rewritten in place
                self._readers = start_readers(pool.containers, clock.t0)
            self._containers = pool.containers
            pool.write_request(self._node_envs(run_cfg, out_dir, root, conditions))
            return self._containers

        def unshape(containers: list) -> None:
            # qdiscs and the ifb device outlive a run in a kept container's netns: shape from scratch
            if self.last_run_reused and conditions.settings.link is not None:
                with ThreadPoolExecutor(max_workers=min(PARALLEL_CALLS, len(containers))) as calls:
                    list(calls.map(lambda c: reset_links(ContainerExec(c)), containers))

        containers = conditions.bring_up(cfg, clock, create, progress, before_shape=unshape)
        return ContainerController(containers, on_action=lambda action, target: pool.mark_dirty(f"{action} {target}"))

    def _node_envs(self, cfg: RunConfig, out_dir: Path, root: Path, conditions: ClusterConditions) -> dict[str, dict[str, str]]:
        """Each role's ``WIIIIIDE_*`` variables for this run, as compose.yaml gives them to a fresh
        container, with the metrics going to ``out_dir/nodes`` (below the pool's mount `root`)."""
        project = load_project(COMPOSE_FILE, PROJECT, {**compose_env(cfg, root, self.image),
                                                       **conditions.settings.compose_env()})
        metrics_dir = f"/results/{out_dir.relative_to(root).as_posix()}/nodes"
        envs = {}
        for role in ("coordinator", "worker"):
            env = {k: v for k, v in project.create_kwargs(role, 1)["environment"].items() if k.startswith("WIIIIIDE_")}
            env["WIIIIIDE_METRICS_DIR"] = metrics_dir
            envs[role] = env
        return envs

    def _listed_states(self) -> dict[str, str]:
        """Container name -> state of every container of the project, from one Engine API list call."""
        return {name.lstrip("/"): item.get("State") for item in self.client.api.containers(
            all=True, filters={"label": f"{PROJECT_LABEL}={PROJECT}"}) for name in item.get("Names") or ()}

    def _pool_running(self) -> bool:
        """Whether every container of the warm pool still runs, the same containers by id (another
        backend of the project, e.g. ``bench-overhead --images``, makes others of the same names)."""
        running = {item.get("Id") for item in self.client.api.containers(
            filters={"label": f"{PROJECT_LABEL}={PROJECT}", "status": "running"})}
        return bool(self._pool and self._pool.containers) and all(c.id in running for c in self._pool.containers)

    def poll(self) -> dict[str, str]:
        """Each node's state (``running``, ``exited``, ``paused``...), from one Engine API list call; in a
        warm container, ``exited`` once its node process of this run has ended (its exit file)."""
        listed = self._listed_states()
        states = {c.name: listed.get(c.name, "exited") for c in self._containers}  # a removed one has exited
        if self._pool is not None:
            for name, state in states.items():
                if state == "running" and self._pool.exit_record(self._pool.slots.get(name, "")) is not None:
                    states[name] = "exited"
        return states

    def exit_code(self, name: str) -> int | None:
        """Container `name`'s exit code once it has exited; None while it runs, or when it cannot be read."""
        for c in self._containers:
            if c.name == name:
                try:
                    c.reload()
                except Exception:  # gone or the engine busy: unknown, the next poll asks again
                    return None
                return c.attrs["State"]["ExitCode"] if c.status in ("exited", "dead") else None
        return None

    def stop(self) -> None:
        """Stop reading link counters and container stats."""
        if self._conditions is not None:
            self._conditions.stop()
        stop_readers(self._readers.values())

    def collect(self, logs_dir: Path, progress: Progress) -> Collected:
        """Exit codes (None: still running), each node's log into `logs_dir`, stats, links, limits.
        With warm containers, the node process's exit code, log and start/end times of this run; the
        pool stays for the next run only when every node exited 0 and nothing touched a container."""
        exit_codes: dict[str, int | None] = {}
        lifetimes: dict[str, dict[str, str | None]] = {}
        pool = self._pool
        for c in self._containers:
            try:
                c.reload()
                exit_codes[c.name] = c.attrs["State"]["ExitCode"] if c.status in ("exited", "dead") else None
                lifetimes[c.name] = container_lifetime(c)
                if pool is not None:
                    slot = pool.slots.get(c.name, "")
                    end, begin = pool.exit_record(slot), pool.start_record(slot)
                    if end is not None and c.status == "running":
                        exit_codes[c.name] = end.get("exit_code")
                    lifetimes[c.name] = {"started_at_utc": (begin or {}).get("started_at_utc"),
                                         "finished_at_utc": (end or {}).get("finished_at_utc")}
                    log = pool.log_bytes(slot)
                    if c.status != "running":  # killed: what the container printed besides its node's output
                        log += c.logs(stdout=True, stderr=True)
                    (logs_dir / f"{c.name}.log").write_bytes(log)
                else:
                    (logs_dir / f"{c.name}.log").write_bytes(c.logs(stdout=True, stderr=True))
            except Exception as exc:  # a container already gone: note it, keep going
                exit_codes.setdefault(c.name, None)
                progress(f"    could not read {c.name}: {exc}")
        if pool is not None and pool.dirty_reason is None:
            pool.clean = bool(self._containers) and all(exit_codes.get(c.name) == 0 for c in self._containers)
        stats = {}
        for c in self._containers:
            if c.name not in self._readers:
                continue
            samples = self._readers[c.name].samples
            if pool is not None and self.last_run_reused:
                # a kept container's counters run from its creation: this run's bytes are those since
                # its node was forked (the zygote read them then; the containers idle between runs)
                baseline = (pool.start_record(pool.slots.get(c.name, "")) or {}).get("counters")
                samples = [since_baseline(s, baseline) for s in samples]
            stats[c.name] = {"role": c.labels.get(SERVICE_LABEL, "?"), "kind": "container",
                             "exit_code": exit_codes.get(c.name), **lifetimes.get(c.name, {}),
                             **({"reused_container": self.last_run_reused} if pool is not None else {}),
                             "samples": samples, "summary": summarize_samples(samples)}
        conditions = self._conditions
        return Collected(exit_codes=exit_codes, containers=stats,
                         links=conditions.links if conditions else {}, limits=conditions.limits if conditions else {})

    def teardown(self) -> None:
        """After a run: remove the project's containers and network (`cluster_down`) if this backend
        started any; with `reuse`, keep them instead when the run ended clean (`collect`)."""
        self.stop()
        self._containers, self._readers, self._conditions = [], {}, None
        pool = self._pool
        if pool is not None and pool.clean:
            pool.end_run()
            return
        if self._started:
            cluster_down(lambda line: None)
            self._started = False
        if pool is not None:
            pool.reset()

    def close(self, progress: Progress = print) -> None:
        """After the last run (also after a failure or Ctrl-C): remove warm containers, the network
        and the control directory. Idempotent.

        Raises:
            ClusterError: something of the project is still there afterwards (`cluster_down`).
        """
        self.stop()
        self._containers, self._readers, self._conditions = [], {}, None
        if self._started:
            cluster_down(progress)
            self._started = False
        if self._pool is not None:
            self._pool.reset()
            shutil.rmtree(self._pool.control_dir, ignore_errors=True)


def _slot_of(container) -> str:
    """A container's slot (`slot_name`) from its Compose labels."""
    return slot_name(container.labels.get(SERVICE_LABEL, "?"), int(container.labels.get(NUMBER_LABEL, "1")))
