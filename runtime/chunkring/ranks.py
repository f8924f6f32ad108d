"""Who this process is in the job: global and node-local rank, read once from the launcher's environment."""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass

from chunkring.errors import ChunkringUsageError

__all__ = ["InJob", "RankInfo"]

# (rank, size, local rank, local size) variable names, by launcher. Open MPI first: it is what
# chunkring-launch starts; MPICH/Hydra so that a user's own `mpiexec` works too.
_LAUNCHER_VARS = (
    ("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_RANK", "OMPI_COMM_WORLD_LOCAL_SIZE"),
    ("PMI_RANK", "PMI_SIZE", "MPI_LOCALRANKID", "MPI_LOCALNRANKS"),
)


@dataclass(frozen=True)
class RankInfo:
    """This process's place in the job. ``world_size == 1`` for a process started without a launcher."""

    rank: int
    world_size: int
    local_rank: int
    local_world_size: int

    def __post_init__(self) -> None:
        if self.world_size < 1 or not 0 <= self.rank < self.world_size:
            raise ChunkringUsageError(f"rank {self.rank} outside world of {self.world_size}", field="rank")
        if self.local_world_size < 1 or not 0 <= self.local_rank < self.local_world_size:
            raise ChunkringUsageError(
                f"local rank {self.local_rank} outside node of {self.local_world_size}", field="local_rank"
            )
        if self.local_world_size > self.world_size:
            raise ChunkringUsageError("more ranks on this node than in the job", field="local_world_size")

    @property
    def single_node(self) -> bool:
        return self.local_world_size == self.world_size

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> RankInfo:
        env = os.environ if environ is None else environ
        for rank_var, size_var, local_var, local_size_var in _LAUNCHER_VARS:
            if rank_var in env and size_var in env:
                rank, size = _int(env, rank_var), _int(env, size_var)
                # Without node-local variables, assume one node (the only safe guess for GPU binding).
                local = _int(env, local_var) if local_var in env else rank
                local_size = _int(env, local_size_var) if local_size_var in env else size
                return cls(rank, size, local, local_size)
        return cls(0, 1, 0, 1)


def _int(env: Mapping[str, str], name: str) -> int:
    try:
        return int(env[name])
    except ValueError:
        raise ChunkringUsageError(f"not an integer: {env[name]!r}", field=name) from None


class InJob:
    """``rank`` and ``world_size`` of an object that holds its job's :class:`RankInfo` as ``ranks``."""

    ranks: RankInfo

    @property
    def rank(self) -> int:
        return self.ranks.rank

    @property
    def world_size(self) -> int:
        return self.ranks.world_size
