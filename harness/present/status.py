"""A running cluster on screen: one row per node (state, step, batches/s, CPU, memory, network), as
a `rich` table, refreshed live with `rich.live.Live` on a terminal and printed as plain text otherwise.

The figures come from `harness.run.status.ClusterStatus`; network rates (bytes/s) are the change of
a container's rx/tx counters between two snapshots divided by the seconds between them.
"""

from __future__ import annotations

import time
from typing import Callable

from rich import box
from rich.console import Console, Group
from rich.live import Live
from rich.table import Table
from rich.text import Text

from harness.errors import ClusterError
from harness.run.status import ClusterStatus, NodeStatus

MIB = 1024 * 1024
COLUMNS = ("node", "container", "state", "step", "batches/s", "steps/s", "CPU %", "memory MiB",
           "net rx MB", "net tx MB", "rx MB/s", "tx MB/s")


def network_rates(previous: ClusterStatus | None, current: ClusterStatus) -> dict[str, tuple[float, float]]:
    """Per container, (rx, tx) bytes/s between two snapshots of the same cluster.

    Args:
        previous: the earlier snapshot (None: no rates).
        current: the later one.

    Returns:
        container name -> (rx_bytes_per_s, tx_bytes_per_s), for containers with figures in both
        snapshots whose counters did not go back (a restarted container starts again from 0).
    """
    if previous is None:
        return {}
    dt_s = current.taken_at_s - previous.taken_at_s
    if dt_s <= 0:
        return {}
    before = {n.container: n.figures for n in previous.nodes if n.figures is not None}
    rates = {}
    for node in current.nodes:
        old, new = before.get(node.container), node.figures
        if old is None or new is None or new.net_rx_bytes < old.net_rx_bytes or new.net_tx_bytes < old.net_tx_bytes:
            continue
        rates[node.container] = ((new.net_rx_bytes - old.net_rx_bytes) / dt_s, (new.net_tx_bytes - old.net_tx_bytes) / dt_s)
    return rates


def _num(value: float | int | None, fmt: str) -> str:
    return "-" if value is None else format(value, fmt)


def node_cells(node: NodeStatus, rates: dict[str, tuple[float, float]]) -> list[str]:
    """The row of one node, as text in `COLUMNS` order (``-`` where a figure is unknown).

    Units: batches/s and steps/s per second; CPU % of one core; memory in MiB (2**20 bytes, without
    page cache); network totals in MB (1e6 bytes) since the container started, rates in MB/s.
    """
    state = node.state if node.exit_code is None else f"{node.state} ({node.exit_code})"
    t, f = node.training, node.figures
    rx_s, tx_s = rates.get(node.container, (None, None))
    return [
        node.node, node.container, state,
        _num(t.step, "d"), _num(t.batches_per_s, ".1f"), _num(t.steps_per_s, ".1f"),
        _num(f and f.cpu_percent, ".1f"), _num(f and f.memory_bytes / MIB, ".1f"),
        _num(f and f.net_rx_bytes / 1e6, ".2f"), _num(f and f.net_tx_bytes / 1e6, ".2f"),
        _num(None if rx_s is None else rx_s / 1e6, ".2f"), _num(None if tx_s is None else tx_s / 1e6, ".2f"),
    ]


def headline(status: ClusterStatus) -> str:
    """``project <p>: 1 coordinator + <n> workers, <r> running; node metrics in <dir>/nodes``."""
    workers = sum(n.role == "worker" for n in status.nodes)
    coordinators = sum(n.role == "coordinator" for n in status.nodes)
    running = sum(n.state == "running" for n in status.nodes)
    line = (f"project {status.project}: {coordinators} coordinator + {workers} worker{'s' * (workers != 1)}, "
            f"{running} running")
    if status.results_dir:
        line += f"; node metrics in {status.results_dir}/nodes"
    return line


def status_table(status: ClusterStatus, previous: ClusterStatus | None = None,
                 table_box: box.Box | None = box.SIMPLE_HEAD) -> Table:
    """The cluster's nodes as a `rich.table.Table`, one row per node (`node_cells`); `status_view`
    puts the `headline` above it.

    Args:
        status: the snapshot to show.
        previous: an earlier snapshot, for the network rates (None: rates show ``-``).
        table_box: the table's borders (None: columns separated by spaces only, for plain text).
    """
    table = Table(box=table_box, show_edge=table_box is not None)
    for i, name in enumerate(COLUMNS):
        table.add_column(name, justify="left" if i < 3 else "right", no_wrap=True)
    rates = network_rates(previous, status)
    for node in status.nodes:
        style = None if node.state == "running" else ("red" if node.exit_code not in (None, 0) else "dim")
        table.add_row(*node_cells(node, rates), style=style)
    return table


def status_view(status: ClusterStatus, previous: ClusterStatus | None = None) -> Group:
    """What a terminal shows: the `headline`, then `status_table` with borders and colours."""
    return Group(Text(headline(status), style="bold"), status_table(status, previous))


def plain_status(status: ClusterStatus, previous: ClusterStatus | None = None, width: int = 200) -> str:
    """`status_table` as plain text (no colour, no box, no escape codes), lines of at most `width` characters."""
    console = Console(width=width, color_system=None, force_terminal=False, no_color=True, highlight=False)
    with console.capture() as capture:
        console.print(Text(headline(status)), soft_wrap=True)
        console.print(status_table(status, previous, table_box=None))
    return "\n".join(line.rstrip() for line in capture.get().splitlines()).strip("\n")


def watch_status(read: Callable[[], ClusterStatus], console: Console, interval_s: float = 2.0,
                 once: bool = False, sleep: Callable[[float], None] = time.sleep) -> int:
    """Show the cluster until none of its containers runs (or Ctrl-C); return the exit code.

    On a terminal (``console.is_terminal``) the table is redrawn in place with `rich.live.Live`;
    otherwise a plain-text snapshot (`plain_status`) is printed every `interval_s`, separated by a
    blank line. `once`: one snapshot, then return.

    Args:
        read: takes a snapshot (`harness.run.status.read_cluster_status`); may raise ClusterError,
            which is passed on.
        console: where to draw.
        interval_s: seconds between snapshots (plus the 1-3 s a snapshot takes).
        sleep: the pause between snapshots (tests pass a fake).

    Returns:
        0 after showing a cluster (also when it ends while watched, or on Ctrl-C).

    Raises:
        ClusterError: the project has no container at the first snapshot (the CLI exits 1), or
            `read` raised it (no engine).
    """
    status = read()
    if not status.nodes:
        raise ClusterError(f"no cluster of project {status.project} is running (no container with label "
                           f"com.docker.compose.project={status.project}); start one with `make cluster-up`")
    if once or not status.running:
        _print_once(console, status, None)
        return 0
    previous: ClusterStatus | None = None
    if not console.is_terminal:
        try:
            while True:
                console.out(plain_status(status, previous), highlight=False)
                if not status.running:
                    return 0
                sleep(interval_s)
                previous, status = status, read()
                console.print()
        except KeyboardInterrupt:
            return 0
    with Live(status_view(status), console=console, auto_refresh=False) as live:
        try:
            while status.running:
                sleep(interval_s)
                previous, status = status, read()
                live.update(Group(status_view(status, previous), Text("Ctrl-C to stop watching (the cluster keeps "
                                                                       "running)", style="dim")), refresh=True)
        except KeyboardInterrupt:
            pass
        live.update(status_view(status, previous), refresh=True)
    return 0


def _print_once(console: Console, status: ClusterStatus, previous: ClusterStatus | None) -> None:
    if console.is_terminal:
        console.print(status_view(status, previous))
    else:
        console.out(plain_status(status, previous), highlight=False)
