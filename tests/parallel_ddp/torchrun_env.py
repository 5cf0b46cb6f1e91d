"""The environment torchrun gives its ranks, for DDP processes started without it (the
one-rank world of plain pytest, the forked ranks of exit_runs.py)."""
from __future__ import annotations

import socket


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rank_environment(rank: int, nodes: int, per_node: int, port: int) -> dict[str, str]:
    """What torchrun sets for global rank ``rank`` of ``nodes`` x ``per_node`` ranks whose
    rendezvous is 127.0.0.1:``port``."""
    return {"RANK": str(rank), "WORLD_SIZE": str(nodes * per_node),
            "LOCAL_RANK": str(rank % per_node), "LOCAL_WORLD_SIZE": str(per_node),
            "GROUP_RANK": str(rank // per_node), "GROUP_WORLD_SIZE": str(nodes),
            "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
