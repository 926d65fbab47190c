"""Keys of what ranks publish to the notebook over ipyparallel's data channel (``publish_data``): one
place for both sides, the rank that publishes (engine/metrics.py, parallel/checkpoint.py) and the cell
that reads (run.py). A leaf: it imports nothing."""

METRICS = "nbdist.metrics."  # + a sequence number: rows logged with nbdist.log
CHECKPOINT = "nbdist.checkpoint"  # the cell's last save_checkpoint: its path and the names it saved
