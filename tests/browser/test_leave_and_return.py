"""A run you can leave: close the page while a distributed cell trains, open the notebook again (a
new page, a new Jupyter session) and see every line it printed and its dashboard, growing until the
cell ends; likewise for a cell that ended while no page was open. JupyterLab in Debian's Chromium;
the reference is what the ranks printed and logged (rank 0 prints STEP n every 5 steps, every step
is logged). Screenshots in test-artifacts/."""

from __future__ import annotations

import json
import re
import time
import urllib.request

import pytest

from tests.browser.test_dashboard_browser import (
    ARTIFACTS,
    _browser,
    _dismiss_news,
    _longest_trace,
    _misplaced,
    _server,
    _write_notebook,
)

STEPS = 160
CELLS = [
    "%load_ext nbdist\n%dist_start -n 2",
    "%%distributed\n"
    "import time, nbdist\n"
    f"for step in range({STEPS}):\n"
    "    if step % 5 == 0 and dist.get_rank() == 0:\n"
    "        print(f'STEP {step}', flush=True)\n"
    "    nbdist.log(step=step, loss=1.0 / (step + 1))\n"
    "    time.sleep(0.1)",
]
# 40 s in all: a page closed and reopened on a loaded machine (CI, Chromium cold) must still find the cell running
SLOW_CELLS = [CELLS[0], CELLS[1].replace("time.sleep(0.1)", "time.sleep(0.25)")]
EXPECTED = [f"STEP {s}" for s in range(0, STEPS, 5)]


def _gated(cells: list[str], gates, steps: tuple[int, ...]) -> list[str]:
    """``cells`` with the training cell waiting, after each of ``steps``, until the test makes ``gates/<step>``."""
    wait = f"    if step in {steps}:\n        while not os.path.exists(f'{gates}/{{step}}'):\n            time.sleep(0.05)\n"
    body = cells[1].replace("import time, nbdist", "import os, time, nbdist") + "\n" + wait
    return [cells[0], body.rstrip("\n")]


def _record(what: str, seconds: float) -> None:
    """Kept beside the screenshots (test-artifacts/reopen-times.json) for the issue's 'within 3 s'."""
    path = ARTIFACTS / "reopen-times.json"
    found = json.loads(path.read_text()) if path.exists() else {}
    found[what] = round(seconds, 2)
    path.write_text(json.dumps(found, indent=1))
    print(f"{what} {seconds:.2f} s")


def _close_unsaved(page) -> None:
    """Close the tab without saving, and make sure nothing was saved: a user who runs all and leaves within the
    autosave interval saves nothing (JupyterLab's autosave is turned off for this test's server)."""
    page.close(run_before_unload=False)


def _steps_shown(page) -> list[str]:
    text = page.evaluate(
        """() => {
        const cells = document.querySelectorAll('.jp-Notebook .jp-Cell');
        if (cells.length < 2) return '';
        const out = cells[1].querySelector('.jp-OutputArea');
        return out ? out.innerText : '';
    }"""
    )
    return re.findall(r"STEP \d+", text)


def _prompt(page) -> str:
    """The second cell's prompt, ``[N]:``."""
    return page.evaluate("() => document.querySelectorAll('.jp-Notebook .jp-Cell')[1].querySelector('.jp-InputPrompt').textContent")


def _kernel_cells(base: str, token: str) -> list[dict]:
    sessions = json.load(urllib.request.urlopen(f"{base}/api/sessions?token={token}"))
    kernel = next(s["kernel"]["id"] for s in sessions if s["path"].endswith("live.ipynb"))
    return json.load(urllib.request.urlopen(f"{base}/nbdist/api/kernels/{kernel}/cells?token={token}"))["cells"]


# A slow server, for the page that runs the cell: every transcript that says a cell still runs is
# handed to the page only once the page has seen its own run end (the last one fetched before the end
# then always arrives after it), and the page counts, every 50 ms, any fall in the STEP lines its
# running cell shows (a page refilled from an older transcript shows fewer).
HOLD_RUNNING_TRANSCRIPTS = """
(() => {
  const fetch0 = window.fetch.bind(window);
  const ended = () => {
    const cells = document.querySelectorAll('.jp-Notebook .jp-Cell');
    const prompt = cells.length > 1 && cells[1].querySelector('.jp-InputPrompt');
    return prompt && window.__nbdistRan && !prompt.textContent.includes('*');
  };
  window.fetch = async (...args) => {
    const response = await fetch0(...args);
    const url = String(args[0] && args[0].url ? args[0].url : args[0]);
    if (url.includes('/nbdist/api/kernels/')) {
      const body = await response.clone().json().catch(() => ({}));
      if ((body.cells || []).some(c => c.running)) {
        while (!ended()) await new Promise(r => setTimeout(r, 50));
        await new Promise(r => setTimeout(r, 200));
      }
    }
    return response;
  };
  window.__nbdistDrops = [];
  let most = 0;
  setInterval(() => {
    const cells = document.querySelectorAll('.jp-Notebook .jp-Cell');
    const out = cells.length > 1 && cells[1].querySelector('.jp-OutputArea');
    const steps = out ? (out.innerText.match(/STEP \\d+/g) || []).length : 0;
    if (steps > 0) window.__nbdistRan = true;
    if (steps < most) window.__nbdistDrops.push([most, steps]);
    most = Math.max(most, steps);
  }, 50);
})();
"""


def _open(browser, base: str, token: str, app: str, init_script: str = "", notebook: str = "live.ipynb"):
    """A page on the notebook (``browser``: a browser, or a context of one: another browser's storage)."""
    page = browser.new_page(
        **({"viewport": {"width": 1400, "height": 1000}} if hasattr(browser, "new_context") else {})
    )
    if init_script:
        page.add_init_script(init_script)
    page.goto(f"{base}/{'lab/tree' if app == 'jupyterlab' else 'notebooks'}/{notebook}?token={token}")
    page.wait_for_selector(".jp-Notebook .jp-Cell", timeout=90_000)
    return page


def _select_kernel(page) -> None:
    """Accept the kernel dialog a page may show for a notebook that has no session yet."""
    try:
        page.click(".jp-Dialog button:has-text('Select')", timeout=10_000)
    except Exception:
        pass


def _end_kernels(base: str, token: str) -> None:
    """Shut down every kernel of the server (their worlds end with them)."""
    try:
        for kernel in json.load(urllib.request.urlopen(f"{base}/api/kernels?token={token}")):
            req = urllib.request.Request(f"{base}/api/kernels/{kernel['id']}?token={token}", method="DELETE")
            urllib.request.urlopen(req)
    except OSError:
        pass


NO_AUTOSAVE = {"@jupyterlab/docmanager-extension:plugin": {"autosave": False}}


@pytest.mark.parametrize("app", ["jupyterlab", "notebook"])
def test_close_the_page_mid_run_and_after_the_end_then_reopen(tmp_path, app):
    """No page saves the notebook while the cell runs (autosave off, closed without saving): what a page opened
    after the end shows comes from the server alone, tied to the cell by its id."""
    _write_notebook(tmp_path / "live.ipynb", SLOW_CELLS)
    written = (tmp_path / "live.ipynb").read_text()
    with _server(tmp_path, app, settings=NO_AUTOSAVE) as (base, token), _browser() as browser:
        try:
            page = _open(browser, base, token, app)
            _select_kernel(page)
            try:
                page.wait_for_selector(".jp-Notebook-ExecutionIndicator[data-status='idle']", timeout=60_000)
            except Exception:
                if app == "jupyterlab":
                    raise  # Notebook 7 may show the kernel's state elsewhere: its run waits for the kernel anyway
            page.click("text=Run", timeout=30_000)
            page.click("text=Run All Cells", timeout=30_000)
            page.wait_for_function("() => document.body.innerText.includes('STEP 15')", timeout=120_000)
            before = _steps_shown(page)
            page.close()  # the tab is closed mid-run
            time.sleep(3)

            page = _open(browser, base, token, app)  # a new page, a new session
            opened = time.monotonic()
            page.wait_for_function(
                "() => document.body.innerText.includes('STEP') && document.querySelector('.js-plotly-plot')",
                timeout=30_000,
            )
            shown_in = time.monotonic() - opened
            _record(f"{app}: reopened mid-run, lines and dashboard shown in", shown_in)
            first = _steps_shown(page)
            _dismiss_news(page)
            page.screenshot(path=str(ARTIFACTS / f"reopened-mid-run-{app}.png"), full_page=True)
            assert len(first) > len(before), (before, first)  # what was printed while no page was open
            assert first == EXPECTED[: len(first)], first  # in order, none missing, none twice
            time.sleep(3)
            later = _steps_shown(page)
            assert later == EXPECTED[: len(later)] and len(later) > len(first), (first, later)  # and it goes on
            steps_then = _longest_trace(page)
            assert 0 < steps_then < STEPS
            _close_unsaved(page)  # closed again, unsaved (no page saves during the run); the cell ends meanwhile

            deadline = time.monotonic() + 120
            while any(c["running"] for c in _kernel_cells(base, token)) and time.monotonic() < deadline:
                time.sleep(0.5)
            assert (tmp_path / "live.ipynb").read_text() == written, "no page saved the notebook during the run"
            page = _open(browser, base, token, app)
            page.wait_for_function(f"() => document.body.innerText.includes('STEP {STEPS - 5}')", timeout=30_000)
            page.wait_for_selector(".js-plotly-plot .gtitle", timeout=30_000)
            _dismiss_news(page)
            page.screenshot(path=str(ARTIFACTS / f"reopened-after-end-{app}.png"), full_page=True)
            assert _steps_shown(page) == EXPECTED  # the complete output, once
            assert _longest_trace(page) == STEPS  # the final dashboard: every logged step
            title = page.evaluate("() => document.querySelector('.js-plotly-plot .gtitle').textContent")
            assert f"step {STEPS - 1}" in title and "ranks 0,1: idle" in title, title
            assert _misplaced(page) == []
            page.keyboard.press("Control+s")
            saved_path = tmp_path / "live.ipynb"
            deadline = time.monotonic() + 30
            while f"STEP {STEPS - 5}" not in saved_path.read_text() and time.monotonic() < deadline:
                time.sleep(0.5)
            saved = json.loads(saved_path.read_text())
            outputs = saved["cells"][1]["outputs"]
            text = "".join("".join(o.get("text", "")) for o in outputs if o["output_type"] == "stream")
            assert re.findall(r"STEP \d+", text) == EXPECTED  # the saved notebook holds them
            assert any("application/vnd.plotly.v1+json" in o.get("data", {}) for o in outputs)
            assert shown_in < 3 + 2, shown_in  # within 3 s of the page's first cell (plus Playwright's own)
        finally:
            _end_kernels(base, token)  # the world ends with its kernel


def test_two_pages_at_once_the_running_one_keeps_its_own_output(tmp_path):
    """Page A runs the cell; page B, another browser on the same notebook, opens mid-run: B is filled
    from the transcript and grows; A keeps its own live output (its live dashboard, never replaced);
    at the end both show every line once. The cell waits at two gates the test opens, so B's first look, B's
    growth and the look at A all fall while the cell runs, however slowly a second browser opens."""
    gates = tmp_path / "gates"
    gates.mkdir()
    _write_notebook(tmp_path / "live.ipynb", _gated(CELLS, gates, (20, 120)))
    with _server(tmp_path, "jupyterlab") as (base, token), _browser() as browser:
        try:
            a = _open(browser, base, token, "jupyterlab", init_script=HOLD_RUNNING_TRANSCRIPTS)
            _select_kernel(a)
            a.wait_for_selector(".jp-Notebook-ExecutionIndicator[data-status='idle']", timeout=90_000)
            a.click("text=Run", timeout=30_000)
            a.click("text=Run All Cells", timeout=30_000)
            a.wait_for_function("() => document.body.innerText.includes('STEP 10')", timeout=120_000)
            other = browser.new_context(viewport={"width": 1400, "height": 1000})  # another browser: its own session
            try:
                b = _open(other, base, token, "jupyterlab")
                b.wait_for_function("() => document.body.innerText.includes('STEP 10')", timeout=30_000)
                first = _steps_shown(b)
                (gates / "20").touch()
                b.wait_for_function(
                    f"() => (document.body.innerText.match(/STEP \\d+/g) || []).length > {len(first)}", timeout=30_000
                )
                assert _steps_shown(b) == EXPECTED[: len(_steps_shown(b))]
                assert "*" in _prompt(a), _prompt(a)  # the cell still runs (held at step 120)
                assert a.query_selector(".nbdist-stat") is not None  # A's live dashboard is still A's own
                (gates / "120").touch()
                a.wait_for_function(f"() => document.body.innerText.includes('STEP {STEPS - 5}')", timeout=120_000)
                b.wait_for_function(f"() => document.body.innerText.includes('STEP {STEPS - 5}')", timeout=30_000)
                a.wait_for_selector(".js-plotly-plot .gtitle", timeout=30_000)  # A's own final figure
                time.sleep(2)  # the transcripts held back (a slow server) reach A now: A must keep its own output
                assert a.evaluate("() => window.__nbdistDrops") == []  # never cleared or refilled from a transcript
                assert _steps_shown(a) == EXPECTED
                assert _steps_shown(b) == EXPECTED
                assert _prompt(b) == _prompt(a) != "[ ]:", (_prompt(a), _prompt(b))  # the count A's kernel replied
                b.screenshot(path=str(ARTIFACTS / "second-page.png"), full_page=True)
            finally:
                other.close()
        finally:
            _end_kernels(base, token)


ATTACH_CELLS = [  # the 16 s cell: the page is closed once it shows STEP 15 and reopened after the end anyway
    "%load_ext nbdist\n%dist_start -n 2 --keep 10m",
    CELLS[1],
    "%load_ext nbdist\n%dist_attach",
]


def test_a_new_kernel_attached_to_the_kept_world_shows_the_run_in_a_page_reopened_after_the_end(
    tmp_path, monkeypatch
):
    """The cell ends while no page is open and nothing was saved; then the notebook's kernel is gone (its session
    shut down: the next page gets a kernel with a new id, as after a server restart, which knows no world). The
    world was kept (``--keep``): in the reopened page ``%dist_attach`` ties the new kernel to it, and within the
    page's next look (5 s while idle) the cell shows every line and its final dashboard, and the next save
    holds them."""
    monkeypatch.setenv("NBDIST_KEPT_DIR", str(tmp_path / "kept"))  # the server's kernels inherit it
    _write_notebook(tmp_path / "live.ipynb", ATTACH_CELLS)
    written = (tmp_path / "live.ipynb").read_text()
    with _server(tmp_path, "jupyterlab", settings=NO_AUTOSAVE) as (base, token), _browser() as browser:
        try:
            page = _open(browser, base, token, "jupyterlab")
            _select_kernel(page)
            page.wait_for_selector(".jp-Notebook-ExecutionIndicator[data-status='idle']", timeout=60_000)
            page.click(".jp-Notebook .jp-Cell >> nth=0")
            page.keyboard.press("Shift+Enter")  # the first two cells only: start the kept world, train
            page.keyboard.press("Shift+Enter")
            page.wait_for_function("() => document.body.innerText.includes('STEP 15')", timeout=120_000)
            _close_unsaved(page)
            deadline = time.monotonic() + 120
            while any(c["running"] for c in _kernel_cells(base, token)) and time.monotonic() < deadline:
                time.sleep(0.5)
            assert not any(c["running"] for c in _kernel_cells(base, token)), "the cell did not end"
            for session in json.load(urllib.request.urlopen(f"{base}/api/sessions?token={token}")):
                req = urllib.request.Request(f"{base}/api/sessions/{session['id']}?token={token}", method="DELETE")
                urllib.request.urlopen(req)  # the kernel is shut down; the kept world stays
            assert (tmp_path / "live.ipynb").read_text() == written, "no page saved the notebook"

            page = _open(browser, base, token, "jupyterlab")
            _select_kernel(page)
            page.wait_for_selector(".jp-Notebook-ExecutionIndicator[data-status='idle']", timeout=60_000)
            time.sleep(6)  # the page's first look and one more: the new kernel knows no world yet
            assert _steps_shown(page) == [], "before %dist_attach the new kernel has no world to show"
            page.click(".jp-Notebook .jp-Cell >> nth=2")
            page.keyboard.press("Shift+Enter")  # %dist_attach in the new kernel
            page.wait_for_function("() => document.body.innerText.includes('attached to')", timeout=60_000)
            page.wait_for_function(f"() => document.body.innerText.includes('STEP {STEPS - 5}')", timeout=30_000)
            page.wait_for_selector(".js-plotly-plot .gtitle", timeout=30_000)
            _dismiss_news(page)
            page.screenshot(path=str(ARTIFACTS / "reopened-after-attach.png"), full_page=True)
            assert _steps_shown(page) == EXPECTED  # the complete output, once
            assert _longest_trace(page) == STEPS  # the final dashboard: every logged step
            page.keyboard.press("Control+s")
            saved_path = tmp_path / "live.ipynb"
            deadline = time.monotonic() + 30
            while f"STEP {STEPS - 5}" not in saved_path.read_text() and time.monotonic() < deadline:
                time.sleep(0.5)
            outputs = json.loads(saved_path.read_text())["cells"][1]["outputs"]
            text = "".join("".join(o.get("text", "")) for o in outputs if o["output_type"] == "stream")
            assert re.findall(r"STEP \d+", text) == EXPECTED  # the saved notebook holds them
        finally:
            try:
                import nbdist

                nbdist.attach().stop()  # the kept world, from this process (its record names it)
            except Exception as exc:
                print(f"no kept world to stop: {exc}")
            _end_kernels(base, token)


def test_a_notebook_moved_while_its_cell_runs_shows_the_run_where_it_went(tmp_path):
    """The page is closed mid-run and the notebook moved to another folder under another name (the contents API,
    as another page's file browser does): its session keeps the old path, so the page opened at the new one gets a
    new kernel. The cells are found by their ids in the world of the kernel that ran them: every line, the final
    dashboard, and one line saying which kernel ran it."""
    _write_notebook(tmp_path / "live.ipynb", CELLS)
    with _server(tmp_path, "jupyterlab", settings=NO_AUTOSAVE) as (base, token), _browser() as browser:
        try:
            page = _open(browser, base, token, "jupyterlab")
            _select_kernel(page)
            page.wait_for_selector(".jp-Notebook-ExecutionIndicator[data-status='idle']", timeout=60_000)
            page.click("text=Run", timeout=30_000)
            page.click("text=Run All Cells", timeout=30_000)
            page.wait_for_function("() => document.body.innerText.includes('STEP 15')", timeout=120_000)
            _close_unsaved(page)

            def call(method: str, path: str, body: dict) -> None:
                req = urllib.request.Request(
                    f"{base}/api/contents/{path}?token={token}", data=json.dumps(body).encode(), method=method
                )
                req.add_header("Content-Type", "application/json")
                urllib.request.urlopen(req)

            call("PUT", "moved", {"type": "directory"})
            call("PATCH", "live.ipynb", {"path": "moved/renamed.ipynb"})
            assert not (tmp_path / "live.ipynb").exists() and (tmp_path / "moved" / "renamed.ipynb").exists()
            page = _open(browser, base, token, "jupyterlab", notebook="moved/renamed.ipynb")
            _select_kernel(page)
            page.wait_for_function(f"() => document.body.innerText.includes('STEP {STEPS - 5}')", timeout=120_000)
            page.wait_for_function(  # opened mid-run, it follows the run to its end: the final figure
                "() => [...document.querySelectorAll('.js-plotly-plot .gtitle')].some(t => t.textContent.includes('idle'))",
                timeout=60_000,
            )
            _dismiss_news(page)
            page.screenshot(path=str(ARTIFACTS / "reopened-after-move.png"), full_page=True)
            assert _steps_shown(page) == EXPECTED  # the complete output, once
            assert _longest_trace(page) == STEPS
            said = page.evaluate("() => document.querySelectorAll('.jp-Notebook .jp-Cell')[1].innerText")
            assert "ran this cell, not this page's kernel" in said and "renamed or moved since" in said, said
            sessions = json.load(urllib.request.urlopen(f"{base}/api/sessions?token={token}"))
            assert len({s["kernel"]["id"] for s in sessions}) == 2, sessions  # the old kernel, and the new page's
        finally:
            _end_kernels(base, token)
