"""Headless Chromium for tests that check what a person would see: a page's images decoded, a
screenshot of the MLflow UI.

``chromium()`` finds Debian's ``chromium``; when it is missing and the test runs as root with
apt-get (CI), it installs it. Missing and not installable: the test is skipped on a developer's
machine, and fails under CI (``CI`` set), where a skipped browser check would pass silently.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import tempfile
from pathlib import Path

import pytest

from apt import apt_install, can_install

FLAGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--disable-dev-shm-usage",
    "--hide-scrollbars",
    "--run-all-compositor-stages-before-draw",
]


def chromium() -> str:
    path = shutil.which("chromium") or shutil.which("chromium-browser")
    if path is None and can_install():
        apt_install("chromium")
        path = shutil.which("chromium")
    if path is None:
        why = "chromium is not installed (apt-get install chromium) and could not be installed here"
        if os.environ.get("CI"):
            pytest.fail(why)
        pytest.skip(why)
    return path


def _run(args: list[str], budget_ms: int, timeout: float = 180) -> subprocess.CompletedProcess:
    with tempfile.TemporaryDirectory(prefix="chromium-profile-") as profile:
        return subprocess.run(
            [chromium(), *FLAGS, f"--user-data-dir={profile}", f"--virtual-time-budget={budget_ms}", *args],
            check=False,
            capture_output=True,
            text=True,
            timeout=timeout,
        )


def screenshot(url: str, out: Path, size: str = "1600,1000", budget_ms: int = 15000) -> Path:
    proc = _run([f"--window-size={size}", f"--screenshot={out}", url], budget_ms)
    assert out.is_file() and out.stat().st_size > 0, f"no screenshot of {url}: {proc.stderr[-2000:]}"
    return out


# Run in the page after load: every <img>'s decoded size, written into the DOM that --dump-dom prints.
_PROBE = """<script>window.addEventListener('load', () => {
  const imgs = [...document.images].map(i => ({alt: i.alt, complete: i.complete, w: i.naturalWidth, h: i.naturalHeight}));
  const out = document.createElement('pre'); out.id = 'image-probe'; out.textContent = JSON.stringify(imgs);
  document.body.appendChild(out);
});</script>"""


def decoded_images(html_file: Path) -> list[dict]:
    """Open a copy of ``html_file`` (with a probe script added) in headless Chromium; returns, per
    <img>, what the browser decoded: ``{"alt", "complete", "w", "h"}`` (w = 0 for a broken image)."""
    with tempfile.TemporaryDirectory(prefix="image-probe-") as tmp:
        copy = Path(tmp) / html_file.name
        copy.write_text(html_file.read_text().replace("</body>", _PROBE + "</body>"))
        proc = _run(["--dump-dom", copy.as_uri()], 5000)
    found = re.search(r'<pre id="image-probe">(.*?)</pre>', proc.stdout, re.DOTALL)
    assert found, f"the page did not finish loading in Chromium: {proc.stderr[-2000:]}"
    return json.loads(found.group(1).replace("&quot;", '"').replace("&amp;", "&"))


def page_text(url: str, size: str = "1600,1000", budget_ms: int = 15000) -> list[str]:
    """The visible text of a page after its scripts ran, one entry per text node, in page order."""
    import html

    proc = _run([f"--window-size={size}", "--dump-dom", url], budget_ms)
    body = re.sub(r"<script.*?</script>|<style.*?</style>", "", proc.stdout, flags=re.DOTALL)
    text = html.unescape(re.sub(r"<[^>]+>", "\n", body))
    return [line.strip() for line in text.splitlines() if line.strip()]
