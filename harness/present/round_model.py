"""The synchronous-round model of a step, set against the steps a sweep measured.

``python -m harness.present.round_model REPORT.json``: one row per point on a rate-limited link, the
model's step time, the measured one (the median over the repeats of each repeat's median timed step,
`_timed_step_s`) and the model's error; ``--markdown``: the errors as the README's tables (one line per
engine, bold within `TARGET_ERROR`, the count within it); ``--per-repeat``: a row per repeat, from that
repeat alone. The README derives the model ("Link conditions and heterogeneous nodes" for the
central server, "Sharded parameter servers" for ``ps_shards``); here it is for the sharded servers and
DDP, with M the model's bytes, N workers and R the link's TCP payload rate (the htb rate x
`TCP_PAYLOAD_SHARE`):

- sharded (``ps_shards`` > 1), bytes only (`sharded_link_s`, the table's last columns): shard j owns s_j
  bytes (the coordinator's ``ps.shard_loads_bytes``). A worker holding shard j sends (M - s_j) of pushes
  and (N - 1) s_j of pulls; a worker without a shard sends M; the coordinator sends N s_0 of pulls. The
  step is the busiest node's bytes over R, plus the compute of a step: what no schedule beats.
- sharded, the model (`sharded_round_s`): the same bytes, partition by partition (the run's layout,
  rebuilt from its shard loads, `_report_partitions`), through a fluid simulation of every node's link:
  one connection per peer sending its messages in order, a node's rate shared equally by its busy
  connections (``push_schedule: concurrent``), a pull sent once every push of its partition is in. An
  ``ordered`` run's pushes join the link one after the other, each once the one before it has at most
  a congestion window of bytes left to cross it (the median window its workers measured as their pushes
  started, ``ps.push_cwnd``; reports from before session 9 have none and are simulated as concurrent).
  What it adds to the bytes: a
  shard's pulls wait for their pushes; the coordinator, which pushes nothing, is idle until its first
  partition is in, after a fair share of every worker's link (`wiiide.ps.partition.pipeline_shard_weights`
  sizes its range for that).
  Each node's egress is a token bucket as the shaper's (the ``burst`` the harness read back,
  `_link_burst_bytes`; session 22): the first bytes of a round, and of each send after an idle spell,
  leave at once. The harness's burst is 4 ms of the rate, which is 10-40 % of the digits model's rounds:
  without it the model overshot int8 on digits at 100 Mbit/s and 4 workers by 11-13 %.
  Each node's bytes are divided by its compression ratio: for a fixed lossy codec, the ratio of what
  the nodes sent with it (``codec_bytes_sent``, `_measured_codec_ratio`: int3z's entropy coder does
  better on real gradients than on the Gaussian values of `_lossy_codec_ratio`, the fallback for reports
  before session 18); otherwise the nodes' measured ``compression_ratio``.
- ddp: ring all-reduce, 2 (W - 1) / W x M / R (gloo; Patarasuk and Yuan 2009), compute overlapped
  with it (buckets) and not added.

Compute of a step: the coordinator's median over its timed steps of each step's median worker's forward
and backward (``compute_median_s``, wall time, so CPU contention on a shared machine is in it; session
22); reports before it: the median over the workers of ``compute_time_s / steps``, which also counts the
warm-up steps (on digits the first step's forward and backward can raise that mean 4x).

The machine's cores, a second resource beside the links: every node of a single-host run
(docker or local backend) shares the harness machine's ``cpu_count_logical`` cores, so a step takes at
least the CPU seconds all nodes spend on it over the cores. Each node's CPU of a step is the median over
its timed steps of its process CPU seconds (``step_cpu_s``, `wiiide.metrics`: user + system of every
thread, which unlike wall time does not grow while a process waits for a core), summed over the nodes,
the median over the repeats. Compressed engines on a two-core machine are CPU-bound (codecs, the shards'
updates and a Python loop per frame in every process), which the links' simulation alone cannot see.

Sharded runs, two phases (session 20). A step of the sharded servers has two phases that do not
overlap much: every worker's forward and backward (the links idle but for the first pushes: a worker
starts its next forward only once all its pulls are in, its batch having come a step ahead,
`wiiide.ps.session.HANDOUT_AHEAD`), then the round of pushes, updates and pulls, which waits for the
last worker's pushes. Each phase takes at least its own CPU over the cores, so the model's step is

    max(compute, C / cores) + max(the links' round, (CPU of a step - C) / cores)

where C is the workers' CPU of a step's forward and backward summed (``compute_cpu_s / steps``, the
training thread's CPU, `_workers_compute_cpu_s`): a bulk-synchronous superstep per phase (Valiant 1990),
each phase bound by the slower of its two resources. The compute phase's bound rises above the
workers' wall time of compute where the workers' forward and backward alone fill the cores, and the
round's where the codecs do (lloyd2 and int3z on the 26 MB model: +4 .. +9 points over the roofline at
7 of their 8 shaped points, session 21).

The cores the nodes get (session 21). The machine's cores are not the nodes' alone: the kernel's network
work in softirq is charged to no process (``/proc/stat`` accounts it apart), and the container engine
(dockerd, containerd and its shims, which stream every container's stats), the harness and anything
else on the machine take their share. The coordinator records the machine's CPU by kind over its timed
steps (``host_cpu_s``, `wiiide.metrics`), and per repeat `_host_cpu_shares` splits it into work a step
needs beyond the nodes' processes (softirq + irq per step: the kernel's work on the step's packets,
which grows with the bytes) and cores taken at a rate that does not depend on the step (the other
processes' user + system seconds, i.e. the machine's less the nodes' own over the same steps, and the
hypervisor's steal, each over the window's wall time). Both bounds on the cores then divide
the nodes' CPU plus the kernel's by the cores left to them.
The cores the scheduler loses (session 24; runs of ``sweep --sched-trace``). Linux does not keep
every core busy while threads wait to run (Lozi et al., EuroSys 2016): with five to nine containers
of 27-44 threads each (a reader and a sender per peer) on two cores, a thread woken onto a busy
core's run queue waits there while the other core idles. `harness.run.sched_trace` measures that time from the kernel's sched events over the
coordinator's timed steps (each repeat's ``sched.lost_cores``: core-seconds idle while a thread
waited on another core's run queue, per second), and the cores' bounds take it off the cores left to
the nodes, as they do the other processes' share. It is measured in each run, not fitted; the
``error, none lost`` column gives the model as if the scheduler had lost nothing. Other idle time of
the cores (waiting between nodes, with no thread runnable) is not in the model: a step with such
gaps is longer than the model says.
The slowest worker (session 22). A synchronous step waits for every worker's pushes, so it is at least
the slowest worker's forward and backward and then the links' round:

    model = max(the two phases above, compute_max + the links' round)

where compute_max is the coordinator's median over its timed steps of each step's slowest worker's
compute wall time (``compute_max_s``, `wiiide.metrics`; the ``w`` of a bulk-synchronous superstep is
the maximum over the processors, Valiant 1990). On this machine the nodes share two cores, and a
worker that gets them last computes while the others already encode their pushes and serve them
(a step timeline of the nodes, in the README): the slowest worker's compute ran 1.2-2.7x the median
worker's on the lossy engines. The two phases stay the larger where the cores bind. What neither
term has: after the slowest worker's backward, its link and the cores both still work, and they
overlap only in part (the simulated schedule, below).
Cores and links simulated together (session 23; part of the model since session 26). Where every node
recorded its CPU in the eight stages of ``stage_cpu_s`` (`wiiide.metrics`: the sends and socket reads
apart from the codecs' work), `harness.present.round_sim` schedules that work: the links as
`sharded_round_s` has them together with the nodes' threads on the cores left to the nodes, each
message's encode before it, its send and receive CPU while its bytes cross and its decode after,
through several steps, the slowest worker held to its measured compute (`_simulated_step_s`). That
is what the closed forms leave out: after the slowest worker's backward, its encoding gets its share
of the cores while the other nodes decode, update and encode, and its link waits for it (lloyd2 on
the 26 MB model at 100 Mbit/s and 4 workers in session 25's second and third runs: the closed forms
286 and 272 ms, the schedule 308 and 301 ms, measured 323 and 310 ms). A step takes at least each
bound and at least the schedule of the work whose place is known, so

    model = max(the two phases, compute_max + the links' round, the simulated schedule)

The CPU outside the eight stages is not scheduled: no node times where it runs, and each place tried
for it put the int8 or fp32 digits points 9-20 % over their measured steps (`harness.present.round_sim`);
it counts in the cores' bound only. On session 25's three runs (40, 40 and 16 points) this model came
within 10 % at 39, 40 and 16, against 39, 39 and 15 for the closed forms alone, and then at all 40
of session 26's new run (README, session 26).
Session 23 had the simulation as a column beside the model, with that CPU spread over the messages:
within 10 % at every sharded fp32 point and at 24, 29 and 29 of the 32 lossy ones on its three runs.
Reports without ``compute_cpu_s`` (before session 20) get the roofline: the larger of compute + the
links' round and the cores' step (Williams, Waterman and Patterson 2009). Reports from before session 13
have no ``step_cpu_s`` and multi-host (swarm) runs have no one machine: for them the links' bound
stands alone.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from collections import Counter, deque
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterable, Sequence

from rich.console import Console
from rich.progress import track

from harness.links.readback import burst_in_force_bytes
from harness.present.egress import spend_tokens
from harness.present.round_sim import STAGE_NAMES, NodeCpu, simulate_sharded_steps
from wiiide.codecs import codec_from_name
from wiiide.codecs.policy import fixed_lossy_ratio, parse_policy_name
from wiiide.ps.partition import (
    FLOAT32_BYTES,
    PER_SHARD_FINEST_BYTES,
    partition_by_weights,
    plan_partitions,
    shard_loads_bytes,
)

MIN_NODE_CORE_SHARE = 0.25  # the cores left to the nodes are taken as at least this share of the machine's
TCP_PAYLOAD_SHARE = 0.956  # TCP payload per bit of an htb rate with 1500-byte frames (README, "Link conditions")
TARGET_ERROR = 0.10  # issue 11: the model within 10 % of the measured step on the shaped links


@dataclass
class _Message:
    """A push or pull queued on a connection in `sharded_round_s`: its bytes still to cross the link."""

    nbytes: float
    kind: str
    index: int


@dataclass(frozen=True)
class ModelRow:
    """One point: its parameters, the model's step (s), the measured step (s) and the error (model / measured - 1)."""

    params: dict[str, Any]
    model_step_s: float
    measured_step_s: float
    bytes_model_step_s: float | None = None  # sharded: compute + the busiest node's bytes (`sharded_link_s`)
    link_model_step_s: float | None = None  # compute + the links' round (the model without the cores' bound)
    cpu_step_s: float | None = None  # the cores' bound (module docstring); None: not measured or not one machine
    compute_phase_s: float | None = None  # sharded, two phases: the compute phase's bound; None: the roofline
    slowest_path_s: float | None = None  # sharded: the slowest worker's compute, then the links' round; None: not recorded
    simulated_step_s: float | None = None  # sharded: the timed stages' work scheduled on the cores and links
    # (`_simulated_step_s`); None: not recorded (reports before session 23) or no one machine's cores
    lost_cores: float | None = None  # the cores the scheduler lost (`HostShares.lost_cores`); None: not traced
    work_conserving_step_s: float | None = None  # the model had the scheduler lost no core; None: not traced

    @property
    def error(self) -> float:
        """Relative error of the model against the measurement (negative: the model is faster)."""
        return self.model_step_s / self.measured_step_s - 1.0

    @property
    def work_conserving_error(self) -> float | None:
        """`error` of the model had the scheduler lost no core; None when the run was not traced."""
        if self.lost_cores is None or self.work_conserving_step_s is None:
            return None
        return self.work_conserving_step_s / self.measured_step_s - 1.0


def sharded_link_s(shard_loads_bytes: Sequence[float], num_workers: int, rate_bps: float,
                   worker_ratio: float = 1.0, coordinator_ratio: float = 1.0) -> float:
    """Seconds the busiest node's link needs for its bytes of a step with sharded servers, dependencies
    left out (see the module's docstring): a lower bound of `sharded_round_s`.

    Args:
        shard_loads_bytes: bytes owned by each shard; shard 0 the coordinator's, shard j worker j's.
        num_workers: N >= 1 (workers beyond the shards hold none).
        rate_bps: the link's TCP payload rate, bit/s (> 0).
        worker_ratio, coordinator_ratio: raw / sent bytes of what each sends (>= 1 when compressed).
    Raises:
        ValueError: no shard, no worker, or a rate or ratio <= 0.
    """
    if not shard_loads_bytes or num_workers < 1 or rate_bps <= 0 or worker_ratio <= 0 or coordinator_ratio <= 0:
        raise ValueError(f"shards {list(shard_loads_bytes)}, workers {num_workers}, rate {rate_bps}, "
                         f"ratios {worker_ratio}/{coordinator_ratio}: need a shard, a worker and positive values")
    model_bytes = float(sum(shard_loads_bytes))
    byte_s = 8.0 / rate_bps
    worker_loads = list(shard_loads_bytes[1:]) + [0.0] * max(0, num_workers - (len(shard_loads_bytes) - 1))
    worker_s = max((model_bytes - s + (num_workers - 1) * s) / worker_ratio * byte_s for s in worker_loads)
    coordinator_s = num_workers * shard_loads_bytes[0] / coordinator_ratio * byte_s
    return max(worker_s, coordinator_s)


def sharded_round_s(partitions: Sequence[tuple[int, float]], num_workers: int, rate_bps: float,
                    worker_ratio: float = 1.0, coordinator_ratio: float = 1.0,
                    push_window_bytes: float | None = None, burst_bytes: float = 0.0,
                    start_tokens_bytes: float | None = None) -> float:
    """Seconds from the first push to the last pull of one synchronous step with sharded servers, by a
    fluid simulation of every node's link rather than the busiest node's bytes (`sharded_link_s`).

    What it simulates (the code of `wiiide.ps.client` and `wiiide.ps.shard`): node 0 is the coordinator,
    node w worker w; shard j lives on node j. Each worker pushes every partition, tail of the vector first
    (backward's order), each on its own connection to the partition's shard; a connection sends its
    messages one after the other (one TCP stream, one sender thread), and a node's egress rate is shared
    equally by its connections that have something to send (TCP's fair share of one bottleneck; ingress
    is not shaped). A shard answers a partition once all `num_workers` pushes of it are in, with one
    pull to every worker. A push or pull to one's own shard is free (loopback). The step ends when the
    last worker has every pull. What this adds to the byte count: a shard's pulls wait for the slowest
    push of their partition, and a node whose egress is shared by fewer connections is idle in between.

    With `push_window_bytes` (``push_schedule: ordered``) a worker's pushes instead join its connections'
    queues one after the other, in the same order, each once the push before it has at most that many
    bytes left to cross the link: the client sends a push once the one before has left its socket
    (TCP_NOTSENT_LOWAT), and what has left the socket may still be in flight, up to that connection's
    congestion window. 0 is one push on the link at a time; a window of a push's size or more is the
    concurrent schedule.

    With `burst_bytes`, each node's egress is a token bucket as the shaper's (htb's ``burst`` and
    ``cburst`` with ``ceil`` = ``rate``; tbf's ``burst``): bytes covered by its tokens leave at the wire's
    speed, which on a veth pair is taken as instant against the shaped rate, and the tokens refill at
    the rate while the node's egress is idle, up to `burst_bytes` (Linux ``sch_htb.c``: a class with
    tokens is in ``HTB_CAN_SEND``; tc-htb(8), "burst"). Each node starts the round with
    `start_tokens_bytes` (default: a full bucket), what its link gathered while the workers computed.
    The harness's burst is one timer tick of the rate (`harness.links.tc.burst_bytes`, rate / 250 Hz):
    it takes 4 ms to refill, and saves 4 ms of the rate's time at each round that starts with it full,
    which on the digits model's rounds of 10-40 ms is 10-40 % of the links' time.

    Args:
        partitions: (shard, bytes) of each partition in vector order (`wiiide.ps.partition.plan_partitions`).
        num_workers: W >= 1; rate_bps: each node's egress (TCP payload), bit/s > 0.
        worker_ratio, coordinator_ratio: raw / sent bytes of what workers and the coordinator send.
        push_window_bytes: None: pushes concurrent; bytes >= 0: ordered pushes with that window.
        burst_bytes: the shaper's token bucket per node (bytes >= 0; 0: none).
        start_tokens_bytes: tokens at the round's start, 0 .. `burst_bytes`; None: `burst_bytes`.
    Raises:
        ValueError: no partition or worker, a shard outside 0..W, a rate or ratio <= 0, a negative window
            or burst, or starting tokens outside 0 .. `burst_bytes`.
    """
    if (not partitions or num_workers < 1 or rate_bps <= 0 or worker_ratio <= 0 or coordinator_ratio <= 0
            or any(not 0 <= shard <= num_workers for shard, _ in partitions)
            or (push_window_bytes is not None and push_window_bytes < 0) or burst_bytes < 0
            or (start_tokens_bytes is not None and not 0 <= start_tokens_bytes <= burst_bytes)):
        raise ValueError(f"{len(partitions)} partitions (shards 0..{num_workers}), workers {num_workers}, "
                         f"rate {rate_bps}, ratios {worker_ratio}/{coordinator_ratio}, window {push_window_bytes}, "
                         f"burst {burst_bytes}, starting tokens {start_tokens_bytes}")
    byte_rate = rate_bps / 8.0
    queues: dict[tuple[int, int], deque] = {}
    pushes_in = [0] * len(partitions)
    pulled = [0] * (num_workers + 1)
    finish_s = [0.0] * (num_workers + 1)
    waiting: dict[int, deque] = {w: deque() for w in range(1, num_workers + 1)}  # ordered pushes not yet sent
    last_push: dict[int, _Message] = {}  # ordered: each worker's latest push still to cross its link
    eps = 1e-9 * byte_rate
    tokens = [burst_bytes if start_tokens_bytes is None else start_tokens_bytes] * (num_workers + 1)
    idle_since: list[float | None] = [0.0] * (num_workers + 1)  # when each egress last fell idle; None: busy

    def send(src: int, dst: int, kind: str, index: int, nbytes: float, now: float) -> None:
        if src == dst:
            if kind == "push":  # to one's own shard: on loopback, nothing left to cross the link
                last_push.pop(src, None)
            arrive(dst, kind, index, now)
        else:
            item = _Message(nbytes, kind, index)
            queues.setdefault((src, dst), deque()).append(item)
            if kind == "push":
                last_push[src] = item

    def admit(worker: int, now: float) -> None:
        while waiting[worker] and (worker not in last_push or last_push[worker].nbytes <= push_window_bytes + eps):
            send(worker, *waiting[worker].popleft(), now)

    def arrive(node: int, kind: str, index: int, now: float) -> None:
        if kind == "push":
            pushes_in[index] += 1
            if pushes_in[index] == num_workers:
                shard, nbytes = partitions[index]
                for worker in range(1, num_workers + 1):
                    send(shard, worker, "pull", index, nbytes / (coordinator_ratio if shard == 0 else worker_ratio), now)
        else:
            pulled[node] += 1
            if pulled[node] == len(partitions):
                finish_s[node] = now

    for worker in range(1, num_workers + 1):
        for index in reversed(range(len(partitions))):
            shard, nbytes = partitions[index]
            if push_window_bytes is None:
                send(worker, shard, "push", index, nbytes / worker_ratio, 0.0)
            else:
                waiting[worker].append((shard, "push", index, nbytes / worker_ratio))
        if push_window_bytes is not None:
            admit(worker, 0.0)
    now = 0.0
    while True:
        while burst_bytes:  # what the buckets cover crosses at once, and lets ordered pushes join
            spend_tokens(queues, tokens, idle_since, now, byte_rate, burst_bytes, eps,
                         lambda dst, message: arrive(dst, message.kind, message.index, now))
            held = sum(map(len, waiting.values()))
            if push_window_bytes is not None:
                for worker in waiting:
                    admit(worker, now)
            if sum(map(len, waiting.values())) == held:
                break
        active = [key for key, q in queues.items() if q]
        if not active:
            break
        sharing = Counter(src for src, _ in active)
        rates = {key: byte_rate / sharing[key[0]] for key in active}
        dt = min(queues[key][0].nbytes / rates[key] for key in active)
        if push_window_bytes is not None:  # or until a worker's latest push is down to the window
            for key in active:
                head = queues[key][0]
                if waiting.get(key[0]) and head is last_push.get(key[0]) and head.nbytes > push_window_bytes:
                    dt = min(dt, (head.nbytes - push_window_bytes) / rates[key])
        now += dt
        done = []
        for key in active:
            head = queues[key][0]
            head.nbytes -= rates[key] * dt
            if head.nbytes <= eps:
                done.append(key)
        for key in done:
            message = queues[key].popleft()
            arrive(key[1], message.kind, message.index, now)
        if push_window_bytes is not None:
            for worker in waiting:
                admit(worker, now)
        for node in sharing:  # an egress whose queues all emptied starts refilling its bucket
            if idle_since[node] is None and not any(q for (src, _), q in queues.items() if src == node):
                idle_since[node] = now
    return max(finish_s[1:])


def _timed_step_s(repeat: dict[str, Any]) -> float | None:
    """A repeat's measured step (s): the coordinator's median over its timed steps (its Training Summary's
    ``median_step_time_s``, warm-up steps left out, as ``step_cpu_s`` leaves them out); reports without it
    give the median over every step (``totals.step_time_median_s``). The warm-up steps of a lossy
    engine are dense (``lossy_warmup_steps``) and several times slower on a shaped link: in the median
    of all steps they raised the measured step above the compressed step the model is of (10 of 60
    steps on digits, 2 of 12 on the 26 MB model)."""
    summary = ((repeat.get("nodes") or {}).get("coordinator") or {}).get("training_summary") or {}
    timed = summary.get("median_step_time_s")
    if isinstance(timed, (int, float)) and timed > 0:
        return float(timed)
    return (repeat.get("totals") or {}).get("step_time_median_s")


def _step_cpu_s(repeats: Sequence[dict[str, Any]]) -> float | None:
    """The nodes' CPU seconds of a step: per repeat the sum over its nodes of each node's median
    ``step_cpu_s``, then the median over the repeats; None when a node of a repeat has no figure."""
    sums = []
    for rep in repeats:
        nodes = list((rep.get("nodes") or {}).values())
        medians = [((node.get("step_cpu_s") or {}).get("median")) for node in nodes]
        if nodes and all(isinstance(m, (int, float)) for m in medians):
            sums.append(float(sum(medians)))
    return _median(sums)


def _coordinator_median_s(repeats: Sequence[dict[str, Any]], field: str = "compute_max_s") -> float | None:
    """The compute of a step as the slowest worker had it (s): per repeat the coordinator's median over
    its timed steps of each step's slowest worker's forward and backward (``compute_max_s``,
    `wiiide.metrics`; with `field` ``compute_median_s``, its median worker's), then the median over the
    repeats; None when a repeat has none (reports before session 22, and the central server)."""
    medians = [(((rep.get("nodes") or {}).get("coordinator") or {}).get(field) or {}).get("median")
               for rep in repeats]
    if not medians or any(not isinstance(m, (int, float)) for m in medians):
        return None
    return _median([float(m) for m in medians])


def _workers_compute_cpu_s(repeats: Sequence[dict[str, Any]]) -> float | None:
    """The workers' CPU seconds of a step's forward and backward: per repeat the sum over its workers of
    ``compute_cpu_s / steps`` (`wiiide.metrics`), then the median over the repeats; None when a worker of
    a repeat has no figure (reports before session 20)."""
    sums = []
    for rep in repeats:
        workers = [n for name, n in (rep.get("nodes") or {}).items() if name.startswith("worker")]
        if not workers or any(not isinstance(n.get("compute_cpu_s"), (int, float)) or not n.get("steps")
                              for n in workers):
            return None
        sums.append(sum(n["compute_cpu_s"] / n["steps"] for n in workers))
    return _median(sums)


@dataclass(frozen=True)
class HostShares:
    """What a step needs of the machine beyond the nodes' processes (`_host_cpu_shares`)."""

    kernel_step_cpu_s: float  # softirq + irq CPU seconds per timed step (the kernel's network work)
    other_cores: float  # cores taken by other processes (engine, harness, ...) over the timed steps
    steal_cores: float  # cores the hypervisor took (steal) over the timed steps
    lost_cores: float | None = None  # cores the scheduler left idle while threads waited (the repeats'
    # ``sched``, `harness.run.sched_trace`); None: not traced


def _host_cpu_shares(repeats: Sequence[dict[str, Any]]) -> HostShares | None:
    """Per repeat, from the coordinator's ``host_cpu_s`` (the machine's CPU seconds by kind over its timed
    steps, `wiiide.metrics`) and every node's timed ``step_cpu_s`` (mean x count: its CPU over the same
    steps): the kernel's softirq + irq seconds per step, the cores the other processes took ((user + nice
    + system - the nodes' CPU) / window, at least 0), the steal's cores and, when every repeat was traced
    (``sched``, `harness.run.sched_trace`), the cores the scheduler left idle while threads waited; each
    the median over the repeats. None when a repeat has no window or a node no ``step_cpu_s`` (reports
    before session 21)."""
    kernel, other, steal, lost = [], [], [], []
    for rep in repeats:
        sched = rep.get("sched") or {}
        if isinstance(sched.get("lost_cores"), (int, float)):
            lost.append(float(sched["lost_cores"]))
        nodes = rep.get("nodes") or {}
        window = (nodes.get("coordinator") or {}).get("host_cpu_s")
        if not window or not window.get("steps") or not window.get("window_s"):
            return None
        node_cpu = [((n.get("step_cpu_s") or {}).get("mean"), (n.get("step_cpu_s") or {}).get("count"))
                    for n in nodes.values()]
        if any(not isinstance(mean, (int, float)) or not count for mean, count in node_cpu):
            return None
        nodes_cpu_s = sum(mean * count for mean, count in node_cpu)
        busy_s = sum(float(window.get(kind) or 0.0) for kind in ("user", "nice", "system"))
        kernel.append((float(window.get("softirq") or 0.0) + float(window.get("irq") or 0.0)) / window["steps"])
        other.append(max(0.0, busy_s - nodes_cpu_s) / window["window_s"])
        steal.append(float(window.get("steal") or 0.0) / window["window_s"])
    if not kernel:
        return None
    return HostShares(_median(kernel), _median(other), _median(steal),
                      _median(lost) if len(lost) == len(repeats) else None)


def _median(values: list[float]) -> float | None:
    return statistics.median(values) if values else None


def point_model(point: dict[str, Any], cores: int | None = None) -> ModelRow | None:
    """The model row of one point of a report (a report.json's ``points`` item), or None when it has no
    rate-limited link, no measured step or an engine the model does not cover. `cores`: the cores all
    nodes shared (one machine), for the cores' bound and the simulated schedule (`_simulated_step_s`,
    up to a second a repeat); None leaves both out."""
    profiles = ((point.get("cluster") or {}).get("link") or {}).get("profiles") or {}
    rates = [p.get("rate_bps") for p in profiles.values() if isinstance(p, dict)]
    if not rates or any(not r for r in rates):
        return None
    rate = min(rates) * TCP_PAYLOAD_SHARE
    ok = [r for r in point.get("repeats") or [] if r.get("status") == "ok" and r.get("nodes")]
    measured = _median([s for s in map(_timed_step_s, ok) if s])
    config = point.get("config") or {}
    workers = int(config.get("num_workers") or 0)
    if not measured or not ok or workers < 1:
        return None
    steps = [node["compute_time_s"] / node["steps"] for rep in ok for name, node in rep["nodes"].items()
             if name.startswith("worker") and node.get("steps") and node.get("compute_time_s")]
    compute_s = _coordinator_median_s(ok, "compute_median_s") or _median(steps) or 0.0
    first = ok[0]
    coord = first["nodes"].get("coordinator", {})
    engine = config.get("engine", "wiiide")
    nodes_cpu_s = _step_cpu_s(ok) if cores else None
    host = _host_cpu_shares(ok) if nodes_cpu_s is not None else None
    node_cores = conserving_cores = cores
    lost_cores = host.lost_cores if host is not None else None
    if host is not None:  # the kernel's work on top of the nodes', on the cores the rest leaves them
        nodes_cpu_s += host.kernel_step_cpu_s
        conserving_cores = max(cores - host.other_cores - host.steal_cores, MIN_NODE_CORE_SHARE * cores)
        node_cores = max(conserving_cores - (lost_cores or 0.0), MIN_NODE_CORE_SHARE * cores)
    cpu_s = nodes_cpu_s / node_cores if nodes_cpu_s is not None else None  # the cores' bound
    params = dict(point.get("params") or {})
    if engine == "ddp":
        grad_bytes = next((n.get("gradient_bytes") for n in first["nodes"].values() if n.get("gradient_bytes")), None)
        if not grad_bytes or config.get("ddp_comm_hook", "none") != "none":
            return None
        ring_s = 2 * (workers - 1) / workers * grad_bytes * 8 / rate
        conserving_s = max(ring_s, nodes_cpu_s / conserving_cores) if lost_cores is not None else None
        return ModelRow(params, max(ring_s, cpu_s or 0.0), measured, link_model_step_s=ring_s, cpu_step_s=cpu_s,
                        lost_cores=lost_cores, work_conserving_step_s=conserving_s)
    ps = coord.get("ps") or {}
    loads = ps.get("shard_loads_bytes")
    if engine != "wiiide" or not loads or config.get("staleness_bound", 0) not in (0, "0"):
        return None
    partitions = _report_partitions(loads, workers, ps.get("partition_bytes") or config.get("partition_bytes"),
                                    ps.get("partition_balance") or "bytes", int(ps.get("partitions_per_shard") or 1),
                                    ps.get("partition_placement") or "contiguous",
                                    ps.get("partition_finest_bytes") or PER_SHARD_FINEST_BYTES)
    if partitions is None:
        return None
    lossy_ratio = _lossy_codec_ratio(config, [nbytes for _, nbytes in partitions])
    if lossy_ratio is not None:
        lossy_ratio = _measured_codec_ratio(ok, config) or lossy_ratio
        worker_ratio = coordinator_ratio = lossy_ratio
    else:
        worker_ratios = [float(n.get("compression_ratio") or 1.0) for k, n in first["nodes"].items()
                         if k.startswith("worker")]
        worker_ratio, coordinator_ratio = _median(worker_ratios) or 1.0, float(coord.get("compression_ratio") or 1.0)
    link_s = sharded_link_s(loads, workers, rate, worker_ratio, coordinator_ratio)
    burst, push_window = _link_burst_bytes(ok), _push_window_bytes(ok, config)
    round_s = sharded_round_s(partitions, workers, rate, worker_ratio, coordinator_ratio,
                              push_window, burst, min(burst, rate / 8 * compute_s))
    compute_cpu_s = _workers_compute_cpu_s(ok) if nodes_cpu_s is not None else None
    if compute_cpu_s is None:  # the roofline
        conserving_s = (max(compute_s + round_s, nodes_cpu_s / conserving_cores)
                        if lost_cores is not None and nodes_cpu_s is not None else None)
        return ModelRow(params, max(compute_s + round_s, cpu_s or 0.0), measured, compute_s + link_s,
                        compute_s + round_s, cpu_s, lost_cores=lost_cores, work_conserving_step_s=conserving_s)

    def two_phases_s(usable_cores: float) -> tuple[float, float]:
        compute_phase_s = max(compute_s, compute_cpu_s / usable_cores)
        return compute_phase_s, compute_phase_s + max(round_s, max(0.0, nodes_cpu_s - compute_cpu_s) / usable_cores)

    def schedule_s(usable_cores: float) -> float | None:
        return _simulated_step_s(ok, partitions, workers, rate, worker_ratio, coordinator_ratio, burst,
                                 push_window, usable_cores,
                                 host.kernel_step_cpu_s if host is not None else 0.0)

    compute_phase_s, phases_s = two_phases_s(node_cores)
    slowest_s = _coordinator_median_s(ok)
    slowest_path_s = slowest_s + round_s if slowest_s is not None else None
    scheduled_s = schedule_s(node_cores)
    conserving_s = None
    if lost_cores is not None:
        conserving_s = max(two_phases_s(conserving_cores)[1], slowest_path_s or 0.0,
                           (schedule_s(conserving_cores) or 0.0) if scheduled_s is not None else 0.0)
    return ModelRow(params, max(phases_s, slowest_path_s or 0.0, scheduled_s or 0.0), measured,
                    compute_s + link_s, compute_s + round_s, cpu_s, compute_phase_s, slowest_path_s, scheduled_s,
                    lost_cores, conserving_s)


def _simulated_step_s(repeats: Sequence[dict[str, Any]], partitions: Sequence[tuple[int, float]], workers: int,
                      rate_bps: float, worker_ratio: float, coordinator_ratio: float, burst_bytes: float,
                      push_window_bytes: float | None, node_cores: float, kernel_step_cpu_s: float) -> float | None:
    """The step of `harness.present.round_sim.simulate_sharded_steps` (s), the median over `repeats`,
    from each repeat's nodes: each stage's median CPU (``stage_cpu_s``), the forward and backward's CPU
    (``compute_cpu_s / steps``), every figure raised by the kernel's CPU per step (`kernel_step_cpu_s`)
    in proportion to the nodes' CPU (their ``step_cpu_s``); worker 1 held to
    the slowest worker's compute (``compute_max_s``), the others to the median worker's
    (``compute_median_s``). None when a node of a repeat lacks one (reports before session 23, whose
    ``stage_cpu_s`` had four stages without the sends)."""
    steps = []
    for rep in repeats:
        nodes = rep.get("nodes") or {}
        names = ["coordinator", *(f"worker-{w}" for w in range(1, workers + 1))]
        if any(not ((nodes.get(name) or {}).get("stage_cpu_s") or {}).get("pull_send") for name in names):
            return None
        coordinator = nodes["coordinator"]
        slowest = ((coordinator.get("compute_max_s") or {}).get("median"))
        median = ((coordinator.get("compute_median_s") or {}).get("median"))
        step_cpu = [((nodes[name].get("step_cpu_s") or {}).get("median")) for name in names]
        if not isinstance(slowest, (int, float)) or not isinstance(median, (int, float)) or None in step_cpu:
            return None
        scale = (sum(step_cpu) + kernel_step_cpu_s) / sum(step_cpu) if sum(step_cpu) > 0 else 1.0
        cpus = []
        for rank, name in enumerate(names):
            node = nodes[name]
            stages = {stage: float(summary.get("median") or 0.0) for stage, summary in node["stage_cpu_s"].items()
                      if stage in STAGE_NAMES and isinstance(summary, dict)}
            if rank and (not isinstance(node.get("compute_cpu_s"), (int, float)) or not node.get("steps")):
                return None
            compute = node["compute_cpu_s"] / node["steps"] if rank else 0.0
            cpus.append(NodeCpu(compute * scale, {k: v * scale for k, v in stages.items()},
                                (slowest if rank == 1 else median) if rank else 0.0))
        steps.append(simulate_sharded_steps(partitions, workers, rate_bps, cpus, node_cores, worker_ratio,
                                            coordinator_ratio, burst_bytes, push_window_bytes))
    return _median(steps)


def _link_burst_bytes(repeats: Sequence[dict[str, Any]]) -> float:
    """The shaper's token bucket on the nodes' egress, bytes: the smallest that the harness read back from
    any node of `repeats` (``links.containers.*.applied``, `harness.links.readback.burst_in_force_bytes`);
    0 when none was read back."""
    found = [burst_in_force_bytes(entries or []) for rep in repeats
             for container in (((rep.get("links") or {}).get("containers")) or {}).values()
             for entries in ((container or {}).get("applied") or {}).values()]
    return float(min((b for b in found if b is not None), default=0))


def _push_window_bytes(repeats: Sequence[dict[str, Any]], config: dict[str, Any]) -> float | None:
    """An ordered run's push window for `sharded_round_s`: the median over the repeats' workers of the
    median congestion window their pushes started with (``ps.push_cwnd.median_bytes``, bytes); None (the
    concurrent simulation) for a concurrent run or a report without the figure (before session 9)."""
    if config.get("push_schedule") != "ordered":
        return None
    windows = [float(node["ps"]["push_cwnd"]["median_bytes"]) for rep in repeats
               for name, node in rep["nodes"].items()
               if name.startswith("worker") and ((node.get("ps") or {}).get("push_cwnd") or {}).get("median_bytes")]
    return _median(windows)


def _lossy_codec_ratio(config: dict[str, Any], partition_nbytes: Sequence[float]) -> float | None:
    """raw / sent bytes of a step's pushes and pulls under a fixed lossy codec (``fixed:int8``,
    ``fixed:int4``, ``fixed:topk-...``; both directions use it after ``lossy_warmup_steps``): the codec's
    payload bytes for float32 partitions of `partition_nbytes` (bytes each), encoded here (their sizes
    depend on the element count only). None for any other policy, whose ratio is the nodes' measured
    ``compression_ratio``. A run's own ``compression_ratio`` does not serve for a lossy codec: it
    counts the dense warm-up steps and the dense traffic outside the steps (the plan's initial
    parameters, the final pull), which in a short run of a large model outweigh the steps (the 26 MB
    model's 12 steps at 4 workers with int4: 3.6 for the workers, against 7.76 per step)."""
    policy = str(config.get("compression") or "none")
    raw = sent = 0.0
    for numel, count in Counter(int(nbytes) // FLOAT32_BYTES for nbytes in partition_nbytes).items():
        ratio = fixed_lossy_ratio(policy, numel)
        if ratio is None:
            return None
        raw += count * numel * FLOAT32_BYTES
        sent += count * numel * FLOAT32_BYTES / ratio
    return raw / sent if sent else None


def _measured_codec_ratio(repeats: Sequence[dict[str, Any]], config: dict[str, Any]) -> float | None:
    """raw / payload bytes of every frame the nodes of `repeats` sent with the fixed policy's codec (their
    ``codec_bytes_sent``, `wiiide.metrics`): the ratio a data-dependent codec (int3z's entropy coder)
    reached on the run's own gradients, where `_lossy_codec_ratio` encodes Gaussian values. None when the
    policy is not a fixed codec or the nodes did not record it (reports before session 18)."""
    try:
        mode, codec_name = parse_policy_name(str(config.get("compression") or "none"))
        name = codec_from_name(codec_name).name if mode == "fixed" else None
    except ValueError:
        return None
    raw = payload = 0
    for rep in repeats:
        for node in (rep.get("nodes") or {}).values():
            sent = (node.get("codec_bytes_sent") or {}).get(name) or {}
            raw += int(sent.get("raw_bytes") or 0)
            payload += int(sent.get("payload_bytes") or 0)
    return raw / payload if raw and payload else None


def _report_partitions(loads: Sequence[int], workers: int, partition_bytes: Any, balance: str, per_shard: int = 1,
                       placement: str = "contiguous",
                       finest_bytes: float = PER_SHARD_FINEST_BYTES) -> list[tuple[int, float]] | None:
    """(shard, bytes) of every partition of a sharded run, rebuilt as the run cut them: with ``pipeline``
    or ``egress`` shares one contiguous range per shard of exactly its reported load (the coordinator's
    at the tail or at the head), cut into partitions of at most `partition_bytes`, at least `per_shard`
    per shard while they stay `finest_bytes` or more (the run's ``ps.partition_finest_bytes``; reports
    from before session 14: 64 KiB), dealt in turns with `placement` ``interleaved``
    (`wiiide.ps.partition.partition_by_weights`); with ``bytes``, `plan_partitions`. None when that does
    not give the loads the run reported."""
    if not isinstance(partition_bytes, int) or any(load % FLOAT32_BYTES or load <= 0 for load in loads):
        return None
    numel, k = sum(loads) // FLOAT32_BYTES, len(loads)
    try:
        if balance in ("pipeline", "egress"):
            order = [*range(1, k), 0] if balance == "pipeline" else None
            parts = partition_by_weights(numel, [load // FLOAT32_BYTES for load in loads], partition_bytes, order,
                                         per_shard, placement == "interleaved", finest_bytes)
        else:
            parts = plan_partitions(numel, k, workers, partition_bytes, balance, per_shard, placement, finest_bytes)
    except ValueError:
        return None
    if shard_loads_bytes(parts, k) != list(loads):
        return None
    return [(p.shard, float((p.stop - p.start) * FLOAT32_BYTES)) for p in parts]


def report_cores(report: dict[str, Any]) -> int | None:
    """The cores every node of a report's runs shared: the harness machine's ``cpu_count_logical`` for
    the single-host backends (docker, local), None for swarm (nodes on several machines) or when unknown."""
    if ((report.get("backend") or {}).get("name")) not in ("docker", "local"):
        return None
    cores = (report.get("machine_info") or {}).get("cpu_count_logical")
    return int(cores) if isinstance(cores, int) and cores >= 1 else None


def model_rows(report: dict[str, Any], per_repeat: bool = False,
               progress: Callable[[list[dict[str, Any]]], Iterable[dict[str, Any]]] | None = None) -> list[ModelRow]:
    """`point_model` of every point of a report (report.json as parsed) that the model covers, with the
    cores' bound where the report names one machine's cores (`report_cores`). `per_repeat`: one row per
    repeat of each point, the model and the measured step from that repeat alone (as a run of one
    repeat would have them; its params gain ``repeat``, the repeat's index). `progress`: wraps the list
    of points to model (a progress display, `rich.progress.track`)."""
    cores = report_cores(report)
    points = report.get("points") or []
    if per_repeat:
        points = [{**p, "params": {**(p.get("params") or {}), "repeat": i}, "repeats": [r]}
                  for p in points for i, r in enumerate(p.get("repeats") or [])]
    rows = (point_model(p, cores) for p in (progress(points) if progress else points))
    return [row for row in rows if row is not None]


def render(rows: Sequence[ModelRow]) -> str:
    """Rows as text: the point's parameters (as wide as the longest, so engine labels stay whole), model
    ms, measured ms, error %, then the model's two bounds (links, cores; ``-`` where not known), the
    compute phase of the two-phase model (``-``: the roofline), the slowest worker's path (``-``: not
    recorded), the simulated schedule (``-``: not recorded), the bytes-only model with
    its error, and for a traced run (``sweep --sched-trace``; ``-`` otherwise) the cores the scheduler
    lost and the model's error had it lost none."""
    labels = [", ".join(f"{k}={v}" for k, v in row.params.items()) for row in rows]
    width = max([60, *map(len, labels)])
    lines = [f"{'point':{width}} {'model ms':>9} {'measured ms':>12} {'error':>7} {'links ms':>9} {'cores ms':>9} "
             f"{'compute ms':>10} {'slowest ms':>10} {'simulated ms':>12} {'bytes-only ms':>14} {'error':>7} "
             f"{'lost cores':>10} {'error, none lost':>16}"]

    def ms(value: float | None) -> str:
        return f"{value * 1e3:9.1f}" if value is not None else f"{'-':>9}"

    for row, label in zip(rows, labels):
        simple = (f" {row.bytes_model_step_s * 1e3:14.1f} {(row.bytes_model_step_s / row.measured_step_s - 1) * 100:+6.1f}%"
                  if row.bytes_model_step_s else f" {'-':>14} {'-':>7}")
        if row.work_conserving_error is not None:
            simple += f" {row.lost_cores:10.2f} {row.work_conserving_error * 100:+15.1f}%"
        else:
            simple += f" {'-':>10} {'-':>16}"
        lines.append(f"{label:{width}} {row.model_step_s * 1e3:9.1f} {row.measured_step_s * 1e3:12.1f} "
                     f"{row.error * 100:+6.1f}% {ms(row.link_model_step_s)} {ms(row.cpu_step_s)} "
                     f"{ms(row.compute_phase_s)} {ms(row.slowest_path_s)}    {ms(row.simulated_step_s)} {simple}")
    return "\n".join(lines)


def _error_cell(error: float) -> str:
    """A relative error as a Markdown cell in % (``+5.0``), bold within `TARGET_ERROR`."""
    text = f"{error * 100:+.1f}"
    return f"**{text}**" if abs(error) <= TARGET_ERROR else text


def render_markdown(rows: Sequence[ModelRow], row_param: str = "engine") -> str:
    """Rows as a Markdown table, the README's form: one line per value of `row_param` (the engine), one
    column per setting of the other parameters (in the order the rows first show them), each cell the
    model's error in % against the measured step, bold within `TARGET_ERROR`; for a traced run (``sweep
    --sched-trace``) the error had the scheduler lost no core after a slash and the lost cores in
    brackets. Then per line and in all, the cells within the target. Rows with one setting twice: the
    first one counts."""
    lines_of: dict[str, dict[str, ModelRow]] = {}
    columns: list[str] = []
    for row in rows:
        line = str(row.params.get(row_param, "-"))
        column = " ".join(str(v) for k, v in row.params.items() if k != row_param)
        if column not in columns:
            columns.append(column)
        lines_of.setdefault(line, {}).setdefault(column, row)
    target = f"{TARGET_ERROR * 100:g} %"
    out = [f"| {row_param} | " + " | ".join(columns) + f" | within {target} |",
           "|---|" + "---|" * (len(columns) + 1)]
    within = total = 0
    for line, cells in lines_of.items():
        texts = []
        for column in columns:
            row = cells.get(column)
            if row is None:
                texts.append("")
                continue
            text = _error_cell(row.error)
            if row.work_conserving_error is not None:
                text += f" / {_error_cell(row.work_conserving_error)} ({row.lost_cores:.2f})"
            texts.append(text)
        hits = sum(abs(row.error) <= TARGET_ERROR for row in cells.values())
        within, total = within + hits, total + len(cells)
        out.append(f"| {line} | " + " | ".join(texts) + f" | {hits} of {len(cells)} |")
    out.append(f"\nWithin {target} of the measured step: {within} of {total} points.")
    return "\n".join(out)


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m harness.present.round_model REPORT``; exit status 0, or 2 with the error."""
    parser = argparse.ArgumentParser(prog="python -m harness.present.round_model", description=__doc__.split("\n")[0])
    parser.add_argument("report", help="a sweep's report.json")
    parser.add_argument("--per-repeat", action="store_true",
                        help="one row per repeat: the model and the measured step from that repeat alone")
    parser.add_argument("--markdown", action="store_true",
                        help=f"the errors as the README's Markdown table (one line per engine, bold within "
                             f"{TARGET_ERROR * 100:g} %%)")
    args = parser.parse_args(argv)
    try:
        report = json.loads(Path(args.report).read_text())
    except (OSError, ValueError) as exc:
        print(f"error: {args.report}: {exc}", file=sys.stderr)
        return 2
    if not isinstance(report, dict) or not isinstance(report.get("points"), list):
        print(f"error: {args.report}: not a sweep report (no 'points')", file=sys.stderr)
        return 2
    console = Console(stderr=True)
    rows = model_rows(report, args.per_repeat,  # the simulated schedules take up to seconds a point
                      (lambda points: track(points, description="modelling the points", console=console,
                                            transient=True)) if console.is_terminal else None)
    print((render_markdown(rows) if args.markdown else render(rows)) if rows
          else "no point on a rate-limited link that the model covers")
    return 0


if __name__ == "__main__":
    sys.exit(main())
