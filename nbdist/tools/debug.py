"""``%dist_debug [RANK]``: post-mortem pdb on a rank, typed into the notebook as ``%debug`` is.

The commands travel to the rank over ipyparallel's signed channels (``engine/debug.py`` runs them in a
``pdb.Pdb`` set on the rank's last traceback) and the answers come back; nothing new listens, and only
this notebook's client can send them. The prompt names the rank. The default rank is the one whose
error failed the last cell.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from ..engine import debug as on_rank
from ..errors import ConfigError
from ..results import RankStatus

if TYPE_CHECKING:
    from ..cluster import Cluster

HANG_S = 60.0  # one pdb command should answer in well under this; more means the rank is busy or gone


def failed_rank(cluster: Cluster) -> int:
    """The rank whose error failed the last cell (raised, not released)."""
    last = cluster.last
    result = last.wait(show=False) if last is not None and hasattr(last, "wait") else last
    raised = [r.rank for r in getattr(result, "ranks", []) if r.status == RankStatus.ERROR]
    if not raised:
        raise ConfigError(
            "the last cell raised on no rank; name one to debug its last exception, e.g. %dist_debug 1."
        )
    return raised[0]


def debug(
    cluster: Cluster,
    rank: int | None = None,
    ask: Callable[[str], str] = input,
    say: Callable[[str], None] = print,
) -> None:
    """Debug ``rank``'s last exception: read commands with ``ask``, show pdb's answers with ``say``."""
    rank = failed_rank(cluster) if rank is None else rank
    if not 0 <= rank < cluster.world_size:
        raise ConfigError(f"rank {rank} is not in this world (ranks 0-{cluster.world_size - 1}); e.g. %dist_debug 0.")
    engines = cluster.engines
    assert engines is not None
    if rank in engines.dead_ranks():
        raise ConfigError(
            f"rank {rank} is dead: its exception went with its process; restart it with %dist_restart --ranks {rank}."
        )
    banner = engines.call([rank], on_rank.open_session, timeout=HANG_S).ordered("opening pdb", [rank])[0]
    if not banner:
        raise ConfigError(f"rank {rank} has no exception to debug: a cell must have raised there first.")
    say(f"post-mortem pdb on rank {rank} (q to leave)\n{banner.rstrip()}")
    while True:
        try:
            line = ask(f"(Pdb rank {rank}) ")
        except (EOFError, KeyboardInterrupt, NotImplementedError):  # NotImplementedError: a front end without input
            line = "q"
        output, over = engines.call([rank], on_rank.command, line, timeout=HANG_S).ordered("pdb", [rank])[0]
        if output:
            say(output.rstrip("\n"))
        if over:
            return
