"""Real ranks on the CPU for the verify tests: N spawned processes with the environment torchrun
gives its processes, each putting its result on a queue."""

from __future__ import annotations

import os
import socket
from collections.abc import Callable
from typing import Any

import torch.multiprocessing as mp


def become_rank(rank: int, world: int, port: int, **extra: str) -> None:
    """This process's environment as torchrun sets it for `rank` of `world`."""
    os.environ.update(
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(world),
        LOCAL_WORLD_SIZE=str(world),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        **extra,
    )


def run_ranks(target: Callable[..., None], world: int, *args: Any) -> list:
    """target(rank, world, port, *args, results) in `world` spawned processes on a free port;
    their results, sorted."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    results = mp.get_context("spawn").Queue()
    mp.start_processes(
        target, args=(world, port, *args, results), nprocs=world, start_method="spawn", join=True
    )
    return sorted(results.get(timeout=60) for _ in range(world))
