"""The world panel in JupyterLab (Chromium, Playwright): 16 ranks grouped as %dist_status groups them,
each busy rank's cell line, the slowest rank and what holds it, refreshed while a cell runs; the
actions clicked while the cell runs (its dashboard as a tab, interrupt); a rank killed from outside in a
running cell shows as dead at once, and the panel restarts it. Screenshots in test-artifacts/."""

from __future__ import annotations

import json
import os
import re
import signal
import time
import urllib.request

from tests.browser.test_dashboard_browser import ARTIFACTS, _browser, _dismiss_news, _server, _write_notebook
from tests.browser.test_leave_and_return import _end_kernels, _select_kernel
from tests.helpers import wait_gone
from tests.why_cases import cell

RANKS = 16
CELLS = [
    f"%load_ext nbdist\n%dist_start -n {RANKS} --oversubscribe",
    "%%distributed\n"
    "import time, nbdist\n"
    "for step in range(100000):\n"
    "    slow = dist.get_rank() == 3  # 30% slower, most of it waiting for data\n"
    "    nbdist.log(step=step, **{'time/step_s': 0.065 if slow else 0.05, 'time/data_s': 0.04 if slow else 0.0})\n"
    "    time.sleep(0.065 if slow else 0.05)",
]


def _open_lab(browser, base: str, token: str):
    """A page on live.ipynb in JupyterLab, its kernel idle."""
    page = browser.new_page(viewport={"width": 1400, "height": 1000})
    page.goto(f"{base}/lab/tree/live.ipynb?token={token}")
    page.wait_for_selector(".jp-Notebook .jp-Cell", timeout=90_000)
    _select_kernel(page)
    page.wait_for_selector(".jp-Notebook-ExecutionIndicator[data-status='idle']", timeout=90_000)
    return page


def _worlds(base: str, token: str) -> list[dict]:
    return json.load(urllib.request.urlopen(f"{base}/nbdist/api/worlds?token={token}"))["worlds"]


def _panel_text(page) -> str:
    return page.evaluate("() => document.getElementById('nbdist-worlds').innerText")


def _states(page) -> dict[int, str]:
    """Each rank's state as the panel's group lines say it ('ranks 0-4,6-15: busy at cell line 4 on vm (cpu)')."""
    states = {}
    for text in page.evaluate(
        "() => Array.from(document.querySelectorAll('#nbdist-worlds .nbdist-group')).map(e => e.innerText)"
    ):
        found = re.match(r"ranks? ([\d,-]+): (.*?)(?: on \S+)? \(", text)
        if not found:
            continue
        for part in found.group(1).split(","):
            low, _, high = part.partition("-")
            for rank in range(int(low), int(high or low) + 1):
                states[rank] = found.group(2)
    return states


def _wait(page, ok, seconds: float) -> dict[int, str]:
    """Until the panel's states satisfy ``ok`` (all 16 ranks named); the states then."""
    deadline = time.monotonic() + seconds
    while True:
        states = _states(page)
        if len(states) == RANKS and ok(states):
            return states
        assert time.monotonic() < deadline, (states, _panel_text(page), _notebook_said(page))
        time.sleep(0.3)


def _notebook_said(page) -> str:
    """The kernel's status and each cell's prompt, for a failure's message."""
    try:
        return page.evaluate(
            "() => (document.querySelector('.jp-Notebook-ExecutionIndicator') || {dataset: {}}).dataset.status + ' ' "
            "+ Array.from(document.querySelectorAll('.jp-Notebook .jp-Cell .jp-InputPrompt')).map(p => p.textContent)"
            ".join(' ')"
        )
    except Exception as exc:  # only a message: never hide the failure it explains
        return f"(the page did not say: {exc})"


def _run_cell(page, index: int) -> None:
    """Run the notebook's cell ``index`` with Shift+Enter, again if its prompt does not turn to [*]: on a loaded
    2-core machine the key can land before the editor has focus, and the cell then never runs."""
    from playwright.sync_api import TimeoutError as PlaywrightTimeout

    cell = page.locator(".jp-Notebook .jp-Cell").nth(index)
    # first the run before it must be over (the kernel idle, the prompt [N] again): a '[*]' still standing from an
    # interrupted run would pass the check below while the key press itself went nowhere
    page.wait_for_selector(".jp-Notebook-ExecutionIndicator[data-status='idle']", timeout=90_000)
    page.wait_for_function(
        "(i) => !document.querySelectorAll('.jp-Notebook .jp-Cell')[i]"
        ".querySelector('.jp-InputPrompt').textContent.includes('*')",
        arg=index,
        timeout=90_000,
    )
    for _ in range(3):
        cell.locator(".jp-InputArea-editor").click()
        page.keyboard.press("Shift+Enter")
        try:
            page.wait_for_function(
                "(i) => document.querySelectorAll('.jp-Notebook .jp-Cell')[i]"
                ".querySelector('.jp-InputPrompt').textContent.includes('*')",
                arg=index,
                timeout=15_000,
            )
            return
        except PlaywrightTimeout:  # press again
            continue
    raise AssertionError(f"cell {index} did not start after three Shift+Enter")


def test_sixteen_ranks_a_killed_rank_and_the_actions_while_a_cell_runs(tmp_path):
    _write_notebook(tmp_path / "live.ipynb", CELLS)
    with _server(tmp_path, "jupyterlab") as (base, token), _browser() as browser:
        try:
            page = _open_lab(browser, base, token)
            page.click("li[data-id='nbdist-worlds']", timeout=30_000)  # the panel's tab in the left bar
            page.wait_for_selector("#nbdist-worlds .nbdist-empty", timeout=30_000)
            page.click("text=Run", timeout=30_000)
            page.click("text=Run All Cells", timeout=30_000)
            page.wait_for_function(  # the world shows as soon as it has started, before any distributed cell
                f"() => document.getElementById('nbdist-worlds').innerText.includes('{RANKS} ranks')", timeout=180_000
            )
            _wait(page, lambda states: all(s.startswith("busy at cell line") for s in states.values()), 180)
            # the slowest rank and what holds it, from the metrics the running cell logs
            page.wait_for_function(
                "() => document.getElementById('nbdist-worlds').innerText.includes('rank 3 slowest')", timeout=60_000
            )
            text = _panel_text(page)
            assert "held by data wait" in text and "live.ipynb · 16 ranks" in text, text
            [world] = _worlds(base, token)
            assert all(r["rss_MiB"] and r["rss_MiB"] > 50 for r in world["ranks"]), world["ranks"]  # each rank's memory
            _dismiss_news(page)
            page.screenshot(path=str(ARTIFACTS / "panel-16-ranks.png"), full_page=True)
            # the memory band (each rank's memory comes once a batch, at the rank's own step) goes on to the slowest
            # rank's latest sample, as drawn: it stopped about 45 steps short (at 105 of rank 3's 150)
            ends = page.evaluate(
                "() => { const out = {}; for (const gd of document.querySelectorAll('.jp-Notebook .js-plotly-plot')) {"
                " for (const t of (gd.data || [])) { const xs = Array.from(t.x || []);"
                " if (xs.length && t.yaxis === 'y2') out[t.name] = Math.max(...xs); } } return out; }"
            )
            band = max((x for name, x in ends.items() if name.startswith("min–max")), default=-1)
            assert band >= ends["rank 3 (slowest)"] - 15, ends  # -1: no band drawn yet
            # while the cell runs: its dashboard as a tab, then interrupt it
            page.click("#nbdist-worlds button:has-text('Dashboard')")
            page.wait_for_selector(
                ".nbdist-DashboardView .js-plotly-plot .gtitle", timeout=90_000
            )  # plotly.js loads first
            title = page.evaluate("() => document.querySelector('.nbdist-DashboardView .gtitle').textContent")
            assert "ranks 0-15: busy" in title, title
            page.screenshot(path=str(ARTIFACTS / "panel-dashboard-tab.png"), full_page=True)
            widths = page.evaluate(
                "() => [document.querySelector('.nbdist-DashboardView').clientWidth,"
                " document.querySelector('.nbdist-DashboardView .js-plotly-plot .main-svg').getBoundingClientRect().width]"
            )
            assert widths[1] > 0.85 * widths[0], f"the figure fills the tab's width: {widths}"  # was half of it
            page.click("#nbdist-worlds button:has-text('Interrupt')")
            _wait(page, lambda states: set(states.values()) == {"idle"}, 60)
            assert "interrupt sent" in _panel_text(page)
            # a rank killed from outside while a cell runs: dead at once, the others released; restart it
            page.click(".lm-DockPanel-tabBar .lm-TabBar-tab:has-text('live.ipynb')")  # back from the dashboard's tab
            _run_cell(page, 1)  # the training cell again
            _wait(page, lambda states: all(s.startswith("busy") for s in states.values()), 120)
            victim = next(r for r in _worlds(base, token)[0]["ranks"] if r["rank"] == 5)
            os.kill(victim["pid"], signal.SIGKILL)
            _wait(
                page, lambda states: states[5] == "dead" and all(s != "dead" for r, s in states.items() if r != 5), 60
            )
            page.screenshot(path=str(ARTIFACTS / "panel-dead-rank.png"), full_page=True)
            page.click("#nbdist-worlds button:has-text('Restart rank 5')")
            _wait(page, lambda states: set(states.values()) == {"idle"}, 120)
            page.wait_for_function(
                "() => document.getElementById('nbdist-worlds').innerText.includes('rank(s) 5 restarted: world rebuilt in')",
                timeout=30_000,
            )
            [world] = _worlds(base, token)
            assert next(r for r in world["ranks"] if r["rank"] == 5)["pid"] != victim["pid"]  # a new process
            page.screenshot(path=str(ARTIFACTS / "panel-after-restart.png"), full_page=True)
            pids = [r["pid"] for r in _worlds(base, token)[0]["ranks"]]
            page.click("#nbdist-worlds button:has-text('Stop')")  # interrupt (nothing runs), then %dist_stop
            page.wait_for_selector("#nbdist-worlds .nbdist-empty", timeout=60_000)
            assert wait_gone(pids, 30) == [], "the panel's Stop ends every rank"
        finally:
            try:  # the world ends with its kernel
                for kernel in json.load(urllib.request.urlopen(f"{base}/api/kernels?token={token}")):
                    req = urllib.request.Request(f"{base}/api/kernels/{kernel['id']}?token={token}", method="DELETE")
                    urllib.request.urlopen(req)
                time.sleep(1)
            except OSError:
                pass


HANG = [
    "%load_ext nbdist\n%dist_start -n 2",
    "%%distributed\nimport time\nif dist.get_rank() == 1:\n    time.sleep(600)  # late\ndist.barrier()",
    "%%dist_why\n" + cell("data", 1, 0),  # rank 1's loader sleeps 30 ms a step
]


def test_two_ranks_at_the_panels_width_with_headers_and_who_a_hang_waits_for(tmp_path):
    """At its default width the panel shows one row per rank under headers (rank, state, where, memory), only the
    state wrapping, the four actions on one line; during a barrier that rank 1 is late to, rank 0's state says what
    %dist_where knows: waiting in barrier for rank 1. Then a %%dist_why cell with slow input on rank 1: the panel's
    line takes the verdict's words."""
    _write_notebook(tmp_path / "live.ipynb", HANG)
    with _server(tmp_path, "jupyterlab") as (base, token), _browser() as browser:
        try:
            page = _open_lab(browser, base, token)
            page.click("li[data-id='nbdist-worlds']", timeout=30_000)
            _run_cell(page, 0)
            _run_cell(page, 1)
            page.wait_for_function(
                "() => document.getElementById('nbdist-worlds').innerText.includes('waiting in barrier for rank 1')",
                timeout=120_000,
            )
            _dismiss_news(page)
            page.screenshot(path=str(ARTIFACTS / "panel-two-ranks-hang.png"))
            rows = page.evaluate(
                """() => Array.from(document.querySelectorAll('#nbdist-worlds tr')).map(tr =>
                    Array.from(tr.children).map(td => {
                        const range = document.createRange();
                        range.selectNodeContents(td);
                        return [td.innerText, range.getClientRects().length];
                    }))"""
            )
            assert [cell[0] for cell in rows[0]] == ["rank", "state", "where", "memory"], rows
            assert [row[0][0] for row in rows[1:]] == ["0", "1"], rows
            assert rows[1][1][0] == "waiting in barrier for rank 1 (cell line 4)", rows
            assert rows[2][1][0] == "busy at cell line 3", rows
            for row in rows:
                for i, (text, lines) in enumerate(row):
                    assert i == 1 or lines == 1, f"{text!r} wraps onto {lines} lines"  # only the state may wrap
            tops = page.evaluate(
                "() => Array.from(document.querySelectorAll('#nbdist-worlds .nbdist-action'))"
                ".map(b => Math.round(b.getBoundingClientRect().top))"
            )
            assert len(tops) == 3 and len(set(tops)) == 1, tops  # Interrupt, Dashboard, Stop on one line
            page.click("#nbdist-worlds .nbdist-action:has-text('Interrupt')")
            page.wait_for_function(
                "() => !document.querySelectorAll('.jp-Notebook .jp-Cell')[1]"
                ".querySelector('.jp-InputPrompt').textContent.includes('*')",
                timeout=60_000,
            )
            _run_cell(page, 2)
            page.wait_for_function(
                "() => document.getElementById('nbdist-worlds').innerText.includes('held by slow input')",
                timeout=120_000,
            )
            line = page.locator("#nbdist-worlds .nbdist-slowest").inner_text()
            assert re.fullmatch(r"rank 1 slowest, \+\d+(\.\d)?%, held by slow input", line), line
            page.wait_for_selector(".jp-Notebook-ExecutionIndicator[data-status='idle']", timeout=90_000)
            page.wait_for_timeout(1500)  # the panel's next refresh
            page.screenshot(path=str(ARTIFACTS / "panel-two-ranks-why.png"))
            # the Interrupt's 'interrupt sent' goes 15 s after it was said (it stayed for good, next to later cells)
            page.wait_for_function(
                "() => !document.getElementById('nbdist-worlds').innerText.includes('interrupt sent')", timeout=30_000
            )
            page.screenshot(path=str(ARTIFACTS / "panel-two-ranks-later.png"))
        finally:
            _end_kernels(base, token)
