"""The HTML report: one self-contained page with every point, axis and failure, images embedded, no
external URL; comparison of several reports on the same axes; the CLI's --html."""

from __future__ import annotations

import base64
import html
import io
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
from markupsafe import escape

matplotlib_image = pytest.importorskip("matplotlib.image")

from harness.present.html import (  # noqa: E402
    CHART_METRICS,
    default_html_path,
    reference_figures,
    render_page,
    write_html,
)
from harness.results.report import parse_report  # noqa: E402
from tests.report_samples import (  # noqa: E402
    FAILED_ERROR,
    PARTIAL_ERROR,
    buffers_report,
    compression_report,
)

REPO_ROOT = Path(__file__).resolve().parents[2]
IMG_SRC = re.compile(r'<img\b[^>]*\bsrc="([^"]*)"')


def _images(page: str) -> list[bytes]:
    out = []
    for src in IMG_SRC.findall(page):
        assert src.startswith("data:image/png;base64,"), src[:80]
        out.append(base64.b64decode(src.split(",", 1)[1], validate=True))
    return out


def _write(tmp_path: Path, name: str, report: dict) -> Path:
    folder = tmp_path / name
    folder.mkdir()
    path = folder / "report.json"
    path.write_text(json.dumps(report))
    return path


@pytest.fixture(scope="module")
def page() -> str:
    return render_page([("seed-buffers-20261121T150827Z", buffers_report())])


def test_every_point_and_axis_is_on_the_page(page):
    report = buffers_report()
    assert "<h1>seed-buffers-20261121T150827Z</h1>" in page
    assert "buffer_bytes" in page  # the axis: table header, chart alt texts
    table = page[page.index("<table>"):page.index("</table>")]
    for point in report["points"]:
        value = point["params"]["buffer_bytes"]
        assert f'<td class="text">{value}</td>' in table, value
        assert f"point {point['index']}: buffer_bytes={value}" in page  # its time series and repeats
    assert table.count("<tr class=") == len(report["points"])
    # every figure with data has its chart, named by its axis
    for key, title, _, _ in CHART_METRICS:
        if any(p["summary"].get(key) for p in report["points"]):
            assert f'alt="{title} by buffer_bytes"' in page, title
    # the spec's description and base are shown, and the machine the numbers come from
    assert str(escape(report["spec"]["description"])) in page and "The seeds' buffer" not in page
    assert "hidden_sizes=512x512" in page and "2 CPUs" in page and "backend docker" in page


def test_images_are_embedded_pngs_that_decode(page):
    images = _images(page)
    ok_points = [p for p in buffers_report()["points"] if p["repeats"]]
    charts = sum(1 for key, *_ in CHART_METRICS if any(p["summary"].get(key) for p in buffers_report()["points"]))
    assert len(images) == charts + len(ok_points)  # metric charts + one time-series figure per point
    for data in images:
        pixels = matplotlib_image.imread(io.BytesIO(data), format="png")
        height, width = pixels.shape[:2]
        assert width >= 500 and height >= 250
        assert len({tuple(px) for px in pixels.reshape(-1, pixels.shape[2])[::7]}) > 20  # not blank


def test_no_external_url_nor_script(page):
    assert "<script" not in page.lower() and "<link" not in page.lower() and "@import" not in page
    assert "http://" not in page and "https://" not in page
    values = re.findall(r"""\b(?:src|srcset|href|action|poster|data)\s*=\s*["']?([^"'\s>]*)""", page)
    assert values and all(v.startswith("data:image/png;base64,") or v.startswith("#") for v in values)
    assert not re.search(r"url\(", page)
    assert "Content-Security-Policy" in page and "default-src 'none'" in page


def test_failed_and_partial_points_are_shown_with_their_errors(page):
    escaped_failed = html.escape(FAILED_ERROR, quote=True)
    assert escaped_failed in page and "<OOM & killed>" not in page  # escaped, not raw markup
    assert html.escape(PARTIAL_ERROR, quote=True) in page
    assert '<tr class="failed">' in page and '<tr class="partial">' in page
    failures = page[page.index('<h3 id="failures-1">Failures</h3>'):]
    assert "point 3" in failures and "buffer_bytes=16MiB" in failures and "point 2" in failures
    # the table has each failed repeat's first line and a link to the whole text
    table = page[page.index("<table>"):page.index("</table>")]
    assert "repeat 0: timed out after 90 s" in table and 'href="#failures-1"' in table


def test_seed_reference_is_matched_to_points_and_compared(page):
    rows = reference_figures(parse_report(buffers_report()))
    by_key = {r.key: r for r in rows}
    assert by_key["1MiB"].value == pytest.approx(1.2e6) and by_key["1MiB"].metric == "goodput_bytes_per_s"
    assert by_key["8MiB"].point.params == {"buffer_bytes": "8MiB"}
    assert by_key["16MiB"].value is None and by_key["16MiB"].text == "no additional benefit"
    section = page[page.index("The seeds' figures next to this sweep"):]
    assert "no additional benefit" in section and "2.42x" in section  # 2.90 / 1.2, the seeds' trend
    rows = {(r.key, r.field): r for r in reference_figures(parse_report(compression_report()))}
    assert rows[("none", "batches_per_s")].metric == "batches_per_s"
    assert rows[("adaptive", "throughput_MBps")].value == pytest.approx(2.9e6)
    assert rows[("none", "ratio")].value is None  # "1.88 (pickle/zlib default)": shown, not charted
    assert rows[("gradient-compression", "ratio")].point is None  # no such point in this sweep


def test_effective_socket_buffers_are_shown(page):
    assert "socket buffers, requested → effective" in page and "1 → 2 MiB" in page


def test_incomplete_local_report_renders_with_banner_and_no_network_panel():
    page = render_page([("local", buffers_report(docker=False, complete=False))])
    assert "INCOMPLETE" in page and "interrupted by SIGINT after 10 of 12 runs" in page
    assert len(_images(page)) >= 4


def test_reports_without_ok_points_or_without_points_render():
    report = buffers_report()
    report["points"] = [p for p in report["points"] if p["status"] == "failed"]
    page = render_page([("all-failed", report)])
    assert "No ok repeat to chart" in page and html.escape(FAILED_ERROR) in page
    report["points"], report["complete"] = [], False
    assert "INCOMPLETE" in render_page([("just-started", report)])
    single = buffers_report()
    single["spec"]["axes"], single["param_names"] = {}, []
    single["points"] = single["points"][:1]
    single["points"][0]["params"] = {}
    assert "(single point)" in render_page([("single", single)])


def test_comparison_puts_reports_on_the_same_axes(tmp_path):
    a = _write(tmp_path, "seed-buffers-A", buffers_report())
    other = buffers_report()
    other["points"] = other["points"][:2]
    b = _write(tmp_path, "seed-buffers-B", other)
    out = write_html([a, b])
    assert out == tmp_path / "seed-buffers-A" / "compare-seed-buffers-B.html" == default_html_path([a, b])
    page = out.read_text()
    assert "Comparison: seed-buffers-A vs seed-buffers-B" in page
    assert "<h2>seed-buffers-A</h2>" in page and "<h2>seed-buffers-B</h2>" in page
    # one set of charts for both (same axis: buffer_bytes), then each report's time series
    charts = page[page.index('<div class="charts">'):page.index("</div>")]
    assert charts.count("<img") == sum(1 for key, *_ in CHART_METRICS
                                       if any(p["summary"].get(key) for p in buffers_report()["points"]))
    assert 'alt="Training speed by buffer_bytes"' in charts
    # different axes: x becomes "name=value" and both reports' points are there
    c = _write(tmp_path, "seed-compression-C", compression_report())
    page = write_html([a, c], tmp_path / "out" / "cmp.html").read_text()
    assert 'alt="Training speed by point"' in page
    for value in ("none", "zlib-1", "zlib-9", "adaptive"):
        assert f"compression={value}" in page
    assert write_html([a]) == a.parent / "report.html"


def test_cli_report_html_prints_table_then_page_path(tmp_path):
    a = _write(tmp_path, "seed-buffers-A", buffers_report())
    out = subprocess.run([sys.executable, "-m", "harness", "report", str(a.parent), "--html"], cwd=REPO_ROOT,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.strip().splitlines()
    assert lines[-1] == str(a.parent / "report.html") and Path(lines[-1]).is_file()
    assert lines[-2] == str(a) and "batches/s" in out.stdout
    b = _write(tmp_path, "seed-compression-B", compression_report())
    out = subprocess.run([sys.executable, "-m", "harness", "report", str(a), str(b), "--html",
                          "--out", str(tmp_path / "c.html")], cwd=REPO_ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().splitlines()[-1] == str(tmp_path / "c.html")
    assert "zlib-9" in out.stdout  # both tables printed
    out = subprocess.run([sys.executable, "-m", "harness", "report", str(a), "--out", "x.html"], cwd=REPO_ROOT,
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and "--html" in out.stderr
    out = subprocess.run([sys.executable, "-m", "harness", "report", str(tmp_path / "nope"), "--html"],
                         cwd=REPO_ROOT, capture_output=True, text=True, timeout=60)
    assert out.returncode == 1 and "cannot read" in out.stderr and "Traceback" not in out.stderr
