"""What Slurm says: the allocation this kernel runs in, job states, node addresses; cancelling by job id.

Plain functions over Slurm's own commands (``squeue``, ``sinfo``, ``scontrol``,
``scancel``) and environment variables. nbdist only ever cancels job ids it submitted.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from collections.abc import Callable, Mapping
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Allocation:
    """The Slurm job this process runs in (``salloc``, ``sbatch``, batchspawner)."""

    job_id: str
    ntasks: int
    nodes: tuple[str, ...]
    gpus: tuple[int, ...] = ()  # GPUs allocated on each node, in the order of ``nodes`` (empty: none)

    def ranks(self) -> int:
        """One rank per allocated GPU, across the nodes, when the job has GPUs; else one per task."""
        return sum(self.gpus) or self.ntasks

    def gpus_per_node(self) -> int:
        """The GPUs on each node when every node has the same number; 0 when they differ or there are none."""
        return self.gpus[0] if self.gpus and len(set(self.gpus)) == 1 else 0

    def describe(self) -> str:
        hosts = ",".join(self.nodes) or "?"
        if sum(self.gpus):
            return f"{sum(self.gpus)} GPUs allocated on {hosts} (Slurm job {self.job_id})"
        return f"{self.ntasks} tasks allocated on {hosts} (Slurm job {self.job_id})"


def allocation(env: Mapping[str, str] | None = None) -> Allocation | None:
    """The allocation this process runs in, from Slurm's environment; None outside one.

    ``SLURM_GPUS_ON_NODE`` counts the GPUs of this node only; a job on several nodes may
    have others elsewhere (or unevenly, with ``--gpus=N``), so the count per node comes
    from ``scontrol show job -d`` when the job has GPUs at all.
    """
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
    here = _int(env.get("SLURM_GPUS_ON_NODE"), 0)
    gpus: tuple[int, ...] = ()
    if here or env.get("SLURM_JOB_GPUS"):
        per_node = node_gpus(str(job_id))
        if per_node and set(per_node) <= set(nodes):
            gpus = tuple(per_node.get(node, 0) for node in nodes)
        else:  # scontrol not answering: assume every node has what this one has
            gpus = (here,) * max(1, len(nodes))
    return Allocation(job_id=str(job_id), ntasks=ntasks, nodes=nodes, gpus=gpus)


def node_gpus(job_id: str) -> dict[str, int]:
    """GPUs the job holds on each node, from ``scontrol show job -d`` (``Nodes=n[1-2] ... GRES=gpu:2(IDX:0-1)``)."""
    try:
        out = _run("scontrol", "show", "job", "-d", job_id)
    except (OSError, RuntimeError, subprocess.TimeoutExpired):
        return {}
    return parse_node_gpus(out, hostnames)


def parse_node_gpus(out: str, expand: Callable[[str], list[str]]) -> dict[str, int]:
    """The per-node ``GRES=`` entries of ``scontrol show job -d``; ``expand`` turns 'n[1-2]' into names."""
    counts: dict[str, int] = {}
    for line in out.splitlines():
        fields = dict(f.split("=", 1) for f in line.split() if "=" in f)
        if "Nodes" not in fields or "GRES" not in fields:
            continue
        total = 0
        for gres in fields["GRES"].split(","):
            name, _, rest = gres.partition(":")
            if name == "gpu":  # gpu:2(IDX:0-1) or gpu:a100:2(IDX:0-1)
                total += _int(rest.split("(")[0].rsplit(":", 1)[-1], 0)
        for node in expand(fields["Nodes"]):
            counts[node] = counts.get(node, 0) + total
    return counts


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


def release(job_ids: list[str], hosts: set[str]) -> list[str]:
    """Give back the nodes of these jobs where no rank of the world runs any more (it went on without them), so
    that a job of a world that grows again can have them: ``scontrol update JobId= NodeList=`` keeps a job on the
    others, and a job left with none is cancelled. What was done, in words ('Slurm job 1 gave back node2')."""
    short = {h.split(".")[0] for h in hosts}
    said = []
    for job in job_ids:
        try:
            nodes = hostnames(_run("squeue", "-h", "-j", job, "-o", "%N").strip() or "")
        except (OSError, RuntimeError, subprocess.TimeoutExpired):
            continue
        kept = [n for n in nodes if n.split(".")[0] in short]
        gone = ", ".join(n for n in nodes if n not in kept)
        if not nodes or not gone:
            continue
        if not kept:
            cancel([job])
            said.append(f"cancelled Slurm job {job} (on {gone})")
            continue
        try:
            _run("scontrol", "update", f"JobId={job}", f"NodeList={','.join(kept)}")
            said.append(f"Slurm job {job} gave back {gone}")
        except (OSError, RuntimeError, subprocess.TimeoutExpired) as exc:
            said.append(f"Slurm job {job} still holds {gone} ({str(exc)[:120]})")
    return said
