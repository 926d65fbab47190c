"""A TensorBoard event file, written by nbdist (``EventFile``): what TensorBoardRun writes its events to.

The format is TensorBoard's (TFRecord): each record is the event's length (8 bytes), that length's masked CRC-32C,
the serialized ``Event`` and its masked CRC-32C; the file's first event names the format (``brain.Event:2``);
TensorBoard reads every ``*tfevents*`` file of a run's folder. The file stays open and each call's events go out in
one write, flushed at once (TensorBoard sees them within its next reload).

Why not torch's ``SummaryWriter``: its writer (TensorBoard's ``EventFileWriter``) opens and closes the file for every
event and checksums it in pure Python: about 60 us of the notebook's CPU for each step of a tracked world, against
10 us here (google-crc32c's C code; TensorBoard's own checksum where that is not installed).
"""

from __future__ import annotations

import itertools
import os
import socket
import struct
import time
from typing import Any

_COUNT = itertools.count()  # files this process opened: two runs in one second get two names


def _masked_crc() -> Any:
    try:
        import google_crc32c
    except ImportError:  # TensorBoard's own, in pure Python
        from tensorboard.compat.tensorflow_stub.pywrap_tensorflow import masked_crc32c

        return masked_crc32c

    def masked(data: bytes) -> int:
        x = google_crc32c.value(data)
        return (((x >> 15) | (x << 17)) + 0xA282EAD8) & 0xFFFFFFFF  # TFRecord's mask

    return masked


class EventFile:
    """One event file in ``folder``, open until ``close``."""

    def __init__(self, folder: str) -> None:
        from tensorboard.compat.proto.event_pb2 import Event

        self._event, self._crc = Event, _masked_crc()
        os.makedirs(folder, exist_ok=True)
        name = f"events.out.tfevents.{int(time.time()):010d}.{socket.gethostname()}.{os.getpid()}.{next(_COUNT)}"
        self.path = os.path.join(folder, name)
        self._file = open(self.path, "ab")  # noqa: SIM115 (open as long as the run)
        self.write([Event(wall_time=time.time(), file_version="brain.Event:2")])

    def summaries(self, steps: list[tuple[int, Any]]) -> None:
        """Write one event for each (step, ``Summary``), in the order given."""
        now = time.time()
        self.write([self._event(wall_time=now, step=step, summary=summary) for step, summary in steps])

    def write(self, events: list[Any]) -> None:
        out = bytearray()
        for event in events:
            data = event.SerializeToString()
            header = struct.pack("<Q", len(data))
            out += header + struct.pack("<I", self._crc(header)) + data + struct.pack("<I", self._crc(data))
        self._file.write(out)
        self._file.flush()

    def close(self) -> None:
        self._file.close()
