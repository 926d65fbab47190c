"""A rank that looks launched: torchrun's worker environment, and no interactive flag.

Libraries decide how to start from what the process shows them, once, often at import:
Lightning reuses a world when ``TORCHELASTIC_RUN_ID`` is set and refuses to run when
``sys.ps1`` exists; Accelerate and the HF Trainer go distributed on CPU only with
``ACCELERATE_USE_CPU``; DeepSpeed and torch's ``env://`` read ``RANK``, ``MASTER_PORT`` and
friends. A rank of nbdist *is* a launched worker, so it shows exactly that:

- ``worker_env``: every variable torchrun's local elastic agent gives a worker
  (``torch/distributed/elastic/agent/server/local_elastic_agent.py``), set by
  ``runtime.configure`` before any cell runs;
- ``world_env``: the ones that change each time the process group is formed (its port, the
  restart count) and Accelerate's CPU switch on ranks without a GPU, as ``accelerate launch
  --cpu`` sets it; set by ``group.join_world``;
- ``not_interactive``: IPython sets ``sys.ps1`` in every shell, ipyparallel's engines included,
  "so that scripts can decide if they are running interactively". A rank is not a prompt a
  person types at (its cells come from the notebook, which has its own); left there, Lightning
  reads it at import as "a notebook: no DDP". IPython never reads it back.

docs/architecture.md ("A rank looks launched") says which variables nbdist leaves unset, and why.
"""

from __future__ import annotations

import os
import sys

# A worker's store is its own (rank 0 hosts it), never a torchrun agent's: torch's env:// would
# otherwise connect every rank as a client of an agent store that is not there.
AGENT_STORE = "False"

# Set by Lightning's CLI (`lightning run`): they replace the arguments a user's code passes to
# Fabric, or make fabric.launch() refuse. A rank inherits them only from the notebook's own
# environment, where they were not meant for it.
DROPPED_PREFIXES = ("LT_",)


def worker_env(
    *,
    rank: int,
    world_size: int,
    local_rank: int,
    local_world_size: int,
    node_rank: int,
    master_addr: str,
    threads: int,
    max_restarts: int = 0,
) -> dict[str, str]:
    """The variables torchrun gives a worker, but MASTER_PORT and the restart count (``world_env``).

    One role, so ROLE_RANK/ROLE_WORLD_SIZE are RANK/WORLD_SIZE (torchrun's default role name is
    "default"); GROUP_RANK is the node's rank (NODE_RANK, the name nbdist's docs use, too) and
    GROUP_WORLD_SIZE the number of nodes."""
    nodes = max(1, world_size // max(1, local_world_size))
    return {
        "RANK": str(rank),
        "LOCAL_RANK": str(local_rank),
        "WORLD_SIZE": str(world_size),
        "LOCAL_WORLD_SIZE": str(local_world_size),
        "GROUP_RANK": str(node_rank),
        "NODE_RANK": str(node_rank),
        "GROUP_WORLD_SIZE": str(nodes),
        "ROLE_RANK": str(rank),
        "ROLE_WORLD_SIZE": str(world_size),
        "ROLE_NAME": "default",
        "MASTER_ADDR": master_addr,
        "TORCHELASTIC_RUN_ID": "nbdist",
        "TORCHELASTIC_MAX_RESTARTS": str(max_restarts),
        "TORCHELASTIC_USE_AGENT_STORE": AGENT_STORE,
        "OMP_NUM_THREADS": str(threads),
        "NUMBA_NUM_THREADS": str(threads),
    }


def world_env(*, master_addr: str, port: int, restarts: int, cpu_only: bool) -> dict[str, str]:
    """What changes each time the process group is formed: its store's address, how many times the
    world was restarted, and (``cpu_only``: gloo on a rank without a GPU) Accelerate's CPU switch."""
    env = {"MASTER_ADDR": master_addr, "MASTER_PORT": str(port), "TORCHELASTIC_RESTART_COUNT": str(restarts)}
    if cpu_only:
        env["ACCELERATE_USE_CPU"] = "true"
    return env


def apply(env: dict[str, str]) -> None:
    """Set these variables in this process, and drop the ones a launched worker would not have."""
    for name in [n for n in os.environ if n.startswith(DROPPED_PREFIXES)]:
        del os.environ[name]
    os.environ.update(env)


def not_interactive() -> None:
    """Remove the prompts IPython set, so libraries see the script-like worker this process is."""
    for name in ("ps1", "ps2", "ps3"):
        if hasattr(sys, name):
            delattr(sys, name)
