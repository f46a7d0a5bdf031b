"""How ranks split the work: the SPMD layout (CFG-parallel x ring x Ulysses x tensor parallel) and its process groups.

Ranks form a grid (cfg, ring, ulysses, tp), row-major: rank = ((cfg_rank * R + ring_rank) * U + ulysses_rank) * T +
tp_rank, tensor parallelism innermost (its all-reduces are the most frequent, so its ranks are neighbours: the same
node, the fastest links). Ranks with the same cfg_rank and tp_rank form a sequence group (R * U shards of one CFG
branch's sequence, ring-major); within it, ranks with the same ring_rank form a Ulysses subgroup (all-to-all of heads
over one contiguous block of shards) and ranks with the same ulysses_rank a ring (blocks pass round it,
kernels/ring.py). Ranks that differ only in cfg_rank form a CFG group (the two branches of the same shard), ranks that
differ only in tp_rank a tensor-parallel group (a torch DeviceMesh: each holds 1/T of every block's linear weights).
Every rank creates every group in the same order, as torch.distributed requires.

| strategy        | flag             | group                       | per step                                      |
|-----------------|------------------|-----------------------------|-----------------------------------------------|
| CFG-parallel    | --cfg-parallel 2 | same shard, other branch    | all_gather of the outputs                     |
| Ulysses         | --ulysses U      | same ring block             | 2 all_to_all per attention                    |
| ring            | --ring R         | same Ulysses position       | R - 1 send/recv of K, V per attention         |
| tensor parallel | --tp T           | same everything else        | 1 all_reduce per row-wise linear (block half) |
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Any

import torch.distributed as dist

from diffusiond.kernels.patch_vae import StripGroup
from diffusiond.kernels.ulysses import UlyssesGroup


@dataclass(frozen=True)
class ParallelLayout:
    world_size: int
    cfg_degree: int = 1
    ulysses_degree: int = 1
    ring_degree: int = 1
    tp_degree: int = 1

    @property
    def sequence_degree(self) -> int:
        return self.ulysses_degree * self.ring_degree

    @property
    def shape(self) -> tuple[int, int, int, int]:
        return (self.cfg_degree, self.ring_degree, self.ulysses_degree, self.tp_degree)

    def validate(self) -> None:
        if self.cfg_degree not in (1, 2):
            raise ValueError(f"--cfg-parallel must be 1 or 2 (two CFG branches), got {self.cfg_degree}")
        for flag, degree in (
            ("--ulysses", self.ulysses_degree),
            ("--ring", self.ring_degree),
            ("--tp", self.tp_degree),
        ):
            if degree < 1:
                raise ValueError(f"{flag} must be >= 1, got {degree}")
        product = self.cfg_degree * self.sequence_degree * self.tp_degree
        if product != self.world_size:
            raise ValueError(
                f"--cfg-parallel ({self.cfg_degree}) x --ulysses ({self.ulysses_degree}) x --ring "
                f"({self.ring_degree}) x --tp ({self.tp_degree}) = {product} must equal the number of ranks "
                f"({self.world_size}: --nproc x --nnodes)"
            )

    def rank_of(self, cfg: int, ring: int, ulysses: int, tp: int) -> int:
        return ((cfg * self.ring_degree + ring) * self.ulysses_degree + ulysses) * self.tp_degree + tp

    def coordinates(self, rank: int) -> tuple[int, int, int, int]:
        """(cfg, ring, ulysses, tp) of `rank`."""
        tp, rest = rank % self.tp_degree, rank // self.tp_degree
        ulysses, rest = rest % self.ulysses_degree, rest // self.ulysses_degree
        return rest // self.ring_degree, rest % self.ring_degree, ulysses, tp


@dataclass(frozen=True)
class CFGGroup:
    group: dist.ProcessGroup
    # 0 computes the first row of each request's (branch 0, branch 1) pair, 1 the second.
    rank: int


@dataclass(frozen=True)
class Groups:
    """This rank's groups; None where the degree is 1."""

    cfg: CFGGroup | None = None
    sequence: UlyssesGroup | None = None
    # A 1-D torch DeviceMesh over this rank's tensor-parallel group (torch.distributed.tensor.parallel takes meshes).
    tp: Any = None
    # Patch-parallel decoding (kernels/patch_vae.py): ranks 0..V-1 decode one image in strips.
    vae: StripGroup | None = None


def build_groups(layout: ParallelLayout, rank: int, device_type: str = "cpu", vae_parallel: int = 1) -> Groups:
    layout.validate()
    if not 1 <= vae_parallel <= layout.world_size:
        raise ValueError(f"--vae-parallel must be between 1 and the number of ranks ({layout.world_size})")
    c, r, u, t = layout.shape
    cfg = sequence = tp = None
    if c > 1:
        for ring_rank, ulysses_rank, tp_rank in itertools.product(range(r), range(u), range(t)):
            ranks = [layout.rank_of(i, ring_rank, ulysses_rank, tp_rank) for i in range(c)]
            group = dist.new_group(ranks)
            if rank in ranks:
                cfg = CFGGroup(group, ranks.index(rank))
    if r * u > 1:
        for cfg_rank, tp_rank in itertools.product(range(c), range(t)):
            ranks = [layout.rank_of(cfg_rank, i, j, tp_rank) for i in range(r) for j in range(u)]  # ring-major
            group = dist.new_group(ranks)
            rings = [dist.new_group(ranks[j::u]) for j in range(u)] if r > 1 else []
            blocks = [dist.new_group(ranks[i * u : (i + 1) * u]) for i in range(r)] if r > 1 and u > 1 else []
            if rank in ranks:
                position = ranks.index(rank)
                sequence = UlyssesGroup(
                    group,
                    position,
                    r * u,
                    ring=rings[position % u] if rings else None,
                    ring_size=r,
                    ulysses=blocks[position // u] if blocks else None,
                )
    if t > 1:
        from torch.distributed.device_mesh import init_device_mesh

        mesh = init_device_mesh(device_type, layout.shape, mesh_dim_names=("cfg", "ring", "ulysses", "tp"))
        tp = mesh["tp"]
    vae = None
    if vae_parallel > 1:
        group = dist.new_group(list(range(vae_parallel)))
        if rank < vae_parallel:
            vae = StripGroup(group, rank, vae_parallel)
    return Groups(cfg, sequence, tp, vae)
