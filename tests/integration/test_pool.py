"""The warm process (nbdist.launch.pool, engine/warm.py): engines forked from a process that imported torch once."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import psutil
import pytest

import nbdist
from nbdist.config import default_threads
from nbdist.launch import pool
from tests.helpers import poll, wait_gone


@pytest.fixture(autouse=True)
def empty_pool():
    pool.shutdown()
    yield
    pool.shutdown()


def _parent(pid: int) -> int:
    return psutil.Process(pid).ppid()


def test_engines_are_forks_of_the_warm_process_and_become_ordinary_engines(tmp_path, monkeypatch):
    threads = default_threads(2)
    server = pool.warm(2, threads)
    assert server and pool.warm(2, threads) is None, "one server serves any number of engines"
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("NBDIST_TEST_MARK", "set-after-warming")  # the job carries today's environment
    with nbdist.start(n=2) as cluster:
        pids = [r.pid for r in cluster.ranks]
        assert [_parent(p) for p in pids] == [server, server]
        result = cluster.run(
            "import os, sys, random, numpy as np\n"
            "t = torch.ones(1)\n"
            "dist.all_reduce(t)\n"
            "seen = (t.item(), os.environ['RANK'], os.environ.get('NBDIST_TEST_MARK'), torch.get_num_threads(),"
            " os.getcwd(), sys.stdin.read(), os.getsid(0) == os.getpid())\n"
            "draws = (float(np.random.rand()), random.random())"
        )
        result.raise_for_error()
        seen = cluster.pull("seen")
        assert seen == [(2.0, str(r), "set-after-warming", threads, str(tmp_path), "", True) for r in range(2)]
        # numpy's and random's global generators are reseeded in each fork, as in fresh processes
        draws = cluster.pull("draws")
        assert draws[0][0] != draws[1][0] and draws[0][1] != draws[1][1]
        # A forked rank left waiting in a collective is released like any other (its watcher
        # thread and signal handling came with the job, not with the import).
        run = cluster.run("if dist.get_rank() == 1:\n    raise ValueError('no')\ndist.all_reduce(torch.ones(4))")
        assert run.released == "failure" and run[0].status == "interrupted" and run[1].status == "error"
        # a replaced rank is forked too
        cluster.restart([1])
        assert _parent(cluster.ranks[1].pid) == server
        cluster.run("t = torch.ones(1); dist.all_reduce(t); v = t.item()").raise_for_error()
        assert cluster.pull("v") == [2.0, 2.0]
        pids.append(cluster.ranks[1].pid)
    assert wait_gone(pids, 5) == [], "stop ends forked engines like cold ones"
    assert pool.pids() == [server] and psutil.pid_exists(server), "the warm process stays for the next start"
    pool.shutdown()
    assert wait_gone([server], 5) == []


SIGNALS = "import signal; dispositions = {s: int(signal.getsignal(getattr(signal, s))) for s in ('SIGPIPE', 'SIGXFSZ')}"


def test_a_forked_rank_has_the_signal_dispositions_of_a_fresh_python_and_survives_a_broken_pipe():
    """Python ignores SIGPIPE (and SIGXFSZ) at start-up; a fork that reset SIGPIPE to the default died without a
    word when it wrote to a socket whose peer had gone: the store rank 0 hosts, or a gloo pair, when another rank
    was killed (#57: 2 kills in 29 took rank 0 along)."""
    fresh: dict = {}
    exec(SIGNALS, fresh)
    assert fresh["dispositions"] == {"SIGPIPE": int(signal.SIG_IGN), "SIGXFSZ": int(signal.SIG_IGN)}
    server = pool.warm(2, default_threads(2))
    with nbdist.start(n=2) as cluster:
        assert [_parent(r.pid) for r in cluster.ranks] == [server, server]
        cluster.run(SIGNALS).raise_for_error()
        assert cluster.pull("dispositions") == [fresh["dispositions"]] * 2
        cluster.run(
            "import socket\n"
            "mine, peer = socket.socketpair()\n"
            "peer.close()\n"
            "try:\n"
            "    for _ in range(4):\n"
            "        mine.send(b'x' * 65536)\n"
            "    wrote = 'sent'\n"
            "except BrokenPipeError:\n"
            "    wrote = 'broken pipe'\n",
            ranks=[0],
        ).raise_for_error()
        assert cluster.pull("wrote", ranks=[0]) == ["broken pipe"]
        assert cluster.dead_ranks() == []


def test_a_start_without_a_warm_process_begins_one_and_ends_it_with_the_cluster():
    with nbdist.start(n=2) as cluster:
        (server,) = pool.pids()
        assert [_parent(r.pid) for r in cluster.ranks] == [server, server]
    assert wait_gone([server], 5) == [] and pool.count() == 0


def test_a_warm_process_for_other_settings_is_left_alone():
    threads = default_threads(2)
    other = pool.warm(1, threads + 1)  # imported torch with another OMP_NUM_THREADS
    with nbdist.start(n=2) as cluster:
        assert other not in {_parent(r.pid) for r in cluster.ranks}, "a mismatched server must not fork engines"
        assert other in pool.pids()
    assert pool.pids() == [other]
    pool.shutdown()
    assert wait_gone([other], 5) == []


def test_a_dead_warm_process_is_replaced():
    threads = default_threads(2)
    server = pool.warm(1, threads)
    os.kill(server, 9)
    psutil.Process(server).wait(5)
    assert pool.count() == 0
    with nbdist.start(n=2) as cluster:
        assert server not in {_parent(r.pid) for r in cluster.ranks}
        cluster.run("t = torch.ones(1); dist.all_reduce(t)").raise_for_error()


def test_engines_outlive_a_warm_process_that_ends_and_end_with_their_cluster():
    server = pool.warm(2, default_threads(2))
    with nbdist.start(n=2) as cluster:
        pool.shutdown()  # %unload_ext nbdist while a cluster runs
        assert wait_gone([server], 5) == []
        # Every watcher thread on each engine looks once more since the server ended (engine/parentwatch.py):
        # one that took the engines for orphans would have ended them, and this cell would fail.
        def looks() -> list[dict[str, int]]:
            cluster.run("from nbdist.engine import parentwatch; looks = dict(parentwatch.LOOKS)").raise_for_error()
            return cluster.pull("looks")

        def looked_once():
            """every engine's watcher looked at least once (a watcher sleeps 0.5 s before its first look, and this
            cell can come sooner after the engine started: CI, 2026-12-06, every engine's looks still {})"""
            return all(found := looks()) and found

        try:
            first = poll(looked_once, 30, every=0.1)
        except BaseException:  # say which threads each engine has: is there a watcher at all?
            cluster.run("import threading; threads = sorted(t.name for t in threading.enumerate())")
            print("each engine's threads:", cluster.pull("threads"), "looks:", cluster.pull("looks"))
            raise

        def looked_again():
            """each engine's every watcher thread looked again after the warm process ended"""
            return all(now[name] > seen[name] for seen, now in zip(first, looks(), strict=True) for name in seen)

        poll(looked_again, 30, every=0.1)
        cluster.run("t = torch.ones(1); dist.all_reduce(t); v = t.item()").raise_for_error()
        assert cluster.pull("v") == [2.0, 2.0]
        pids = cluster.pids()
    assert wait_gone(pids, 5) == []


def test_nbdist_warm_0_turns_warming_off(monkeypatch):
    monkeypatch.setenv("NBDIST_WARM", "0")
    assert pool.warm(2, 1) is None
    with nbdist.start(n=2) as cluster:
        assert pool.count() == 0
        assert {_parent(r.pid) for r in cluster.ranks} == {os.getpid()}, "cold engines are this process's children"


def _compiler_of(server: int) -> psutil.Process | None:
    for child in psutil.Process(server).children():
        if "compile_when_quiet()" in " ".join(child.cmdline()):
            return child
    return None


def test_an_empty_numba_cache_is_filled_beside_the_warm_process_and_no_start_waits_for_it(tmp_path, monkeypatch):
    """Issue 30: with numba's cache empty (a fresh install) compiling every kernel takes ~16 s of a
    core. A niced child of the warm process compiles them into the cache while the warm process goes
    on forking: the world comes up while the compiler still runs. Once it is done the warm process
    loads them, and ranks forked after that start with them loaded."""
    monkeypatch.setenv("NUMBA_CACHE_DIR", str(tmp_path / "numba"))
    server = pool.warm(2, default_threads(2))
    compiler = poll(lambda: _compiler_of(server), 60)  # once torch and nbdist.parallel are imported
    with nbdist.start(n=2) as cluster:
        assert compiler.is_running(), "the start waited for the kernels to compile"
        cluster.run("t = torch.ones(1); dist.all_reduce(t)").raise_for_error()
        compiler.wait(180)
        kernels = "__import__('nbdist.compression.kernels', fromlist=['k'])"
        assert cluster.pull(f"{kernels}.cached()") == [True, True], "the cache the ranks read is filled"

        def restarted_ranks_have_the_kernels_loaded():
            cluster.restart()
            return all(cluster.pull(f"len({kernels}.scatter_add.signatures) > 0"))

        poll(restarted_ranks_have_the_kernels_loaded, 30, every=0.5)
        assert cluster.pull(f"{kernels}.sign_unpack.stats.cache_misses") == [{}, {}], "loaded, not compiled"


def _cpu_s(pid: int) -> float:
    t = psutil.Process(pid).cpu_times()
    return t.user + t.system


def test_the_warm_process_leaves_every_core_to_the_ranks_and_does_its_idle_work_once_one_is_free():
    """Its idle work (about 1.5 s of a core after a start: what a replayed setup cell imports, numba's kernels) ran
    beside the first cell: on a 2-core laptop one rank computed about half as fast for a second, and %dist_why named
    it (compute skew, CI 2026-12-03). Here a spinner per core stands for ranks that compute: the warm process does
    nothing while they spin, and its work once they stop (ranks forked after it start with numba's kernels loaded)."""
    cores = len(os.sched_getaffinity(0))
    spinners = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(cores)]
    try:
        server = pool.warm(2, default_threads(2))
        with nbdist.start(n=2, timeout=120) as cluster:
            before = _cpu_s(server)
            time.sleep(5)
            used = _cpu_s(server) - before
            for spinner in spinners:
                spinner.kill()
            assert used < 0.15, f"the warm process took {used:.2f} s of a core while every core computed"
            kernels = "__import__('nbdist.compression.kernels', fromlist=['k'])"

            def restarted_ranks_have_the_kernels_loaded():
                cluster.restart()
                return all(cluster.pull(f"len({kernels}.scatter_add.signatures) > 0"))

            # within 20 s: the step the warm process takes anyway after 30 s of busy cores cannot be what did it
            poll(restarted_ranks_have_the_kernels_loaded, 20, every=0.5)
    finally:
        for spinner in spinners:
            spinner.kill()
            spinner.wait()


def test_the_numba_compiler_beside_the_warm_process_compiles_only_while_a_core_is_free(tmp_path, monkeypatch):
    """A fresh install's kernels (about 16 s of a core) compile in a child of the warm process. Its nice does not
    put it below the ranks (each engine is a session of its own, and the kernel's autogroups weigh sessions first),
    so it compiles a kernel at a time, each once a core is free. A spinner per core stands for ranks that compute:
    once the kernel it was compiling is done, the compiler waits; when they stop, it fills the cache."""
    monkeypatch.setenv("NUMBA_CACHE_DIR", str(tmp_path / "numba"))
    server = pool.warm(2, default_threads(2))
    compiler = poll(lambda: _compiler_of(server), 60)  # begun once the warm process's imports are done
    cores = len(os.sched_getaffinity(0))
    spinners = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(cores)]
    try:
        time.sleep(8)  # the kernel being compiled when they began is finished (numba's first is the longest)
        before = _cpu_s(compiler.pid)
        time.sleep(5)
        used = _cpu_s(compiler.pid) - before
    finally:
        for spinner in spinners:
            spinner.kill()
            spinner.wait()
    assert compiler.is_running() and used < 0.3, f"the compiler took {used:.2f} s of a core while every core computed"
    compiler.wait(180)
    from nbdist.compression import kernels

    indexes = list((tmp_path / "numba").rglob("*.nbi"))  # one per kernel compiled into the cache
    assert len(indexes) >= len(kernels.warm_up_steps()), f"the cache is filled once the cores are free: {indexes}"


POISON = """
import sys, threading, time
if "nbdist.engine.warm" in sys.orig_argv WHERE:  # a thread started when Python starts, in the fork servers only
    threading.Thread(target=time.sleep, args=(3600,), name="planted", daemon=True).start()
"""


def _poison(tmp_path, monkeypatch, where: str = "") -> None:
    (tmp_path / "sitecustomize.py").write_text(POISON.replace("WHERE", where))
    monkeypatch.setenv("PYTHONPATH", f"{tmp_path}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")


def _gone(pid: int) -> bool:
    return not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE


def _works(cluster) -> None:
    cluster.run("t = torch.ones(1)\ndist.all_reduce(t)\nv = t.item()").raise_for_error()
    assert cluster.pull("v") == [2.0, 2.0]


def test_a_warm_process_that_cannot_fork_safely_refuses_and_the_ranks_come_from_a_fork_server(
    tmp_path, monkeypatch, capfd
):
    """A thread besides the main one in the warm process only (planted by a sitecustomize that spares a lean fork
    server, as something the warm process imports beyond torch and ipyparallel's engine might start one): it
    refuses to fork, says why in one line, and the ranks come from a fork server begun for them (--start
    forkserver), which ends with the world."""
    _poison(tmp_path, monkeypatch, 'and "--lean" not in sys.orig_argv')
    server = pool.warm(2, default_threads(2))
    assert server
    with nbdist.start(n=2) as cluster:
        makers = {_parent(r.pid) for r in cluster.ranks}
        assert len(makers) == 1 and server not in makers, "a rank was forked from the poisoned process"
        (maker,) = makers
        assert "--lean" in psutil.Process(maker).cmdline()
        _works(cluster)
    said = capfd.readouterr().err
    assert said.count("cannot fork ranks safely") == 1, said  # once: the refused server is ended, not asked again
    assert f"the warm process (pid {server}) cannot fork ranks safely: 1 thread(s) besides its main one" in said, said
    assert "They start from a fork server of their own instead (--start forkserver" in said, said
    assert _gone(server) and wait_gone([maker], 5) == []
    # the poison gone (the sitecustomize removed), the next start forks from a new warm process and says nothing
    monkeypatch.setenv("PYTHONPATH", os.environ["PYTHONPATH"].split(os.pathsep, 1)[1])
    clean = pool.warm(2, default_threads(2))
    with nbdist.start(n=2) as cluster:
        assert {_parent(r.pid) for r in cluster.ranks} == {clean}
        _works(cluster)
    assert "cannot fork" not in capfd.readouterr().err


def test_fork_servers_that_cannot_fork_safely_refuse_and_the_ranks_start_cold(tmp_path, monkeypatch, capfd):
    """The same thread in every fork server (a sitecustomize runs in each): the warm process refuses, then the fork
    server begun instead, each said once, and the ranks start cold (--start spawn) and work."""
    _poison(tmp_path, monkeypatch)
    server = pool.warm(2, default_threads(2))
    assert server
    with nbdist.start(n=2) as cluster:
        assert {_parent(r.pid) for r in cluster.ranks} == {os.getpid()}, "a rank was forked from a poisoned process"
        _works(cluster)
    said = capfd.readouterr().err
    assert said.count("cannot fork ranks safely") == 2, said
    assert f"the warm process (pid {server}) cannot fork ranks safely: 1 thread(s) besides its main one" in said, said
    assert "the fork server (pid " in said and "They start cold instead (--start spawn" in said, said
    assert _gone(server) and pool.pids() == []
    # the next start asks every kind of server again: with the poison now in the warm process only, a fork server
    # makes its ranks (a refusal is not remembered past its start)
    _poison(tmp_path, monkeypatch, 'and "--lean" not in sys.orig_argv')
    again = pool.warm(2, default_threads(2))
    with nbdist.start(n=2) as cluster:
        makers = {_parent(r.pid) for r in cluster.ranks}
        assert again not in makers and all("--lean" in psutil.Process(m).cmdline() for m in makers), makers
        _works(cluster)
    assert capfd.readouterr().err.count("cannot fork ranks safely") == 1
