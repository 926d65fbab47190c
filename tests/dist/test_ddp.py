"""DDP, metrics, accumulation and checkpoints on a real 2-rank gloo world, against single-process references."""

from __future__ import annotations

import os
import signal
import textwrap

import pytest
import torch

from tests.helpers import SETUP, check_ddp_against_one_process, local, run_cell

def test_ddp_matches_one_process_with_the_combined_batch(cluster):
    check_ddp_against_one_process(cluster)


def test_accumulation_with_no_sync_equals_the_full_batch(cluster):
    cluster.run(SETUP).raise_for_error()
    cluster.run(
        textwrap.dedent(
            """
            from nbdist.parallel import accumulate, apply_ddp
            data = make_data()
            x, y = data[list(range(dist.get_rank(), 16, 2))]  # 8 samples per rank
            results = []
            for micro in (1, 2, 4):
                model = apply_ddp(make_model())
                opt = torch.optim.SGD(model.parameters(), lr=0.1)
                opt.zero_grad()
                chunk = 8 // micro
                for i in range(micro):
                    with accumulate(model, i, micro) as last:
                        loss = torch.nn.functional.mse_loss(model(x[i*chunk:(i+1)*chunk]), y[i*chunk:(i+1)*chunk]) / micro
                        loss.backward()
                opt.step()
                results.append(torch.cat([p.detach().flatten() for p in model.parameters()]))
            """
        )
    ).raise_for_error()
    for results in cluster.pull("results"):
        # Mean of micro-batch means over equal chunks = full-batch mean; rounding only.
        torch.testing.assert_close(results[1], results[0], rtol=0, atol=1e-6)
        torch.testing.assert_close(results[2], results[0], rtol=0, atol=1e-6)


def test_apply_ddp_buckets_by_its_cap_and_none_gives_ddps_own_buckets(cluster):
    # bucket_cap_mb=25 passed to DDP turns off its 1 MB first bucket: a 6.3 MB model is one
    # bucket; None keeps DDP's default (a first bucket of about 1 MB, then the rest).
    cluster.run(
        textwrap.dedent(
            """
            from nbdist.parallel import apply_ddp

            def seen_buckets(cap):
                def spy(state, bucket):
                    state.append(bucket.buffer().numel())
                    f = torch.futures.Future()
                    f.set_result(bucket.buffer())
                    return f
                sizes = []
                torch.manual_seed(0)
                model = torch.nn.Sequential(torch.nn.Linear(512, 1024), torch.nn.ReLU(), torch.nn.Linear(1024, 1024))
                model = apply_ddp(model, bucket_cap_mb=cap, comm_hook=spy, hook_state=sizes, metrics=False)
                for _ in range(3):  # DDP rebuilds its buckets after the first step
                    model(torch.randn(4, 512)).sum().backward()
                return sizes[-2:] if cap is None else sizes[-1:]

            buckets = {"25": seen_buckets(25.0), "default": seen_buckets(None)}
            """
        )
    ).raise_for_error()
    buckets = cluster.pull("buckets", ranks=0)[0]
    assert buckets["25"] == [512 * 1024 + 1024 + 1024 * 1024 + 1024]
    assert buckets["default"] == [1024 * 1024 + 1024, 512 * 1024 + 1024]  # the last layer's bucket first


def test_metric_helpers_reduce_across_ranks(cluster):
    cluster.run(
        "from nbdist.parallel import all_reduce_mean, all_reduce_sum, gather_values\n"
        "m = all_reduce_mean(float(dist.get_rank()))\n"
        "s = all_reduce_sum(torch.tensor([1.0, dist.get_rank()]))\n"
        "g = gather_values({'rank': dist.get_rank()})"
    ).raise_for_error()
    assert cluster.pull("m") == [0.5, 0.5]
    assert [s.tolist() for s in cluster.pull("s")] == [[2.0, 1.0], [2.0, 1.0]]
    assert cluster.pull("g") == [[{"rank": 0}, {"rank": 1}]] * 2


TRAIN = textwrap.dedent(
    """
    from nbdist.parallel import apply_ddp, shard, save_checkpoint, load_checkpoint
    loader = shard(make_data(), batch_size=4, shuffle=False)
    batches = list(loader)
    model = apply_ddp(make_model())
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)

    def train(first, last):
        for step in range(first, last):
            x, y = batches[step % len(batches)]
            opt.zero_grad()
            torch.nn.functional.mse_loss(model(x), y).backward()
            opt.step()
    """
)


def _train(cluster, ckpt: str, body: str) -> None:
    """Fresh model and optimizer on every rank (SETUP + TRAIN), ckpt pushed, then body."""
    cluster.run(SETUP + TRAIN).raise_for_error()
    cluster.push({"ckpt": ckpt})
    cluster.run(body).raise_for_error()


def test_checkpoint_survives_killed_engines_bit_identically(cluster, ip, tmp_path):
    ckpt = str(tmp_path / "ckpt")
    _train(
        cluster,
        ckpt,
        "train(0, 3)\nsave_checkpoint(ckpt, model, opt, step=3)\ntrain(3, 6)\n"
        "straight = [p.detach().clone() for p in model.module.parameters()]",
    )
    straight = cluster.pull("straight", ranks=0)[0]
    assert sorted(os.listdir(ckpt)) == ["latest", "step-000000003"]

    for rank in cluster.ranks:  # kill -9 every engine, then bring the world back
        os.kill(rank.pid, signal.SIGKILL)
    run_cell(ip, "%dist_restart")
    _train(
        cluster,
        ckpt,
        "step = load_checkpoint(ckpt, model, opt)\ntrain(step, 6)\n"
        "resumed = [p.detach().clone() for p in model.module.parameters()]",
    )
    assert cluster.pull("step") == [3, 3]
    for a, b in zip(straight, cluster.pull("resumed", ranks=0)[0], strict=True):
        assert torch.equal(a, b), "training must continue bit-identically after a restart"


def test_a_half_written_checkpoint_never_becomes_the_latest(cluster, tmp_path):
    ckpt = str(tmp_path / "ckpt")
    _train(
        cluster,
        ckpt,
        "train(0, 2)\nsave_checkpoint(ckpt, model, opt, step=2)\nkeep = [p.detach().clone() for p in model.parameters()]",
    )
    os.makedirs(os.path.join(ckpt, "step-000000004.partial"))  # a save that died half-way
    with open(os.path.join(ckpt, "step-000000004.partial", "junk"), "w") as fh:
        fh.write("not a checkpoint")
    cluster.run(
        "from nbdist.parallel import latest_step\ntrain(2, 4)\nlatest = latest_step(ckpt)\n"
        "step = load_checkpoint(ckpt, model, opt)\nsame = all(torch.equal(a, b) for a, b in zip(keep, model.parameters()))"
    ).raise_for_error()
    assert cluster.pull("latest") == [2, 2] and cluster.pull("step") == [2, 2] and cluster.pull("same") == [True, True]


def test_apply_fsdp_times_its_all_gathers_and_reduce_scatters(cluster):
    cluster.run(SETUP).raise_for_error()
    r = cluster.run(
        textwrap.dedent(
            """
            from nbdist.parallel import apply_fsdp
            def wide():  # big enough that shard padding is negligible
                torch.manual_seed(0)
                return torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.ReLU(), torch.nn.Linear(128, 64))
            model = apply_fsdp(wide())
            opt = torch.optim.SGD(model.parameters(), lr=0.1)
            x, y = torch.randn(8, 64), torch.randn(8, 64)
            for step in range(5):
                opt.zero_grad()
                torch.nn.functional.mse_loss(model(x), y).backward()
                opt.step()
            full_bytes = sum(p.numel() * p.element_size() for p in wide().parameters())
            """
        )
    )
    r.raise_for_error()
    full = cluster.pull("full_bytes", ranks=0)[0]
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
    ckpt = str(tmp_path / "fsdp")
    cluster.run(SETUP).raise_for_error()
    cluster.push({"ckpt": ckpt})
    cluster.run(
        textwrap.dedent(
            """
            from nbdist.parallel import apply_fsdp, save_checkpoint, load_checkpoint
            m = apply_fsdp(make_model())
            o = torch.optim.Adam(m.parameters(), lr=0.01)
            x, y = make_data()[:8]
            torch.nn.functional.mse_loss(m(x), y).backward()
            o.step()
            save_checkpoint(ckpt, m, o, step=1)
            m2 = apply_fsdp(make_model())
            o2 = torch.optim.Adam(m2.parameters(), lr=0.01)
            load_checkpoint(ckpt, m2, o2)
            same = all(torch.equal(a.full_tensor(), b.full_tensor()) for a, b in zip(m.parameters(), m2.parameters()))
            moved = not torch.equal(next(m2.parameters()).full_tensor(), next(apply_fsdp(make_model()).parameters()).full_tensor())
            """
        )
    ).raise_for_error()
    assert cluster.pull("same") == [True, True] and cluster.pull("moved") == [True, True]


def test_apply_ddp_logs_step_metrics_for_the_dashboard(cluster):
    cluster.run(SETUP).raise_for_error()
    r = cluster.run(
        textwrap.dedent(
            """
            from nbdist.parallel import apply_ddp
            model = apply_ddp(make_model())
            opt = torch.optim.SGD(model.parameters(), lr=0.1)
            x, y = make_data()[:8]
            for step in range(8):
                opt.zero_grad()
                if step in (5, 6):  # gradient accumulation: these backwards do not communicate
                    with model.no_sync():
                        torch.nn.functional.mse_loss(model(x), y).backward()
                else:
                    torch.nn.functional.mse_loss(model(x), y).backward()
                opt.step()
            nbytes = sum(p.numel() * p.element_size() for p in model.parameters())
            """
        )
    )
    r.raise_for_error()
    nbytes = cluster.pull("nbytes", ranks=0)[0]
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
    cluster.run(SETUP).raise_for_error()
    r = cluster.run(
        textwrap.dedent(
            """
            from torch.nn.parallel import DistributedDataParallel as DDP
            from nbdist.parallel.instrument import StepMeter, timing_hook
            x, y = make_data()[:8]
            timed, plain = DDP(make_model()), DDP(make_model())
            meter = StepMeter()
            timed.register_comm_hook(meter, timing_hook)
            timed.register_forward_pre_hook(meter.on_forward)
            for model in (timed, plain):
                opt = torch.optim.SGD(model.parameters(), lr=0.1)
                for step in range(4):
                    opt.zero_grad()
                    torch.nn.functional.mse_loss(model(x), y).backward()
                    opt.step()
            same = all(torch.equal(a, b) for a, b in zip(timed.parameters(), plain.parameters()))
            """
        )
    )
    r.raise_for_error()
    assert cluster.pull("same") == [True, True]
    for rank in (0, 1):
        rows = r.metrics[rank]
        assert [row["step"] for row in rows] == [0, 1, 2]
        for row in rows:
            assert 0 < row["comm/time_s"] <= row["time/step_s"]
            assert row["comm/bytes"] == 4 * (8 * 16 + 16 + 16 + 1)  # every gradient, float32


OVERHEAD = """
import statistics, time
from nbdist.parallel import apply_ddp

def mlp():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(512, 1024), torch.nn.ReLU(), torch.nn.Linear(1024, 1024),
                               torch.nn.ReLU(), torch.nn.Linear(1024, 10))

def no_comm(state, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    fut = torch.futures.Future()
    fut.set_result(bucket.buffer())
    return fut

measured = apply_ddp(mlp())  # what users run: the step metrics come from here
skipped = torch.nn.parallel.DistributedDataParallel(mlp())
skipped.register_comm_hook(None, no_comm)  # the same step with communication skipped
opts = {m: torch.optim.SGD(m.parameters(), lr=0.01) for m in (measured, skipped)}
g = torch.Generator().manual_seed(dist.get_rank())
x, y = torch.randn(64, 512, generator=g), torch.randint(0, 10, (64,), generator=g)
walls = {measured: [], skipped: []}
for block in range(32):  # alternate blocks of 10 steps, so drift hits both alike
    model = measured if block % 2 == 0 else skipped
    for i in range(10):
        t = time.perf_counter()
        opts[model].zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        opts[model].step()
        if i >= 2:
            walls[model].append(time.perf_counter() - t)
independent = 100 * (1 - statistics.median(walls[skipped]) / statistics.median(walls[measured]))
"""


def test_reported_overhead_agrees_with_skipping_communication(cluster):
    # The dashboard's comm/overhead(%) from apply_ddp's own instrumentation, against an
    # independent figure: 1 - t(step with communication skipped) / t(step), same cell, same
    # data, blocks alternated. Both ranks share the world's overhead, so compare their means.
    import statistics

    def measure() -> tuple[float, float]:
        r = cluster.run(OVERHEAD)
        r.raise_for_error()
        independent = statistics.mean(cluster.pull("independent"))
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
    cluster.run(SETUP).raise_for_error()
    r = cluster.run(
        textwrap.dedent(
            """
            from nbdist.parallel import apply_ddp
            model = apply_ddp(make_model(), compression="topk:0.1")
            opt = torch.optim.SGD(model.parameters(), lr=0.1)
            x, y = make_data()[:8]
            model.eval(); model(x); model.train()  # an evaluation forward must not shift the accounting
            for step in range(6):
                opt.zero_grad()
                torch.nn.functional.mse_loss(model(x), y).backward()
                opt.step()
            totals = model.compression_state.step_totals()
            """
        )
    )
    r.raise_for_error()
    for rank in (0, 1):
        totals = cluster.pull("totals", ranks=rank)[0]
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
    cluster.run(SETUP).raise_for_error()
    cluster.run(
        textwrap.dedent(
            """
            from nbdist.parallel import apply_ddp
            alone = [dist.new_group([0]), dist.new_group([1])][dist.get_rank()]
            model = apply_ddp(make_model(), compression="fp16", process_group=alone)
            x, y = make_data()[dist.get_rank() * 4:(dist.get_rank() + 1) * 4]   # different data on each rank
            for step in range(3):   # the hook compresses from its third step (two warm-up steps)
                model.zero_grad()
                torch.nn.functional.mse_loss(model(x), y).backward()
            ref = make_model()
            ref.load_state_dict(model.module.state_dict())
            torch.nn.functional.mse_loss(ref(x), y).backward()
            mine = torch.cat([p.grad.flatten() for p in model.parameters()])
            local_grad = torch.cat([p.grad.flatten() for p in ref.parameters()])
            world_seen = model.compression_state.process_group.size()
            """
        )
    ).raise_for_error()
    mine, local_grad, world_seen = (cluster.pull(n) for n in ("mine", "local_grad", "world_seen"))
    assert world_seen == [1, 1]
    for rank in (0, 1):
        torch.testing.assert_close(mine[rank], local_grad[rank], rtol=1e-3, atol=1e-4)  # fp16 rounding
    assert not torch.allclose(local_grad[0], local_grad[1], atol=1e-3)  # so an average would have shown


def test_powersgd_steps_report_their_time_in_collectives(cluster):
    # PowerSGD runs torch's own hook, which nbdist does not time: DDP's timers must give
    # the time in collectives, not the hook records' missing figures read as zero.
    cluster.run(SETUP).raise_for_error()
    r = cluster.run(
        textwrap.dedent(
            """
            from nbdist.parallel import apply_ddp
            model = apply_ddp(make_model(), compression="powersgd:1")
            opt = torch.optim.SGD(model.parameters(), lr=0.1)
            x, y = make_data()[:8]
            for step in range(6):
                opt.zero_grad()
                torch.nn.functional.mse_loss(model(x), y).backward()
                opt.step()
            """
        )
    )
    r.raise_for_error()
    for rank in (0, 1):
        rows = [row for row in r.metrics[rank] if "comm/bytes" in row]
        assert len(rows) == 5
        for row in rows:
            assert 0 < row["comm/time_s"] <= row["time/step_s"], row
            assert 0 <= row["comm/exposed_s"] <= row["comm/time_s"], row
        assert rows[-1]["comm/ratio"] > 1  # compressed once PowerSGD starts


def test_profiler_traces_are_written_per_rank(cluster, tmp_path):
    import json

    cluster.run(SETUP).raise_for_error()
    cluster.push({"trace_dir": str(tmp_path / "traces")})
    r = cluster.run(
        "from nbdist.parallel import apply_ddp, profile\n"
        "model = apply_ddp(make_model(), metrics=False)\n"
        "x, y = make_data()[:8]\n"
        "with profile(trace_dir):\n"
        "    for _ in range(2):\n"
        "        torch.nn.functional.mse_loss(model(x), y).backward()"
    )
    r.raise_for_error()
    for rank in (0, 1):
        path = tmp_path / "traces" / f"rank{rank}.json"
        trace = json.loads(path.read_text())
        assert trace["traceEvents"], f"rank {rank}'s trace is empty"
        assert f"profiler trace: {path}" in r[rank].stdout
