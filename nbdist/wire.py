"""Keys and message types nbdist sends between ranks and notebook over ipyparallel's channels: one place
for both sides, the rank that publishes (engine/metrics.py, parallel/checkpoint.py, engine/debug.py, engine/exits.py) and
the notebook that reads (cells/watch.py, cells/pdbrelay.py). A leaf: it imports nothing."""

METRICS = "nbdist.metrics."  # + a sequence number: rows logged with nbdist.log
EXITED = "nbdist.exited"  # the cell's code called exit() on a rank: its status and cell line
CHECKPOINT = "nbdist.checkpoint"  # the cell's last save_checkpoint: its path and the names it saved
PDB = "application/vnd.nbdist.pdb+json"  # a display: a rank's live debugger printed this (and prompts, or left)
PDB_REQUEST = "nbdist_pdb_request"  # control channel, notebook -> rank: a line typed for its debugger
PDB_REPLY = "nbdist_pdb_reply"  # its answer: {"status": "ok"} or {"status": "refused", "why": ...}
KEEP_ENV = "NBDIST_KEEP_S"  # in a kept world's processes: seconds of idleness it outlives the kernel by
LEASE = "lease"  # in a kept world's directory: its modification time is the world's last sign of life
STEPS_ENV = "NBDIST_STEPS_DIR"  # where each engine says its step on the way in (engine/steps.py)
WAITING = "waiting-{pid}"  # in a kept world's directory: this process saw its kernel go and waits out the lease
REPORT = "rank{rank}.json"  # in the world's directory: where a rank is, written when it gets SIGUSR1 (engine/runtime.py)
PEER_ENV = "NBDIST_PEER_RECOVERY"  # "1" on a rank of a world that recovers from a live peer (parallel/peer.py)
