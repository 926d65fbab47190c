"""DDP, metrics, accumulation and checkpoints on a real 2-rank gloo world, against single-process references.
What the ranks run is in programs.py."""

from __future__ import annotations

import os
import signal

import pytest
import torch

from tests.dist import programs
from tests.helpers import check_ddp_against_one_process, on_ranks, run_cell


def test_ddp_matches_one_process_with_the_combined_batch(cluster):
    check_ddp_against_one_process(cluster)


def test_accumulation_with_no_sync_equals_the_full_batch(cluster):
    _, per_rank = on_ranks(cluster, programs.accumulated)
    for results in per_rank:
        # Mean of micro-batch means over equal chunks = full-batch mean; rounding only.
        torch.testing.assert_close(results[1], results[0], rtol=0, atol=1e-6)
        torch.testing.assert_close(results[2], results[0], rtol=0, atol=1e-6)


def test_apply_ddp_buckets_by_its_cap_and_none_gives_ddps_own_buckets(cluster):
    # bucket_cap_mb=25 passed to DDP turns off its 1 MB first bucket: a 6.3 MB model is one
    # bucket; None keeps DDP's default (a first bucket of about 1 MB, then the rest).
    _, (buckets, _) = on_ranks(cluster, programs.bucket_sizes)
    assert buckets["25"] == [512 * 1024 + 1024 + 1024 * 1024 + 1024]
    assert buckets["default"] == [1024 * 1024 + 1024, 512 * 1024 + 1024]  # the last layer's bucket first


def test_metric_helpers_reduce_across_ranks(cluster):
    _, per_rank = on_ranks(cluster, programs.reduced_values)
    assert per_rank == [(0.5, [2.0, 1.0], [{"rank": 0}, {"rank": 1}])] * 2


def test_checkpoint_survives_killed_engines_bit_identically(cluster, ip, tmp_path):
    ckpt = str(tmp_path / "ckpt")
    _, runs = on_ranks(cluster, programs.ddp_with_checkpoints, ckpt, 6, save_at=3)
    straight = runs[0]["params"]
    assert sorted(os.listdir(ckpt)) == ["latest", "step-000000003"]

    for rank in cluster.ranks:  # kill -9 every engine, then bring the world back
        os.kill(rank.pid, signal.SIGKILL)
    run_cell(ip, "%dist_restart")
    _, resumed = on_ranks(cluster, programs.ddp_with_checkpoints, ckpt, 6, resume=True)
    assert [r["first"] for r in resumed] == [3, 3]
    for a, b in zip(straight, resumed[0]["params"], strict=True):
        assert torch.equal(a, b), "training must continue bit-identically after a restart"


def test_a_half_written_checkpoint_never_becomes_the_latest(cluster, tmp_path):
    ckpt = str(tmp_path / "ckpt")
    _, runs = on_ranks(cluster, programs.ddp_with_checkpoints, ckpt, 2, save_at=2)
    os.makedirs(os.path.join(ckpt, "step-000000004.partial"))  # a save that died half-way
    with open(os.path.join(ckpt, "step-000000004.partial", "junk"), "w") as fh:
        fh.write("not a checkpoint")
    _, loaded = on_ranks(cluster, programs.latest_then_load, ckpt, runs[0]["saved"])
    assert loaded == [(2, 2, True)] * 2  # latest step, step loaded, the parameters saved at step 2


def test_apply_fsdp_times_its_all_gathers_and_reduce_scatters(cluster):
    r, (full, _) = on_ranks(cluster, programs.fsdp_steps)
    for rank in (0, 1):
        rows = r.metrics[rank]
        assert [row["step"] for row in rows] == [0, 1, 2, 3]
        for row in rows:
            # forward all-gathers send this rank's half, reduce-scatter the whole gradient; the
            # backward may gather again: between 1.5x and 2x the parameters (plus padding)
            assert 1.5 * full <= row["comm/bytes"] <= 2.1 * full, (row["comm/bytes"], full)
            assert 0 < row["comm/time_s"] <= row["time/step_s"]
            assert row["comm/overhead(%)"] == pytest.approx(100 * row["comm/time_s"] / row["time/step_s"])
        assert len({row["comm/bytes"] for row in rows}) == 1  # the same collectives every step


def test_fsdp_checkpoint_round_trips(cluster, tmp_path):
    _, per_rank = on_ranks(cluster, programs.fsdp_round_trip, str(tmp_path / "fsdp"))
    assert per_rank == [(True, True)] * 2  # the same parameters, moved from the initial ones


def test_apply_ddp_logs_step_metrics_for_the_dashboard(cluster):
    r, (nbytes, _) = on_ranks(cluster, programs.ddp_with_no_sync)
    for rank in (0, 1):
        rows = r.metrics[rank]
        assert [row["step"] for row in rows] == list(range(7))  # a step is closed by the next forward
        for row in rows:
            quiet = row["step"] in (5, 6)
            assert row["comm/bytes"] == (0 if quiet else nbytes), row
            assert (row["comm/time_s"] == 0) == quiet, row
            assert 0 <= row["comm/overhead(%)"] <= 100
            assert 0 <= row["comm/exposed_s"] <= row["comm/time_s"] <= row["time/step_s"]
            assert row["throughput/samples_per_s"] == pytest.approx(8 / row["time/step_s"])


def test_the_gpu_timing_hook_run_on_cpu_reduces_like_torch_and_times_the_step(cluster):
    # On a GPU, apply_ddp times the all-reduce with timing_hook instead of DDP's timers
    # (CUDA events would synchronise every step). Registered by hand here on CPU: the
    # gradients are the built-in all-reduce's, and the span it reports lies inside the step.
    r, same = on_ranks(cluster, programs.timed_and_plain)
    assert same == [True, True]
    for rank in (0, 1):
        rows = r.metrics[rank]
        assert [row["step"] for row in rows] == [0, 1, 2]
        for row in rows:
            assert 0 < row["comm/time_s"] <= row["time/step_s"]
            assert row["comm/bytes"] == 4 * (8 * 16 + 16 + 16 + 1)  # every gradient, float32


@pytest.mark.alone  # two timings compared: with no other test taking the cores between them
def test_reported_overhead_agrees_with_skipping_communication(cluster):
    # The dashboard's comm/overhead(%) from apply_ddp's own instrumentation, against an
    # independent figure: 1 - t(step with communication skipped) / t(step), same cell, same
    # data, blocks alternated. Both ranks share the world's overhead, so compare their means.
    import statistics

    def measure() -> tuple[float, float]:
        r, independents = on_ranks(cluster, programs.overhead_by_skipping)
        independent = statistics.mean(independents)
        reported = statistics.mean(
            statistics.median(
                row["comm/overhead(%)"] for row in r.metrics[rank] if row["step"] >= 10 and 2 <= row["step"] % 10 <= 8
            )
            for rank in (0, 1)
        )  # steps 0-9 warm up; the 10th of a block is closed a block later; the first two absorb skew
        return reported, independent

    # Within 15% of the independent figure (relative). Measured: the reported figure is 2-7%
    # below on this machine and 11% below once in CI (skipping communication also frees the
    # core the collective's copies took from the overlapped backward, which DDP's timers do not
    # see). Timing on 2 shared cores is noisy, so one disagreement is measured again; a metric
    # that is wrong (exposed time only, or the whole backward) is off by far more, twice.
    attempts = [measure()]
    if abs(attempts[0][0] - attempts[0][1]) > 0.15 * attempts[0][1]:
        attempts.append(measure())
    reported, independent = attempts[-1]
    assert independent > 15, "the test needs communication worth measuring"
    assert abs(reported - independent) <= 0.15 * independent, attempts


def test_compressed_ddp_publishes_the_hook_records_as_step_metrics(cluster):
    r, per_rank = on_ranks(cluster, programs.compressed_totals)
    for rank in (0, 1):
        totals = per_rank[rank]
        rows = [row for row in r.metrics[rank] if "comm/bytes" in row]
        assert len(rows) == 5  # steps 0-4, each closed by the next training forward
        for row, total in zip(rows, totals, strict=False):
            assert row["comm/bytes"] == total["bytes_after"] and row["comm/bytes_raw"] == total["bytes_before"]
            assert row["comm/ratio"] == pytest.approx(total["bytes_before"] / total["bytes_after"])
            assert row["comm/compress_s"] == pytest.approx(total["compress_s"])
            assert 0 <= row["comm/overhead(%)"] <= 100
        assert rows[0]["comm/ratio"] == 1.0  # warm-up: DDP rebuilds buckets before compression starts
        assert rows[-1]["comm/ratio"] > 4  # top-10%: values + int32 indices, 5x fewer bytes


def test_a_compressed_ddp_in_a_subgroup_reduces_in_that_group_only(cluster):
    # Each rank alone in its own group: the compression hook must use DDP's group (world 1, the
    # rank's own gradient), not the default group (which would average the two ranks' gradients).
    _, per_rank = on_ranks(cluster, programs.alone_in_a_subgroup)
    mine, local_grad, world_seen = (list(column) for column in zip(*per_rank, strict=True))
    assert world_seen == [1, 1]
    for rank in (0, 1):
        torch.testing.assert_close(mine[rank], local_grad[rank], rtol=1e-3, atol=1e-4)  # fp16 rounding
    assert not torch.allclose(local_grad[0], local_grad[1], atol=1e-3)  # so an average would have shown


def test_powersgd_steps_report_their_time_in_collectives(cluster):
    # PowerSGD runs torch's own hook, which nbdist does not time: DDP's timers must give
    # the time in collectives, not the hook records' missing figures read as zero.
    r, _ = on_ranks(cluster, programs.powersgd_steps)
    for rank in (0, 1):
        rows = [row for row in r.metrics[rank] if "comm/bytes" in row]
        assert len(rows) == 5
        for row in rows:
            assert 0 < row["comm/time_s"] <= row["time/step_s"], row
            assert 0 <= row["comm/exposed_s"] <= row["comm/time_s"], row
        assert rows[-1]["comm/ratio"] > 1  # compressed once PowerSGD starts


def test_profiler_traces_are_written_per_rank(cluster, tmp_path):
    import json

    r, _ = on_ranks(cluster, programs.profiled, str(tmp_path / "traces"))
    for rank in (0, 1):
        path = tmp_path / "traces" / f"rank{rank}.json"
        trace = json.loads(path.read_text())
        assert trace["traceEvents"], f"rank {rank}'s trace is empty"
        assert f"profiler trace: {path}" in r[rank].stdout


def test_a_steps_number_is_its_loaders_count_so_a_rebuilt_model_goes_on_counting(cluster):
    """The dashboard's x axis: a model built again (as a setup cell replayed after a recovery, or on a grown world)
    that trains on a shard loader logs the loader's batch count, not a count of its own from 0."""
    setup = (
        "from nbdist.parallel import apply_ddp, shard\n"
        "torch.manual_seed(0)\n"
        "m = apply_ddp(torch.nn.Linear(4, 1))\n"
        "loader = shard(torch.utils.data.TensorDataset(torch.randn(64, 4)), batch_size=4)\n"  # 8 batches a rank
    )
    train = "for i, (x,) in enumerate(loader):\n    m(x).sum().backward()\n    if i == 4:\n        break\nm(x)\n"
    cluster.run(setup).raise_for_error()
    first = cluster.run(train).raise_for_error()
    again = cluster.run("m = apply_ddp(torch.nn.Linear(4, 1))\n" + train.replace("enumerate(loader)", "enumerate(loader, 5)")).raise_for_error()
    for rank in (0, 1):
        assert [row["step"] for row in first.metrics[rank]] == [0, 1, 2, 3, 4], first.metrics[rank]
        assert [row["step"] for row in again.metrics[rank]] == [5, 6, 7], again.metrics[rank]
