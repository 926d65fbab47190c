"""A run you can leave (#50), as a person has it: JupyterLab in Chromium, a notebook that starts ``--ranks`` ranks
and runs one cell logging ``--steps`` steps, the page open the whole time. Sampled every second: the resident
memory of the Jupyter server (its nbdist extension serves the transcripts and the panel), of the kernel, and the
page's JavaScript heap (``performance.memory``, Chromium's). Reported: each at the cell's start and end, and the
peak. JSON under results/soak_page.json.

    python benchmarks/soak_page.py --ranks 8 --steps 1000000
"""

from __future__ import annotations

import argparse
import contextlib
import pathlib
import sys
import tempfile
import threading
import time

from _common import save
from soak import rss_mib

HERE = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(HERE))

from tests.browser.test_dashboard_browser import _ensure_chromium, _server, _write_notebook  # noqa: E402
from tests.browser.test_leave_and_return import _open  # noqa: E402
from tests.browser.test_world_panel import _run_cell  # noqa: E402

HEAP = "() => { window.gc(); return performance.memory.usedJSHeapSize; }"  # after a collection: what is held


def _browser():  # as the tests' own, with gc() exposed to the page
    from playwright.sync_api import sync_playwright

    @contextlib.contextmanager
    def launched():
        with sync_playwright() as pw:
            browser = pw.chromium.launch(
                executable_path=_ensure_chromium(),
                headless=True,
                args=["--no-sandbox", "--disable-gpu", "--no-first-run", "--js-flags=--expose-gc"],
            )
            try:
                yield browser
            finally:
                browser.close()

    return launched()


def find(word: str) -> int:
    """The pid of the one process whose command line holds ``word``."""
    import psutil

    for proc in psutil.process_iter(["pid", "cmdline"]):
        if any(word in part for part in proc.info["cmdline"] or []):
            return int(proc.info["pid"])
    raise RuntimeError(f"no process holds {word!r}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=8)
    parser.add_argument("--steps", type=int, default=1_000_000)
    args = parser.parse_args()
    cells = [
        f"%load_ext nbdist\n%dist_start -n {args.ranks} --oversubscribe --timeout 180",
        "%%distributed\nimport nbdist\nnbdist.log(step=0, loss=1.0)",  # the dashboard and its imports, first
        f"%%distributed\nimport nbdist\nfor s in range({args.steps}):\n    nbdist.log(step=s, loss=1.0 / (s + 1))",
    ]
    out: dict = {"ranks": args.ranks, "steps": args.steps}
    with tempfile.TemporaryDirectory() as tmp:
        root = pathlib.Path(tmp)
        _write_notebook(root / "soak.ipynb", cells)
        with _server(root, "jupyterlab") as (base, token), _browser() as browser:
            server = find(f"--IdentityProvider.token={token}")
            page = _open(browser, base, token, "jupyterlab", notebook="soak.ipynb")
            with contextlib.suppress(Exception):  # a kernel to choose, asked on some first opens
                page.click(".jp-Dialog button:has-text('Select')", timeout=10_000)
            _run_cell(page, 0)
            page.wait_for_function("() => document.body.innerText.includes('ranks ready')", timeout=300_000)
            _run_cell(page, 1)
            page.wait_for_selector(".js-plotly-plot", timeout=120_000)
            page.wait_for_selector(".jp-Notebook-ExecutionIndicator[data-status='idle']", timeout=120_000)
            import json
            import urllib.request

            [kernel_id] = [k["id"] for k in json.load(urllib.request.urlopen(f"{base}/api/kernels?token={token}"))]
            kernel = find(f"kernel-{kernel_id}.json")
            samples: list[tuple[float, float, float, float]] = []
            done = threading.Event()

            def sample() -> None:
                while not done.is_set():
                    samples.append((time.perf_counter(), rss_mib(server), rss_mib(kernel), float("nan")))
                    done.wait(1.0)

            sampler = threading.Thread(target=sample, daemon=True)
            sampler.start()
            heap: list[float] = [page.evaluate(HEAP) / 2**20]
            tic = time.perf_counter()
            _run_cell(page, 2)
            while True:  # the page's own heap, read on the page's thread
                heap.append(page.evaluate(HEAP) / 2**20)
                status = page.evaluate(
                    "() => (document.querySelector('.jp-Notebook-ExecutionIndicator') || {dataset: {}}).dataset.status"
                )
                if status == "idle":
                    break
                time.sleep(1.0)
            out["cell_s"] = round(time.perf_counter() - tic, 1)
            time.sleep(2.0)
            heap.append(page.evaluate(HEAP) / 2**20)
            done.set()
            sampler.join()
            for name, i in (("server", 1), ("kernel", 2)):
                values = [s[i] for s in samples]
                out[f"{name}_MiB"] = {
                    "start": round(values[0], 1),
                    "end": round(values[-1], 1),
                    "peak": round(max(values), 1),
                    "growth": round(values[-1] - values[0], 1),
                }
            out["page_heap_MiB"] = {
                "start": round(heap[0], 1),
                "end": round(heap[-1], 1),
                "peak": round(max(heap), 1),
                "growth": round(heap[-1] - heap[0], 1),
            }
            page.close()
            for k in json.load(urllib.request.urlopen(f"{base}/api/kernels?token={token}")):  # the world ends with it
                req = urllib.request.Request(f"{base}/api/kernels/{k['id']}?token={token}", method="DELETE")
                urllib.request.urlopen(req)
            time.sleep(2.0)
    print(json.dumps(out, indent=1))
    save("soak_page", out)


if __name__ == "__main__":
    main()
