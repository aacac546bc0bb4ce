"""A learner of several ranks: `tether launch learner` hands itself to torch.distributed's own
launcher (torchrun), which starts ``learner.ranks`` processes on this host with RANK, LOCAL_RANK,
WORLD_SIZE, MASTER_ADDR and MASTER_PORT set, watches them and stops them all if one fails.
Across hosts, every host runs the same command with its ``--node-rank``."""

from __future__ import annotations

import os
import sys

from common.config import ConfigError, TetherConfig
from protocol.transport import free_port


def torchrun_command(config: TetherConfig, cli_args: list[str], nnodes: int, node_rank: int, master_addr: str,
                     master_port: int, training=None) -> list[str]:
    """The torchrun command that starts this host's ranks, each running ``launch.cli <cli_args>``:
    ``training.ranks`` of them on port ``training.dist_port`` (``training``: the learner's section,
    or a stage's)."""
    training = training or config.learner
    if not 0 <= node_rank < nnodes:
        raise ConfigError(f"--node-rank {node_rank} is not in 0..{nnodes - 1} (--nnodes {nnodes})")
    port = master_port or training.dist_port
    if not port:
        if nnodes > 1:
            raise ConfigError("dist_port (or --master-port) must name the port of node rank 0 when the "
                              "learner spans several hosts")
        port = free_port()
    return [sys.executable, "-m", "torch.distributed.run", f"--nnodes={nnodes}", f"--node-rank={node_rank}",
            f"--nproc-per-node={training.ranks}", f"--master-addr={master_addr}", f"--master-port={port}",
            "--max-restarts=0", "-m", "launch.cli", *cli_args]


def launch_ranks(config: TetherConfig, cli_args: list[str], nnodes: int, node_rank: int, master_addr: str,
                 master_port: int, training=None, name: str = "learner") -> int:
    training = training or config.learner
    command = torchrun_command(config, cli_args, nnodes, node_rank, master_addr, master_port, training)
    print(f"{name}: {training.ranks} rank(s) on this host, node {node_rank} of {nnodes}: {' '.join(command)}",
          file=sys.stderr, flush=True)
    # exec, not a child: the launcher keeps this process id, so `tether run` and a scheduler signal it directly
    os.execv(sys.executable, command)
    return 0  # not reached
