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

from diffusiond.kernels.layout import ParallelLayout
from diffusiond.kernels.patch_vae import StripGroup
from diffusiond.kernels.ulysses import UlyssesGroup


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


def build_groups(layout: ParallelLayout, rank: int, device_type: str = "cpu") -> Groups:
    """This rank's groups of a validated layout (models/loading/setup.py `check_setup`)."""
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
    if layout.vae_degree > 1:
        group = dist.new_group(list(range(layout.vae_degree)))
        if rank < layout.vae_degree:
            vae = StripGroup(group, rank, layout.vae_degree)
    return Groups(cfg, sequence, tp, vae)
