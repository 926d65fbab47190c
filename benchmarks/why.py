"""%dist_why's fault-injection suite (#53): each fault planted on a chosen rank, seeds apart; the confusion table.

One world of ``--ranks`` ranks (4: gloo, oversubscribed on a small machine). For each fault of tests/why_cases.py
(slow input, compute skew, a slow DDP communication hook, a garbage-collection pause, I/O in the step, a checkpoint
and an evaluation inside the loop, a hang, a desync) and ``--seeds`` seeds, the cell with the fault on rank
1 + seed % (ranks - 1) runs under %dist_why (hangs and desyncs released after 12 s); and as many balanced runs. Two
loops (``--wraps``): DDP, and FSDP2 (``fully_shard`` per layer), which cannot have the hook and evaluation faults.
Counted: the cause and the rank right, the time a hang took to be named (from the stall). The cost of timing: the
balanced cell's median step (its own clock) run plainly and under %dist_why, alternating, ``--overhead`` pairs, on 2
ranks (4 would share the 2 cores and measure their turns on them).
Targets: >= 95% right, no verdict on balanced runs, a hang named within 10 s, <= 2% a step.

Beside it, in the same run: traceml 0.5 (``traceml run --nproc-per-node N``, its summary mode) on the same cell as a
script (``traceml_ai.init()`` first, each step inside its ``trace_step(model)``), ``--traceml-seeds`` seeds a fault
(not the hang and the desync: traceml does not time collectives, and the script would wait for gloo's 30-minute
timeout); its primary diagnosis and the rank it names (``evidence.worst.rank``) go in the table beside nbdist's.
Saved under results/why.json.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter

from _common import save

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

import nbdist  # noqa: E402
from tests.why_cases import FAULTS, FSDP_FAULTS, cell  # noqa: E402

RELEASE_S = 12


TRACEML_RIGHT = {  # traceml's step-time kinds that name each planted fault's cause (it has no word for the others)
    "none": {"BALANCED", "NO_CLEAR_PERFORMANCE_BOTTLENECK", "COMPUTE_BOUND"},
    "data": {"INPUT_STRAGGLER"},
    "compute": {"COMPUTE_STRAGGLER"},
}


def traceml(fault: str, rank: int, seed: int, ranks: int, wrap: str = "ddp") -> dict:
    """traceml 0.5's primary diagnosis of the cell run as a script under ``traceml run``."""
    exe = shutil.which("traceml", path=str(pathlib.Path(sys.executable).parent))
    if exe is None:
        return {"kind": "not installed (pip install traceml-ai==0.5.0)", "rank": None}
    with tempfile.TemporaryDirectory() as tmp:
        script = pathlib.Path(tmp, "cell.py")
        script.write_text(
            "import torch.distributed as dist\ndist.init_process_group('gloo')\nimport traceml_ai\ntraceml_ai.init()\n"
            "from traceml_ai import trace_step as STEP\n"
            + cell(fault, rank, seed, steps=40, wrap=wrap)
            + "dist.barrier()\ndist.destroy_process_group()\n"
        )
        done = subprocess.run(
            [
                exe,
                "run",
                str(script),
                "--nproc-per-node",
                str(ranks),
                "--logs-dir",
                tmp + "/logs",
                "--run-name",
                "r",
                "--mode",
                "summary",
            ],
            capture_output=True,
            text=True,
            timeout=600,
            cwd=tmp,
            env={**os.environ, "OMP_NUM_THREADS": "1"},
        )
        try:
            summary = json.loads(pathlib.Path(tmp, "logs", "r", "final_summary.json").read_text())
        except (OSError, ValueError):
            return {"kind": f"no summary (exit {done.returncode})", "rank": None}
    primary = summary.get("primary_diagnosis") or {}
    worst = ((primary.get("evidence") or {}).get("worst") or {}).get("rank")
    return {
        "kind": primary.get("kind"),
        "severity": primary.get("severity"),
        "rank": worst,
        "summary": primary.get("summary"),
    }


def step_s(cluster) -> float:
    stamps = cluster.pull("stamps")[0]
    return statistics.median(b - a for a, b in zip(stamps[2:], stamps[3:], strict=False))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=4)
    parser.add_argument("--seeds", type=int, default=10)
    parser.add_argument("--overhead", type=int, default=10)
    parser.add_argument("--faults", nargs="*", default=list(FAULTS))
    parser.add_argument("--wraps", nargs="*", default=["ddp", "fsdp"], help="the loops: DDP, FSDP2 (fully_shard)")
    parser.add_argument("--traceml-seeds", type=int, default=3, help="seeds a fault run under traceml too (0: none)")
    args = parser.parse_args()
    rows, table = [], Counter()
    with nbdist.start(n=args.ranks, oversubscribe=True) as cluster:
        for wrap in args.wraps:
            for fault in [f for f in args.faults if wrap == "ddp" or f in FSDP_FAULTS]:
                for seed in range(args.seeds):
                    rank = 1 + seed % (args.ranks - 1) if fault != "none" else None
                    slow = fault in ("hang", "desync")
                    tic = time.perf_counter()
                    verdict = nbdist.why(
                        cell(fault, rank if rank is not None else -1, seed, wrap=wrap),
                        cluster,
                        timeout=RELEASE_S if slow else None,
                    )
                    named = verdict.figures.get("ranks")
                    right = verdict.cause in FAULTS[fault] and (rank is None or named == [rank])
                    among = verdict.cause in FAULTS[fault] and (rank is None or rank in (named or []))
                    row = {
                        "wrap": wrap,
                        "fault": fault,
                        "seed": seed,
                        "rank": rank,
                        "verdict": verdict.cause,
                        "named": named,
                        "right": right,
                        "cause_right_rank_among": among,
                        "seconds": time.perf_counter() - tic,
                        "stalled_s": verdict.figures.get("stalled_s"),
                        # the largest difference as a share of a step, and in how many of the window's steps it
                        # passed the quiet bar (said where ranks share cores and it is under the crowded bar)
                        "share": verdict.figures.get("excess_s", 0) / verdict.figures.get("step_s", 1),
                        "steady": verdict.figures.get("steady"),
                        "text": verdict.text,
                    }
                    rows.append(row)
                    table[(wrap, fault, verdict.cause)] += 1
                    print(
                        f"{wrap:4} {fault:8} seed {seed} rank {rank}: {verdict.cause:9} {named} {'ok' if right else 'WRONG'}"
                        + (f"  named after {row['stalled_s']:.1f} s of stall" if row["stalled_s"] else "")
                        + (f"  {row['share']:.0%} of a step" if "excess_s" in verdict.figures else "")
                        + (" steady in {} of {} steps".format(*row["steady"]) if row["steady"] else ""),
                        flush=True,
                    )
                    if not right:
                        print("    " + verdict.text, flush=True)
                    if seed < args.traceml_seeds and fault not in ("hang", "desync"):
                        theirs = traceml(fault, rank if rank is not None else -1, seed, args.ranks, wrap)
                        row["traceml"] = theirs
                        row["traceml_rank_right"] = rank is None or theirs["rank"] == rank
                        row["traceml_cause_right"] = (
                            theirs["kind"] in TRACEML_RIGHT.get(fault, ()) and row["traceml_rank_right"]
                        )
                        print(
                            f"    traceml: {theirs['kind']} ({theirs.get('severity')}) rank {theirs['rank']}",
                            flush=True,
                        )
    # the cost of timing, where the ranks do not share cores: 2 ranks, the balanced cell, plain and timed alternately
    plain, timed = [], []
    with nbdist.start(n=2) as cluster:
        for _ in range(args.overhead):
            cluster.run(cell("none", -1, 0, steps=200)).raise_for_error()
            plain.append(step_s(cluster))
            nbdist.why(cell("none", -1, 0, steps=200), cluster)
            timed.append(step_s(cluster))
    causes = sorted({c for *_, c in table})
    for wrap in args.wraps:
        print(f"\nconfusion, {wrap} loop (rows: the fault planted; columns: the verdict)")
        print(f"{'':9}" + "".join(f"{c:>10}" for c in causes))
        for fault in args.faults:
            if any(table[(wrap, fault, c)] for c in causes):
                print(f"{fault:9}" + "".join(f"{table[(wrap, fault, c)] or '':>10}" for c in causes))
        print(f"\nbeside traceml 0.5, {wrap} loop (the same cell as a script, seeds 0-{args.traceml_seeds - 1})")
        print(f"{'':9}{'nbdist':>34}{'traceml':>60}")
        for fault in args.faults:
            mine = [r for r in rows if r["fault"] == fault and r["wrap"] == wrap and "traceml" in r]
            if not mine:
                continue
            ours = Counter(f"{r['verdict']} {r['named']}" for r in mine)
            theirs = Counter(f"{r['traceml']['kind']} r{r['traceml']['rank']}" for r in mine)
            print(
                f"{fault:9}{', '.join(f'{k} x{n}' for k, n in ours.items()):>34}"
                f"{', '.join(f'{k} x{n}' for k, n in theirs.items()):>60}"
            )
    faulty = [r for r in rows if r["fault"] != "none"]
    balanced = [r for r in rows if r["fault"] == "none"]
    stalls = [r["stalled_s"] for r in rows if r["stalled_s"]]
    cost = statistics.median(t / p for t, p in zip(timed, plain, strict=True)) - 1  # pair by pair
    summary = {
        "right_faulty": sum(r["right"] for r in faulty) / max(1, len(faulty)),
        "cause_right_rank_among": sum(r["cause_right_rank_among"] for r in faulty) / max(1, len(faulty)),
        "false_alarms": sum(not r["right"] for r in balanced),
        "balanced_runs": len(balanced),
        "hang_named_after_s_max": max(stalls) if stalls else None,
        "step_plain_s": statistics.median(plain),
        "step_timed_s": statistics.median(timed),
        "overhead": cost,
        "traceml_runs": sum("traceml" in r for r in rows),
        "traceml_cause_right": sum(r.get("traceml_cause_right", False) for r in rows),
        "traceml_rank_right": sum(r.get("traceml_rank_right", False) for r in rows),
    }
    print(
        f"\nright (cause and rank) in {summary['right_faulty']:.0%} of {len(faulty)} faulty runs; "
        f"{summary['false_alarms']} false alarm(s) in {len(balanced)} balanced runs; hangs named after at most "
        f"{summary['hang_named_after_s_max']} s of stall; a step {summary['step_plain_s'] * 1e3:.2f} ms plain, "
        f"{summary['step_timed_s'] * 1e3:.2f} ms timed ({cost:+.1%})"
    )
    save(
        "why",
        {
            "ranks": args.ranks,
            "seeds": args.seeds,
            "rows": rows,
            "summary": summary,
            "confusion": {f"{w} {f}->{c}": n for (w, f, c), n in table.items()},
        },
    )


if __name__ == "__main__":
    main()
