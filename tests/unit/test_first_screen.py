"""What a newcomer reads first (#51): the README's first screen is install, load, start, a distributed cell and where
to go next; the curriculum's README, written beside the notebooks by ``python -m nbdist.tutorials``, speaks to
someone who installed the wheel (no checkout's paths)."""

from __future__ import annotations

import pathlib

REPO = pathlib.Path(__file__).resolve().parents[2]
FIRST_SCREEN = 24  # lines: a laptop's window, before any scrolling


def test_the_readmes_first_screen_is_install_load_start_a_cell_and_next():
    first = REPO.joinpath("README.md").read_text().splitlines()[:FIRST_SCREEN]
    text = "\n".join(first)
    order = ["pip install nbdist", "%load_ext nbdist", "%dist_start -n 2", "%%distributed", "python -m nbdist.tutorials"]
    at = [text.find(step) for step in order]
    assert -1 not in at and at == sorted(at), dict(zip(order, at, strict=True))
    assert "00_quickstart.ipynb" in text
    for noise in (" s on a ", "MiB", "| `", "benchmark"):  # start-up figures, layout tables, benchmarks: further down
        assert noise not in text, noise


def test_the_curriculum_readme_speaks_to_a_wheel_user():
    text = REPO.joinpath("notebooks", "README.md").read_text()
    opening = text.split("| # |")[0]
    for checkout in ("make demo", ".venv/", "pip install -e", "notebooks/`"):
        assert checkout not in opening, checkout
    assert "00_quickstart.ipynb" in opening and 'pip install "nbdist[tutorials]"' in opening


def test_no_notebook_points_a_wheel_user_at_the_checkout_or_nbdists_insides():
    """The notebooks are written from the wheel (``python -m nbdist.tutorials``), where docs/, tests/, benchmarks/
    and deploy/ do not exist; and a lesson imports what a user may import: nbdist, nbdist.parallel and nbdist's
    top-level names, not its internal modules."""
    import json
    import re

    public = ("nbdist", "nbdist.parallel", "nbdist.compression")
    found = []
    for path in sorted(REPO.joinpath("notebooks").glob("*.ipynb")):
        for i, cell in enumerate(json.loads(path.read_text())["cells"]):
            text = "".join(cell["source"])
            found += [(path.name, i, m) for m in re.findall(r"`?(?:docs|tests|benchmarks|deploy)/[\w./-]*`?", text)]
            if cell["cell_type"] == "code":
                for module in re.findall(r"^\s*(?:from|import) (nbdist[\w.]*)", text, re.M):
                    if module not in public:
                        found.append((path.name, i, module))
    assert not found, found
