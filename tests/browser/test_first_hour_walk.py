"""The first hour, walked as a learner walks it (#51): ``python -m nbdist.tutorials DIR`` writes the notebooks,
JupyterLab opens 00, 06 and 08 in Debian's Chromium, and Run All runs each from top to bottom. What the learner
sees is checked on the page: each notebook reaches its last cell; the only error boxes are those of the cells
tagged ``raises-exception`` (each says what went wrong in nbdist's words, with no traceback through nbdist's own
modules); 06's one communication share reads the same in its printed line and in the dashboard's title; 08's kill
is followed by the line that says the world was rebuilt. Each notebook is then saved from the page, and the saved
file is held to the same checks as the notebooks nbclient runs (tests/notebooks: check_notebook), which therefore
does not run these three again. Screenshots of the cells a learner stops at are kept in test-artifacts/walk-*.png.
"""

from __future__ import annotations

import re
import subprocess
import sys
import time

import nbformat
import pytest

from tests.browser.test_dashboard_browser import ARTIFACTS, _browser, _dismiss_news, _misplaced, _server
from tests.browser.test_leave_and_return import _end_kernels, _select_kernel
from tests.notebooks.test_notebooks import WALKED, check_notebook, stream_text

# notebook -> (cells tagged raises-exception, cells whose picture is kept)
WALK = {
    "00_quickstart": (1, {}),
    "06_monitoring": (0, {"dashboard": 3, "headline": 5, "bench": 7, "claims": 12, "tracked": 17}),
    "08_faults_and_recovery": (2, {"raises": 4, "kill": 16, "compare": 17, "mismatch": 31}),
}
assert sorted(f"{name}.ipynb" for name in WALK) == sorted(WALKED)
NOTEBOOK_S = 600  # a hang guard: each runs in about a minute alone, 06 took 353 s beside 64 ranks starting
SHOWN = ".jp-NotebookPanel:not(.lm-mod-hidden)"  # the notebook in front (the ones opened before stay in the page)


def _outputs(page) -> list[dict]:
    """Every cell's outputs as the page shows them: its text and how many error boxes it holds."""
    cells = page.locator(f"{SHOWN} .jp-Notebook .jp-Cell")
    out = []
    for i in range(cells.count()):
        cell = cells.nth(i)
        cell.scroll_into_view_if_needed()
        out.append(
            cell.evaluate(
                """cell => ({
                text: Array.from(cell.querySelectorAll('.jp-OutputArea-output')).map(o => o.innerText).join('\\n'),
                errors: cell.querySelectorAll(
                    '.jp-OutputArea-output[data-mime-type="application/vnd.jupyter.stderr"]').length,
            })"""
            )
            | {"i": i}
        )
    return out


def _run_all(browser, base: str, token: str, name: str):
    """A page of its own with only this notebook open (``reset``: the tabs of the last page are not restored)."""
    page = browser.new_page(viewport={"width": 1400, "height": 1000})
    page.goto(f"{base}/lab/tree/{name}.ipynb?reset&token={token}")
    page.wait_for_selector(f"{SHOWN} .jp-Notebook .jp-Cell", timeout=90_000)
    _select_kernel(page)
    page.wait_for_selector(f"{SHOWN} .jp-Notebook-ExecutionIndicator[data-status='idle']", timeout=90_000)
    page.click("text=Run", timeout=30_000)
    page.click("text=Run All Cells", timeout=30_000)
    return page


def _finished(page) -> bool:
    """The last cell ran (%dist_stop said so) and the kernel is idle again."""
    return page.evaluate(
        f"""() => {{
        const cells = document.querySelectorAll('{SHOWN} .jp-Notebook .jp-CodeCell');
        const last = cells[cells.length - 1];
        return !!last && last.innerText.includes('cluster stopped')
            && !!document.querySelector("{SHOWN} .jp-Notebook-ExecutionIndicator[data-status='idle']");
    }}"""
    )


@pytest.mark.timeout(3 * NOTEBOOK_S + 120)
def test_a_learner_runs_00_06_and_08_in_jupyterlab(tmp_path):
    where = tmp_path / "tutorials"
    wrote = subprocess.run(
        [sys.executable, "-m", "nbdist.tutorials", str(where)], capture_output=True, text=True, check=True
    )
    assert "start with 00_quickstart.ipynb" in wrote.stdout, wrote.stdout
    # every cell in the page (JupyterLab draws only those near the view by default), so that indices hold
    every_cell = {"@jupyterlab/notebook-extension:tracker": {"windowingMode": "none"}}
    with _server(where, "jupyterlab", settings=every_cell) as (base, token), _browser() as browser:
        try:
            for name, (tagged, pictures) in WALK.items():
                page = _run_all(browser, base, token, name)
                deadline = time.monotonic() + NOTEBOOK_S
                while not _finished(page):
                    assert time.monotonic() < deadline, f"{name} did not reach its last cell"
                    time.sleep(1)
                _dismiss_news(page)
                cells = _outputs(page)
                page.screenshot(path=str(ARTIFACTS / f"walk-{name[:2]}-end.png"))
                for label, index in pictures.items():
                    page.locator(f"{SHOWN} .jp-Notebook .jp-Cell").nth(index).screenshot(
                        path=str(ARTIFACTS / f"walk-{name[:2]}-{label}.png")
                    )
                boxes = [c for c in cells if c["errors"]]
                assert len(boxes) == tagged, [(c["i"], c["text"][-400:]) for c in boxes]
                for box in boxes:  # the learner's own cell and nbdist's words; no frame of nbdist's own modules
                    assert not re.search(r"nbdist/[\w/]+\.py", box["text"]), box["text"][:600]
                    assert re.search(r"rank \d raised \w+", box["text"]), box["text"][:600]
                assert not _misplaced(page), _misplaced(page)
                if name.startswith("06"):
                    title = re.search(r"([0-9.]+)% of each step in communication", cells[3]["text"])
                    printed = re.search(r"all ranks: ([0-9.]+)% \(the mean of the ranks", cells[5]["text"])
                    assert title and printed and title[1] == printed[1], (cells[3]["text"], cells[5]["text"])
                if name.startswith("08"):
                    assert "rank 1 raised ValueError in cell line 3: bad batch" in cells[4]["text"], cells[4]["text"]
                    said = [(c["i"], ln) for c in cells for ln in c["text"].splitlines() if "died during the cell" in ln]
                    assert "from rank 0's memory (nothing recomputed)" in cells[16]["text"], said
                    assert "bit for bit: [True, True]" in cells[17]["text"], cells[17]["text"]
                page.keyboard.press("Control+s")
                saved = where / f"{name}.ipynb"
                deadline = time.monotonic() + 30
                while "cluster stopped" not in saved.read_text():
                    assert time.monotonic() < deadline, f"{name} was not saved"
                    time.sleep(0.5)
                nb = nbformat.read(saved, as_version=4)
                check_notebook(saved.name, nb, stream_text(nb))
                page.close()
        finally:
            _end_kernels(base, token)
