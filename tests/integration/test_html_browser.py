"""The HTML report in a real browser: headless Debian chromium loads the page from file://, and over the
DevTools protocol (on a pipe: no port, no extra package) we collect console errors, uncaught exceptions
and failed or refused loads, check that every image decoded, and take a full-page screenshot.

`make test` installs chromium first (`make browser`, as root, from Debian's packages). The test skips
only where chromium is missing and cannot be installed (not root); as root a missing chromium fails.
"""

from __future__ import annotations

import base64
import fcntl
import io
import json
import os
import select
import shutil
import signal
import subprocess
import time
from pathlib import Path
from typing import Any

import pytest

matplotlib_image = pytest.importorskip("matplotlib.image")

from harness.present.html import render_page  # noqa: E402
from tests.report_samples import buffers_report  # noqa: E402

CHROMIUM_FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                  "--disable-background-networking", "--disable-component-update", "--disable-sync",
                  "--disable-extensions", "--disable-default-apps", "--mute-audio", "--hide-scrollbars",
                  "--remote-debugging-pipe", "--window-size=1280,2000"]
WIDTH = 1280


def _chromium() -> str:
    path = shutil.which("chromium") or ("/usr/bin/chromium" if os.path.exists("/usr/bin/chromium") else None)
    if path:
        return path
    if os.geteuid() != 0:
        pytest.skip("chromium is not installed and cannot be installed here (not root): "
                    "as root, `make browser` installs Debian's chromium")
    pytest.fail("chromium is missing: run `make browser` (or `make test`, which does) to install Debian's chromium")


def _above_9(fd: int) -> int:
    high = fcntl.fcntl(fd, fcntl.F_DUPFD_CLOEXEC, 10)
    os.close(fd)
    return high


class DevTools:
    """Chrome DevTools protocol over --remote-debugging-pipe (fd 3: commands in, fd 4: replies and events
    out, each message JSON ended by NUL)."""

    def __init__(self, chromium: str, profile: Path, log_path: Path) -> None:
        to_chrome_r, self._to_chrome = os.pipe()
        self._from_chrome, from_chrome_w = os.pipe()
        # the child's ends above fd 9, so that moving them to 3 and 4 cannot clobber one another
        to_chrome_r, from_chrome_w = (_above_9(fd) for fd in (to_chrome_r, from_chrome_w))
        self._log = open(log_path, "wb")
        # bash (dash takes one-digit fds only) moves them to fds 3 and 4, where chromium expects them
        moves = f"3<&{to_chrome_r} 4>&{from_chrome_w} {to_chrome_r}<&- {from_chrome_w}>&-"
        self.proc = subprocess.Popen(
            ["/bin/bash", "-c", f'exec "$0" "$@" {moves}', chromium, *CHROMIUM_FLAGS,
             f"--user-data-dir={profile}", "about:blank"],
            pass_fds=(to_chrome_r, from_chrome_w), stdin=subprocess.DEVNULL, stdout=self._log,
            stderr=subprocess.STDOUT, start_new_session=True)
        os.close(to_chrome_r)
        os.close(from_chrome_w)
        self._buf = b""
        self._next_id = 0
        self.events: list[dict[str, Any]] = []

    def _read_message(self, deadline: float) -> dict[str, Any]:
        while b"\0" not in self._buf:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError("chromium did not answer over the DevTools pipe in time")
            ready, _, _ = select.select([self._from_chrome], [], [], left)
            if ready:
                chunk = os.read(self._from_chrome, 1 << 20)
                if not chunk:
                    raise ConnectionError(f"chromium closed the DevTools pipe (exit code {self.proc.poll()})")
                self._buf += chunk
        raw, self._buf = self._buf.split(b"\0", 1)
        return json.loads(raw)

    def send(self, method: str, params: dict[str, Any] | None = None, session: str | None = None,
             timeout_s: float = 60.0) -> dict[str, Any]:
        self._next_id += 1
        message: dict[str, Any] = {"id": self._next_id, "method": method, "params": params or {}}
        if session:
            message["sessionId"] = session
        os.write(self._to_chrome, json.dumps(message).encode() + b"\0")
        deadline = time.monotonic() + timeout_s
        while True:
            reply = self._read_message(deadline)
            if reply.get("id") == self._next_id:
                if "error" in reply:
                    raise RuntimeError(f"{method}: {reply['error']}")
                return reply.get("result", {})
            self.events.append(reply)

    def wait_event(self, method: str, timeout_s: float = 60.0) -> dict[str, Any]:
        for event in self.events:
            if event.get("method") == method:
                return event
        deadline = time.monotonic() + timeout_s
        while True:
            event = self._read_message(deadline)
            self.events.append(event)
            if event.get("method") == method:
                return event

    def drain(self, seconds: float) -> None:
        deadline = time.monotonic() + seconds
        try:
            while True:
                self.events.append(self._read_message(deadline))
        except TimeoutError:
            pass

    def close(self) -> None:
        try:
            if self.proc.poll() is None:
                self.send("Browser.close", timeout_s=10)
        except (OSError, RuntimeError, TimeoutError, ConnectionError):
            pass
        try:
            self.proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)  # the group chromium leads (start_new_session)
            self.proc.wait(timeout=10)
        for fd in (self._to_chrome, self._from_chrome):
            try:
                os.close(fd)
            except OSError:
                pass
        self._log.close()


def load_in_chromium(page: Path, tmp_path: Path) -> dict[str, Any]:
    """Open `page` in headless chromium; return its errors, image check and full-page screenshot (PNG)."""
    tools = DevTools(_chromium(), tmp_path / "profile", tmp_path / "chromium.log")
    try:
        target = tools.send("Target.createTarget", {"url": "about:blank"})["targetId"]
        session = tools.send("Target.attachToTarget", {"targetId": target, "flatten": True})["sessionId"]
        for domain in ("Page", "Runtime", "Log"):
            tools.send(f"{domain}.enable", session=session)
        tools.send("Emulation.setDeviceMetricsOverride",
                   {"width": WIDTH, "height": 2000, "deviceScaleFactor": 1, "mobile": False}, session=session)
        nav = tools.send("Page.navigate", {"url": page.resolve().as_uri()}, session=session)
        assert not nav.get("errorText"), nav
        tools.wait_event("Page.loadEventFired")
        tools.drain(1.0)  # late console messages
        check = tools.send("Runtime.evaluate", {"returnByValue": True, "expression": """JSON.stringify({
            images: document.images.length,
            broken: Array.from(document.images).filter(i => !i.complete || i.naturalWidth === 0).length,
            height: document.documentElement.scrollHeight, title: document.title})"""}, session=session)
        info = json.loads(check["result"]["value"])
        shot = tools.send("Page.captureScreenshot", {"format": "png", "captureBeyondViewport": True,
                                                      "clip": {"x": 0, "y": 0, "width": WIDTH,
                                                               "height": min(info["height"], 16000), "scale": 1}},
                          session=session, timeout_s=120)
        tools.drain(0.3)
    finally:
        tools.close()
    errors = []
    for event in tools.events:
        method, params = event.get("method"), event.get("params", {})
        if method == "Runtime.exceptionThrown":
            errors.append(f"exception: {params['exceptionDetails'].get('text')}")
        elif method == "Runtime.consoleAPICalled" and params.get("type") in ("error", "assert"):
            errors.append(f"console.{params['type']}: {[a.get('value') for a in params.get('args', [])]}")
        elif method == "Log.entryAdded" and params["entry"].get("level") == "error":
            entry = params["entry"]
            errors.append(f"log ({entry.get('source')}): {entry.get('text')} {entry.get('url', '')}")
    return {"errors": errors, "info": info, "png": base64.b64decode(shot["data"])}


def _distinct_colours(png: bytes) -> int:
    pixels = matplotlib_image.imread(io.BytesIO(png), format="png")
    flat = (pixels.reshape(-1, pixels.shape[2])[:, :3] * 255).astype("uint8")
    return len({bytes(px) for px in flat[::3]})


@pytest.fixture(scope="module")
def rendered(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("html")
    page = tmp / "report.html"
    page.write_text(render_page([("seed-buffers-20261121T150827Z", buffers_report())]), encoding="utf-8")
    return load_in_chromium(page, tmp), tmp


def test_page_renders_without_console_errors(rendered):
    result, tmp = rendered
    shot = tmp / "screenshot.png"
    shot.write_bytes(result["png"])
    print(f"screenshot: {shot}")
    assert result["errors"] == []
    assert result["info"]["title"] == "seed-buffers-20261121T150827Z"
    assert result["info"]["images"] >= 10 and result["info"]["broken"] == 0


def test_screenshot_is_not_blank(rendered):
    result, _ = rendered
    pixels = matplotlib_image.imread(io.BytesIO(result["png"]), format="png")
    height, width = pixels.shape[:2]
    assert width == WIDTH and height > 2000  # the whole page, taller than one window
    assert _distinct_colours(result["png"]) > 500  # charts, text and tables, not one flat colour


def test_an_external_load_would_be_caught(tmp_path):
    """The check above can fail: a page trying to load from outside is refused (CSP) and logged."""
    text = render_page([("control", buffers_report())])
    bad = tmp_path / "bad.html"
    bad.write_text(text.replace("<body>", '<body><img src="https://example.invalid/pixel.png" alt="">', 1))
    result = load_in_chromium(bad, tmp_path)
    assert any("example.invalid" in e for e in result["errors"]), result["errors"]
