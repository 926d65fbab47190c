"""A world kept past its kernel (%dist_start --keep) and attached to from a new one (%dist_attach), with real
kernels (jupyter_client, as JupyterLab restarts them) and a real 2-rank cluster; its end by itself after its
idle time; and the bad input. Without --keep, a dying kernel still ends everything:
test_lifecycle.py::test_fault5_engines_and_controller_end_with_the_kernel.

Time bounds here catch hangs only."""

from __future__ import annotations

import json
import os
import signal

import psutil
import pytest

import nbdist
from nbdist import wire
from nbdist.cells import pointers, transcript
from nbdist.errors import ConfigError
from nbdist.launch import procs
from tests.helpers import Kernel, poll, wait_gone

START = """
%load_ext nbdist
%dist_start -n 2 --keep {keep}
import json, nbdist
print(json.dumps(nbdist.current().pids()))
"""


@pytest.fixture
def kept_dir(tmp_path, monkeypatch):
    path = tmp_path / "kept"
    monkeypatch.setenv("NBDIST_KEPT_DIR", str(path))
    return path


def start_kept(kept_dir, keep: str, connection_file: str = "") -> tuple[Kernel, list[int]]:
    kernel = Kernel(env={**os.environ, "NBDIST_KEPT_DIR": str(kept_dir)}, connection_file=connection_file)
    content, text, _ = kernel.run(START.format(keep=keep))
    assert content["status"] == "ok", text
    return kernel, json.loads(text.strip().splitlines()[-1])


def waiting_out_the_lease(workdir: str, pids: list[int]) -> None:
    """Until every process of the kept world that the kernel started (its parent not one of them) has seen the
    kernel go and said it waits out the lease (engine/parentwatch.py): a watcher that would end it has looked."""

    def said() -> bool:
        """each process the kernel started says it waits out the lease"""
        tops = set()
        for pid in pids:
            try:
                if psutil.Process(pid).ppid() not in pids:
                    tops.add(pid)
            except psutil.NoSuchProcess:
                pass  # gone: it will never say so; the caller's assert names it
        return all(os.path.exists(os.path.join(workdir, wire.WAITING.format(pid=p))) for p in tops)

    poll(said, 30, every=0.05)


def test_a_kept_world_outlives_a_kernel_restart_and_a_new_kernel_finds_it_as_it_was(kept_dir, tmp_path):
    kernel_id = "7d1f0c2a-keep"  # named as a Jupyter server names a kernel's connection file
    kernel, pids = start_kept(kept_dir, "60", connection_file=str(tmp_path / f"kernel-{kernel_id}.json"))
    try:
        content, text, _ = kernel.run(
            "%%distributed\nkept_value = 1000 + dist.get_rank()\nlayer = torch.nn.Linear(2, 2)\nprint('value', kept_value)"
        )
        assert content["status"] == "ok", text
        (record,) = kept_dir.glob("*.json")
        assert oct(record.stat().st_mode & 0o777) == "0o600" and oct(kept_dir.stat().st_mode & 0o777) == "0o700"
        workdir = json.loads(record.read_text())["workdir"]
        kernel.km.restart_kernel(now=False)  # JupyterLab's "Restart kernel": a clean exit, atexit handlers run
        waiting_out_the_lease(workdir, pids)
        assert [p for p in pids if not procs.alive(p)] == [], "a process of the kept world ended with the kernel"
        os.unlink(pointers.pointer_path(kernel_id))  # as if this were another kernel: only %dist_attach points it
        content, text, _ = kernel.run("%load_ext nbdist\n%dist_attach\n%dist_status")
        assert content["status"] == "ok", text
        assert f"attached to {record.stem}: 2 ranks, backend gloo" in text
        assert f"kept world {record.stem}" in text and "at most 60 s idle" in text, "%dist_status shows age and limit"
        # the kept world's transcripts come back with it: the kernel points at them, for its pages (issue 42)
        assert json.loads(open(pointers.pointer_path(kernel_id)).read())["workdir"] == workdir
        shown = [transcript.read(p) for p in transcript.cells(workdir)]
        assert any(
            "print('value', kept_value)" in c.code and "[rank 0] value 1000" in c.outputs[0]["text"] for c in shown
        )
        cell = "%%distributed\nt = torch.ones(1) * kept_value\ndist.all_reduce(t)\nprint('sum', t.item(), tuple(layer.weight.shape))"
        content, text, _ = kernel.run(cell)
        assert content["status"] == "ok", text
        assert "[ranks 0,1] sum 2001.0 (2, 2)" in text, "variables, a model and the process group as left"
        content, text, _ = kernel.run("%dist_stop")
        assert content["status"] == "ok", text
        assert wait_gone(pids, 30) == [], "%dist_stop in the attached kernel ends the kept world"
        assert not record.exists(), "and its record"
    finally:
        kernel.close()
        procs.kill([p for p in pids if procs.alive(p)])


def test_a_kept_world_ends_by_itself_once_idle_for_its_time_and_then_cannot_be_attached(kept_dir):
    kernel, pids = start_kept(kept_dir, "5s")
    try:
        (record,) = kept_dir.glob("*.json")
        workdir = json.loads(record.read_text())["workdir"]
        os.kill(kernel.km.provisioner.pid, signal.SIGKILL)  # the kernel dies: the idle time starts
        waiting_out_the_lease(workdir, pids)
        assert [p for p in pids if not procs.alive(p)] == [], "ended before its idle time"
        assert wait_gone(pids, 30) == [], "the kept world outlived its idle time"
        with pytest.raises(ConfigError, match=r"the kept world nbdist-\w+ \(ended at [\d:]+\) ran out of time"):
            nbdist.attach()
        assert list(kept_dir.glob("*.json")) == [], "the stale record went with the world"
    finally:
        kernel.close()
        procs.kill([p for p in pids if procs.alive(p)])


def test_attach_with_nothing_kept_or_a_world_of_another_user_says_so(kept_dir, ip):
    from IPython.core.error import UsageError

    with pytest.raises(ConfigError, match=r"no world is kept in .*kept; start one with %dist_start -n 2 --keep 30m"):
        nbdist.attach()
    ip.run_line_magic("load_ext", "nbdist")
    with pytest.raises(UsageError, match="no world named 'nbdist-x' is kept"):
        ip.run_line_magic("dist_attach", "nbdist-x")
    if os.getuid() != 0:
        pytest.skip("giving a record to another user needs root (chown)")
    kept_dir.mkdir(exist_ok=True)
    other = kept_dir / "nbdist-other.json"
    other.write_text("{}")
    os.chown(other, 65534, 65534)
    with pytest.raises(ConfigError, match=r"belongs to user \w+, not to you .* only the user who started a world"):
        nbdist.attach()


def test_keep_that_does_not_parse_is_named_with_an_example():
    from nbdist.config import StartConfig

    with pytest.raises(ConfigError, match=r"--keep '5x' is not a duration; write e.g. --keep 30m"):
        StartConfig.of(keep="5x")
    with pytest.raises(ConfigError, match=r"--keep '0' must be more than 0 and at most a week"):
        StartConfig.of(keep="0")
    assert StartConfig.of(keep="1h30m").world.keep == 5400.0


def test_attach_proves_the_world_alive_rank_by_rank_instead_of_trusting_its_record(kept_dir):
    from nbdist.errors import ClusterError

    with nbdist.start(n=2, keep="60") as cluster:
        (record,) = kept_dir.glob("*.json")
        assert json.loads(record.read_text())["keep_s"] == 60.0
        victim = cluster.engines.ranks[1].pid
        os.kill(victim, signal.SIGKILL)
        assert wait_gone([victim], 10) == []
        with pytest.raises(ClusterError, match=rf"{record.stem} (did not answer as recorded|.*are gone from)"):
            nbdist.attach()


def test_an_attached_kernel_restarts_a_dead_rank_of_the_kept_world_and_stop_ends_everything(kept_dir):
    cluster = nbdist.start(n=2, keep="60")
    first = cluster.pids()
    try:
        cluster.run("kept_value = 1000 + dist.get_rank()").raise_for_error()
        again = nbdist.attach()  # a second client, as a new kernel would have
        old = again.engines.ranks[1].pid
        os.kill(old, signal.SIGKILL)
        assert wait_gone([old], 10) == []
        again.restart([1])
        assert again.engines.ranks[1].pid not in (0, old)
        assert again.pull("kept_value", ranks=[0]) == [1000], "rank 0 kept its variables"
        assert again.run("t = torch.ones(1)\ndist.all_reduce(t)\nassert t.item() == 2.0").ok
        (record,) = kept_dir.glob("*.json")
        assert again.engines.ranks[1].pid in [r["pid"] for r in json.loads(record.read_text())["ranks"]]
        everything = again.pids()
        again.stop()
        assert wait_gone(sorted(set(everything) | set(first) - {old}), 30) == []
    finally:
        procs.kill([p for p in cluster.pids() if procs.alive(p)])
