"""A real 2-engine cluster with a real gloo process group, driven through the API and the magics.

One cluster for the module. Each fault drill (docs/faults.md, rows 1, 2, 3, 8, 9, 10) ends by
proving the world is usable again: the next cell's all_reduce gives the right sum.

Time bounds here only catch a hang: HANG_S is far below torch's 30-minute process-group
timeout, which is what a rank left waiting would otherwise wait for. How fast nbdist
releases and recovers is measured in benchmarks/cell_latency.py and benchmarks/faults.py.
"""

from __future__ import annotations

import os
import re
import signal
import threading
import time

import pytest

from nbdist.cells.output import Sink
from nbdist.errors import RankError, RunTimeout
from nbdist.results import RankStatus
from tests.helpers import run_cell, touch_code, wait_for, wait_for_file

PROOF = "z = torch.ones(1) * (dist.get_rank() + 1)\ndist.all_reduce(z)\nproof = z.item()"
HANG_S = 60.0  # a drill that takes longer than this waited for torch's timeout, not for nbdist


def assert_usable(cluster) -> None:
    cluster.run(PROOF).raise_for_error()
    assert cluster.pull("proof") == [3.0, 3.0]


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


def test_output_streams_while_the_cell_runs(cluster, tmp_path):
    """The cell waits until the test has received its first line: it can only see the file
    if that line was shown while the cell still ran."""
    flag = tmp_path / "early-arrived"

    class Recorder(Sink):
        def stream(self, rank, name, text):
            if "early" in text:
                flag.touch()

    cluster.run("print('early', flush=True)\n" + wait_for_file(flag), ranks=0, sink=Recorder()).raise_for_error()
    assert cluster.pull("seen", ranks=0) == ["seen"], "the first line should arrive before the cell ends"


_WRITTEN = (("stdout", "out", "\n"), ("stderr", "err", "\n"), ("display", "'shown", "'"))


def test_what_a_rank_writes_at_once_reaches_the_sink_whole_and_in_the_order_written(cluster):
    """The cell's first words come before the notebook could look for them (no wait in the cell): each rank's
    stdout, stderr and displays reach the sink in the order written, each once, every time. The sink is given
    each message as heard, not ipyparallel's store (which keeps the streams apart)."""
    code = (
        "import sys\nfrom IPython.display import display\n"
        "for k in range(3):\n"
        "    print(f'out {k}', flush=True); print(f'err {k}', file=sys.stderr, flush=True); display(f'shown {k}')"
    )
    want = [(name, f"{what} {k}" + end) for k in range(3) for name, what, end in _WRITTEN]

    class Recorder(Sink):
        def __init__(self):
            self.got = {0: [], 1: []}

        def stream(self, rank, name, text):  # a print may come in two messages ('out 0', then its newline)
            got = self.got[rank]
            if got and got[-1][0] == name:
                got[-1] = (name, got[-1][1] + text)
            else:
                got.append((name, text))

        def display(self, rank, content):
            self.got[rank].append(("display", content["data"]["text/plain"]))

    for _ in range(5):
        sink = Recorder()
        cluster.run(code, sink=sink).raise_for_error()
        assert sink.got == {0: want, 1: want}, sink.got


def test_rich_display_and_results_come_back_per_rank(cluster):
    r = cluster.run(
        "from IPython.display import HTML, display\ndisplay(HTML(f'<b>rank {dist.get_rank()}</b>'))\ndist.get_rank() * 2"
    )
    r.raise_for_error()
    assert r[1].outputs[0]["data"]["text/html"] == "<b>rank 1</b>"
    assert r[0].result["data"]["text/plain"] == "0" and r[1].result["data"]["text/plain"] == "2"


def test_a_rank_sends_a_cells_output_and_a_count_of_it_but_no_status_and_no_echo_of_its_code(cluster):
    """An engine's kernel publishes neither its busy status nor the execute_input echo of each cell's code, which
    nbdist never reads, and ends a cell's output with a count in its reply, not an idle status (compat.lean_iopub;
    ipykernel publishes all three: test_compat's probe); what the cell printed, its value and its error still come, in
    order, and the output is in once the count was heard. What a rank printed may come in more than one stream message
    (ipykernel sends what was written so far every 0.2 s: under load, 'hi' and its newline have come apart), so
    consecutive stream messages count as one, and their text must be whole."""
    import itertools

    from nbdist import compat

    view = cluster.view([0, 1])
    cells = {"print('hi')\n1 + 1": (["stream", "execute_result"], "hi\n"), "raise ValueError('no')": (["error"], "")}
    for code, (expected, printed) in cells.items():
        heard: dict[int, list[tuple[str, str | None, str]]] = {0: [], 1: []}

        def hear(k, future, heard=heard):
            future.iopub_callbacks.append(
                lambda msg, k=k: heard[k].append(
                    (msg["header"]["msg_type"], msg["content"].get("execution_state"), msg["content"].get("text", ""))
                )
            )

        ar = compat.execute_heard(view, code, hear)
        ar.wait(HANG_S)
        assert ar.wait_for_output(HANG_S) is True
        shown = {k: [kind for kind, _ in itertools.groupby(m[0] for m in msgs)] for k, msgs in heard.items()}
        assert shown == {0: expected, 1: expected}, (code, heard)  # no status among them
        texts = {k: "".join(text for kind, _, text in msgs if kind == "stream") for k, msgs in heard.items()}
        assert texts == {0: printed, 1: printed}, (code, heard)
    # ipyparallel's own requests ask for no count: their output still ends with the idle status, which they wait for
    assert view.execute("print('plain')", block=False).wait_for_output(HANG_S) is True


def test_a_cells_output_is_in_when_its_counted_messages_are_even_when_the_reply_comes_before_them(cluster):
    """A rank's reply goes through the controller's shell channel, its output through iopub: a reply may come before
    the last of what its cell printed. With no idle status after them (compat.lean_iopub), the cell's output is in
    only once the messages its reply counted were all heard: 8 MiB of prints, each flushed, are all there when
    ``wait_for_output`` returns, on both ranks, five times over."""
    from nbdist import compat

    view = cluster.view([0, 1])
    code = "for k in range(32):\n    print(str(k % 10) * (256 * 1024 - 1), flush=True)\n7"
    for _ in range(5):
        texts: dict[int, list[str]] = {0: [], 1: []}

        def hear(k, future, texts=texts):
            future.iopub_callbacks.append(lambda msg, k=k: texts[k].append(msg["content"].get("text", "")))

        ar = compat.execute_heard(view, code, hear)
        assert ar.wait_for_output(HANG_S) is True
        got = {k: "".join(parts) for k, parts in texts.items()}
        want = "".join(str(k % 10) * (256 * 1024 - 1) + "\n" for k in range(32))
        assert {k: len(t) for k, t in got.items()} == {0: len(want), 1: len(want)}
        assert got == {0: want, 1: want}


def test_a_failed_cell_sets_no_rank_aborting_the_requests_behind_it(cluster):
    """A cell is over once its ranks replied and the output they counted was heard, so the next cell can reach a rank
    sooner than when it waited for the idle status, which ipykernel publishes only after it began aborting the execute
    requests behind a failed one (``stop_on_error``, ``Kernel._abort_queues``) and before it has stopped: CI saw rank
    0 answer the cell after a failed one with TaskAborted while rank 1 ran it. nbdist's cells ask for no such abort
    (compat.execute_heard): each rank's kernel records the aborts it begins, and a failed cell, then the next, begin
    none; the next cell runs on both ranks."""
    record = (
        "_k = get_ipython().kernel\n_k._nbdist_aborts = []\n_abort = type(_k)._abort_queues\n"
        "_k._abort_queues = lambda *a, **kw: (_k._nbdist_aborts.append(a), _abort(_k, *a, **kw))[1]"
    )
    cluster.run(record, quiet=True).raise_for_error()
    try:
        for k in range(3):
            assert not cluster.run("raise ValueError('first')", quiet=True).ok
            cluster.run(f"_after = {k}", quiet=True).raise_for_error()
        assert cluster.pull("get_ipython().kernel._nbdist_aborts") == [[], []]
        assert cluster.pull("_after") == [2, 2]
    finally:
        cluster.run("get_ipython().kernel.__dict__.pop('_abort_queues', None)", quiet=True)


def test_the_notebooks_client_reads_each_replys_start_with_datetime(cluster):
    """The world's client reads each reply's timestamps with datetime, not dateutil (compat.fast_iso_dates, about
    0.1 ms a rank a cell on the client's IO thread); a rank's time in the cell is read from them as before."""
    from datetime import timezone

    view = cluster.view([0, 1])
    ar = view.execute("import time; time.sleep(0.2)", block=True)
    started = [md["started"] for md in ar.metadata]  # read on the client's IO thread as each reply came
    assert all(s.tzinfo is timezone.utc for s in started), started  # dateutil's parser gives its own tz objects
    result = cluster.run("import time; time.sleep(0.2)", quiet=True)
    assert all(0.2 <= r.wall_s < 0.2 + HANG_S for r in result.ranks), [r.wall_s for r in result.ranks]


def test_the_controller_keeps_no_record_and_logs_no_line_of_each_request(cluster):
    """nbdist's controller runs its hub without ipyparallel's in-memory record of every request (which held their
    output, up to 1 GiB) and without a log line of each (nbdist.engine.controller.main): asked for its records, it has
    none; its log has its start and no request in it. The cells themselves are as before."""
    import glob

    for _ in range(3):
        assert cluster.run("print('kept?')", quiet=True).ok
    client = cluster.view([0, 1]).client
    with pytest.raises(Exception, match="NoData"):  # a DictDB would answer with the requests just run
        client.db_query({"msg_id": {"$ne": ""}}, keys=["msg_id"])
    logs = glob.glob(os.path.join(cluster.engines.workdir, "profile", "log", "ipcontroller-*.log"))
    assert len(logs) == 1, logs
    with open(logs[0]) as fh:
        text = fh.read()
    assert "submitted request" not in text and "completed on" not in text, text[-2000:]
    assert cluster.pull("1 + 1") == [2, 2]


def test_the_controllers_hub_reads_no_copy_of_the_cells_requests_and_replies(cluster):
    """nbdist's controller's hub hears only the monitor topics it acts on (compat.lean_hub_monitor): not a copy of each
    direct request and reply, nor each rank's iopub status and output. Asked how many requests each engine has
    queued and completed, it counts none of the cells just run (ipyparallel's hub counts every one); the cells, their
    output and a pull are as before."""
    client = cluster.view([0, 1]).client
    for k in range(3):
        result = cluster.run(f"print('cell {k}')", quiet=True)
        assert result.ok and [r.stdout for r in result.ranks] == [f"cell {k}\n"] * 2
    assert cluster.pull("1 + 1") == [2, 2]
    status = client.queue_status()
    counted = {eid: (s["queue"], s["completed"]) for eid, s in status.items() if eid != "unassigned"}
    assert counted == dict.fromkeys(client.ids, (0, 0)), status


def test_a_traceback_a_cell_shows_itself_fails_its_rank_though_its_reply_says_ok(cluster):
    """An ok reply is read from its metadata alone (replies.error_of: two reads of the future fewer, in each of three
    looks at every rank's reply): what iopub said still counts. ``showtraceback()`` publishes an error while the reply
    says ok; nbdist has always failed such a rank (ipyparallel keeps that error beside the reply), and still does."""
    code = "try:\n    1 / 0\nexcept Exception:\n    get_ipython().showtraceback()\nafter = 1"
    ar = cluster.view([0, 1]).execute(code, silent=False, block=True)
    assert [md["status"] for md in ar.metadata] == ["ok", "ok"]  # the reply itself says nothing failed
    result = cluster.run(code, sink=Sink())
    assert [(r.status, (r.error or {}).get("ename")) for r in result.ranks] == [
        (RankStatus.ERROR, "ZeroDivisionError")
    ] * 2, result
    assert cluster.pull("after") == [1, 1]
    assert cluster.run("ok = 1", sink=Sink()).ok


def test_noblock_returns_at_once_and_collects_later(cluster, ip, tmp_path):
    """The cell cannot finish before the test creates a file, which it does only after the magic returned."""
    flag = tmp_path / "go"
    pending = run_cell(ip, "%%distributed --noblock\n" + wait_for_file(flag) + "nb = dist.get_rank()")
    assert not pending.done()
    flag.touch()
    result = pending.wait(show=False)
    assert result.ok and cluster.pull("nb") == [0, 1]
    assert cluster.pull("seen") == ["seen", "seen"]


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
    assert str(err).startswith("rank 1 raised ValueError in cell line 3: bad batch on rank 1"), str(err)
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
    assert took < HANG_S, f"the waiting rank was not released by nbdist (took {took:.0f} s)"
    assert r.released == "failure"
    assert r[1].status == "error" and r[0].status == "interrupted"
    assert any("process group was rebuilt" in n for n in r.notes)
    assert any("rank 0 was at cell line 3, in all_reduce" in n for n in r.notes)
    with pytest.raises(RankError) as info:
        r.raise_for_error()
    assert info.value.rank == 1
    assert_usable(cluster)


def test_a_released_rank_that_is_slow_to_stop_is_left_to_finish_and_keeps_its_variables(cluster):
    """A released rank that takes longer than the 3 s escalation to stop, working all the while (here its own
    handler computes for 8 s at one line, past two looks 3 s apart; on a loaded machine, formatting its traceback),
    is not ended: nbdist ends only ranks that are stuck (cells/release.py ``stuck``). It used to end it at 3 s ("did
    not stop after an interrupt; nbdist ended it"), with every variable of that rank; then at the second look, as
    long as a rank forked from the warm process could not read its own CPU time (ranks report it, rising)."""
    cluster.run("kept = dist.get_rank() + 10").raise_for_error()
    r = cluster.run(
        "import time\n"
        "if dist.get_rank() == 1:\n"
        "    raise RuntimeError('rank 1 gives up')\n"
        "try:\n"
        "    dist.all_reduce(torch.ones(4))\n"
        "except BaseException:\n"
        "    _end = time.process_time() + 8.0\n"
        "    while time.process_time() < _end: pass\n"
        "    raise\n"
    )
    assert r.released == "failure"
    assert r[1].status == "error" and r[0].status == "interrupted", (r[0].status, r[0].error)
    assert cluster.dead_ranks() == []
    assert cluster.pull("kept") == [10, 11]
    cluster.run("from nbdist.engine import runtime\ncpu = runtime._main_thread_cpu()").raise_for_error()
    cpu = cluster.pull("cpu")
    assert cpu[0] > 8.0 and 0 < cpu[1] < 8.0, cpu  # rank 0 computed in its handler, rank 1 raised
    assert_usable(cluster)


SIGNAL_ITSELF = "import os, signal\n_released = lambda: os.kill(os.getpid(), signal.SIGINT)\n"


def _a_cell_signalled_where(cluster, capsys, install: str, remove: str) -> None:
    """With ``install`` run on the ranks (it hooks ``_released``, which signals its own rank as a release does, into
    a cell's end), a cell says nothing of an interrupt and leaves no rank busy; ``remove`` takes the hook out."""
    from nbdist.world import reports

    cluster.run(SIGNAL_ITSELF + install).raise_for_error()
    try:
        capsys.readouterr()
        cluster.run("x = 1").raise_for_error()
        said = "".join(capsys.readouterr())
        assert "KeyboardInterrupt" not in said and "Error in callback" not in said, said
        where = reports.where(cluster.engines, [0, 1], wait=HANG_S)
        assert {r: rep.get("busy") for r, rep in where.items()} == {0: False, 1: False}, where
    finally:
        cluster.run(remove).raise_for_error()
    assert_usable(cluster)


def test_a_release_that_comes_while_a_cell_ends_cuts_nothing_short(cluster, capsys):
    """The release that follows a death can reach a living rank while its post-cell hook runs (its collective broke
    and its cell just ended). Here each rank's cell-end work signals itself (SIGINT, as a release does): the hook
    goes on to the end, nothing is said of an interrupt, and the rank is not left marked busy in a cell that is over
    (with the hook's own SIGINT guard last, the interrupt cut it short: busy forever, and a second signal before the
    reply lost the reply, and nbdist then ended the living rank)."""
    _a_cell_signalled_where(
        cluster,
        capsys,
        "from nbdist.engine import state\nstate.CELL_END.append(_released)",
        "state.CELL_END.remove(_released)",
    )


def test_a_release_between_the_cells_code_and_its_post_cell_hook_is_ignored(cluster, capsys):
    """Between a cell's code and nbdist's post-cell hook IPython does its own work (history, the post-execute
    callbacks); a release that came there raised KeyboardInterrupt, and out of IPython's callback loop it left
    run_cell with no hook run and no reply sent (CI: a living rank idle and busy, ended as stuck). Here a
    post-execute callback signals its rank as a release does: SIGINT is ignored from the end of the code on, so
    nothing is said of an interrupt, the reply comes, and the rank is not busy."""
    _a_cell_signalled_where(
        cluster,
        capsys,
        "get_ipython().events.register('post_execute', _released)",
        "get_ipython().events.unregister('post_execute', _released)",
    )


def _rank_1_ended(cluster, capsys, code: str):
    """Run ``code`` (rank 0 raises, rank 1 stays in the cell after the release): the result, and the line nbdist
    said as it ended rank 1 (where it was last seen, what its watcher did)."""
    r = cluster.run(code, timeout=HANG_S)
    said = capsys.readouterr().out
    assert r[1].status == "dead" and r[0].status == "error", (r[0].status, r[1].status)
    assert "nbdist: ending rank 1, which did not stop after the release (in its cell): " in said, said
    return r, said.split("nbdist: ending rank 1, which did not stop after the release (in its cell): ", 1)[1].splitlines()[0]


@pytest.mark.parametrize(
    ("handler", "broke"),
    [
        ("signal.SIG_IGN", r"; its group was not broken"),
        ("lambda *a: None", r"; its watcher shut ([1-9]\d*) of its group's \1 connections \d+\.\d s before it was last seen"),
    ],
)
def test_a_stuck_rank_that_is_ended_is_named_with_where_it_was_last_seen(cluster, capsys, handler, broke):
    """A released rank that ignores the interrupt and sleeps at one line (no CPU, the same place at two looks) is
    stuck: nbdist ends it, and says first where it was, in the cell's output and in the rank's error, so the person
    sees what held it (before: "did not stop after an interrupt; nbdist ended it", and nothing more); and whether its
    watcher broke its group: a rank that ignores SIGINT altogether never lets its watcher hear it, one whose handler
    does nothing does, and a rank that stays put with its connections shut waits on something else."""
    r, line = _rank_1_ended(
        cluster,
        capsys,
        "import signal, time\n"
        "if dist.get_rank() == 1:\n"
        f"    signal.signal(signal.SIGINT, {handler})\n"
        "    while True:\n"
        "        time.sleep(0.2)\n"
        "raise RuntimeError('rank 0 gives up')\n",
    )
    assert "in <module>" in line, line
    assert re.search(broke + "$", line), line
    assert "did not stop after an interrupt (last seen in <module>, " in r[1].error["evalue"], r[1].error
    cluster.restart([1])
    assert_usable(cluster)


def test_a_rank_waiting_in_backward_after_its_group_broke_is_ended_at_the_first_look(cluster, capsys):
    """DDP's all-reduce can wait in autograd's C++ on a send gloo never tells of (cells/release.py): its connections
    shut, the rank still waits, for the group's timeout. Here rank 1's DDP waits on a comm hook's future that never
    completes, the same wait seen from the rank: in backward, its main thread idle since its watcher broke the
    group. nbdist ends it at its first look after the release (FIRST_LOOK_S), not at a later one (an escalation
    apart), and says where it waited."""
    from nbdist.cells.release import ESCALATE_S, FIRST_LOOK_S

    _, line = _rank_1_ended(
        cluster,
        capsys,
        "from torch.nn.parallel import DistributedDataParallel as DDP\n"
        "model = DDP(torch.nn.Linear(4, 1))\n"
        "if dist.get_rank() == 0:\n"
        "    raise RuntimeError('rank 0 gives up')\n"
        "model.register_comm_hook(None, lambda state, bucket: torch.futures.Future())  # never completes\n"
        "model(torch.ones(2, 4)).sum().backward()\n",
    )
    assert line.startswith("graph.py:") and "in _engine_run_backward" in line.split(" <- ")[0], line
    found = re.search(r"; its watcher shut [1-9]\d* of its group's \d+ connections (\d+\.\d) s before it was last seen$", line)
    assert found, line
    first = FIRST_LOOK_S + ESCALATE_S / 2  # the break comes 0.3 s after the release; the second look an escalation on
    assert float(found.group(1)) < first, f"ended at a later look than the first after the release: {line}"
    cluster.restart([1])
    assert_usable(cluster)


def test_a_rank_waiting_for_the_preemption_flags_stops_at_the_release(cluster, capsys):
    """The preemption flags (engine/preempt.py, engine/flags.py) are read at a loop's step boundary, on the main
    thread, once every rank said its part. Rank 0 fails at its first step, having said its part of the first exchange
    only; rank 1 goes on and waits at a later boundary for the part rank 0 never says. It must stop at the release's
    interrupt by itself, its process kept, and no rank be ended. (Over a gloo all-reduce that wait was C++, which
    holds the interrupt: at 64 ranks nbdist ended a living rank there, 6 s after the release.)"""
    r = cluster.run(
        "import time\n"
        "from nbdist.parallel import shard\n"
        "for step, (x,) in shard(torch.utils.data.TensorDataset(torch.arange(64.0)), batch_size=2).steps(8):\n"
        "    if dist.get_rank() == 0:\n"
        "        raise RuntimeError('rank 0 gives up')\n"
        "    time.sleep(0.05)\n",
        timeout=HANG_S,
    )
    said = capsys.readouterr().out
    assert "nbdist: ending rank" not in said, said
    assert r[0].status == "error" and r[1].status == "interrupted", (r[0].status, r[1].status, said)
    plain = re.sub(r"\x1b\[[0-9;]*m", "", "\n".join(r[1].error["traceback"]))
    assert r[1].error["ename"] == "KeyboardInterrupt" and "in _exchange" in plain, plain  # reached in the wait
    assert re.search(r"engine/flags\.py:\d+, in OverStore\.read", plain), plain
    assert cluster.dead_ranks() == []
    assert_usable(cluster)


def test_fault3_ctrl_c_reaches_ranks_blocked_in_collectives(cluster, tmp_path):
    here = tmp_path / "in-collective"

    def interrupt():
        wait_for(f"{here}-0", f"{here}-1")  # each rank is at its collective's line (the next one blocks)
        os.kill(os.getpid(), signal.SIGINT)

    threading.Thread(target=interrupt, daemon=True).start()
    tic = time.perf_counter()
    with pytest.raises(KeyboardInterrupt):
        cluster.run(
            touch_code(here) + "if dist.get_rank() == 0:\n    dist.all_reduce(torch.ones(1))\n"
            "else:\n    dist.broadcast(torch.ones(3), src=1)\n    dist.barrier()"
        )
    took = time.perf_counter() - tic
    assert took < HANG_S, f"Ctrl-C did not reach the ranks in their collectives (took {took:.0f} s)"
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
    with pytest.raises(UsageError, match="^rank 1 has no variable 'nope'"):
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
    assert took < HANG_S
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
    """Each rank is pinned to its own cores, and threads gloo starts afterwards inherit them:
    the threads a new gloo group adds (its workers) run on the rank's cores only."""
    import os

    allowed = sorted(os.sched_getaffinity(0))
    if len(allowed) < 2:
        pytest.skip(f"pinning 2 ranks needs 2 cores; this process may use {allowed}")
    cluster.run(
        "import os\n"
        "def tasks():\n"
        "    return {int(t): sorted(os.sched_getaffinity(int(t))) for t in os.listdir('/proc/self/task')}\n"
        "mine = sorted(os.sched_getaffinity(0))\n"
        "before = tasks()\n"
        "group = dist.new_group(backend='gloo')\n"
        "dist.all_reduce(torch.ones(1), group=group)\n"
        "gloo_threads = {tid: cpus for tid, cpus in tasks().items() if tid not in before}\n"
        "dist.destroy_process_group(group)"
    ).raise_for_error()
    mine = cluster.pull("mine")
    assert mine[0] and mine[1] and not set(mine[0]) & set(mine[1]), mine
    assert set(mine[0]) | set(mine[1]) <= set(allowed)
    assert [r["cpus"] for r in cluster.status()] == [
        ",".join(map(str, m)) if len(m) == 1 else f"{m[0]}-{m[-1]}" for m in mine
    ]
    for rank, threads in enumerate(cluster.pull("gloo_threads")):
        assert threads, f"rank {rank}: the new gloo group started no thread to check"
        assert all(cpus == mine[rank] for cpus in threads.values()), (rank, mine[rank], threads)


def test_status_lists_ranks(cluster, ip, capsys):
    rows = cluster.status()
    assert [r["rank"] for r in rows] == [0, 1]
    assert all(r["state"] == "idle" and r["backend"] == "gloo" and r["device"] == "cpu" for r in rows)
    run_cell(ip, "%dist_status")
    out = capsys.readouterr().out
    assert "rank" in out and "engine_id" in out and str(rows[1]["pid"]) in out


def test_fault10_default_watchdog_releases_a_rank_left_alone_in_a_collective(cluster):
    old = cluster.config.recovery.watchdog
    cluster.config.recovery.watchdog = 2.0
    try:
        tic = time.perf_counter()
        r = cluster.run("if dist.get_rank() == 0:\n    dist.all_reduce(torch.ones(1))")  # rank 1 skips it
        took = time.perf_counter() - tic
    finally:
        cluster.config.recovery.watchdog = old
    assert r.released == "watchdog" and r[0].status == "timeout" and r[1].status == "ok"
    assert any("rank 0 was at cell line 2, in all_reduce" in n for n in r.notes)
    assert took < HANG_S
    with pytest.raises(RunTimeout):
        r.raise_for_error()
    assert_usable(cluster)


def test_watchdog_leaves_legitimate_work_alone(cluster):
    old = cluster.config.recovery.watchdog
    cluster.config.recovery.watchdog = 0.5
    try:
        r = cluster.run("import time\nif dist.get_rank() == 0:\n    time.sleep(2.0)\ndone_sleeping = True")
    finally:
        cluster.config.recovery.watchdog = old
    assert r.ok and r.released is None


def test_fault9_huge_output_is_cut_in_view_but_kept_and_never_blocks(cluster, capsys):
    tic = time.perf_counter()
    r = cluster.run("import sys\nsys.stderr.write('e' * 200_000 + '\\n')\nbig_done = True")
    took = time.perf_counter() - tic
    r.raise_for_error()
    err = capsys.readouterr().err
    assert "cut at 100,000 characters" in err and len(err) < 2 * 110_000
    assert len(r[0].stderr) >= 200_000  # nothing lost
    assert took < HANG_S
    assert_usable(cluster)


def test_logged_metrics_arrive_tagged_by_rank_while_the_cell_runs(cluster, tmp_path):
    """Rows arrive batched, tagged by rank, and while the cell runs: the cell waits until the
    test's sink has received rows from both ranks before it ends."""
    flag = tmp_path / "rows-arrived"
    arrivals: list[tuple[int, int]] = []

    class Recorder(Sink):
        def metrics(self, rank, rows):
            arrivals.append((rank, len(rows)))
            if {r for r, _ in arrivals} == {0, 1}:
                flag.touch()

    tic = time.perf_counter()
    r = cluster.run(
        "import time, nbdist\nfor i in range(20):\n    nbdist.log(step=i, loss=dist.get_rank() + 1.0 / (i + 1))\n"
        "    time.sleep(0.05)\n" + wait_for_file(flag),
        sink=Recorder(),
    )
    r.raise_for_error()
    took = time.perf_counter() - tic
    assert cluster.pull("seen") == ["seen", "seen"], "batches should arrive while the cell runs"
    assert {rank: len(rows) for rank, rows in r.metrics.items()} == {0: 20, 1: 20}
    assert r.metrics[1][0]["loss"] == 2.0 and r.metrics[0][19]["step"] == 19
    batches_per_rank = len(arrivals) / 2
    assert 2 <= batches_per_rank <= took / 0.2 + 2  # batched: at most ~5 a second, not one per row


def test_bench_sweep_and_scaling_report(cluster):
    from nbdist.tools.bench import bench, figure

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
    assert sc["n_ranks_no_comm_samples_per_s"] > 0 and sc["cores"] >= 1
    fig = figure(report)
    assert [t.name for t in fig.data] == ["all_reduce (busbw = algbw at 2 ranks)", "memcpy (same run)"]  # no hidden line
    assert list(fig.layout.xaxis.ticktext) == ["4 KiB", "1 MiB"]  # the sizes swept, not plotly's 2 and 5s


def test_waiting_on_a_background_cell_that_failed_says_what_failed(cluster, capsys):
    """``.wait()`` on a ``--noblock`` cell (notebook 08 follows its kill that way) shows a failure as the magic
    would have; ``show=False`` leaves it to the caller."""
    code = "if dist.get_rank() == 1:\n    raise ValueError('late')"
    capsys.readouterr()
    assert not cluster.run(code, block=False).wait().ok
    assert "rank 1 raised ValueError in cell line 2: late" in capsys.readouterr().err
    assert not cluster.run(code, block=False).wait(show=False).ok
    assert "raised ValueError" not in capsys.readouterr().err
