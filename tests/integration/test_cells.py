"""A real 2-engine cluster with a real gloo process group, driven through the API and the magics.

One cluster for the module. Each fault drill (FAULTS.md rows 1, 2, 3, 8, 10) ends by
proving the world is usable again: the next cell's all_reduce gives the right sum.
"""

from __future__ import annotations

import os
import signal
import threading
import time

import pytest

from nbdist.errors import RankError, RunTimeout
from nbdist.run import Sink
from tests.conftest import run_cell

PROOF = "z = torch.ones(1) * (dist.get_rank() + 1)\ndist.all_reduce(z)\nproof = z.item()"


def assert_usable(cluster, within: float = 5.0) -> None:
    tic = time.perf_counter()
    cluster.run(PROOF).raise_for_error()
    assert cluster.pull("proof") == [3.0, 3.0]
    assert time.perf_counter() - tic < within


def test_world_is_initialised_and_all_reduce_sums_on_every_rank(cluster):
    r = cluster.run(
        "import os\nt = torch.tensor([float(dist.get_rank() + 1)])\ndist.all_reduce(t)\ninfo = (dist.get_rank(), dist.get_world_size(), os.environ['RANK'], os.environ['LOCAL_RANK'], os.environ['WORLD_SIZE'], os.environ['MASTER_ADDR'], os.environ['OMP_NUM_THREADS'], t.item(), torch.get_num_threads())"
    )
    r.raise_for_error()
    threads = str(max(1, (os.cpu_count() or 1) // 2))
    assert cluster.pull("info") == [
        (0, 2, "0", "0", "2", "127.0.0.1", threads, 3.0, int(threads)),
        (1, 2, "1", "1", "2", "127.0.0.1", threads, 3.0, int(threads)),
    ]
    assert cluster.backend == "gloo"


def test_state_persists_across_cells_and_magics_tag_output(cluster, ip, capsys):
    run_cell(ip, "%%distributed\ncounter = dist.get_rank() * 10")
    run_cell(ip, "%%distributed\ncounter += 1\nprint('counter is', counter)")
    out = capsys.readouterr().out
    assert "[rank 0] counter is 1" in out and "[rank 1] counter is 11" in out


def test_rank_subsets(cluster, ip, capsys):
    run_cell(ip, "%%rank 1\nonly_one = 'yes'\nprint('hello from', dist.get_rank())")
    out = capsys.readouterr().out
    assert "[rank 1] hello from 1" in out and "[rank 0]" not in out
    run_cell(ip, "%%distributed --ranks 0,1\nprint('has it:', 'only_one' in globals())")
    out = capsys.readouterr().out
    assert "[rank 0] has it: False" in out and "[rank 1] has it: True" in out
    assert cluster.pull("only_one", ranks=1) == ["yes"]


def test_quiet_shows_rank_zero_only(cluster, ip, capsys):
    run_cell(ip, "%%distributed --quiet\nprint('rank says', dist.get_rank())")
    out = capsys.readouterr().out
    assert "[rank 0] rank says 0" in out and "[rank 1]" not in out


def test_output_streams_while_the_cell_runs(cluster):
    seen: list[tuple[float, str]] = []

    class Recorder(Sink):
        def stream(self, rank, name, text):
            seen.append((time.perf_counter(), text))

    tic = time.perf_counter()
    cluster.run(
        "import time\nprint('early', flush=True)\ntime.sleep(1.5)\nprint('late')", ranks=0, sink=Recorder()
    ).raise_for_error()
    early = [t for t, text in seen if "early" in text]
    assert early and early[0] - tic < 1.2, "the first line should arrive before the cell ends"


def test_rich_display_and_results_come_back_per_rank(cluster):
    r = cluster.run(
        "from IPython.display import HTML, display\ndisplay(HTML(f'<b>rank {dist.get_rank()}</b>'))\ndist.get_rank() * 2"
    )
    r.raise_for_error()
    assert r[1].outputs[0]["data"]["text/html"] == "<b>rank 1</b>"
    assert r[0].result["data"]["text/plain"] == "0" and r[1].result["data"]["text/plain"] == "2"


def test_noblock_returns_at_once_and_collects_later(cluster, ip):
    tic = time.perf_counter()
    pending = run_cell(ip, "%%distributed --noblock\nimport time\ntime.sleep(1)\nnb = dist.get_rank()")
    assert time.perf_counter() - tic < 0.8
    assert not pending.done()
    result = pending.wait(show=False)
    assert result.ok and cluster.pull("nb") == [0, 1]


def test_push_and_pull_magics(cluster, ip):
    ip.user_ns["weights"] = [1, 2, 3]
    run_cell(ip, "%dist_push weights")
    run_cell(ip, "%%distributed\nw_sum = sum(weights) + dist.get_rank()")
    assert run_cell(ip, "%dist_pull w_sum") == [6, 7]


def test_fault1_error_on_one_rank_fails_the_cell_with_its_traceback_first(cluster, ip, capsys):
    code = "%%distributed\nx1 = 1\nif dist.get_rank() == 1:\n    raise ValueError('bad batch on rank 1')\nx1 = 2"
    result = ip.run_cell(code)
    err = result.error_in_exec
    assert isinstance(err, RankError)
    assert err.rank == 1
    assert str(err).startswith("rank 1 (engine ") and "raised ValueError in cell line 3: bad batch on rank 1" in str(
        err
    )
    rendered = "\n".join(err._render_traceback_())
    assert "raise ValueError('bad batch on rank 1')" in rendered  # the cell's own source line
    assert "<string>" not in rendered
    assert any("state on the ranks may now differ" in n for n in err.notes)
    assert cluster.pull("x1") == [2, 1]
    assert_usable(cluster)


def test_fault2_rank_fails_while_others_wait_in_a_collective(cluster):
    tic = time.perf_counter()
    r = cluster.run(
        "if dist.get_rank() == 1:\n    raise RuntimeError('rank 1 gives up')\ndist.all_reduce(torch.ones(4))"
    )
    took = time.perf_counter() - tic
    assert took < 5, f"the waiting rank should be released within seconds, took {took:.1f}s"
    assert r.released == "failure"
    assert r[1].status == "error" and r[0].status == "interrupted"
    assert any("process group was rebuilt" in n for n in r.notes)
    assert any("rank 0 was at cell line 3, in all_reduce" in n for n in r.notes)
    with pytest.raises(RankError) as info:
        r.raise_for_error()
    assert info.value.rank == 1
    assert_usable(cluster)


def test_fault3_ctrl_c_reaches_ranks_blocked_in_collectives(cluster):
    def interrupt():
        time.sleep(1.0)
        os.kill(os.getpid(), signal.SIGINT)

    threading.Thread(target=interrupt, daemon=True).start()
    tic = time.perf_counter()
    with pytest.raises(KeyboardInterrupt):
        cluster.run(
            "if dist.get_rank() == 0:\n    dist.all_reduce(torch.ones(1))\nelse:\n    dist.broadcast(torch.ones(3), src=1)\n    dist.barrier()"
        )
    took = time.perf_counter() - tic - 1.0
    assert took < 4, f"every rank should stop within ~3 s of Ctrl-C, took {took:.1f}s"
    assert cluster.dead_ranks() == []
    assert_usable(cluster)


def test_fault8_unpicklable_values_name_rank_variable_and_type(cluster, ip):
    from IPython.core.error import UsageError

    run_cell(ip, "%%distributed\nimport threading\nlock = threading.Lock()")
    with pytest.raises(UsageError) as info:
        run_cell(ip, "%dist_pull lock")
    msg = str(info.value)
    assert "'lock'" in msg and "_thread.lock" in msg and "rank 0" in msg
    ip.user_ns["gen"] = (i for i in range(3))
    with pytest.raises(UsageError) as info:
        run_cell(ip, "%dist_push gen")
    assert "'gen'" in str(info.value) and "generator" in str(info.value) and ".cpu()" in str(info.value)
    with pytest.raises(UsageError, match="rank 1 .* has no variable 'nope'"):
        run_cell(ip, "%dist_pull nope --ranks 1")


def test_fault10_timeout_reports_where_each_rank_waits_and_releases(cluster, ip):
    tic = time.perf_counter()
    result = ip.run_cell(
        "%%distributed --timeout 2\nif dist.get_rank() == 0:\n    dist.all_reduce(torch.ones(1))\nwaited = True"
    )
    took = time.perf_counter() - tic
    err = result.error_in_exec
    assert isinstance(err, RunTimeout)
    assert "rank 0" in str(err) and "did not finish in time in cell line 2" in str(err)
    assert any("rank 0 was at cell line 2, in all_reduce (inside torch.distributed)" in n for n in err.notes)
    assert took < 2 + 5
    assert_usable(cluster)


def test_dist_mode_runs_every_cell_on_all_ranks(cluster, ip, capsys):
    run_cell(ip, "%dist_mode on")
    try:
        run_cell(ip, "mode_value = dist.get_rank() + 100\nprint('mode', mode_value)")
    finally:
        run_cell(ip, "%dist_mode off")
    out = capsys.readouterr().out
    assert "[rank 0] mode 100" in out and "[rank 1] mode 101" in out
    assert "mode_value" not in ip.user_ns


def test_each_rank_and_its_gloo_threads_run_on_their_own_cores(cluster):
    import os

    allowed = sorted(os.sched_getaffinity(0))
    cluster.run(
        "import os, threading\n"
        "mine = sorted(os.sched_getaffinity(0))\n"
        "threads = {}\n"
        "for tid in os.listdir('/proc/self/task'):\n"  # threads the process group started inherit it
        "    with open(f'/proc/self/task/{tid}/comm') as fh:\n"
        "        name = fh.read().strip()\n"
        "    threads[name] = sorted(os.sched_getaffinity(int(tid)))"
    ).raise_for_error()
    mine = cluster.pull("mine")
    if len(allowed) >= 2:
        assert mine[0] and mine[1] and not set(mine[0]) & set(mine[1]), mine
        assert set(mine[0]) | set(mine[1]) <= set(allowed)
        assert [r["cpus"] for r in cluster.status()] == [
            ",".join(map(str, m)) if len(m) == 1 else f"{m[0]}-{m[-1]}" for m in mine
        ]
        for rank, threads in enumerate(cluster.pull("threads")):
            gloo = [cpus for name, cpus in threads.items() if "gloo" in name.lower()]
            assert all(cpus == mine[rank] for cpus in gloo), threads


def test_status_lists_ranks(cluster, ip, capsys):
    rows = cluster.status()
    assert [r["rank"] for r in rows] == [0, 1]
    assert all(r["state"] == "idle" and r["backend"] == "gloo" and r["device"] == "cpu" for r in rows)
    run_cell(ip, "%dist_status")
    out = capsys.readouterr().out
    assert "rank" in out and "engine_id" in out and str(rows[1]["pid"]) in out


def test_fault10_default_watchdog_releases_a_rank_left_alone_in_a_collective(cluster):
    old = cluster.config.watchdog
    cluster.config.watchdog = 2.0
    try:
        tic = time.perf_counter()
        r = cluster.run("if dist.get_rank() == 0:\n    dist.all_reduce(torch.ones(1))")  # rank 1 skips it
        took = time.perf_counter() - tic
    finally:
        cluster.config.watchdog = old
    assert r.released == "watchdog" and r[0].status == "timeout" and r[1].status == "ok"
    assert any("rank 0 was at cell line 2, in all_reduce" in n for n in r.notes)
    assert took < 2.0 + 5
    with pytest.raises(RunTimeout):
        r.raise_for_error()
    assert_usable(cluster)


def test_watchdog_leaves_legitimate_work_alone(cluster):
    old = cluster.config.watchdog
    cluster.config.watchdog = 0.5
    try:
        r = cluster.run("import time\nif dist.get_rank() == 0:\n    time.sleep(2.0)\ndone_sleeping = True")
    finally:
        cluster.config.watchdog = old
    assert r.ok and r.released is None


def test_fault9_huge_output_is_cut_in_view_but_kept_and_never_blocks(cluster, capsys):
    tic = time.perf_counter()
    r = cluster.run("import sys\nsys.stderr.write('e' * 200_000 + '\\n')\nbig_done = True")
    took = time.perf_counter() - tic
    r.raise_for_error()
    err = capsys.readouterr().err
    assert "cut at 100,000 characters" in err and len(err) < 2 * 110_000
    assert len(r[0].stderr) >= 200_000  # nothing lost
    assert took < 10
    assert_usable(cluster)


def test_logged_metrics_arrive_tagged_by_rank_while_the_cell_runs(cluster):
    arrivals: list[tuple[float, int, int]] = []

    class Recorder(Sink):
        def metrics(self, rank, rows):
            arrivals.append((time.perf_counter(), rank, len(rows)))

    tic = time.perf_counter()
    r = cluster.run(
        "import time, nbdist\nfor i in range(20):\n    nbdist.log(step=i, loss=dist.get_rank() + 1.0 / (i + 1))\n    time.sleep(0.05)",
        sink=Recorder(),
    )
    r.raise_for_error()
    took = time.perf_counter() - tic
    assert {rank: len(rows) for rank, rows in r.metrics.items()} == {0: 20, 1: 20}
    assert r.metrics[1][0]["loss"] == 2.0 and r.metrics[0][19]["step"] == 19
    early = [t - tic for t, _, _ in arrivals if t - tic < took - 0.3]
    assert early, "batches should arrive while the cell runs"
    batches_per_rank = len(arrivals) / 2
    assert 2 <= batches_per_rank <= took / 0.2 + 2  # batched: at most ~5 a second


def test_bench_sweep_and_scaling_report(cluster):
    from nbdist.bench import bench, figure

    report = bench(cluster, sizes=[4096, 1 << 20], scaling=True)
    rows = report["allreduce"]
    assert [r["bytes"] for r in rows] == [4096, 1 << 20]
    for r in rows:
        assert r["seconds"] > 0
        assert r["algbw_GBps"] == pytest.approx(r["bytes"] / r["seconds"] / 1e9)
        assert r["busbw_GBps"] == pytest.approx(r["algbw_GBps"] * 2 * (2 - 1) / 2)  # 2(n-1)/n with n = 2
    assert report["memcpy_GBps"] > rows[-1]["algbw_GBps"]  # loopback all_reduce cannot beat a local copy
    sc = report["scaling"]
    assert sc["efficiency"] == pytest.approx(sc["n_ranks_samples_per_s"] / (2 * sc["one_rank_samples_per_s"]))
    assert len(figure(report).data) == 3
