"""``python -m harness.bench.overhead`` (also ``wiiide-lab bench-overhead``): the harness's own cost per
sweep point, phase by phase.

Runs one short point (digits, ``--duration-s`` seconds of training) at each of ``--workers``
(default 1+4 and 1+8 containers) ``--repeats`` times (default 3), on one backend, one run at a time,
through the same loop a sweep uses (`harness.run.loop.run_point`). For every run it keeps:

- ``phases_s``: the harness's seconds per phase (`harness.run.backend.PhaseClock`: ``clean``,
  ``plan``, ``create``, ``shape``, ``gate``, ``run``, ``stop``, ``collect``, ``teardown``);
- ``train_time_s``: the coordinator's own seconds in its training loop (its metrics file);
- ``nodes_s``: the nodes' side of the ``run`` phase (`node_phases`): start-up to training, training,
  and after training to the last container's exit;
- ``overhead_s``: the run's wall time minus ``train_time_s`` (everything that is not training:
  the harness's phases and the nodes' start-up, connecting, evaluation and exit);
- ``load_average``: the machine's 1/5/15-minute load average before and after (``os.getloadavg``).

``--images OLD NEW`` compares node images (e.g. before and after a change to `wiiide/`) in one run:
each image is used as it is (not rebuilt), the runs are interleaved (image, then worker count, then
repeat) so a change in the machine's load falls on both, and the summary has one row per image and
worker count (``1+8 <image>``).

On docker, warm containers are kept between the runs of the same cluster (the sweep's default,
`harness.run.zygote_pool`): the first run of each worker count creates them, the later ones fork
fresh nodes in them; each run records ``reused``, and the summary keeps ``overhead_s_reused`` and
``overhead_s_fresh`` apart. ``--no-reuse``: fresh containers for every run.

Writes ``results/bench-overhead-<UTC stamp>.json`` with ``machine_info`` and ``commit_info`` at the
top, every raw run, and per worker count the median, min and max of each figure; prints a table.
The image check a sweep does once (``prepare_s``) is measured once and kept apart.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import sys
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Callable, Sequence

from harness import REPO_ROOT
from harness.bench import sigterm_as_interrupt
from harness.run.backend import Backend
from harness.run.loop import run_point
from harness.run.machine import commit_info, machine_info
from harness.spec.points import build_spec
from wiiide.metrics import write_json_atomic

Log = Callable[[str], None]

DEFAULT_WORKERS = (4, 8)
DEFAULT_REPEATS = 3
DEFAULT_DURATION_S = 5.0


def bench_spec(num_workers: int, duration_s: float, link: str | None = None):
    """The one-point `SweepSpec` the benchmark runs: digits, `num_workers` workers, `duration_s`
    seconds of training, quiet logs; `link`: a link preset name (experiments/links.yaml) or None.

    Raises:
        SpecError: a value is out of range (as in any sweep spec).
    """
    base: dict[str, Any] = {"dataset": "digits", "num_workers": num_workers, "duration_s": duration_s,
                            "log_tier": "normal", "log_every_steps": 100000}
    if link:
        base["link"] = link
    return build_spec({"name": f"bench-overhead-{num_workers}", "base": base}, "bench-overhead")


def measure_point(backend: Backend, num_workers: int, duration_s: float, out_dir: Path, log: Log,
                  link: str | None = None, image: str | None = None) -> dict[str, Any]:
    """Run the bench point once on `backend` and return its figures (see the module doc); seconds.
    `image`: the node image's tag, recorded with the figures (None: the backend's one image).

    Raises:
        ClusterError: the backend cannot run the point at all (a failed run is recorded instead).
    """
    spec = bench_spec(num_workers, duration_s, link)
    point = spec.points[0]
    load_before = list(os.getloadavg())
    t0 = time.monotonic()
    result = run_point(backend, point.config, out_dir, progress=log, cluster=point.cluster)
    wall_s = time.monotonic() - t0
    coordinator = result.nodes.get("coordinator") or {}
    train_time_s = coordinator.get("train_time_s")
    return {
        "num_workers": num_workers, "containers": num_workers + 1, "duration_s": duration_s, "link": link,
        "image": image,
        "status": result.status, "error": result.error, "wall_s": round(wall_s, 3),
        "train_time_s": train_time_s, "coordinator_wall_time_s": coordinator.get("wall_time_s"),
        "overhead_s": round(wall_s - train_time_s, 3) if train_time_s is not None else None,
        "phases_s": result.phases_s, "nodes_s": node_phases(result.containers, coordinator),
        "lifetimes": {name: {"started_at_utc": c.get("started_at_utc"), "finished_at_utc": c.get("finished_at_utc"),
                             "exit_code": c.get("exit_code")} for name, c in result.containers.items()},
        "node_times": {name: {"started_at_utc": n.get("started_at_utc"), "ended_at_utc": n.get("ended_at_utc")}
                       for name, n in result.nodes.items()},
        "load_average_before": load_before, "load_average_after": list(os.getloadavg()),
    }


def _utc_s(stamp: str | None) -> float | None:
    """An RFC 3339 / ISO 8601 UTC time (the Engine API's nanoseconds cut to microseconds) -> POSIX seconds."""
    if not stamp:
        return None
    text = stamp.replace("Z", "+00:00")
    head, dot, rest = text.partition(".")
    if dot:
        digits = "".join(ch for ch in rest if ch.isdigit())
        text = f"{head}.{digits[:6]}{rest[len(digits):]}"
    return datetime.fromisoformat(text).timestamp()


def node_phases(containers: dict[str, dict[str, Any]], coordinator: dict[str, Any]) -> dict[str, float | None]:
    """The nodes' side of the harness's ``run`` phase, in seconds, from the containers' start and finish
    times (Engine API) and the coordinator's metrics (its end and ``train_time_s``):

    - ``to_training_s``: first container started -> training started (imports, data, connecting);
    - ``train_time_s``: the coordinator's training loop;
    - ``after_training_s``: training ended -> last container finished (evaluation, metrics, exit).

    Training is taken to end when the coordinator's metrics were written, less nothing: its
    evaluation after training (milliseconds for the bench's model) counts as after training. All
    None on the local backend (processes carry no start/finish times).
    """
    starts = [_utc_s(c.get("started_at_utc")) for c in containers.values()]
    ends = [_utc_s(c.get("finished_at_utc")) for c in containers.values()]
    coordinator_end = _utc_s(coordinator.get("ended_at_utc"))
    train_s = coordinator.get("train_time_s")
    if not starts or None in starts or None in ends or coordinator_end is None or train_s is None:
        return {"to_training_s": None, "train_time_s": train_s, "after_training_s": None}
    train_start = coordinator_end - train_s
    return {"to_training_s": round(train_start - min(starts), 3), "train_time_s": round(train_s, 3),
            "after_training_s": round(max(ends) - coordinator_end, 3)}


def _stats(values: Sequence[float]) -> dict[str, float | int | None]:
    """Median, min, max and count of `values` (pyperf style: raw values are kept beside)."""
    values = [v for v in values if v is not None]
    if not values:
        return {"count": 0, "median": None, "min": None, "max": None}
    return {"count": len(values), "median": round(statistics.median(values), 3),
            "min": round(min(values), 3), "max": round(max(values), 3)}


def summarize(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Per worker count (and per image when runs carry more than one): statistics of ``wall_s``,
    ``train_time_s``, ``overhead_s`` (also apart for runs in reused and in fresh containers:
    ``overhead_s_reused``, ``overhead_s_fresh``) and each phase over the runs that ended ``ok``. Keys:
    ``1+8``, or ``1+8 <image>``."""
    summary: dict[str, Any] = {}
    images = list(dict.fromkeys(r.get("image") for r in runs))
    for workers, image in sorted({(r["num_workers"], r.get("image")) for r in runs},
                                 key=lambda key: (key[0], images.index(key[1]))):
        mine = [r for r in runs if r["num_workers"] == workers and r.get("image") == image]
        ok = [r for r in mine if r["status"] == "ok"]
        phases = list(dict.fromkeys(name for r in ok for name in r["phases_s"]))
        summary[f"1+{workers}" + (f" {image}" if len(images) > 1 else "")] = {
            "runs_ok": len(ok), "runs": len(mine),
            "wall_s": _stats([r["wall_s"] for r in ok]),
            "train_time_s": _stats([r["train_time_s"] for r in ok]),
            "overhead_s": _stats([r["overhead_s"] for r in ok]),
            # runs in warm containers kept from the run before, and runs that created their containers
            "overhead_s_reused": _stats([r["overhead_s"] for r in ok if r.get("reused")]),
            "overhead_s_fresh": _stats([r["overhead_s"] for r in ok if not r.get("reused")]),
            "phases_s": {name: _stats([r["phases_s"].get(name) for r in ok]) for name in phases},
            "nodes_s": {name: _stats([r["nodes_s"].get(name) for r in ok])
                        for name in ("to_training_s", "train_time_s", "after_training_s")},
        }
    return summary


def format_summary(summary: dict[str, Any]) -> str:
    """A plain text table: one row per worker count, median seconds of the overhead and each phase."""
    phases = list(dict.fromkeys(p for s in summary.values() for p in s["phases_s"]))
    head = ["cluster", "runs", "wall", "train", "overhead", *phases, "| to_train", "after_train"]
    rows = [head]
    for name, s in summary.items():
        def med(stat: dict[str, Any]) -> str:
            return "-" if stat["median"] is None else f"{stat['median']:.1f}"
        rows.append([name, f"{s['runs_ok']}/{s['runs']}", med(s["wall_s"]), med(s["train_time_s"]),
                     med(s["overhead_s"]), *(med(s["phases_s"][p]) if p in s["phases_s"] else "-" for p in phases),
                     med(s["nodes_s"]["to_training_s"]), med(s["nodes_s"]["after_training_s"])])
    widths = [max(len(r[i]) for r in rows) for i in range(len(head))]
    lines = ["  ".join(cell.rjust(w) for cell, w in zip(row, widths)) for row in rows]
    return ("median seconds (harness phases; after |: the nodes' side of `run`)\n" + "\n".join(lines))


def _image_backends(images: Sequence[str], reuse: bool) -> dict[str, Backend]:
    """One docker backend per image tag, each image used as it is (not rebuilt from this checkout).

    Raises:
        ClusterError: no Docker engine, or an image that does not exist.
    """
    from harness.errors import ClusterError
    from harness.run.compose import ComposeBackend
    from harness.run.base_image import image_exists

    backends: dict[str, Backend] = {}
    for tag in images:
        backend = ComposeBackend(image_tag=tag, reuse=reuse)
        if not image_exists(backend.client, tag):
            raise ClusterError(f"bench-overhead --images: no image {tag!r}; build it first "
                               f"(`wiiide-lab image --tag {tag}` in the checkout it should hold)")
        backends[tag] = backend
    return backends


def run_bench(workers: Sequence[int], repeats: int, duration_s: float, backend_name: str, results_dir: Path,
              log: Log, link: str | None = None, images: Sequence[str] = (), reuse: bool = True) -> Path:
    """Measure every worker count `repeats` times (interleaved: 4, 8, 4, 8...) and write the JSON.
    `images`: node image tags to compare (docker only, used as they are, interleaved per run);
    empty: the backend's own image, built from this checkout. `reuse`: docker keeps warm containers
    between runs of the same cluster (each run says whether it found them: ``reused``); with several
    images or worker counts interleaved, every run changes the cluster and starts fresh.

    Returns:
        The path of ``bench-overhead-<stamp>.json`` in `results_dir`.

    Raises:
        ClusterError: the backend cannot be had (no engine, no image).
    """
    from harness.run.select import select_backend

    stamp = datetime.now(timezone.utc).strftime("%Y%m%dT%H%M%SZ")
    work_dir = results_dir / f"bench-overhead-{stamp}"
    t0 = time.monotonic()
    backends: dict[str | None, Backend] = (
        dict(_image_backends(images, reuse)) if images else {None: select_backend(backend_name, log, reuse=reuse)})
    prepare_s = time.monotonic() - t0
    backend = next(iter(backends.values()))
    runs: list[dict[str, Any]] = []
    try:
        for repeat in range(repeats):
            for n in workers:
                for i, (image, each) in enumerate(backends.items()):
                    label = f"1+{n} containers" + (f" of {image}" if image else "")
                    log(f"[bench-overhead] {label}, repeat {repeat + 1}/{repeats}, load {os.getloadavg()[0]:.2f}")
                    out_dir = work_dir / (f"w{n}-r{repeat}" + (f"-i{i}" if image else ""))
                    record = measure_point(each, n, duration_s, out_dir, log, link, image)
                    record["repeat"] = repeat
                    record["reused"] = bool(getattr(each, "last_run_reused", False))
                    runs.append(record)
                    log(f"[bench-overhead]   {record['status']}: wall {record['wall_s']:.1f} s, training "
                        f"{record['train_time_s'] or 0:.1f} s, overhead {record['overhead_s'] or 0:.1f} s, "
                        f"phases {record['phases_s']}")
    finally:
        for each in backends.values():
            each.teardown()
            close = getattr(each, "close", None)  # warm containers (reuse) and a swarm the harness started
            if close is not None:
                close(log)
    data = {
        "kind": "bench-overhead", "machine_info": machine_info(), "commit_info": commit_info(),
        "params": {"workers": list(workers), "repeats": repeats, "duration_s": duration_s,
                   "backend": backend.name, "link": link, "images": list(images), "reuse": reuse},
        "backend": backend.describe(), "prepare_s": round(prepare_s, 3),
        "runs": runs, "summary": summarize(runs),
    }
    path = results_dir / f"bench-overhead-{stamp}.json"
    write_json_atomic(path, data)
    return path


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The command line of ``bench-overhead``."""
    parser.add_argument("--workers", type=int, nargs="+", default=list(DEFAULT_WORKERS),
                        help="worker counts to measure (default: 4 8)")
    parser.add_argument("--repeats", type=int, default=DEFAULT_REPEATS, help="runs per worker count (default 3)")
    parser.add_argument("--duration-s", type=float, default=DEFAULT_DURATION_S,
                        help="seconds of training per run (default 5)")
    parser.add_argument("--backend", choices=["auto", "docker", "local"], default="docker")
    parser.add_argument("--link", help="a link preset to shape every container with (e.g. rate-100m)")
    parser.add_argument("--images", nargs="+", default=[], metavar="TAG",
                        help="node images to compare, interleaved (docker; used as they are, not rebuilt)")
    parser.add_argument("--no-reuse", dest="reuse", action="store_false",
                        help="fresh containers for every run (default: warm containers kept between the runs "
                             "of the same cluster, each run forking fresh node processes in them)")
    parser.add_argument("--results-dir", default=str(REPO_ROOT / "results"),
                        help="where bench-overhead-<stamp>.json goes (default: results/)")


def main_from_args(args: argparse.Namespace, log: Log) -> int:
    """Run the benchmark from parsed arguments, print the table and the JSON's path; exit code 0."""
    path = run_bench(args.workers, args.repeats, args.duration_s, args.backend, Path(args.results_dir), log,
                     args.link, args.images, args.reuse)
    print(format_summary(json.loads(path.read_text())["summary"]))
    print(path)
    return 0


def main(argv: list[str] | None = None) -> int:
    """``python -m harness.bench.overhead [--workers 4 8] [--repeats 3] [--duration-s 5]``."""
    parser = argparse.ArgumentParser(prog="python -m harness.bench.overhead", description=__doc__.split("\n")[0])
    add_arguments(parser)
    signal.signal(signal.SIGTERM, sigterm_as_interrupt)  # `timeout`, `kill`: unwind as Ctrl-C does, removing the containers
    return main_from_args(parser.parse_args(argv), lambda line: print(line, file=sys.stderr, flush=True))


if __name__ == "__main__":
    sys.exit(main())
