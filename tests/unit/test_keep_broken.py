"""engine/group.keep_broken: a broken world's groups are kept from being freed on the thread that leaves the world;
past KEPT_BROKEN worlds, the oldest world's are freed on a thread of their own (no process group: objects that say
where they were freed stand for the groups)."""

from __future__ import annotations

import threading

from nbdist.engine import group
from tests.helpers import poll


class _Group:
    freed_on: list[str] = []

    def __del__(self) -> None:
        _Group.freed_on.append(threading.current_thread().name)


def test_the_last_worlds_groups_are_kept_and_an_older_worlds_are_freed_off_the_leaving_thread(monkeypatch):
    monkeypatch.setattr(group, "BROKEN", [])
    _Group.freed_on = []
    for _ in range(group.KEPT_BROKEN):
        group.keep_broken([_Group(), _Group()])
    assert _Group.freed_on == [] and len(group.BROKEN) == group.KEPT_BROKEN
    group.keep_broken([_Group()])  # one world more: the first world's two groups go
    poll(lambda: len(_Group.freed_on) == 2, within=10, every=0.01)
    assert _Group.freed_on == ["nbdist-free-groups"] * 2, _Group.freed_on
    assert len(group.BROKEN) == group.KEPT_BROKEN
