"""A simulation of the sharded servers' steps on one machine's cores and every node's link together.

The round model's closed forms (`harness.analysis.round_model`) bound a step by the links or by the
cores, and by the slowest worker's path; on a two-core machine the lossy engines' steps fall between
them, because the cores and the links overlap only in part. This simulates both resources at once,
through several steps, from what the nodes measured of their own CPU in eight stages (``stage_cpu_s``,
`wiiide.metrics`):

- **Links**: as `round_model.sharded_round_s`: one queue per (sender, receiver), its messages in order
  (a worker's pushes to a shard and its own shard's pulls to that shard's node go on two sockets,
  taken as one queue, which came closer to the measured steps than two); a node's egress rate shared equally by its queues with bytes to send; the
  shaper's token bucket (bytes covered by tokens leave at once; tokens refill while the egress is
  idle); a message to one's own shard goes over loopback (no shaped link, but its send and receive CPU).
- **Cores**: every node's threads share the machine's cores left to the nodes. The container engine
  puts each node in its own cpu cgroup of equal weight, and the kernel's CFS shares the cores fairly
  between busy groups first, then between a group's runnable threads (sched(7), "group scheduling"):
  each node with runnable threads gets an equal share of the cores, at most one core per runnable
  thread, what a node cannot use going to the others (water-filling).
- **Threads and their work** (the code of `wiiide.server.ps.client` and `wiiide.server.ps.shard`): a worker's
  training thread runs forward and backward (its CPU, held to at least the wall time the run measured
  for its median or, for worker 1, its slowest worker: on a shared machine the scheduler lets one worker
  fall behind, which a fair share does not reproduce); then one sender thread per shard encodes each
  push (``push_encode``) and sends it (``push_send``, while its bytes cross the link). The shard's
  reader thread of that connection reads it (``push_receive``, while the bytes arrive), decodes it
  once all of it is in (``push_decode``) and, at a partition's last push, updates it (``update``) and
  queues one pull per worker; its sender threads send them (``pull_send``); each worker's reader
  thread of that shard reads (``pull_receive``) and decodes and applies each pull (``pull_decode``).
  A message has arrived once its bytes have crossed and its send and receive CPU are done. A worker
  starts its next step once every pull is in (its batch came a step ahead).
- **What is not scheduled**: the CPU of a node's step (``step_cpu_s``) beyond its forward and backward
  and the eight stages (the handling of each message outside the timed sections, the heartbeats, the
  barrier and the batch handout: 1.3-1.5 ms of int8's 10 ms a step on a digits worker). No node times
  where it runs, so the simulation leaves it out and it counts only in the closed forms' bound on the
  cores (`harness.analysis.point_model`); each place tried for it put it on a path where the real
  nodes do not have it (studies/round-model/NOTE.md).
- **Scale**: each stage's CPU of a step is spread over its messages by their raw bytes, and every
  node's CPU is raised by the kernel's network work per step (softirq, charged to no process) in
  proportion to it.

The result is the mean step over the steps after the first few (the steady state: the first step starts
with every link's bucket full and no worker behind). A fluid simulation (rates constant between events,
as SimGrid's network and CPU models: Casanova et al. 2014). It has no latency per message, and it
keeps the cores busy whenever a thread can run, which the kernel did not on these machines: on the
digits model at 4 workers the cores sat idle 9-12 % of the time while threads waited for them (the
nodes' ``run_delay_s``), and there it is 9-12 % shorter than the measured step (studies/round-model/NOTE.md).
"""

from __future__ import annotations

from collections import Counter, deque
from dataclasses import dataclass, field
from typing import Callable, Sequence

from harness.analysis.egress import spend_tokens

SIM_STEPS = 8  # steps simulated
SIM_SKIPPED_STEPS = 3  # the first steps left out of the mean (the links' buckets start full)
STAGE_NAMES = ("push_encode", "push_send", "push_receive", "push_decode", "update", "pull_send", "pull_receive",
               "pull_decode")


@dataclass(frozen=True)
class NodeCpu:
    """One node's CPU seconds per step (s, each >= 0): its forward and backward (``compute_s``, 0 on the
    coordinator), each stage of `STAGE_NAMES` (``stages``: the median over the timed steps of its
    ``stage_cpu_s``), and the wall time its forward and backward take at least (``compute_floor_s``)."""

    compute_s: float = 0.0
    stages: dict[str, float] = field(default_factory=dict)
    compute_floor_s: float = 0.0

    def stage(self, name: str) -> float:
        return float(self.stages.get(name, 0.0))


def cgroup_fair_shares(runnable: dict[int, int], cores: float) -> dict[int, float]:
    """Cores each node gets (CFS group scheduling with equal weights, module docstring): `runnable` maps
    a node to its runnable threads (>= 1), `cores` > 0. Each node gets an equal share, at most one core
    per runnable thread; what a node cannot use is shared among the rest (water-filling). Returns the
    cores per node; their sum is min(cores, all runnable threads)."""
    shares: dict[int, float] = {}
    left = dict(runnable)
    free = float(cores)
    while left:
        fair = free / len(left)
        capped = {node: n for node, n in left.items() if n <= fair}
        if not capped:
            shares.update({node: fair for node in left})
            break
        for node, n in capped.items():
            shares[node] = float(n)
            free -= n
            del left[node]
    return shares


class _Task:
    __slots__ = ("cpu_s", "done")

    def __init__(self, cpu_s: float, done: Callable[[], None]) -> None:
        self.cpu_s = max(0.0, cpu_s)
        self.done = done


class _Transfer:
    """A message on a connection: its bytes still to cross and the parts (link, send, receive) still due."""
    __slots__ = ("key", "nbytes", "parts", "arrived")

    def __init__(self, key: tuple[int, int], nbytes: float, arrived: Callable[[], None]) -> None:
        self.key = key
        self.nbytes = nbytes
        self.parts = 3
        self.arrived = arrived

    def part_done(self) -> None:
        self.parts -= 1
        if self.parts == 0:
            self.arrived()


def simulate_sharded_steps(partitions: Sequence[tuple[int, float]], num_workers: int, rate_bps: float,
                           nodes: Sequence[NodeCpu], cores: float, worker_ratio: float = 1.0,
                           coordinator_ratio: float = 1.0, burst_bytes: float = 0.0,
                           push_window_bytes: float | None = None, steps: int = SIM_STEPS,
                           skipped_steps: int = SIM_SKIPPED_STEPS) -> float:
    """The steady step (s) of synchronous sharded servers on one machine (the module's docstring).

    Args:
        partitions: (shard, raw bytes) of each partition in vector order (`wiiide.server.ps.partition`); shard 0
            is the coordinator's, shard w worker w's.
        num_workers: W >= 1. rate_bps: each node's egress (TCP payload), bit/s > 0.
        nodes: W + 1 `NodeCpu`, the coordinator's first.
        cores: the cores the nodes share (> 0).
        worker_ratio, coordinator_ratio: raw / sent bytes of what workers and the coordinator send (> 0).
        burst_bytes: the shaper's token bucket per egress (bytes >= 0; 0: none).
        push_window_bytes: None: pushes concurrent, each encoded and sent by its connection's sender
            thread. Bytes >= 0 (``push_schedule: ordered``, as `round_model.sharded_round_s`): a worker's
            pushes, encoded in order by one thread, are sent by another one after the other, each once
            the push before it has at most that many bytes left to cross its link.
        steps, skipped_steps: steps simulated and the first ones left out of the mean (steps > skipped >= 0);
            a step ends when the last worker has its last pull.
    Raises:
        ValueError: no partition, a shard outside 0..W, W + 1 nodes not given, or a rate, ratio, core
            count or step count out of range.
    """
    if (not partitions or num_workers < 1 or len(nodes) != num_workers + 1 or rate_bps <= 0 or cores <= 0
            or worker_ratio <= 0 or coordinator_ratio <= 0 or burst_bytes < 0 or not 0 <= skipped_steps < steps
            or (push_window_bytes is not None and push_window_bytes < 0)
            or any(not 0 <= shard <= num_workers for shard, _ in partitions)):
        raise ValueError(f"{len(partitions)} partitions, {num_workers} workers, {len(nodes)} nodes, rate {rate_bps}, "
                         f"cores {cores}, ratios {worker_ratio}/{coordinator_ratio}, burst {burst_bytes}, "
                         f"steps {steps}/{skipped_steps}: out of range")
    W = num_workers
    model_bytes = float(sum(nbytes for _, nbytes in partitions))
    owned = [0.0] * (W + 1)
    for shard, nbytes in partitions:
        owned[shard] += nbytes
    byte_rate = rate_bps / 8.0
    eps_bytes = 1e-9 * byte_rate
    threads: dict[tuple, deque] = {}
    links: dict[tuple[int, int], deque] = {}
    tokens = [float(burst_bytes)] * (W + 1)
    idle_since: list[float | None] = [0.0] * (W + 1)
    timers: list[tuple[float, Callable[[], None]]] = []
    clock = [0.0]
    pushes_in: Counter = Counter()
    pulls_in: Counter = Counter()
    step_end: dict[int, float] = {}
    ready: dict[int, deque] = {w: deque() for w in range(1, W + 1)}  # ordered: encoded pushes not yet sent
    last_push: dict[int, _Transfer] = {}  # ordered: each worker's latest push sent

    def run(node: int, thread: object, cpu_s: float, done: Callable[[], None]) -> None:
        queue = threads.setdefault((node, thread), deque())
        if cpu_s <= 0 and not queue:  # nothing to wait for: at once, in the order the events came
            done()
        else:
            queue.append(_Task(cpu_s, done))

    def transfer(src: int, dst: int, nbytes: float, send_cpu_s: float, receive_cpu_s: float,
                 arrived: Callable[[], None], sender: object = None) -> _Transfer:
        """Queue a message: its bytes on the (src, dst) connection (none on loopback), its send CPU on the
        `sender` thread (default: the connection's) and its receive CPU on the receiver's reader thread
        of that connection."""
        message = _Transfer((src, dst), nbytes if src != dst else 0.0, arrived)
        run(src, sender or ("send", dst), send_cpu_s, message.part_done)
        run(dst, ("read", src), receive_cpu_s, message.part_done)
        if message.nbytes <= 0:
            message.part_done()
        else:
            links.setdefault(message.key, deque()).append(message)
        return message

    def admit_pushes() -> bool:
        """Ordered pushes: send each worker's next encoded push once its last one is down to the window."""
        sent = False
        for worker, queue in ready.items():
            while queue and (worker not in last_push or last_push[worker].nbytes <= push_window_bytes + eps_bytes):
                last_push[worker] = queue.popleft()()
                sent = True
        return sent

    def push(worker: int, step: int, index: int) -> None:
        shard, nbytes = partitions[index]
        cpu, share = nodes[worker], nbytes / model_bytes
        into = nodes[shard]
        per_push = nbytes / (W * owned[shard])

        def pushed() -> None:
            run(shard, ("read", worker), into.stage("push_decode") * per_push, lambda: decoded())

        def decoded() -> None:
            pushes_in[step, index] += 1
            if pushes_in[step, index] == W:
                run(shard, ("read", worker), into.stage("update") * nbytes / owned[shard], lambda: pulls(shard, step, index))

        def send() -> _Transfer:
            return transfer(worker, shard, nbytes / worker_ratio, cpu.stage("push_send") * share,
                            into.stage("push_receive") * per_push, pushed,
                            None if push_window_bytes is None else "push")

        if push_window_bytes is None:
            run(worker, ("send", shard), cpu.stage("push_encode") * share, send)
        else:
            run(worker, "encode", cpu.stage("push_encode") * share, lambda: ready[worker].append(send))

    def pulls(shard: int, step: int, index: int) -> None:
        nbytes = partitions[index][1]
        sender, ratio = nodes[shard], (coordinator_ratio if shard == 0 else worker_ratio)
        for worker in range(1, W + 1):
            share = nbytes / model_bytes
            transfer(shard, worker, nbytes / ratio, sender.stage("pull_send") * nbytes / (W * owned[shard]),
                     nodes[worker].stage("pull_receive") * share,
                     lambda w=worker, s=share: run(w, ("read", shard), nodes[w].stage("pull_decode") * s,
                                                   lambda: pulled(w, step)))

    def pulled(worker: int, step: int) -> None:
        pulls_in[step, worker] += 1
        if pulls_in[step, worker] == len(partitions):
            step_end[step] = max(step_end.get(step, 0.0), clock[0])
            if step + 1 < steps:
                begin(worker, step + 1)

    def begin(worker: int, step: int) -> None:
        started = clock[0]
        cpu = nodes[worker]

        def pushes() -> None:
            for index in reversed(range(len(partitions))):  # backward's order: the vector's tail first
                push(worker, step, index)

        def computed() -> None:
            if clock[0] < started + cpu.compute_floor_s:
                timers.append((started + cpu.compute_floor_s, pushes))
            else:
                pushes()

        run(worker, "train", cpu.compute_s, computed)

    def link_crossed(_receiver: int, message: _Transfer) -> None:
        message.part_done()

    for worker in range(1, W + 1):
        begin(worker, 0)
    while True:
        spend_tokens(links, tokens, idle_since, clock[0], byte_rate, burst_bytes, eps_bytes, link_crossed)
        while push_window_bytes is not None and admit_pushes():
            spend_tokens(links, tokens, idle_since, clock[0], byte_rate, burst_bytes, eps_bytes, link_crossed)
        heads = [(key, q[0]) for key, q in threads.items() if q]
        active = [key for key, q in links.items() if q]
        if not heads and not active and not timers:
            break
        shares = cgroup_fair_shares(Counter(node for (node, _), _ in heads), cores) if heads else {}
        per_thread = Counter(node for (node, _), _ in heads)
        cpu_rate = {key: shares[key[0]] / per_thread[key[0]] for key, _ in heads}
        sending = Counter(key[0] for key in active)
        link_rate = {key: byte_rate / sending[key[0]] for key in active}
        waits = [task.cpu_s / cpu_rate[key] for key, task in heads]
        waits += [links[key][0].nbytes / link_rate[key] for key in active]
        waits += [at - clock[0] for at, _ in timers]
        for worker, queue in ready.items():  # ordered: or until a worker's last push is down to the window
            last = last_push.get(worker)
            if queue and last is not None and last.nbytes > push_window_bytes and last.key in link_rate \
                    and links[last.key][0] is last:
                waits.append((last.nbytes - push_window_bytes) / link_rate[last.key])
        dt = max(0.0, min(waits))
        clock[0] += dt
        finished = []
        for key, task in heads:
            task.cpu_s -= cpu_rate[key] * dt
            if task.cpu_s <= 1e-12:
                finished.append(key)
        crossed = []
        for key in active:
            links[key][0].nbytes -= link_rate[key] * dt
            if links[key][0].nbytes <= eps_bytes:
                crossed.append(key)
        for key in finished:
            threads[key].popleft().done()
        for key in crossed:
            links[key].popleft().part_done()
        still_sending = {node for (node, _), q in links.items() if q}
        for src in sending:  # an egress whose connections all emptied starts refilling its bucket
            if idle_since[src] is None and src not in still_sending:
                idle_since[src] = clock[0]
        due = [timer for timer in timers if timer[0] <= clock[0] + 1e-12]
        for timer in due:
            timers.remove(timer)
            timer[1]()
    if len(step_end) < steps:
        raise RuntimeError(f"the simulation ended after {len(step_end)} of {steps} steps")  # a bug, not bad input
    window_start_s = step_end[skipped_steps - 1] if skipped_steps else 0.0
    return (step_end[steps - 1] - window_start_s) / (steps - skipped_steps)
