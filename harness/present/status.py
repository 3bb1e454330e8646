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
# Every figure, one column each (plain text, wide terminals).
COLUMNS = ("node", "container", "state", "step", "batches/s", "steps/s", "CPU %", "memory MiB",
           "net rx MB", "net tx MB", "rx MB/s", "tx MB/s")
# An 80-column terminal: no container name, no steps/s, rx/tx in one column.
COMPACT_COLUMNS = ("node", "state", "step", "batches/s", "CPU %", "mem MiB", "rx/tx MB", "rx/tx MB/s")
WIDE_CONSOLE_COLUMNS = 120  # from this console width on, the terminal shows `COLUMNS`


def network_rates(previous: ClusterStatus | None, current: ClusterStatus) -> dict[str, tuple[float, float]]:
    """Per container, (rx, tx) bytes/s between two snapshots of the same cluster.

    The seconds between are the engine's own sample times (`ContainerFigures.read_at_s`) when both
    samples have one, else the snapshots' `taken_at_s`.

    Args:
        previous: the earlier snapshot (None: no rates).
        current: the later one.

    Returns:
        container name -> (rx_bytes_per_s, tx_bytes_per_s), for containers with figures in both
        snapshots whose counters did not go back (a restarted container starts again from 0).
    """
    if previous is None:
        return {}
    before = {n.container: n.figures for n in previous.nodes if n.figures is not None}
    rates = {}
    for node in current.nodes:
        old, new = before.get(node.container), node.figures
        if old is None or new is None or new.net_rx_bytes < old.net_rx_bytes or new.net_tx_bytes < old.net_tx_bytes:
            continue
        if old.read_at_s is not None and new.read_at_s is not None:
            dt_s = new.read_at_s - old.read_at_s
        else:
            dt_s = current.taken_at_s - previous.taken_at_s
        if dt_s > 0:
            rates[node.container] = ((new.net_rx_bytes - old.net_rx_bytes) / dt_s,
                                     (new.net_tx_bytes - old.net_tx_bytes) / dt_s)
    return rates


def _num(value: float | int | None, fmt: str) -> str:
    return "-" if value is None else format(value, fmt)


def node_cells(node: NodeStatus, rates: dict[str, tuple[float, float]], compact: bool = False) -> list[str]:
    """The row of one node, as text in `COLUMNS` order (`COMPACT_COLUMNS` when `compact`), ``-`` where
    a figure is unknown.

    Units: batches/s and steps/s per second; CPU % of one core; memory in MiB (2**20 bytes, without
    page cache); network totals in MB (1e6 bytes) since the container started, rates in MB/s
    (`network_rates`).
    """
    t, f = node.training, node.figures
    rx_s, tx_s = rates.get(node.container, (None, None))
    rx_mb, tx_mb = (None, None) if f is None else (f.net_rx_bytes / 1e6, f.net_tx_bytes / 1e6)
    rx_mb_s, tx_mb_s = (None, None) if rx_s is None else (rx_s / 1e6, tx_s / 1e6)
    cpu, mem_mib = (None, None) if f is None else (f.cpu_percent, f.memory_bytes / MIB)
    if compact:
        state = node.state if node.exit_code is None else f"{node.state} {node.exit_code}"
        return [node.node, state, _num(t.step, "d"), _num(t.batches_per_s, ".1f"), _num(cpu, ".1f"),
                _num(mem_mib, ".1f"), _pair(rx_mb, tx_mb, ".1f"), _pair(rx_mb_s, tx_mb_s, ".2f")]
    state = node.state if node.exit_code is None else f"{node.state} ({node.exit_code})"
    return [node.node, node.container, state, _num(t.step, "d"), _num(t.batches_per_s, ".1f"),
            _num(t.steps_per_s, ".1f"), _num(cpu, ".1f"), _num(mem_mib, ".1f"), _num(rx_mb, ".2f"),
            _num(tx_mb, ".2f"), _num(rx_mb_s, ".2f"), _num(tx_mb_s, ".2f")]


def _pair(a: float | None, b: float | None, fmt: str) -> str:
    return "-" if a is None or b is None else f"{a:{fmt}}/{b:{fmt}}"


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
                 table_box: box.Box | None = box.SIMPLE_HEAD, compact: bool = False) -> Table:
    """The cluster's nodes as a `rich.table.Table`, one row per node (`node_cells`); `status_view`
    puts the `headline` above it.

    Args:
        status: the snapshot to show.
        previous: an earlier snapshot, for the network rates (None: rates show ``-``).
        table_box: the table's borders (None: columns separated by spaces only, for plain text).
        compact: `COMPACT_COLUMNS` (fits 80 columns) instead of `COLUMNS`.
    """
    columns = COMPACT_COLUMNS if compact else COLUMNS
    table = Table(box=table_box, show_edge=False, pad_edge=False, padding=(0, 2 if table_box is None else 1, 0, 0))
    for name in columns:
        table.add_column(name, justify="left" if name in ("node", "container", "state") else "right", no_wrap=True)
    rates = network_rates(previous, status)
    for node in status.nodes:
        style = None if node.state == "running" else ("red" if node.exit_code not in (None, 0) else "dim")
        table.add_row(*node_cells(node, rates, compact), style=style)
    return table


def status_view(status: ClusterStatus, previous: ClusterStatus | None = None, width: int = 80) -> Group:
    """What a terminal `width` columns wide shows: the `headline`, then `status_table` with a header
    rule and colours (compact below `WIDE_CONSOLE_COLUMNS`)."""
    return Group(Text(headline(status), style="bold"),
                 status_table(status, previous, compact=width < WIDE_CONSOLE_COLUMNS))


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
    with Live(status_view(status, None, console.width), console=console, auto_refresh=False) as live:
        try:
            while status.running:
                sleep(interval_s)
                previous, status = status, read()
                live.update(Group(status_view(status, previous, console.width), Text("Ctrl-C to stop watching (the cluster keeps "
                                                                       "running)", style="dim")), refresh=True)
        except KeyboardInterrupt:
            pass
        live.update(status_view(status, previous, console.width), refresh=True)
    return 0


def _print_once(console: Console, status: ClusterStatus, previous: ClusterStatus | None) -> None:
    if console.is_terminal:
        console.print(status_view(status, previous, console.width))
    else:
        console.out(plain_status(status, previous), highlight=False)
