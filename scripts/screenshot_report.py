#!/usr/bin/env python3
"""Render a report.html in headless Chromium, offline, and save a screenshot.

    python scripts/screenshot_report.py REPORT_DIR/report.html OUT.png [--height 4000]

Network features are switched off and a fresh profile is used, so anything the page failed to
inline would show as a broken image. Exit status 2 when no Chromium is installed.
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

BROWSERS = ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable")


def find_browser() -> str | None:
    return next((path for name in BROWSERS if (path := shutil.which(name))), None)


def screenshot(html_path: str, png_path: str, width: int = 1200, height: int = 4000, timeout: int = 120) -> None:
    browser = find_browser()
    if browser is None:
        raise FileNotFoundError("no Chromium found (apt-get install -y chromium)")
    with tempfile.TemporaryDirectory(prefix="requant-chromium-") as profile:
        subprocess.run(
            [browser, "--headless", "--no-sandbox", "--disable-gpu", "--no-first-run",
             "--disable-background-networking", "--disable-component-update", "--disable-sync",
             "--disable-extensions", "--hide-scrollbars", f"--user-data-dir={profile}",
             f"--window-size={width},{height}", f"--screenshot={Path(png_path).resolve()}",
             Path(html_path).resolve().as_uri()],
            check=True, capture_output=True, timeout=timeout)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("html")
    parser.add_argument("png")
    parser.add_argument("--width", type=int, default=1200)
    parser.add_argument("--height", type=int, default=4000)
    args = parser.parse_args()
    try:
        screenshot(args.html, args.png, args.width, args.height)
    except FileNotFoundError as e:
        print(e, file=sys.stderr)
        return 2
    print(args.png)
    return 0


if __name__ == "__main__":
    sys.exit(main())
