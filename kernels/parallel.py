"""How ranks split the work: the SPMD layout (CFG-parallel x ring x Ulysses) and its process groups.

rank = cfg_rank * (R * U) + ring_rank * U + ulysses_rank. Ranks with the same cfg_rank form a sequence group (they
shard one CFG branch's sequence, R * U shards); within it, ranks with the same ring_rank form a Ulysses subgroup
(all-to-all of heads over one contiguous block of shards) and ranks with the same ulysses_rank a ring (blocks pass
round it, kernels/ring.py). Ranks with the same position in their sequence group form a CFG group (they hold the two
branches of the same sequence shard). Every rank creates every group in the same order, as torch.distributed
requires.

| strategy     | flag             | group                          | per step                              |
|--------------|------------------|--------------------------------|---------------------------------------|
| CFG-parallel | --cfg-parallel 2 | same shard, other branch       | all_gather of the outputs             |
| Ulysses      | --ulysses U      | same ring block                | 2 all_to_all per attention            |
| ring         | --ring R         | same Ulysses position          | R - 1 send/recv of K, V per attention |
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
    ring_degree: int = 1

    @property
    def sequence_degree(self) -> int:
        return self.ulysses_degree * self.ring_degree

    def validate(self) -> None:
        if self.cfg_degree not in (1, 2):
            raise ValueError(f"--cfg-parallel must be 1 or 2 (two CFG branches), got {self.cfg_degree}")
        if self.ulysses_degree < 1:
            raise ValueError(f"--ulysses must be >= 1, got {self.ulysses_degree}")
        if self.ring_degree < 1:
            raise ValueError(f"--ring must be >= 1, got {self.ring_degree}")
        if self.cfg_degree * self.sequence_degree != self.world_size:
            raise ValueError(
                f"--cfg-parallel ({self.cfg_degree}) x --ulysses ({self.ulysses_degree}) x --ring "
                f"({self.ring_degree}) = {self.cfg_degree * self.sequence_degree} must equal the number of ranks "
                f"({self.world_size}: --nproc x --nnodes)"
            )


@dataclass(frozen=True)
class CFGGroup:
    group: dist.ProcessGroup
    # 0 computes the first row of each request's (branch 0, branch 1) pair, 1 the second.
    rank: int


def build_groups(layout: ParallelLayout, rank: int) -> tuple[CFGGroup | None, UlyssesGroup | None]:
    """This rank's CFG group and sequence group (Ulysses and ring subgroups inside), None where the degree is 1."""
    layout.validate()
    u, r, n = layout.ulysses_degree, layout.ring_degree, layout.sequence_degree
    cfg = sequence = None
    if layout.cfg_degree > 1:
        for position in range(n):
            ranks = [c * n + position for c in range(layout.cfg_degree)]
            group = dist.new_group(ranks)
            if rank in ranks:
                cfg = CFGGroup(group, ranks.index(rank))
    if n > 1:
        for cfg_rank in range(layout.cfg_degree):
            base = cfg_rank * n
            ranks = list(range(base, base + n))
            group = dist.new_group(ranks)
            rings = [dist.new_group([base + i * u + j for i in range(r)]) for j in range(u)] if r > 1 else []
            blocks = [dist.new_group([base + i * u + j for j in range(u)]) for i in range(r)] if r > 1 and u > 1 else []
            if rank in ranks:
                position = ranks.index(rank)
                sequence = UlyssesGroup(
                    group,
                    position,
                    n,
                    ring=rings[position % u] if rings else None,
                    ring_size=r,
                    ulysses=blocks[position // u] if blocks else None,
                )
    return cfg, sequence
