"""A bench-wire report as text: three tables (frames vs raw, codecs, links) and the targets, printed
with the harness's one table printer, `harness.present.table.render_table` (rich, no colour).
"""

from __future__ import annotations

import statistics
from typing import Any, Sequence

from harness.bench.wire.summary import rate_key
from harness.present.table import render_table
from wiiide.units import format_size


def _table(title: str, columns: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    return render_table(title, columns, rows, left_columns=columns[:1])


def _mb(value_bytes_per_s: float | None) -> str:
    return "-" if value_bytes_per_s is None else f"{value_bytes_per_s / 1e6:.0f}"


def _rate_label(rate_bps: float | None) -> str:
    return f"{rate_bps / 1e6:.0f} Mbit/s" if rate_bps else "unpaced"


def frames_table(report: dict[str, Any]) -> str | None:
    """Frames: per size, iperf3's MB/s, the fastest raw variant's MB/s (and its name), and each codec's MB/s
    with its median ratio to raw (and to iperf3 for ``none``); None without rows."""
    frames = report.get("frames", [])
    if not frames:
        return None
    codecs = list(frames[0]["frames"])

    def iperf3_cell(r: dict[str, Any]) -> str:
        return _mb(r.get("iperf3", {}).get("bytes_per_s_median"))

    def codec_cell(r: dict[str, Any], c: str) -> str:
        entry = r["frames"][c]
        vs_iperf3 = f", {entry['vs_iperf3']:.2f}x iperf3" if c == "none" and "vs_iperf3" in entry else ""
        return f"{_mb(entry['bytes_per_s_median'])} ({entry['vs_raw']:.2f}x{vs_iperf3})"

    rows = [[format_size(r["size_bytes"]), iperf3_cell(r),
             f"{_mb(r['raw_bytes_per_s_median'])} {r.get('raw_variant', '')}".rstrip(),
             *(codec_cell(r, c) for c in codecs)]
            for r in frames]
    plan = report.get("plan", {})
    chunk = plan.get("recv_chunk_bytes")
    ahead = plan.get("read_ahead_bytes") or 0
    readers = plan.get("frame_readers") or ["exact"]  # reports before frame_readers: exact reads
    return _table(f"frames: MB/s of tensor bytes delivered (median of repeats) and x of the raw socket (its "
                  f"fastest variant); the receiver reads {readers[0]} frames (none/<reader>: the same "
                  f"frames read another way), recv_chunk_bytes {format_size(chunk)}, read_ahead_bytes "
                  f"{format_size(ahead) if ahead else 0}",
                  ["size", "iperf3", "raw socket", *codecs], rows)


def raw_variants_table(report: dict[str, Any]) -> str | None:
    """Raw variants: per size, every raw loop's median MB/s; None without rows or variants."""
    frames = [r for r in report.get("frames", []) if r.get("raw_variants")]
    if not frames:
        return None
    names = list(frames[0]["raw_variants"])
    rows = [[format_size(r["size_bytes"]), *(_mb(r["raw_variants"][n]["bytes_per_s_median"]) for n in names)]
            for r in frames]
    return _table("raw socket loops: MB/s (median of repeats), sender/receiver", ["size", *names], rows)


def cpu_table(report: dict[str, Any]) -> str | None:
    """CPU: per size, the source's and the sink's CPU seconds per second (median of repeats) in the raw
    reference's trials and the uncompressed frames' (``none`` and ``none/prebuilt``); None without the
    figures (reports before they were recorded)."""
    frames = [r for r in report.get("frames", []) if "source_cpu_per_s" in r["frames"].get("none", {})]
    if not frames:
        return None

    def cell(entry: dict[str, Any] | None) -> str:
        if not entry or "source_cpu_per_s" not in entry:
            return "-"
        return (f"{statistics.median(entry['source_cpu_per_s']):.2f} / "
                f"{statistics.median(entry['sink_cpu_per_s']):.2f}")

    keys = [k for k in ("none", "none/prebuilt") if k in frames[0]["frames"]]
    rows = [[format_size(r["size_bytes"]), cell(r["raw_variants"].get(r["raw_variant"])),
             *(cell(r["frames"].get(k)) for k in keys)] for r in frames]
    return _table("CPU seconds per second of a trial, source / sink (median of repeats): the side near 1.00 "
                  "binds", ["size", "raw socket", *keys], rows)


def codecs_table(report: dict[str, Any]) -> str | None:
    """Codecs: ratio and median encode / decode MB/s (raw bytes) per gradient, codec and threads; None without rows."""
    codecs = report.get("codecs", [])
    if not codecs:
        return None
    rows = [[c["gradient"], c["codec"], str(c["threads"]), f"{c['ratio']:.3f}",
             _mb(c["encode_bytes_per_s_median"]), _mb(c["decode_bytes_per_s_median"])] for c in codecs]
    return _table("codecs on real gradients: ratio, encode / decode MB/s of raw bytes (median)",
                  ["gradient", "codec", "threads", "ratio", "encode MB/s", "decode MB/s"], rows)


def links_table(report: dict[str, Any]) -> str | None:
    """Links: median ms per synchronous round trip, per rate and policy; None without rows."""
    links = report.get("links", [])
    if not links:
        return None
    policies = list(dict.fromkeys(r["policy"] for r in links))
    rows = []
    for rate in dict.fromkeys(r["rate_bps"] for r in links):
        median_s = {r["policy"]: r["message_s_median"] for r in links if r["rate_bps"] == rate}
        rows.append([_rate_label(rate), *(f"{median_s[p] * 1e3:.2f}" if p in median_s else "-" for p in policies)])
    return _table("links: ms per synchronous gradient round trip (median; digits MLP, 1.2 MB), paced sender",
                  ["link", *policies], rows)


def target_lines(summary: dict[str, Any]) -> list[str]:
    """The summary's targets, one line each: frames vs raw, then network-aware per link rate."""
    ratios = summary.get("uncompressed_frames_vs_raw_from_1MiB", {})
    met = "met" if summary.get("uncompressed_frames_target_0_90_met") else "MISSED"
    lines = [f"target: uncompressed frames >= 1 MiB at >= 0.90x raw: {met} "
             f"({', '.join(f'{format_size(int(k))} {v:.3f}x' for k, v in ratios.items())})"]
    vs_iperf3 = summary.get("uncompressed_frames_vs_iperf3_from_1MiB", {})
    if vs_iperf3:
        lines.append("uncompressed frames >= 1 MiB vs iperf3: "
                     + ", ".join(f"{format_size(int(k))} {v:.3f}x" for k, v in vs_iperf3.items()))
    for key, v in summary.get("links", {}).items():
        label = "unpaced" if key == rate_key(None) else _rate_label(float(key))
        p25 = v.get("network_aware_vs_best_fixed_p25")
        vs_seed = v.get("network_aware_vs_seed")
        lines.append(f"target at {label}: network-aware {v['network_aware_vs_best_fixed']:.3f}x the best fixed "
                     f"({v['best_fixed']}), {'<=' if v['within_5pct_of_best_fixed'] else '>'} 1.05 "
                     f"({'-' if p25 is None else f'{p25:.3f}x'} at the 25th percentile); vs seed "
                     f"{'-' if vs_seed is None else f'{vs_seed:.3f}x'} "
                     f"({'beats' if v['beats_seed'] else 'does not beat'} seed)")
    return lines


def format_report(report: dict[str, Any]) -> str:
    """The whole report as plain text (no colour codes): a header line, the three tables, the targets.

    Raises:
        KeyError: a section row without the fields the sections write (a report of schema_version 1
        spells its rates differently and is refused here).
    """
    m = report.get("machine_info", {})
    commit = (report.get("commit_info", {}).get("id") or "?")[:10]
    parts = [f"bench-wire | backend {report['backend']['name']} | {m.get('cpu_count_logical')} CPUs | "
             f"commit {commit}"]
    parts += [table for table in (frames_table(report), raw_variants_table(report), cpu_table(report),
                                   codecs_table(report), links_table(report)) if table]
    parts += target_lines(report.get("summary", {}))
    return "\n\n".join(parts) + "\n"
