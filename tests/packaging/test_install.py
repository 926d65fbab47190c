"""nbdist as users install it (issue 30): the wheel into a fresh venv that already has torch, the
tutorials copied out of it, a read-only install, the binder requirements, and PyPI's metadata check.

One venv per module (torch 2.13.0, CPU, installed first as a user's environment would have it),
then the built wheel with its runtime dependencies only: no test extra reaches it.
"""

from __future__ import annotations

import json
import os
import pathlib
import re
import subprocess
import sys
import textwrap

import pytest

from tests.helpers import rank_said

REPO = pathlib.Path(__file__).resolve().parents[2]
TORCH = "torch==2.13.0"
SLOW_S = 900  # a hang bound for an install


def _run(*cmd: str | os.PathLike, timeout: float = SLOW_S, **kw) -> subprocess.CompletedProcess:
    """Run, outside the checkout unless told (``python -c`` puts the cwd first on sys.path, which
    would import the checkout's nbdist instead of the installed one); fail with its output."""
    kw.setdefault("cwd", "/")
    done = subprocess.run([str(c) for c in cmd], capture_output=True, text=True, timeout=timeout, **kw)
    assert done.returncode == 0, (
        f"{' '.join(map(str, cmd))[:300]} failed:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    )
    return done


def _venv(path: pathlib.Path) -> pathlib.Path:
    """A fresh venv with the CPU torch in it, as a user's environment already has its torch."""
    _run(sys.executable, "-m", "venv", path)
    python = path / "bin" / "python"
    _run(python, "-m", "pip", "install", "--quiet", TORCH)
    return python


def _in_tree(site: str) -> dict[str, float]:
    """numba's cache files inside the installed package, with their modification times."""
    return {str(p): p.stat().st_mtime for p in pathlib.Path(site, "nbdist").glob("**/*.nb[ic]")}


def _torch_fingerprint(python: pathlib.Path) -> dict:
    code = (
        "import importlib.metadata as m, json, hashlib; d = m.distribution('torch'); "
        "print(json.dumps({'version': d.version, 'record': hashlib.sha256(d.read_text('RECORD').encode()).hexdigest(), "
        "'path': str(d.locate_file('torch'))}))"
    )
    return json.loads(_run(python, "-c", code).stdout)


@pytest.fixture(scope="module")
def built(tmp_path_factory) -> dict[str, pathlib.Path]:
    out = tmp_path_factory.mktemp("dist")
    _run(sys.executable, "-m", "build", "--sdist", "--wheel", "--outdir", out, REPO)
    return {"wheel": next(out.glob("nbdist-*.whl")), "sdist": next(out.glob("nbdist-*.tar.gz"))}


@pytest.fixture(scope="module")
def user_env(tmp_path_factory, built) -> dict:
    """A user's venv: torch first, then ``pip install nbdist-*.whl``."""
    root = tmp_path_factory.mktemp("user")
    python = _venv(root / "venv")
    before = _torch_fingerprint(python)
    install = _run(python, "-m", "pip", "install", built["wheel"])
    return {"python": python, "root": root, "torch_before": before, "install": install.stdout + install.stderr}


def test_pypi_accepts_the_metadata_and_the_readme_renders(built):
    done = _run(sys.executable, "-m", "twine", "check", "--strict", built["wheel"], built["sdist"])
    assert done.stdout.count("PASSED") == 2, done.stdout
    meta = _run(
        sys.executable,
        "-c",
        f"import zipfile; z = zipfile.ZipFile({str(built['wheel'])!r}); "
        "print(z.read(next(n for n in z.namelist() if n.endswith('METADATA'))).decode())",
    ).stdout
    assert "Classifier: Framework :: Jupyter" in meta and "Description-Content-Type: text/markdown" in meta
    assert "Requires-Dist: torch" in meta
    assert "pytest" not in meta.split("Provides-Extra: dev")[0], "a test tool among the runtime requirements"


def test_the_wheel_keeps_the_users_torch(user_env):
    assert "Uninstalling torch" not in user_env["install"]
    assert _torch_fingerprint(user_env["python"]) == user_env["torch_before"]


def test_the_lab_and_server_extensions_are_enabled_from_the_wheel_with_no_build_step(user_env):
    """The prebuilt lab extension and the server extension's switch come with the wheel: Jupyter lists
    both as enabled in the user's venv, which has no Node."""
    bin_dir = user_env["python"].parent
    labs = _run(bin_dir / "jupyter", "labextension", "list")
    listed = labs.stdout + labs.stderr
    assert re.search(r"nbdist v[\d.]+ .*enabled.*OK", _plain(listed)), listed
    servers = _run(bin_dir / "jupyter", "server", "extension", "list")
    listed = _plain(servers.stdout + servers.stderr)
    assert re.search(r"nbdist\.server\s+enabled", listed) and re.search(r"nbdist\.server\s+OK", listed), listed


def _plain(text: str) -> str:
    return re.sub(r"\x1b\[[0-9;]*m", "", text)  # without the terminal's colours


def test_import_nbdist_alone_loads_no_widgets_and_the_magics_start_a_world(user_env, tmp_path):
    light = _run(
        user_env["python"],
        "-c",
        "import nbdist, sys; print(sorted({m.split('.')[0] for m in sys.modules} & "
        "{'ipywidgets', 'plotly', 'anywidget', 'IPython', 'ipyparallel', 'torch'}))",
    )
    assert light.stdout.strip() == "[]", f"import nbdist loaded {light.stdout.strip()}"
    where = _run(user_env["python"], "-c", "import nbdist; print(nbdist.__file__)").stdout
    assert where.startswith(str(user_env["root"])), f"not the installed nbdist: {where}"
    # the cells as a notebook sends them
    code = textwrap.dedent(
        """
        from IPython.core.interactiveshell import InteractiveShell
        ip = InteractiveShell.instance()
        for cell in ("%load_ext nbdist", "%dist_start -n 2",
                     "%%distributed\\nt = torch.tensor([dist.get_rank() + 1.0])\\ndist.all_reduce(t)\\nprint('sum', t.item())",
                     "%dist_stop"):
            result = ip.run_cell(cell)
            result.raise_error()
        """
    )
    done = _run(user_env["python"], "-c", code, cwd=tmp_path, env={**os.environ, "OMP_NUM_THREADS": "1"}, timeout=300)
    assert rank_said(done.stdout, 0, "sum 3.0") and rank_said(done.stdout, 1, "sum 3.0"), done.stdout


def test_the_tutorials_come_out_of_the_wheel_and_run_from_there(user_env, tmp_path):
    python, dest = user_env["python"], tmp_path / "tutorials"
    first = _run(python, "-m", "nbdist.tutorials", dest)
    shipped_files = len(list((REPO / "notebooks").glob("*.ipynb"))) + 1  # and the README
    assert f"wrote {shipped_files} file(s)" in first.stdout and "00_quickstart.ipynb" in first.stdout
    shipped = sorted(p.name for p in dest.glob("*.ipynb"))
    assert shipped == sorted(p.name for p in (REPO / "notebooks").glob("*.ipynb"))
    # an edited notebook is not overwritten without --force; an untouched one is left alone
    edited = dest / "01_data_parallel.ipynb"
    edited.write_text(edited.read_text().replace("DistributedDataParallel", "DDP (my notes)", 1))
    again = subprocess.run([python, "-m", "nbdist.tutorials", dest], capture_output=True, text=True, cwd="/")
    assert again.returncode == 2 and "01_data_parallel.ipynb in" in again.stderr and "--force" in again.stderr
    assert "my notes" in edited.read_text()
    assert "wrote 1 file(s)" in _run(python, "-m", "nbdist.tutorials", dest, "--force").stdout
    # notebook 00 runs from the copy, in the user's venv
    run00 = textwrap.dedent(
        f"""
        import nbformat
        from nbclient import NotebookClient
        nb = nbformat.read({str(dest / "00_quickstart.ipynb")!r}, as_version=4)
        NotebookClient(nb, timeout=300, kernel_name="python3", resources={{"metadata": {{"path": {str(dest)!r}}}}}).execute()
        print("ran", sum(c.cell_type == "code" for c in nb.cells), "cells")
        """
    )
    done = _run(python, "-c", run00, cwd=dest, env={**os.environ, "OMP_NUM_THREADS": "1"}, timeout=600)
    assert "ran" in done.stdout


def test_a_read_only_install_keeps_numbas_cache_per_user(user_env, tmp_path):
    """As on a JupyterHub whose environment users cannot write: the package's own folder is
    read-only (a read-only bind mount, which binds root too), and the kernels' cache goes under
    the user's home instead, where the next process finds it."""
    if os.geteuid() != 0:
        pytest.skip("needs root: the test makes a read-only bind mount in a mount namespace")
    python, home = user_env["python"], tmp_path / "home"
    home.mkdir()
    site = _run(
        python, "-c", "import nbdist, os; print(os.path.dirname(os.path.dirname(nbdist.__file__)))"
    ).stdout.strip()
    probe = (
        "from nbdist.compression import kernels; import numpy as np, json, os; "
        "was = kernels.cached(); kernels.warm_up(); "
        "print(json.dumps({'was': was, 'now': kernels.cached(), "
        "'writable': os.access(os.path.dirname(kernels.__file__), os.W_OK)}))"
    )
    in_tree_before = _in_tree(site)  # earlier tests may have filled it, while the install was writable
    env = {"PATH": os.environ["PATH"], "HOME": str(home), "OMP_NUM_THREADS": "1"}
    sh = 'mount --bind "$0" "$0" && mount -o remount,bind,ro "$0" && exec "$1" -c "$2"'
    runs = [
        json.loads(_run("unshare", "--mount", "sh", "-c", sh, site, python, probe, env=env).stdout.splitlines()[-1])
        for _ in range(2)
    ]
    assert runs[0]["writable"] is False, "the bind mount did not make the install read-only"
    assert runs[0]["was"] is False and runs[0]["now"] is True, runs
    assert runs[1]["was"] is True, "the second process did not find the first one's cache"
    assert list(home.glob(".cache/**/*.nbi")), "the cache is not under the user's home"
    assert _in_tree(site) == in_tree_before, "the cache went into the read-only install"


def test_binders_requirements_install_into_a_fresh_venv_and_notebook_00_runs(tmp_path):
    """What mybinder's repo2docker does with binder/, without Docker: pip install -r
    binder/requirements.txt from the repository's root into a fresh environment, run postBuild,
    then notebook 00. (PyTorch's CPU index in that file is unreachable here; torch comes from
    the local wheel, the same 2.13.0.)"""
    home = tmp_path / "home"
    home.mkdir()
    _run(sys.executable, "-m", "venv", tmp_path / "venv")
    python = tmp_path / "venv" / "bin" / "python"
    env = {**os.environ, "HOME": str(home), "PIP_RETRIES": "0"}
    _run(python, "-m", "pip", "install", "--quiet", "-r", "binder/requirements.txt", cwd=REPO, env=env)
    _run("bash", REPO / "binder" / "postBuild", env=env)
    run00 = textwrap.dedent(
        f"""
        import nbformat
        from nbclient import NotebookClient
        nb = nbformat.read({str(REPO / "notebooks" / "00_quickstart.ipynb")!r}, as_version=4)
        NotebookClient(nb, timeout=300, kernel_name="python3").execute()
        print("ran 00")
        """
    )
    env.pop("OMP_NUM_THREADS", None)  # postBuild's IPython start-up file sets it, as on mybinder
    done = _run(
        python, "-c", run00, env={**env, "PATH": f"{tmp_path / 'venv' / 'bin'}:{os.environ['PATH']}"}, timeout=600
    )
    assert "ran 00" in done.stdout
    startup = home / ".ipython" / "profile_default" / "startup" / "00-nbdist.py"
    assert 'os.environ.setdefault("OMP_NUM_THREADS", "1")' in startup.read_text()


def test_the_demo_runs_quietly_and_says_first_what_it_does():
    """``make demo``'s command, as a first-time user sees it: its first line says what it is
    doing, and neither nbdist nor its harness prints a warning (ipykernel warned about TCP
    without encryption before the demo's kernel used unix sockets)."""
    done = _run(sys.executable, "-m", "nbdist.demo", env={**os.environ, "OMP_NUM_THREADS": "1"}, timeout=600)
    lines = (done.stdout + done.stderr).splitlines()
    assert lines[0] == "running 00_quickstart.ipynb on 2 CPU ranks (headless)...", lines[:3]
    noisy = [ln for ln in lines if "warn" in ln.lower()]
    assert not noisy, noisy
    assert "[ranks 0,1] after all_reduce: [3.0, 3.0, 3.0]" in lines and lines[-1].startswith("done in")
