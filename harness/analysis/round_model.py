"""The synchronous-round model of a step of the sharded parameter servers and DDP over shaped links.

Terms: M the model's bytes, N workers, R a link's TCP payload rate (the htb rate x `TCP_PAYLOAD_SHARE`),
s_j the bytes shard j owns (the coordinator's ``ps.shard_loads_bytes``).

- Bytes only (`sharded_link_s`): a worker holding shard j sends (M - s_j) of pushes and (N - 1) s_j of
  pulls, a worker without a shard M, the coordinator N s_0 of pulls; the busiest node's bytes over R
  is what no schedule beats.
- The links' round (`sharded_round_s`): the same bytes partition by partition through a fluid
  simulation of every node's link: one connection per peer sending in order, a node's rate shared by
  its busy connections (``push_schedule: concurrent``), or (``ordered``) each push joining once the one
  before has at most a congestion window left (``ps.push_cwnd``); a pull leaves once every push of its
  partition is in. Each egress is a token bucket with the shaper's burst (`harness.analysis.egress`);
  each node's bytes are divided by its measured compression ratio.
- DDP: ring all-reduce, 2 (W - 1) / W x M / R (Patarasuk and Yuan 2009), compute overlapped.

A report's point is then modelled (`harness.analysis.point_model`) as the largest of the bounds a step
cannot beat:

    max(compute, C / cores) + max(links' round, (CPU of a step - C) / cores)     two phases (Valiant 1990)
    compute_max + links' round                                                the slowest worker
    the simulated schedule of the timed stages on cores and links            (`harness.analysis.round_sim`)

with C the workers' forward and backward CPU, cores the machine's logical cores less what other
processes, steal and the scheduler's lost cores (`harness.analysis.sched_trace`; Lozi et al. 2016) took,
and compute_max the slowest worker's compute a step. Reports without per-stage CPU get the roofline
(Williams, Waterman and Patterson 2009). `harness.analysis.round_table` prints the model beside the
measured steps (``wiiide-lab round-model REPORT``). How the terms were chosen, and the runs that tested
them: studies/round-model/NOTE.md.
"""

from __future__ import annotations

from collections import Counter, deque
from dataclasses import dataclass
from typing import Sequence

from harness.analysis.egress import spend_tokens

TCP_PAYLOAD_SHARE = 0.956  # TCP payload per bit of an htb rate with 1500-byte frames (1448 of 1514 bytes)


@dataclass
class _Message:
    """A push or pull queued on a connection in `sharded_round_s`: its bytes still to cross the link."""

    nbytes: float
    kind: str
    index: int



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

    What it simulates (the code of `wiiide.server.ps.client` and `wiiide.server.ps.shard`): node 0 is the coordinator,
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
        partitions: (shard, bytes) of each partition in vector order (`wiiide.server.ps.partition.plan_partitions`).
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
