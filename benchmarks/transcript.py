"""What keeping a distributed cell's transcript costs (cells/transcript.py), measured beside the same
cell without it, alternated in one run; and what the server extension's route costs per request.

1. Training: 2 ranks train a small DDP model for STEPS steps, logging every step (``nbdist.log``) and
   printing every 10th; the kernel's sink either keeps a transcript (as in a notebook) or not. Reported:
   the ranks' median step time and the cell's wall time, each with and without, and the kernel's CPU
   seconds per cell. Goal: <= 1% on the step time.
2. The route: a transcript of 2, 16 and 64 ranks x 1,000 logged steps, read and drawn as the page
   receives it (``server.routes.shown``, uncached: a running cell's transcript grows between two looks).
"""

from __future__ import annotations

import argparse
import os
import resource
import tempfile
import time

from _common import save, stats

STEPS = 400
CELL = f"""
import time, nbdist
from nbdist.parallel import apply_ddp
torch.manual_seed(0)
model = apply_ddp(torch.nn.Sequential(torch.nn.Linear(128, 256), torch.nn.ReLU(), torch.nn.Linear(256, 10)), metrics=False)
opt = torch.optim.SGD(model.parameters(), lr=0.05)
x, y = torch.randn(64, 128), torch.randint(0, 10, (64,))
times = []
for step in range({STEPS}):
    t = time.perf_counter()
    opt.zero_grad()
    loss = torch.nn.functional.cross_entropy(model(x), y)
    loss.backward()
    opt.step()
    nbdist.log(step=step, loss=loss.item(), **{{"time/step_s": time.perf_counter() - t}})
    times.append(time.perf_counter() - t)
    if step % 10 == 0 and dist.get_rank() == 0:
        print(f"step {{step}} loss {{loss.item():.4f}}", flush=True)
times.sort()
median_step = times[len(times) // 2]
"""


def _kernel_cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def training(rounds: int) -> dict:
    import io
    import sys

    import nbdist
    from nbdist.cells import transcript
    from nbdist.cells.output import TaggedPrinter

    out: dict[str, dict[str, list[float]]] = {
        k: {"step_s": [], "wall_s": [], "kernel_cpu_s": []} for k in ("kept", "not")
    }
    with nbdist.start(n=2) as cluster, tempfile.TemporaryDirectory() as world:
        os.chmod(world, 0o700)
        cluster.run(
            CELL, quiet=True, sink=TaggedPrinter(ranks=[0, 1])
        ).raise_for_error()  # warm: imports, DDP's first build
        for i in range(rounds):
            for kind in ("not", "kept") if i % 2 else ("kept", "not"):
                kept = (
                    transcript.Transcript.open(world, {"id": "c", "count": i, "code": CELL}) if kind == "kept" else None
                )
                sink = TaggedPrinter(ranks=[0, 1], transcript=kept)
                real, sys.stdout = sys.stdout, io.StringIO()  # the lines go where a notebook's would, not to this log
                try:
                    cpu, tic = _kernel_cpu(), time.perf_counter()
                    result = cluster.run(CELL, sink=sink)
                    if kept is not None:
                        kept.end(result)
                    wall, cpu = time.perf_counter() - tic, _kernel_cpu() - cpu
                finally:
                    sys.stdout = real
                result.raise_for_error()
                out[kind]["step_s"].append(max(cluster.pull("median_step")))
                out[kind]["wall_s"].append(wall)
                out[kind]["kernel_cpu_s"].append(cpu)
            print(
                f"round {i + 1}: step {out['kept']['step_s'][-1] * 1e3:.3f} ms kept, {out['not']['step_s'][-1] * 1e3:.3f} ms not; "
                f"cell {out['kept']['wall_s'][-1]:.2f} s kept, {out['not']['wall_s'][-1]:.2f} s not",
                flush=True,
            )
        size = sum(os.path.getsize(p) for p in transcript.cells(world)) / max(1, len(transcript.cells(world)))
    report = {kind: {k: stats(v) for k, v in d.items()} for kind, d in out.items()}
    step_s = report["not"]["step_s"]["median"]
    added_cpu = (report["kept"]["kernel_cpu_s"]["median"] - report["not"]["kernel_cpu_s"]["median"]) / STEPS
    wall = report["kept"]["wall_s"]["median"] / report["not"]["wall_s"]["median"] - 1
    alone = isolated()
    print(
        f"\nranks' median step: {report['kept']['step_s']['median'] * 1e3:.3f} ms kept vs {step_s * 1e3:.3f} ms not "
        f"(2 ranks and the kernel share 2 cores: rounds vary by +-40%, see the samples); cell wall {wall:+.1%}"
    )
    print(
        f"the kernel's CPU per step: +{added_cpu * 1e6:.1f} us with the transcript = {added_cpu / step_s:.2%} of a step "
        f"(goal <= 1%); the transcript's work alone: {alone * 1e6:.1f} us per step = {alone / step_s:.2%}; "
        f"{size / 1024:.0f} KiB per cell ({STEPS} steps x 2 ranks)"
    )
    return {
        "steps": STEPS,
        "ranks": 2,
        **report,
        "kernel_cpu_per_step_added_s": added_cpu,
        "share_of_step": added_cpu / step_s,
        "isolated_per_step_s": alone,
        "wall_overhead": wall,
        "bytes_per_cell": size,
    }


def isolated(steps: int = 20_000) -> float:
    """What the sink's transcript calls cost per step of a 2-rank cell, without the cluster: two ranks'
    metric rows (as apply_ddp logs them), a line every 10th step, the flush every 0.25 s."""
    from nbdist.cells import transcript

    with tempfile.TemporaryDirectory() as world:
        kept = transcript.Transcript.open(world, {"id": "c", "count": 1, "code": CELL})
        row = {"loss": 0.5, "time/step_s": 0.001, "comm/time_s": 0.0002, "comm/bytes": 140000, "samples_per_s": 60000.0}
        tic = time.perf_counter()
        for step in range(steps):
            for rank in (0, 1):
                kept.metrics(rank, [{"step": step, **row}])
            if step % 10 == 0:
                kept.output({"output_type": "stream", "name": "stdout", "text": f"[rank 0] step {step} loss 0.5\n"})
            kept.tick()
        kept.end()
        return (time.perf_counter() - tic) / steps


def route(rounds: int) -> dict:
    from nbdist.cells import transcript
    from nbdist.server import routes

    found = {}
    for ranks in (2, 16, 64):
        with tempfile.TemporaryDirectory() as world:
            kept = transcript.Transcript.open(world, {"id": "c", "count": 1, "code": "%%distributed"})
            for step in range(1000):
                for rank in range(ranks):
                    kept.metrics(
                        rank, [{"step": step, "loss": 1 / (step + 1), "time/step_s": 0.01, "memory/rss_MiB": 200.0}]
                    )
                if step % 10 == 0:
                    kept.output({"output_type": "stream", "name": "stdout", "text": f"[rank 0] step {step}\n"})
            kept.end()
            [path] = transcript.cells(world)
            times, growing = [], []
            for _ in range(rounds):
                routes.forget([])  # a page's first look: the whole transcript read and drawn
                tic = time.perf_counter()
                routes.shown(path)
                times.append(time.perf_counter() - tic)
                kept_more = transcript.Transcript(path, open(path, "a"))  # noqa: SIM115 (closed by end)
                for rank in range(ranks):  # a second of a running cell at 10 steps/s: what the next look reads
                    kept_more.metrics(rank, [{"step": 1000 + s, "loss": 0.001} for s in range(10)])
                kept_more.flush()
                tic = time.perf_counter()
                routes.shown(path)
                growing.append(time.perf_counter() - tic)
                kept_more.end()
            found[ranks] = {"first_look_s": stats(times), "next_look_s": stats(growing), "bytes": os.path.getsize(path)}
            print(
                f"route, {ranks} ranks x 1,000 steps ({os.path.getsize(path) / 2**20:.1f} MiB): first look "
                f"{found[ranks]['first_look_s']['median'] * 1e3:.0f} ms, next look (10 more steps) "
                f"{found[ranks]['next_look_s']['median'] * 1e3:.0f} ms"
            )
    return found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rounds", type=int, default=10)
    args = parser.parse_args()
    save("transcript", {"training": training(args.rounds), "route": route(5)})


if __name__ == "__main__":
    main()
