"""What runs on the Ray nodes for a world (rayworld.py, in the driver, makes these actors): a rank's actor, which holds
its CPUs and GPUs and starts its engine (cold, or forked by its node's warm process), and a node's warm actor, whose
child is nbdist's warm process. Imported on the nodes by the actors' Ray workers: it imports no more than it needs."""

from __future__ import annotations

import os
import signal
import threading
from typing import Any

from . import procs

ENGINE = ["-m", "nbdist.engine"]  # the engine's command is [python, *ENGINE, args...]
FORK_S = 120.0  # the first fork waits while the node's warm process imports torch


class Engine:
    """A Ray actor holding one rank's CPUs and GPUs and its engine: a child started cold, or a fork of the node's
    warm process."""

    def start(self, cmd: list[str], env: dict[str, str], warm: Any = None, log: str = "") -> tuple[str, int, bool]:
        """Start the engine: its output to ``log`` (a file in the cluster's directory, which the driver relays; ''
        where there is none: this actor's own output, in Ray's logs on the node)."""
        import socket
        import subprocess

        self.proc: Any = None
        self.pid = 0
        output = log or f"/proc/{os.getpid()}/fd/1"
        if warm is not None and cmd[1:3] == ENGINE:
            import ray

            job = {
                "args": cmd[3:],
                "env": {**os.environ, **env, "NBDIST_PARENT_PID": str(os.getpid())},  # the engine ends with us
                "cwd": os.getcwd(),
                "output": output,
            }
            pid = ray.get(warm.fork.remote(job), timeout=FORK_S)
            if pid:
                self.pid = pid
                return socket.gethostname(), pid, True
        out = os.open(output, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
        try:
            self.proc = subprocess.Popen(
                cmd, env={**os.environ, **env}, stdout=out, stderr=out, preexec_fn=_die_with_parent
            )
        finally:
            os.close(out)
        self.pid = self.proc.pid
        return socket.gethostname(), self.pid, False

    def poll(self) -> int | None:
        if self.proc is not None:
            return self.proc.poll()
        return None if procs.alive(self.pid) else 0  # the warm process's child: its status is not ours to read

    def stop(self) -> None:
        if self.proc is not None:
            if self.proc.poll() is None:
                self.proc.kill()
                self.proc.wait()
        elif procs.alive(self.pid):
            os.kill(self.pid, signal.SIGKILL)


class NodeWarm:
    """A Ray actor (no CPU of its own) on one node: its child is nbdist's warm process, which forks engines."""

    def __init__(self, python: str, env: dict[str, str]) -> None:
        import subprocess

        self.lock = threading.Lock()
        self.proc = subprocess.Popen(
            [python, "-m", "nbdist.engine.warm"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            env={**os.environ, **env},
            preexec_fn=_die_with_parent,
        )

    def fork(self, job: dict[str, Any]) -> int:
        """The forked engine's pid; 0 when the warm process cannot (the rank then starts cold)."""
        with self.lock:
            if self.proc.poll() is not None:
                return 0
            try:
                return max(procs.ask_fork(self.proc, job, FORK_S), 0)
            except (OSError, TimeoutError, EOFError, procs.ForkRefused):  # refused: it stays unsafe
                self.proc.kill()
                return 0


def _die_with_parent() -> None:
    """In the child, before it runs: end with the actor that started it (prctl PR_SET_PDEATHSIG), and take
    signals as a process of its own would: a Ray worker ignores SIGINT, and an ignored signal stays ignored
    across exec, so the engine would never see an interrupt (Python installs its SIGINT handler only where the
    signal is at its default)."""
    import ctypes

    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGUSR1, signal.SIGUSR2):
        signal.signal(sig, signal.SIG_DFL)
    signal.pthread_sigmask(signal.SIG_SETMASK, [])
    ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)
