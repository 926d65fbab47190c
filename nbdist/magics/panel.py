"""What the world panel's buttons do in the kernel, called by the server's action route (server/actions.py),
never typed into a notebook: each answers a result, ``{"ok": bool, "line": str}``, that the panel shows as it is.

The line says what was done, in the words the magics print (``%dist_restart``, ``%dist_stop``); an error of
nbdist's (no world, a rank that is not dead, ...) is ``ok: False`` with its one line, nothing raised.
"""

from __future__ import annotations

from .. import cluster as api
from ..errors import NbdistError

ACTIONS = ("restart", "stop")


def act(action: str, ranks: list[int] | None = None) -> dict[str, object]:
    """Do ``action`` on this kernel's world (``restart``: ``ranks``, or every rank; ``stop``); its result."""
    try:
        cluster = api.current()
        if action == "restart":
            seconds = cluster.restart(ranks)
            which = ", ".join(map(str, ranks)) if ranks else "every rank"
            return {"ok": True, "line": f"rank(s) {which} restarted: world rebuilt in {seconds:.1f} s"}
        if action == "stop":
            size = cluster.world_size
            cluster.stop()
            return {"ok": True, "line": f"the world of {size} ranks stopped"}
    except NbdistError as exc:
        return {"ok": False, "line": str(exc)}
    return {"ok": False, "line": f"no action {action!r}; the panel knows {', '.join(ACTIONS)}"}
