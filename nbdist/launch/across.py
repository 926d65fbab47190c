"""The base of launchers whose engines run on several hosts (hosts.py's Slurm, srun and MPI, and any a package
adds): where the controller listens, and what every engine is told of it.

The controller always runs beside the kernel. It listens on the address that routes to the nodes (or
``--ip``), never on every interface; engines read its 0600 connection file from the cluster's private
directory, which must be visible from the nodes (the home directory, or ``$NBDIST_WORKDIR``).
"""

from __future__ import annotations

import ipaddress
import os
import socket
from dataclasses import dataclass
from typing import Any

from ..config import LauncherOptions, StartConfig, option
from ..errors import ConfigError
from . import net
from .launchers import IP_HELP, Launcher, build_cluster

# Engines end when the controller's heartbeat stops for HB_MISSES checks of (period + 0.5 s):
# about 12 s after the kernel (and so the controller) is gone.
HB_MISSES = 20


def check_address(ip: str | None) -> None:
    """--ip: an address (whether it is this host's is known only where the controller starts)."""
    if ip is not None:
        try:
            ipaddress.ip_address(ip)
        except ValueError:
            raise ConfigError(f"--ip {ip!r} is not an address; name one of this host's, e.g. --ip 10.0.0.5.") from None


@dataclass(kw_only=True)
class HostsOptions(LauncherOptions):
    """What every launcher of engines on several hosts takes: the address the controller listens on."""

    ip: str | None = option(help=IP_HELP, metavar="ADDR")

    def check(self, n: int) -> None:
        check_address(self.ip)


class ManyHostsLauncher(Launcher):
    """The base of a launcher whose engines may run on other hosts: the controller binds the interface that
    routes to the nodes (``node_addresses``, or ``--ip``); engines get its address and the cluster's directory
    (under ``workdir_base``, which the nodes must see) in their environment, and ipyparallel's nanny, which
    carries signals to them. A subclass names its engine-set launcher (``engine_set``) and sets that
    launcher's own options (``configure_engines``); ``queue``, ``job_ids`` and ``cancel`` when it submits
    batch jobs."""

    rank_vars: tuple[str, ...] = ("SLURM_PROCID",)

    def __init__(self) -> None:
        self.ip = ""

    def node_addresses(self, config: StartConfig) -> list[str]:
        """Addresses of the nodes engines may run on (to find the interface that reaches them)."""
        return []

    def controller_ip(self, config: StartConfig) -> str:
        """``--ip`` when given (checked to be this host's), else this host's address on the route to the nodes."""
        ip = config.options_as(HostsOptions).ip
        if ip:
            if not net.is_local(ip):
                raise ConfigError(f"--ip {ip} is not an address of this host; use one of: {net.describe()}.")
            return ip
        addrs = self.node_addresses(config)
        for addr in addrs:
            try:
                return net.route_source(socket.gethostbyname(addr))
            except OSError:
                continue
        if not addrs:
            return net.LOOPBACK  # every engine runs on this host
        raise ConfigError(
            f"no interface of this host routes to the nodes ({', '.join(addrs)}); name the one they reach "
            f"with --ip (this host has: {net.describe()})."
        )

    def cluster(self, config: StartConfig, profile_dir: str, fresh: bool = True) -> Any:
        self.ip = self.controller_ip(config)
        workdir = os.path.dirname(profile_dir)
        cluster, engines = build_cluster(
            config,
            profile_dir,
            fresh=fresh,
            ip=self.ip,
            engines=self.engine_set(),
            # the nanny (ipyparallel's default) carries signals to engines on other hosts
            engine_args=[f"--IPEngine.max_heartbeat_misses={HB_MISSES}"],
            env={
                "NBDIST_CONTROLLER_IP": self.ip,
                "NBDIST_CLUSTER_DIR": workdir,  # where an engine that cannot reach the controller says so
                "NBDIST_RANK_VARS": ",".join(self.rank_vars),
            },
            controller_env={"NBDIST_JOBS_FILE": os.path.join(workdir, "jobs")},
        )
        self.configure_engines(engines, config)
        return cluster

    def engine_set(self) -> type:
        raise NotImplementedError

    def configure_engines(self, c: Any, config: StartConfig) -> None:
        """Set the engine-set launcher's own options."""

    def master_address(self, rank0_addr: str) -> str:
        return rank0_addr

    def unreachable_hint(self) -> str:
        return (
            f"Start again with --ip naming an address of this host that the nodes reach (this host has: "
            f"{net.describe()}), or open the port in the firewall."
        )

    def workdir_base(self) -> str | None:
        base = os.environ.get("NBDIST_WORKDIR") or os.path.join(os.path.expanduser("~"), ".nbdist")
        os.makedirs(base, mode=0o700, exist_ok=True)
        return base
