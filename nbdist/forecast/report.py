"""A forecast's answer: each strategy and world size, the peak one rank holds and its parts, and what fits."""

from __future__ import annotations

import html
from dataclasses import dataclass, field
from typing import Any

MiB = 2**20
SHOWN = ("parameters", "gradients", "optimizer", "activations", "temporaries", "buckets")


def size(n: float) -> str:
    """Bytes as a person reads them: 103.2 MiB, 1.50 GiB."""
    if n >= 2**30:
        return f"{n / 2**30:.2f} GiB"
    if 0 < n < MiB:
        return f"{n / 2**10:.1f} KiB"
    return f"{n / MiB:.1f} MiB"


def seconds(s: float) -> str:
    return f"{1e3 * s:.0f} ms" if s < 10 else f"{s:.1f} s"


@dataclass(slots=True)
class Times:
    """A rank's step time from its forecast: the operators' time, shared with the ranks beyond the cores, and each
    collective at the cost measured here (all of it exposed: on CPU ranks gloo and the step share the cores). A
    pipeline stage also waits while the pipe fills and drains, (m + p - 1) / m of its compute for GPipe, or shares
    the cores with the other stages, whichever is longer."""

    fit: dict[str, tuple[float, float]]
    measured_at: int
    cores: int
    microbatches: int

    def share(self, world: int) -> float:
        return max(1.0, world / self.cores)

    def add(self, row: dict[str, Any]) -> None:
        from .comm import time_of

        world, m = row["world"], row.get("microbatches", self.microbatches)
        compute = row["compute_s"] * self.share(world)
        if row["strategy"] == "pp":  # the pipe fills and drains; stages that wait free their cores for the rest
            compute = row["compute_s"] * max((m + world - 1) / m, self.share(world))
        scale = self.share(world) / self.share(self.measured_at)
        groups = row["collectives"]  # (kind, bytes, the ranks of its group: a 2-D mix's are fewer than the world)
        comm = sum(time_of(k, b, g, self.fit, self.measured_at) for k, b, g in groups) * scale
        row["time"] = {"compute_s": compute, "comm_s": comm, "step_s": compute + comm}
        row["time"]["comm_measured"] = all(g == self.measured_at for _, _, g in groups)


@dataclass(slots=True)
class Option:
    """One strategy at one world size: each forecast rank's numbers (a pipeline's stages differ, the rest are alike)."""

    strategy: str
    world: int
    ranks: dict[int, dict[str, Any]] = field(default_factory=dict)
    error: str | None = None

    @property
    def peak_rank(self) -> int:
        return max(self.ranks, key=lambda r: self.ranks[r]["peak"])

    @property
    def step_s(self) -> float:
        """The slowest rank's forecast step (a pipeline's ranks each wait for the slowest stage)."""
        return max((r["time"]["step_s"] for r in self.ranks.values() if "time" in r), default=0.0)

    @property
    def peak(self) -> int:
        """The most any one rank holds at its step's peak."""
        return self.ranks[self.peak_rank]["peak"] if self.ranks else 0

    @property
    def partial(self) -> list[str]:
        """The layers that ran as boxes, outside the tracker, each with why ('layer 1 (Peek): it reads ...')."""
        return sorted({why for r in self.ranks.values() for why in r.get("partial", ())})

    def differ(self) -> str:
        """Where ranks differ, which rank peaks: 'rank 1 peaks; rank 0 holds 25.0 MiB'."""
        if len(self.ranks) < 2:
            return ""
        low = min(self.ranks, key=lambda r: self.ranks[r]["peak"])
        if self.ranks[low]["peak"] == self.peak:
            return "every stage alike"
        return f"rank {self.peak_rank} peaks; rank {low} holds {size(self.ranks[low]['peak'])}"


@dataclass(slots=True)
class Forecast:
    """``nbdist.fit``'s answer. ``options``: one per strategy and world size, in the order asked; ``memory``: the
    bytes one rank has, if given. ``best`` is the smallest world (then the least memory) that fits it."""

    options: list[Option]
    memory: int | None = None
    seconds: float = 0.0
    measured: str = "two gloo processes"
    device: str = "cpu"  # where each rank's tensors were made (fake)
    watched: str | None = None  # the strategy the live world's dashboards compare the run with
    advice: str = ""  # one more line for the person (why nothing is watched)

    def expectation(self, strategy: str) -> dict[int, dict[str, Any]]:
        """What the dashboard compares a run under ``strategy`` with, by world size: step_s and peak_MiB."""
        from ..config import STRATEGIES, did_you_mean
        from ..errors import ConfigError

        done = {o.world: o for o in self.options if o.strategy == strategy and not o.error}
        if not done:
            hint = did_you_mean(strategy, STRATEGIES) if strategy not in STRATEGIES else "forecast it first."
            raise ConfigError(f"--watch {strategy!r}: no forecast of it here; {hint}")
        return {n: {"label": strategy, "step_s": o.step_s, "peak_MiB": o.peak / MiB} for n, o in done.items()}

    def option(self, strategy: str, world: int) -> Option:
        for opt in self.options:
            if (opt.strategy, opt.world) == (strategy, world):
                return opt
        raise KeyError(f"no forecast for {strategy} at {world} ranks")

    def peak(self, strategy: str, world: int, rank: int | None = None) -> int:
        """The forecast peak of ``rank`` (default: the rank that holds the most) under ``strategy`` at ``world``."""
        opt = self.option(strategy, world)
        if opt.error:
            raise KeyError(f"{strategy} at {world} ranks was not forecast: {opt.error}")
        if rank is None:
            return opt.peak
        return opt.ranks[rank if strategy == "pp" else 0]["peak"]

    @property
    def best(self) -> Option | None:
        if self.memory is None:
            return None
        fits = [o for o in self.options if not o.error and o.peak <= self.memory]
        return min(fits, key=lambda o: (o.world, o.peak), default=None)

    def verdict(self) -> str:
        """One line: what fits the memory given, or the least it would take."""
        done = [o for o in self.options if not o.error]
        if self.memory is None or not done:
            return ""
        best = self.best
        if best is not None:
            where = f"on rank {best.peak_rank}" if best.strategy == "pp" else "per rank"
            inside = f"; partial: {_layers(best.partial)} not counted inside" if best.partial else ""
            return (
                f"fits {size(self.memory)} per rank: {best.world} ranks with {best.strategy} (peak {size(best.peak)} "
                f"{where}{inside})"
            )
        least = min(done, key=lambda o: o.peak)
        return (
            f"fits nowhere in {size(self.memory)} per rank: the least is {size(least.peak)} ({least.strategy} at "
            f"{least.world} ranks); give each rank {size(least.peak)}, or forecast more ranks (-n 16)."
        )

    def rows(self) -> list[list[str]]:
        head = ["strategy", "ranks", "peak", *SHOWN, "step (compute + comm)", "note"]
        out = [head]
        for o in self.options:
            if o.error:
                out.append([o.strategy, str(o.world), "", *[""] * (len(SHOWN) + 1), f"not forecast: {o.error}"])
                continue
            top = o.ranks[o.peak_rank]
            peak = size(o.peak) + (f" (rank {o.peak_rank})" if o.strategy == "pp" else "")
            t = top.get("time")
            step = ""
            if t:
                mark = "" if t["comm_measured"] else " *"
                step = f"{seconds(o.step_s)} ({seconds(t['compute_s'])} + {seconds(t['comm_s'])}{mark})"
            note = "; ".join(n for n in (o.differ(), f"partial: {_layers(o.partial)} ran alone" if o.partial else "") if n)
            out.append([o.strategy, str(o.world), peak, *[size(top["parts"][p]) for p in SHOWN], step, note])
        return out

    def __str__(self) -> str:
        rows = self.rows()
        widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]) - 1)]
        lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths, strict=False)).rstrip() + "  " + r[-1] for r in rows]
        lines = [line.rstrip() for line in lines]
        lines.append(
            f"one rank's step at its peak on {self.device}, as torch's MemTracker counts under fake tensors ({self.seconds:.1f} s; "
            f"nothing allocated); the step's time: its operators timed one at a time, its collectives as measured on "
            f"{self.measured} (*: carried to another world size, an estimate)"
        )
        for why in sorted({w for o in self.options for w in o.partial}):
            lines.append(
                f"partial: {why}; so it ran alone, for real and outside the tracker: its output, the gradients it "
                "passes back and its parameters' are counted, what it holds inside is not"
            )
        if self.verdict():
            lines.append(self.verdict())
        if self.watched:
            lines.append(
                f"the live world's dashboards now draw the {self.watched} forecast and say when a step is over it"
            )
        if self.advice:
            lines.append(self.advice)
        return "\n".join(lines)

    def __repr__(self) -> str:
        return str(self)

    def _repr_html_(self) -> str:
        rows = self.rows()
        head = "".join(f"<th>{html.escape(c)}</th>" for c in rows[0])
        body = "".join("<tr>" + "".join(f"<td>{html.escape(c)}</td>" for c in r) + "</tr>" for r in rows[1:])
        below = str(self).splitlines()[len(rows) :]
        foot = "".join(
            f"<p><b>{html.escape(ln)}</b></p>" if ln == self.verdict() else f"<p>{html.escape(ln)}</p>" for ln in below
        )
        return f"<table><tr>{head}</tr>{body}</table>{foot}"


def _layers(partial: list[str]) -> str:
    """'layer 1 (Peek)' from 'layer 1 (Peek): it reads ...', joined."""
    return ", ".join(sorted({why.split(": ", 1)[0] for why in partial}))
