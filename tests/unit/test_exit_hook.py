"""A world's exit hook (lifecycle/membership.py): the kernel's own exit ends its world as %dist_stop does, and only in
the process that started it: a child forked from the kernel (``os.fork`` in a cell) inherits the hook, and its exit
must not end its parent's world. (A real kernel's exit: tests/integration/test_lifecycle.py, fault 5.)"""

from __future__ import annotations

import os

from nbdist.cells.history import History
from nbdist.config import StartConfig
from nbdist.lifecycle.membership import Membership


def test_the_exit_hook_stops_the_world_in_its_own_process_and_not_in_a_forked_child(tmp_path):
    world = Membership(StartConfig(), History(), say=lambda line: None)
    world.workdir = str(tmp_path / "world")  # what stop removes, standing for its processes too
    os.mkdir(world.workdir)
    started_in = os.getpid()
    child = os.fork()
    if child == 0:  # the hook, as a forked child's exit runs it
        try:
            world.stop_at_exit(started_in)
        finally:
            os._exit(0 if os.path.isdir(world.workdir) else 1)
    _, status = os.waitpid(child, 0)
    assert os.waitstatus_to_exitcode(status) == 0, "a forked child's exit ended its parent's world"
    assert os.path.isdir(world.workdir)
    world.stop_at_exit(started_in)  # the kernel's own exit
    assert not os.path.exists(world.workdir)
