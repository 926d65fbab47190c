"""The world panel in JupyterLab (Chromium, Playwright): 16 ranks grouped as %dist_status groups them,
refreshed while a cell runs; a rank killed from outside shows as dead at once; the panel's actions
clicked while the cell runs: the dashboard as a tab, interrupt, restart the dead rank (it runs as soon as
the cell has stopped). Screenshots in test-artifacts/."""

from __future__ import annotations

import json
import os
import signal
import time
import urllib.request

from tests.browser.test_dashboard_browser import ARTIFACTS, _browser, _dismiss_news, _server, _write_notebook

RANKS = 16
CELLS = [
    f"%load_ext nbdist\n%dist_start -n {RANKS}",
    "%%distributed\n"
    "import time, nbdist\n"
    "for step in range(100000):\n"
    "    nbdist.log(step=step, **{'time/step_s': 0.05, 'time/data_s': 0.03 if dist.get_rank() == 3 else 0.0})\n"
    "    time.sleep(0.05 * (1.3 if dist.get_rank() == 3 else 1.0))",
]


def _worlds(base: str, token: str) -> list[dict]:
    return json.load(urllib.request.urlopen(f"{base}/nbdist/api/worlds?token={token}"))["worlds"]


def _panel_text(page) -> str:
    return page.evaluate("() => document.getElementById('nbdist-worlds').innerText")


def test_sixteen_ranks_a_killed_rank_and_the_actions_while_a_cell_runs(tmp_path):
    _write_notebook(tmp_path / "live.ipynb", CELLS)
    with _server(tmp_path, "jupyterlab") as (base, token), _browser() as browser:
        try:
            page = browser.new_page(viewport={"width": 1400, "height": 1000})
            page.goto(f"{base}/lab/tree/live.ipynb?token={token}")
            page.wait_for_selector(".jp-Notebook .jp-Cell", timeout=90_000)
            try:
                page.click(".jp-Dialog button:has-text('Select')", timeout=10_000)
            except Exception:
                pass
            page.wait_for_selector(".jp-Notebook-ExecutionIndicator[data-status='idle']", timeout=90_000)
            page.click("li[data-id='nbdist-worlds']", timeout=30_000)  # the panel's tab in the left bar
            page.wait_for_selector("#nbdist-worlds .nbdist-empty", timeout=30_000)
            page.click("text=Run", timeout=30_000)
            page.click("text=Run All Cells", timeout=30_000)
            page.wait_for_function(
                f"() => document.getElementById('nbdist-worlds').innerText.includes('ranks 0-{RANKS - 1}: busy at cell line')",
                timeout=180_000,
            )
            # the slowest rank and what holds it, from the metrics the running cell logs
            page.wait_for_function(
                "() => document.getElementById('nbdist-worlds').innerText.includes('rank 3 slowest')", timeout=60_000
            )
            text = _panel_text(page)
            assert "held by data wait" in text and "live.ipynb · 16 ranks" in text, text
            [world] = _worlds(base, token)
            assert all(r["rss_MiB"] and r["rss_MiB"] > 50 for r in world["ranks"]), world["ranks"]  # each rank's memory
            victim = next(r for r in world["ranks"] if r["rank"] == 5)
            os.kill(victim["pid"], signal.SIGKILL)  # from outside the notebook, mid-cell
            page.wait_for_function(
                "() => document.getElementById('nbdist-worlds').innerText.includes('rank 5: dead')", timeout=30_000
            )
            text = _panel_text(page)
            assert "ranks 0-4,6-15: busy at cell line" in text, text
            _dismiss_news(page)
            page.screenshot(path=str(ARTIFACTS / "panel-16-ranks.png"), full_page=True)
            page.click("#nbdist-worlds button:has-text('Dashboard')")
            page.wait_for_selector(".nbdist-DashboardView .js-plotly-plot", timeout=30_000)
            page.screenshot(path=str(ARTIFACTS / "panel-dashboard-tab.png"), full_page=True)
            page.click("#nbdist-worlds button:has-text('Restart rank 5')")  # queued: the cell still runs
            page.wait_for_function(
                "() => document.getElementById('nbdist-worlds').innerText.includes('after the running cell')",
                timeout=10_000,
            )
            page.click("#nbdist-worlds button:has-text('Interrupt')")
            page.wait_for_function(
                f"() => document.getElementById('nbdist-worlds').innerText.includes('ranks 0-{RANKS - 1}: idle')",
                timeout=180_000,
            )  # the cell stopped, then rank 5 came back
            assert "%dist_restart 5: done" in _panel_text(page), _panel_text(page)
            page.screenshot(path=str(ARTIFACTS / "panel-after-restart.png"), full_page=True)
        finally:
            try:  # the world ends with its kernel
                for kernel in json.load(urllib.request.urlopen(f"{base}/api/kernels?token={token}")):
                    req = urllib.request.Request(f"{base}/api/kernels/{kernel['id']}?token={token}", method="DELETE")
                    urllib.request.urlopen(req)
                time.sleep(1)
            except OSError:
                pass
