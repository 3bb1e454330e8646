"""The ``bench-wire`` verb's options: argparse arguments, their parsing into a `WirePlan`, and the run.

Sizes are read by `wiiide.units.parse_size_bytes` (IEC: ``256k`` = ``256KiB`` = 262,144 bytes) and
link rates by `wiiide.units.parse_rate_bps` (SI bit/s: ``100mbit`` = 100,000,000), as everywhere else;
``0`` (or ``unpaced``) in ``--link-rates`` means an unpaced link.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Callable

from harness.bench.wire.plan import (
    DEFAULT_FRAME_CODECS,
    DEFAULT_LINK_RATES_BPS,
    DEFAULT_SIZES_BYTES,
    SECTIONS,
    PlanError,
    WirePlan,
)
from harness.errors import SpecError
from wiiide.units import MIB, UnitError, parse_rate_bps, parse_size_bytes

UNPACED = ("0", "unpaced")


def split_list(text: str, option: str) -> list[str]:
    """``"64KiB, 1MiB,"`` -> ``["64KiB", "1MiB"]`` (comma-separated, blanks dropped).

    Raises:
        UnitError: nothing left, naming `option`.
    """
    parts = [p.strip() for p in text.split(",") if p.strip()]
    if not parts:
        raise UnitError(f"{option}: {text!r} is an empty list: write e.g. 64KiB,1MiB or 100mbit,0")
    return parts


def parse_sizes(text: str, option: str = "--sizes") -> list[int]:
    """``"64KiB,256k,1MiB"`` -> bytes ``[65536, 262144, 1048576]`` (IEC; `wiiide.units.parse_size_bytes`).

    Raises:
        UnitError: an empty list or a value that is not a size, the message naming `option`.
    """
    return [parse_size_bytes(part, option) for part in split_list(text, option)]


def parse_link_rates(text: str, option: str = "--link-rates") -> list[float]:
    """``"100mbit,2.5gbit,0"`` -> bit/s ``[1e8, 2.5e9, 0.0]`` (SI; `wiiide.units.parse_rate_bps`; 0 = unpaced).

    Raises:
        UnitError: an empty list or a value that is not a rate (a bare number other than 0, ``mbps``),
        the message naming `option`.
    """
    return [0.0 if part.lower() in UNPACED else float(parse_rate_bps(part, option))
            for part in split_list(text, option)]


def add_arguments(p: argparse.ArgumentParser) -> None:
    """Add the verb's options to `p` (the ``bench-wire`` subparser of ``python -m harness``)."""
    p.add_argument("--backend", choices=["local", "docker"], default="local",
                   help="local: two processes over 127.0.0.1; docker: two containers of the node image")
    p.add_argument("--sizes", help="frame sizes, IEC (k = 1024), e.g. 64KiB,256k,1MiB,64MiB "
                                   "(default 64 KiB .. 64 MiB, x4)")
    p.add_argument("--link-rates", help="paced link rates in bit/s, SI, e.g. 100mbit,1gbit,0 (0: unpaced; default "
                                        "100mbit,200mbit,500mbit,1gbit,2.5gbit,0)")
    p.add_argument("--frame-codecs", help="codecs of the frames section, e.g. none,int8 (default "
                                          "none,lz4,zstd-1,shuffle-lz4,shuffle-zstd,fp16,int8)")
    p.add_argument("--sections", help="which sections run, e.g. frames or frames,links (default frames,links,codecs)")
    p.add_argument("--repeats", type=int, default=5, help="interleaved repeats of every frame trial (default 5)")
    p.add_argument("--bytes-per-trial-mib", type=int, default=256, help="MiB per raw / uncompressed trial")
    p.add_argument("--link-messages", type=int, default=100, help="gradient round trips per policy and rate")
    p.add_argument("--codec-threads", type=int, default=1, help="codec threads for frames and links (default 1)")
    p.add_argument("--small", action="store_true", help="a small synthetic model (for tests)")
    p.add_argument("--recv-chunk-bytes", default="64MiB",
                   help="the receiver's recv_chunk_bytes for frames, IEC (default: the nodes' 64MiB)")
    p.add_argument("--read-ahead-bytes", default="0",
                   help="the receiver's FrameReader read_ahead_bytes for exact reads (--frame-readers exact), IEC, "
                        "e.g. 4KiB (default 0: none)")
    p.add_argument("--frame-readers", default="whole",
                   help="how the sink reads frames: whole (the nodes' reader), exact (three reads a frame), or "
                        "whole,exact for both side by side (default whole)")
    p.add_argument("--results-dir", help="where bench-wire-<stamp>.json goes (default results/)")


def plan_from_args(args: argparse.Namespace) -> WirePlan:
    """The `WirePlan` the options ask for (defaults for what is not given).

    Raises:
        SpecError: a value that does not parse or is out of range; the message starts ``bench-wire: <option>``.
    """
    try:
        return WirePlan(
            sizes_bytes=tuple(parse_sizes(args.sizes)) if args.sizes else DEFAULT_SIZES_BYTES,
            link_rates_bps=tuple(parse_link_rates(args.link_rates)) if args.link_rates else DEFAULT_LINK_RATES_BPS,
            frame_codecs=(tuple(split_list(args.frame_codecs, "--frame-codecs")) if args.frame_codecs
                          else DEFAULT_FRAME_CODECS),
            repeats=args.repeats, bytes_per_trial=args.bytes_per_trial_mib * MIB, link_messages=args.link_messages,
            codec_threads=args.codec_threads, small=args.small,
            sections=tuple(split_list(args.sections, "--sections")) if args.sections else SECTIONS,
            recv_chunk_bytes=parse_size_bytes(args.recv_chunk_bytes, "--recv-chunk-bytes"),
            read_ahead_bytes=parse_size_bytes(args.read_ahead_bytes, "--read-ahead-bytes"),
            frame_readers=tuple(split_list(args.frame_readers, "--frame-readers")))
    except (UnitError, PlanError) as exc:
        raise SpecError(f"bench-wire: {exc}") from None


def main_from_args(args: argparse.Namespace, progress: Callable[[str], None]) -> int:
    """The CLI verb: check the options, run, print the tables and the JSON's path; return 0.

    Raises:
        SpecError: bad options (before anything starts). ClusterError, OSError: as `run_bench`.
    """
    import json

    from harness.bench.wire.run import run_bench
    from harness.bench.wire.table import format_report

    plan = plan_from_args(args)
    path = run_bench(plan, args.backend, results_dir=Path(args.results_dir) if args.results_dir else None,
                     progress=progress)
    print(format_report(json.loads(path.read_text())))
    print(path)
    return 0
