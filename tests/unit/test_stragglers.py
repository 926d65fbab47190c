"""stragglers.slow and stragglers.hang on made-up rows and reports: the verdicts, the bar, and saying when it
cannot tell. The planted faults on real ranks: tests/integration/test_why.py and benchmarks/why.py."""

from __future__ import annotations

from nbdist.stragglers import hang, slow


def rows(n=10, **phases):
    base = {"data": 0.001, "forward": 0.004, "backward_compute": 0.006, "optimizer": 0.001, "exposed": 0.002}
    base.update(phases)
    step = sum(v for k, v in base.items() if k in ("data", "forward", "optimizer", "other", "gc", "save", "eval"))
    step += base["backward_compute"] + base["exposed"]
    row = {f"why/{k}_s": v for k, v in base.items()}
    row["why/backward_s"] = base["backward_compute"] + base["exposed"]
    row["why/step_s"] = step
    return [dict(row) for _ in range(n)]


def test_balanced_ranks_get_no_verdict_and_the_largest_difference_is_given():
    verdict = slow({0: rows(), 1: rows(), 2: rows(forward=0.0045)})
    assert verdict.cause == "balanced" and "the largest difference, rank 2's compute, is 0.5 ms" in verdict.text


def test_the_rank_whose_phase_stands_out_is_named_with_the_phase_and_the_numbers():
    verdict = slow({0: rows(exposed=0.03), 1: rows(exposed=0.03), 2: rows(data=0.031)})
    assert (verdict.cause, verdict.figures["ranks"]) == ("data", [2])
    assert "slow input on rank 2: it waits for its input" in verdict.text and "31.0 ms a step" in verdict.text


def test_a_pause_counted_in_a_phase_is_named_as_the_pause():
    # a save on rank 1 happens between backward and the optimizer: it is in 'other' too, and named as the save
    verdict = slow({0: rows(exposed=0.02), 1: rows(save=0.02, other=0.02)})
    assert (verdict.cause, verdict.figures["ranks"]) == ("save", [1])


def test_what_every_rank_does_is_said_for_all_and_crowded_ranks_are_not_called_communication_bound():
    saves = slow({r: rows(save=0.01) for r in range(3)})
    assert saves.cause == "save" and "on every rank" in saves.text
    comm = {r: rows(exposed=0.05) for r in range(3)}
    assert slow(comm).cause == "comm"
    crowded = slow(comm, crowded="4 ranks on 2 cores")
    assert crowded.cause == "balanced" and "4 ranks on 2 cores" in crowded.text


def _split_read_every_4th(rs):
    """engine/why.py reads DDP's split of backward on some steps only: the other rows have backward_s alone."""
    for i, r in enumerate(rs):
        if i % 4:
            del r["why/exposed_s"], r["why/backward_compute_s"]
    return rs


def test_compute_and_communication_come_from_the_rows_with_ddps_split():
    comm = {r: _split_read_every_4th(rows(20, exposed=0.05)) for r in range(3)}
    assert slow(comm).cause == "comm"  # backward's wait in the rows without the split is not compute
    data = {0: rows(20, exposed=0.03), 1: rows(20, exposed=0.03), 2: rows(20, data=0.031)}
    verdict = slow({r: _split_read_every_4th(rs) for r, rs in data.items()})
    assert (verdict.cause, verdict.figures["ranks"]) == ("data", [2]), verdict.text
    assert verdict.figures["typical"][0]["compute"] == verdict.figures["typical"][2]["compute"]


def test_too_few_steps_one_rank_and_missing_ranks_are_said():
    assert slow({0: rows(2), 1: rows(2)}).cause == "cannot"
    alone = slow({0: rows()}, world=1)
    assert alone.cause == "cannot" and "only one rank timed steps" in alone.text
    gone = slow({0: rows(), 1: rows(data=0.03)}, world=3)
    assert gone.cause == "data" and "rank(s) 2 timed no step" in gone.text


def report(busy=True, collective=False, autograd=False, line=9, code="x", op=None, shapes=(), count=5):
    stack = ["/x/torch/autograd/graph.py:1 in _engine_run_backward"] if autograd else ["<cell>:9 in <module>"]
    return {
        "busy": busy,
        "in_collective": collective,
        "stack": stack,
        "cell_line": line,
        "function": "f",
        "cell_stack": [{"line": line, "function": "<module>", "code": code}],
        "collective": {"op": op, "shapes": list(shapes), "count": count},
    }


def test_the_rank_outside_the_collective_the_others_wait_in_is_named_with_its_line():
    said = {0: report(autograd=True, line=12), 1: report(line=8, code="time.sleep(3600)")}
    verdict = hang(said, 3.2)
    assert verdict.cause == "hang" and verdict.figures["ranks"] == [1]
    assert "rank 1 is at cell line 8 (time.sleep(3600))" in verdict.text and "no step for 3.2 s" in verdict.text


def test_ranks_in_different_collectives_are_a_desync_and_nobody_waiting_is_no_verdict():
    said = {
        0: report(collective=True, op="all_reduce", shapes=["[4] float32"]),
        1: report(collective=True, op="all_reduce", shapes=["[3] float32"]),
    }
    verdict = hang(said, 4.0)
    assert verdict.cause == "desync" and "rank 0 all_reduce [4] float32; rank 1 all_reduce [3] float32" in verdict.text
    drifted = {**said, 1: report(autograd=True, count=9)}  # another count (a cell released before): still a desync
    assert hang(drifted, 4.0).cause == "desync"
    assert hang({0: report(), 1: report()}, 4.0) is None


def test_a_desync_whose_waits_tie_is_told_by_what_each_rank_called_from_the_line_they_wait_at():
    """4 ranks, rank 2 all-reduces 3 numbers, the others 4 (cell line 64): gloo let ranks 0 and 2 return, and they
    wait in backward, whose DDP hook all-reduced a bucket since; 1 and 3 wait in the all-reduce (2 against 2, as in
    benchmarks/why.py). What each called from line 64 says rank 2 called the odd one."""
    cell, hook = "/tmp/ipykernel_{}/3106666263.py:64", "torch/distributed/algorithms/ddp_comm_hooks/default_hooks.py:40"

    def calls(rank, mine, then_hook):  # a cell's file is in a folder of each rank's own
        made = [
            {"op": "all_reduce", "shapes": ["[82689] float32"], "at": hook},
            {"op": "all_reduce", "shapes": [mine], "at": cell.format(4300 + rank)},
        ]
        return made + made[:1] if then_hook else made

    def rep(rank, mine, waiting):
        out = report(autograd=not waiting, collective=waiting, op="all_reduce", shapes=[mine], count=10)
        out["collective"]["recent"] = calls(rank, mine, then_hook=not waiting)
        return out

    said = {
        0: rep(0, "[4] float32", False),
        1: rep(1, "[4] float32", True),
        2: rep(2, "[3] float32", False),
        3: rep(3, "[4] float32", True),
    }
    verdict = hang(said, 3.0)
    assert verdict.cause == "desync" and verdict.figures["ranks"] == [2], verdict.text
    assert (
        "from the line where they wait, rank 2 called all_reduce [3] float32, the others all_reduce [4]" in verdict.text
    )
    even = {**said, 0: rep(0, "[3] float32", False)}  # 2 called each: nothing singles a side out
    assert hang(even, 3.0).figures["ranks"] == [0, 1, 2, 3]


def test_the_dashboard_headline_says_the_verdict_when_the_steps_were_timed():
    from nbdist.widgets.dashboard import headline_parts
    from nbdist.widgets.figure import panels
    from nbdist.widgets.store import MetricStore

    store = MetricStore(ranks=3, judge=slow)
    # the cell's own rows (a step each, and a step time every rank shares, as a synchronous step makes it), then
    # %dist_why's: the timings take no step number, draw no panel, and the verdict replaces "ranks within 3%"
    for rank in range(3):
        store.add(rank, [{"step": s, "loss": 1.0 / (s + 1), "time/step_s": 0.04} for s in range(5)])
    for rank, mine in {0: rows(exposed=0.03), 1: rows(exposed=0.03), 2: rows(data=0.031)}.items():
        mine[-1]["memory/rss_MiB"] = 300.0  # as a batch's last row carries it (engine/metrics.flush)
        store.add(rank, mine)
    assert "rank 2: slow input" in headline_parts(store)
    assert store.headline()["step"] == 4 and "slowest" not in store.headline()
    assert not [p.key for p in panels(store) if p.key.startswith("why/")], panels(store)
    plain = MetricStore(ranks=3)  # no judge handed in: nothing said
    plain.add(0, rows())
    assert not any("slow input" in p or "balanced" in p for p in headline_parts(plain))
    # DDP's split read on every 4th step only: the store hands the judge the rows as they came
    sampled = MetricStore(ranks=3, judge=slow)
    data = {0: rows(20, exposed=0.03), 1: rows(20, exposed=0.03), 2: rows(20, data=0.031)}
    for rank, mine in data.items():
        sampled.add(rank, _split_read_every_4th(mine))
    assert sampled.why().text == slow(data).text and "rank 2: slow input" in headline_parts(sampled)
    waits = MetricStore(ranks=3, judge=slow)
    for rank in range(3):
        waits.add(rank, _split_read_every_4th(rows(20, exposed=0.05)))
    assert waits.why().cause == "comm", waits.why().text  # every rank waits for the all-reduce, not computes


def test_the_world_panel_says_the_verdict_and_a_balanced_one_as_even():
    from nbdist.server.worlds import slowest_of
    from nbdist.widgets.store import MetricStore

    store = MetricStore(ranks=3, judge=slow)
    for rank, mine in {0: rows(exposed=0.03), 1: rows(exposed=0.03), 2: rows(data=0.031)}.items():
        store.add(rank, mine)
    said = slowest_of(store)
    assert said["rank"] == 2 and said["holds"] == "slow input" and said["pct"] > 50, said
    even = MetricStore(ranks=3, judge=slow)
    for rank in range(3):  # balanced, beside step times every rank shares (no "slowest" in the headline then)
        even.add(rank, [{"step": s, "time/step_s": 0.04} for s in range(5)])
        even.add(rank, rows())
    said = slowest_of(even)
    assert said is not None and said["pct"] < 3 and said["verdict"].startswith("balanced"), said


def test_ranks_that_share_cores_need_a_larger_difference_to_be_named_unless_it_is_steady():
    # 4 ms more forward on rank 2 (15% of the step) in 15 of the last 20 steps: turns on a core, typically
    def some(n_slow, forward=0.008):
        return rows(n=2 + 20 - n_slow) + rows(n=n_slow, forward=forward)

    near = {0: rows(n=22, exposed=0.02), 1: rows(n=22, exposed=0.02), 2: some(15)}
    assert slow(near).cause == "compute"
    crowded = slow(near, crowded="4 ranks on 2 cores")
    assert crowded.cause == "balanced" and "the bar is 30%, or 10% in 80% of the steps" in crowded.text
    assert crowded.figures["steady"] == (15, 20), crowded.figures
    # a balanced 4-rank run on 2 cores in CI: one rank's compute 8.6 ms against 4.4 ms of a 19.7 ms step (21%)
    seen = {0: rows(n=22, exposed=0.02), 1: rows(n=22, exposed=0.02), 2: some(15, forward=0.0106)}
    assert slow(seen).cause == "compute" and slow(seen, crowded="4 ranks on 2 cores").cause == "balanced"
    # the same 4 ms in 16 of 20 steps, or every step (a fault planted: benchmarks/why.py's FSDP2 loop, a 31 ms
    # input wait in a crowded 100-130 ms step, 23-31%): named, and the steps said
    for n_slow in (16, 20):
        steady = {0: rows(n=22, exposed=0.02), 1: rows(n=22, exposed=0.02), 2: some(n_slow)}
        verdict = slow(steady, crowded="4 ranks on 2 cores")
        assert (verdict.cause, verdict.figures["ranks"]) == ("compute", [2]), verdict.text
        assert f"in {n_slow} of the last 20 steps: steady" in verdict.text


def test_a_save_or_evaluation_of_one_rank_needs_only_the_quiet_bar_where_ranks_share_cores():
    # timed inside torch.save and the no-grad forwards, and nothing where a rank does neither: crowding cannot make
    # one appear (benchmarks/why.py's FSDP2 loop: a 12.5 ms save in a crowded 68 ms step, 18%)
    for phase in ("save", "eval"):
        ranks = {0: rows(exposed=0.02), 1: rows(exposed=0.02, **{phase: 0.006, "other": 0.0}), 2: rows(exposed=0.02)}
        verdict = slow(ranks, crowded="4 ranks on 2 cores")
        assert (verdict.cause, verdict.figures["ranks"]) == (phase, [1]), verdict.text
    stretched = {0: rows(n=22, exposed=0.02), 1: rows(n=22, exposed=0.02), 2: rows(n=9) + rows(n=13, forward=0.008)}
    assert slow(stretched, crowded="4 ranks on 2 cores").cause == "balanced"  # 4 ms more in 13 of 20 steps: 15%
