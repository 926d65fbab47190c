"""The launchers for ranks on several hosts that nbdist brings, each on ipyparallel's own engine-set launchers
(their shared base is across.py's ``ManyHostsLauncher``):

- ``slurm``: the engines are one ``sbatch`` job (ipyparallel's ``SlurmEngineSetLauncher``,
  its template extended with --nodes, --time, --gpus-per-node, ...);
- ``srun``: inside an allocation (``salloc``, a batch job, batchspawner) the engines are one
  ``srun --overlap`` step (ipyparallel's ``MPIEngineSetLauncher`` with srun as its mpiexec);
- ``mpi``: ``mpiexec`` (ipyparallel's ``MPIEngineSetLauncher``).

Ranks follow the launch rank (SLURM_PROCID, the MPI rank), not the order in which engines registered.
"""

from __future__ import annotations

import functools
import os
import re
import shutil
import subprocess
import tempfile
from dataclasses import dataclass
from typing import Any

from .. import compat
from ..config import LauncherSpec, StartConfig, check_plain_value, option
from ..errors import ClusterError, ConfigError
from . import slurm
from .across import HB_MISSES, HostsOptions, ManyHostsLauncher
from .launchers import IPP_LOG
from .pool import ENGINE_CMD

SBATCH_TEMPLATE = """#!/bin/sh
#SBATCH --job-name=nbdist-{cluster_id}
#SBATCH --ntasks={n}
#SBATCH --output={output_file}
#SBATCH --export=ALL
%(options)s
exec srun --kill-on-bad-exit=0 {program_and_args}
"""


# Values that reach an sbatch script: Slurm's own syntax, nothing a script line or a shell reads more in.
SLURM_VALUES = {
    "--partition": (
        re.compile(r"[A-Za-z0-9_.-]+(,[A-Za-z0-9_.-]+)*"),
        "a partition name (several: comma-separated)",
        "gpu",
    ),
    "--account": (re.compile(r"[A-Za-z0-9_.-]+"), "an account name", "myproject"),
    "--time": (
        re.compile(r"(\d+-)?\d+(:\d+){0,2}|UNLIMITED|unlimited|INFINITE|infinite"),
        "a Slurm time limit (minutes, H:MM:SS or D-HH)",
        "1:00:00",
    ),
}


def check_nodes(nodes: int | None, n: int) -> None:
    if nodes is not None and not 1 <= nodes <= n:
        raise ConfigError(f"--nodes {nodes} must be between 1 and the number of ranks ({n}).")


def nodes_option() -> Any:
    return option(help="nodes to spread the ranks over", metavar="K")


@dataclass(kw_only=True)
class SlurmOptions(HostsOptions):
    """sbatch's options: where the job runs, for how long, on whose account, with how many GPUs."""

    nodes: int | None = nodes_option()
    partition: str | None = option(help="Slurm partition", metavar="P")
    time: str | None = option(help="Slurm time limit, e.g. 30 or 1:00:00", metavar="T")
    account: str | None = option(help="Slurm account", metavar="A")
    gpus_per_node: int | None = option(help="GPUs per node", metavar="G")
    sbatch_args: list[str] = option(
        [], help="one more sbatch option, e.g. --sbatch-arg=--mem=8G", metavar="ARG", flag="--sbatch-arg"
    )

    def check(self, n: int) -> None:
        """Values that go into the sbatch script or an argv: Slurm's syntax, one line each, before any is used."""
        super().check(n)
        given = {"--partition": self.partition, "--account": self.account, "--time": self.time}
        for flag, value in given.items():
            pattern, what, example = SLURM_VALUES[flag]
            if value is not None and not pattern.fullmatch(str(value)):
                raise ConfigError(
                    f"{flag} {value!r} is not {what}: Slurm's syntax only, no spaces, line breaks or shell "
                    f"characters; e.g. {flag} {example}."
                )
        for value in self.sbatch_args:
            check_plain_value("--sbatch-arg", str(value), "--mem=8G")
            if not str(value).startswith("-"):
                raise ConfigError(
                    f"--sbatch-arg {value!r} is not an sbatch option; give one option, e.g. --sbatch-arg --mem=8G."
                )
        check_nodes(self.nodes, n)
        if self.gpus_per_node is not None and self.gpus_per_node < 0:
            raise ConfigError(f"--gpus-per-node ({self.gpus_per_node}) must be 0 or more.")

    def ranks_per_host(self, n: int) -> int:
        return -(-n // self.nodes) if self.nodes else n


@dataclass(kw_only=True)
class SrunOptions(HostsOptions):
    """srun's options inside an allocation: how many of its nodes, how many ranks on each."""

    nodes: int | None = nodes_option()
    ranks_per_node: int | None = option(help="ranks on each node, e.g. one per GPU", metavar="R")

    def check(self, n: int) -> None:
        super().check(n)
        check_nodes(self.nodes, n)
        if self.ranks_per_node is not None and not 1 <= self.ranks_per_node <= n:
            raise ConfigError(
                f"--ranks-per-node {self.ranks_per_node} must be between 1 and the number of ranks ({n})."
            )

    def ranks_per_host(self, n: int) -> int:
        return self.ranks_per_node or (-(-n // self.nodes) if self.nodes else n)


@dataclass(kw_only=True)
class MpiOptions(HostsOptions):
    """mpiexec's own options, passed as they are."""

    mpi_args: list[str] = option([], help="one more mpiexec option", metavar="ARG", flag="--mpi-arg")

    def check(self, n: int) -> None:
        super().check(n)
        for value in self.mpi_args:
            check_plain_value("--mpi-arg", str(value), "--bind-to=none")


class SubmitError(ClusterError):
    """The batch system refused to start the engines."""


@functools.cache
def _engine_launchers() -> tuple[type, type]:
    """ipyparallel's Slurm and MPI engine sets, extended (imported late: ipyparallel is slow to import)."""
    from ipyparallel.cluster.launcher import MPIEngineSetLauncher, SlurmEngineSetLauncher
    from traitlets import Integer, List, Unicode

    @compat.route_run_command
    class SbatchEngines(SlurmEngineSetLauncher):  # type: ignore[misc]
        """One sbatch job of n engines; --nodes shrinks for a job of fewer engines (a restart)."""

        nodes = Integer(0, config=True)
        sbatch_options = List(Unicode(), config=True)

        def write_batch_script(self, n: int = 1) -> None:
            lines = [f"#SBATCH {opt}" for opt in self.sbatch_options]
            if self.nodes:
                lines.append(f"#SBATCH --nodes={min(self.nodes, n)}")
            # ipyparallel writes the script to the kernel's working directory; keep it in the cluster's own
            self.batch_file = os.path.join(self.profile_dir, self.batch_file_name)
            escaped = "\n".join(lines).replace("{", "{{").replace("}", "}}")
            self.batch_template = SBATCH_TEMPLATE % {"options": escaped}
            super().write_batch_script(n)

        def run_command(self, command: list[str], **kwargs: Any) -> str:
            """Slurm's own words when it refuses (ipyparallel lets stderr go to the kernel's terminal)."""
            done = subprocess.run(command, stdin=subprocess.DEVNULL, capture_output=True, text=True, **kwargs)
            if done.returncode != 0:
                said = " ".join((done.stderr or done.stdout).split())[:500]
                raise SubmitError(f"{command[0]} refused the job: {said}")
            return done.stdout

        def stop(self) -> Any:
            if not self.job_id:  # never submitted: nothing to cancel (scancel '' would fail)
                self.notify_stop({"job_id": "", "output": ""})
                return ""
            return super().stop()

    class StepEngines(MPIEngineSetLauncher):  # type: ignore[misc]
        """mpiexec, or srun, with --nodes no larger than the number of engines; for srun,
        --ntasks-per-node (with --overcommit: the job may hold fewer tasks than GPUs)."""

        nodes = Integer(0, config=True)
        ranks_per_node = Integer(0, config=True)

        def find_args(self) -> list[str]:
            args: list[str] = super().find_args()
            at = len(self.mpi_cmd)
            if self.ranks_per_node and self.n > self.ranks_per_node:
                # block: neighbouring ranks share a node (the kernel's step may pass srun cyclic in its env)
                args[at:at] = [f"--ntasks-per-node={self.ranks_per_node}", "--distribution=block", "--overcommit"]
                args.insert(at, f"--nodes={-(-self.n // self.ranks_per_node)}")
            elif self.nodes:
                args.insert(at, f"--nodes={min(self.nodes, self.n)}")
            return args

    return SbatchEngines, StepEngines


class SlurmLauncher(ManyHostsLauncher):
    """Engines as one sbatch job; the controller stays with the kernel."""

    spec = LauncherSpec("slurm", "sbatch a job", options=SlurmOptions)

    def engine_set(self) -> type:
        return _engine_launchers()[0]

    def node_addresses(self, config: StartConfig) -> list[str]:
        if not slurm.available():
            raise ConfigError(
                "--launcher slurm needs Slurm's sbatch and squeue on this host's PATH (a login node of the "
                "cluster); use --launcher local here."
            )
        return slurm.node_addresses(partition=config.options_as(SlurmOptions).partition)

    def configure_engines(self, c: Any, config: StartConfig) -> None:
        own = config.options_as(SlurmOptions)
        options = [f"--time={own.time}"] if own.time else []
        if own.account:
            options.append(f"--account={own.account}")
        if own.partition:
            options.append(f"--partition={own.partition}")
        if own.gpus_per_node:
            options.append(f"--gpus-per-node={own.gpus_per_node}")
        c.sbatch_options = options + list(own.sbatch_args)
        c.nodes = own.nodes or 0

    def job_ids(self, engine_launchers: list[Any]) -> list[str]:
        return [str(el.job_id) for el in engine_launchers if getattr(el, "job_id", "")]

    def cancel(self, job_ids: list[str]) -> None:
        slurm.cancel(job_ids)

    def release(self, job_ids: list[str], hosts: set[str]) -> list[str]:
        return slurm.release(job_ids, hosts)

    def later(self, cluster: Any) -> None:
        cluster.config[self.engine_set().__name__].nodes = 0  # not --nodes: wherever Slurm has room

    def queue(self, engine_launchers: list[Any]) -> tuple[str, list[Any]]:
        states = slurm.job_states(self.job_ids(engine_launchers))
        pending = [f"Slurm job {job} {state}" for job, state in states.items() if state.startswith("PENDING")]
        gone = [el for el in engine_launchers if getattr(el, "job_id", "") and str(el.job_id) not in states]
        return "; ".join(pending), gone


class SrunLauncher(ManyHostsLauncher):
    """Inside an allocation: engines as one ``srun --overlap`` step of the kernel's own job."""

    spec = LauncherSpec("srun", "srun --overlap inside an allocation", options=SrunOptions)

    def engine_set(self) -> type:
        return _engine_launchers()[1]

    def node_addresses(self, config: StartConfig) -> list[str]:
        alloc = slurm.allocation()
        if alloc is None or not shutil.which("srun"):
            raise ConfigError(
                "--launcher srun runs engines inside this kernel's Slurm allocation, but SLURM_JOB_ID is not set; "
                "start the notebook inside salloc/sbatch, or use --launcher slurm to submit a job."
            )
        return slurm.node_addresses(nodes=list(alloc.nodes)) or list(alloc.nodes)

    def configure_engines(self, c: Any, config: StartConfig) -> None:
        # Without --overlap the step waits behind the notebook's own step and hangs without a word.
        # --export=ALL: a batch job submitted with --export=LIST (batchspawner does) leaves
        # SLURM_EXPORT_ENV=LIST to its steps, which would then start engines without PATH or NBDIST_*.
        c.mpi_cmd = ["srun"]
        c.mpi_args = ["--overlap", "--export=ALL", "--kill-on-bad-exit=0"]
        own = config.options_as(SrunOptions)
        c.nodes = own.nodes or 0
        c.ranks_per_node = own.ranks_per_node or 0

    def queue(self, engine_launchers: list[Any]) -> tuple[str, list[Any]]:
        for el in engine_launchers:
            text = el.get_output(remove=False) if hasattr(el, "get_output") else ""
            for line in reversed(text.splitlines()):
                if "step creation" in line or "nodes are busy" in line or "Requested node" in line:
                    return f"srun is waiting for the allocation: {line.strip()}", []
        return "", []  # srun's own exit is seen through its process


class MpiLauncher(ManyHostsLauncher):
    """Engines through mpiexec; rank = MPI rank."""

    spec = LauncherSpec("mpi", "mpiexec", options=MpiOptions)
    rank_vars = ("OMPI_COMM_WORLD_RANK", "PMIX_RANK", "PMI_RANK")

    def engine_set(self) -> type:
        return _engine_launchers()[1]

    def node_addresses(self, config: StartConfig) -> list[str]:
        if not shutil.which("mpiexec"):
            raise ConfigError(
                "--launcher mpi needs mpiexec on this host's PATH (Open MPI or MPICH); use --launcher local here."
            )
        args = list(config.options_as(MpiOptions).mpi_args)
        for flag in ("--hostfile", "-hostfile", "--machinefile", "-machinefile"):
            if flag in args and args.index(flag) + 1 < len(args):
                with open(args[args.index(flag) + 1]) as fh:
                    return [line.split()[0] for line in fh if line.strip() and not line.startswith("#")]
        for flag in ("--host", "-host", "-H"):
            if flag in args and args.index(flag) + 1 < len(args):
                return [h.split(":")[0] for h in args[args.index(flag) + 1].split(",")]
        return []

    def configure_engines(self, c: Any, config: StartConfig) -> None:
        c.mpi_cmd = ["mpiexec"]
        c.mpi_args = list(config.options_as(MpiOptions).mpi_args)
        env = dict(c.environment)
        if os.geteuid() == 0:  # Open MPI refuses root unless told twice
            env.update(OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")
        if config.world.oversubscribe or config.world.n > (os.cpu_count() or 1):
            env["OMPI_MCA_rmaps_base_oversubscribe"] = "1"
        c.environment = env


def script_of(n: int = 2, **options: object) -> str:
    """``nbdist.batch_script(n, **options)``: the sbatch script ``%dist_start --launcher slurm -n N ...`` would
    submit, with the same options (``nodes=2``, ``time="30"``), as text: to read where Slurm is absent."""
    return batch_script(StartConfig.of(n=n, launcher="slurm", **options))


def batch_script(config: StartConfig) -> str:
    """The sbatch script ``--launcher slurm`` would submit for this config (to show where Slurm is absent)."""
    launcher = SlurmLauncher()
    with tempfile.TemporaryDirectory() as tmp:
        profile = os.path.join(tmp, "profile")
        engines = launcher.engine_set()(work_dir=tmp, profile_dir=profile, cluster_id="nbdist", log=IPP_LOG)
        launcher.configure_engines(engines, config)
        engines.engine_cmd = list(ENGINE_CMD)
        engines.engine_args = [f"--IPEngine.max_heartbeat_misses={HB_MISSES}"]
        engines.write_batch_script(config.world.n)
        with open(engines.batch_file) as fh:
            return fh.read().replace(tmp, "$HOME/.nbdist/nbdist-XXXX")
