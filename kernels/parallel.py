"""How ranks split the work: the SPMD layout (CFG-parallel x Ulysses) and its process groups.

rank = cfg_rank * ulysses_degree + ulysses_rank. Ranks with the same cfg_rank form a Ulysses group (they shard one
CFG branch's sequence); ranks with the same ulysses_rank form a CFG group (they hold the two branches of the same
sequence shard). Every rank creates every group in the same order, as torch.distributed requires.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch.distributed as dist

from diffusiond.kernels.ulysses import UlyssesGroup


@dataclass(frozen=True)
class ParallelLayout:
    world_size: int
    cfg_degree: int = 1
    ulysses_degree: int = 1

    def validate(self) -> None:
        if self.cfg_degree not in (1, 2):
            raise ValueError(f"--cfg-parallel must be 1 or 2 (two CFG branches), got {self.cfg_degree}")
        if self.ulysses_degree < 1:
            raise ValueError(f"--ulysses must be >= 1, got {self.ulysses_degree}")
        if self.cfg_degree * self.ulysses_degree != self.world_size:
            raise ValueError(
                f"--cfg-parallel ({self.cfg_degree}) x --ulysses ({self.ulysses_degree}) must equal the number of "
                f"ranks ({self.world_size}: --nproc x --nnodes)"
            )


@dataclass(frozen=True)
class CFGGroup:
    group: dist.ProcessGroup
    # 0 computes the first row of each request's (branch 0, branch 1) pair, 1 the second.
    rank: int


def build_groups(layout: ParallelLayout, rank: int) -> tuple[CFGGroup | None, UlyssesGroup | None]:
    layout.validate()
    u = layout.ulysses_degree
    cfg = ulysses = None
    if layout.cfg_degree > 1:
        for ulysses_rank in range(u):
            ranks = [c * u + ulysses_rank for c in range(layout.cfg_degree)]
            group = dist.new_group(ranks)
            if rank in ranks:
                cfg = CFGGroup(group, ranks.index(rank))
    if u > 1:
        for cfg_rank in range(layout.cfg_degree):
            ranks = [cfg_rank * u + j for j in range(u)]
            group = dist.new_group(ranks)
            if rank in ranks:
                ulysses = UlyssesGroup(group, ranks.index(rank), u)
    return cfg, ulysses
