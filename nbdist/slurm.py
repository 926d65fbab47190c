"""What Slurm says: the allocation this kernel runs in, job states, node addresses; cancelling by job id.

Plain functions over Slurm's own commands (``squeue``, ``sinfo``, ``scontrol``,
``scancel``) and environment variables. nbdist only ever cancels job ids it submitted.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from collections.abc import Mapping
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Allocation:
    """The Slurm job this process runs in (``salloc``, ``sbatch``, batchspawner)."""

    job_id: str
    ntasks: int
    nodes: tuple[str, ...]
    gpus_per_node: int = 0

    def ranks(self) -> int:
        """One rank per GPU when the job has GPUs, else one per task."""
        if self.gpus_per_node:
            return self.gpus_per_node * max(1, len(self.nodes))
        return self.ntasks

    def describe(self) -> str:
        hosts = ",".join(self.nodes) or "?"
        unit = f"{self.gpus_per_node} GPU(s) per node" if self.gpus_per_node else f"{self.ntasks} task(s)"
        return f"Slurm job {self.job_id}: {unit} on {len(self.nodes)} node(s) ({hosts})"


def allocation(env: Mapping[str, str] | None = None) -> Allocation | None:
    """The allocation this process runs in, from Slurm's environment; None outside one."""
    env = os.environ if env is None else env
    job_id = env.get("SLURM_JOB_ID") or env.get("SLURM_JOBID")
    if not job_id:
        return None
    ntasks = _int(env.get("SLURM_NTASKS") or env.get("SLURM_NPROCS"), 0)
    if "SLURM_STEP_NUM_TASKS" in env:  # inside a step (batchspawner, srun): SLURM_NTASKS is the step's
        ntasks = job_tasks(str(job_id)) or ntasks
    nodelist = env.get("SLURM_JOB_NODELIST") or env.get("SLURM_NODELIST") or ""
    nodes = tuple(hostnames(nodelist)) if nodelist else ()
    if not ntasks:
        ntasks = max(1, len(nodes))
    gpus = _int(env.get("SLURM_GPUS_ON_NODE"), 0)
    return Allocation(job_id=str(job_id), ntasks=ntasks, nodes=nodes, gpus_per_node=gpus)


def _int(text: str | None, default: int) -> int:
    try:
        return int(str(text).split("(")[0])
    except (TypeError, ValueError):
        return default


def available() -> bool:
    return shutil.which("sbatch") is not None and shutil.which("squeue") is not None


def _run(*cmd: str, timeout: float = 15) -> str:
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)}: {done.stderr.strip() or 'exit ' + str(done.returncode)}")
    return done.stdout


def hostnames(nodelist: str) -> list[str]:
    """'node[1-2]' -> ['node1', 'node2'] (scontrol's own expansion)."""
    try:
        return _run("scontrol", "show", "hostnames", nodelist).split()
    except (OSError, RuntimeError, subprocess.TimeoutExpired):
        return [nodelist] if "[" not in nodelist else []


def job_tasks(job_id: str) -> int:
    """The job's task count (NumTasks), from scontrol; 0 when unknown."""
    try:
        out = _run("scontrol", "show", "job", "-o", job_id)
    except (OSError, RuntimeError, subprocess.TimeoutExpired):
        return 0
    for field in out.split():
        if field.startswith("NumTasks="):
            return _int(field.split("=", 1)[1], 0)
    return 0


def node_addresses(partition: str | None = None, nodes: list[str] | None = None) -> list[str]:
    """The addresses Slurm reaches nodes at (NodeAddr), for a partition or a node list."""
    cmd = ["sinfo", "-h", "-N", "-o", "%o"]
    if partition:
        cmd += ["-p", partition]
    if nodes:
        cmd += ["-n", ",".join(nodes)]
    try:
        out = _run(*cmd)
    except (OSError, RuntimeError, subprocess.TimeoutExpired):
        return []
    seen: list[str] = []
    for addr in out.split():
        if addr not in seen:
            seen.append(addr)
    return seen


def job_states(job_ids: list[str]) -> dict[str, str]:
    """'PENDING (Resources)', 'RUNNING', ... for each job id still known to squeue."""
    if not job_ids:
        return {}
    try:
        out = _run("squeue", "-h", "-j", ",".join(job_ids), "-o", "%i|%T|%r")
    except (OSError, RuntimeError, subprocess.TimeoutExpired):
        return {}
    states = {}
    for line in out.splitlines():
        parts = line.strip().split("|")
        if len(parts) == 3:
            job, state, reason = parts
            states[job] = f"{state} ({reason})" if state == "PENDING" and reason not in ("", "None") else state
    return states


def cancel(job_ids: list[str]) -> None:
    """scancel these job ids (only ids nbdist submitted)."""
    ids = [j for j in job_ids if j]
    if ids:
        try:
            _run("scancel", *ids)
        except (OSError, RuntimeError, subprocess.TimeoutExpired):
            pass
