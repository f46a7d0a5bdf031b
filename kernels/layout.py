"""The SPMD layout: how many ranks, and how they split the work (CFG-parallel x ring x Ulysses x tensor parallel,
sharded weights, strip decoding). Plain Python, so start-up validation reads it before torch is imported; the
process groups it describes are built by kernels/parallel.py."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ParallelLayout:
    world_size: int
    cfg_degree: int = 1
    ulysses_degree: int = 1
    ring_degree: int = 1
    tp_degree: int = 1
    # Not degrees of the grid: FSDP2 over every rank (each keeps 1/N of the transformer's weights; with
    # `shard_replicas` R > 1, HSDP: R copies, each sharded over N / R ranks), and the ranks 0..V-1 that decode one
    # image in strips.
    shard_weights: bool = False
    vae_degree: int = 1
    shard_replicas: int = 1

    @property
    def sharded(self) -> bool:
        """Whether FSDP2 shards the weights: `shard_weights`, unless each replica is one rank (HSDP Rx1: R whole
        copies)."""
        return self.shard_weights and self.shard_mesh[-1] > 1

    @property
    def shard_mesh(self) -> tuple[int, ...]:
        """The sharded weights' device mesh: (ranks) for FSDP, (replicas, ranks per replica) for HSDP."""
        if self.shard_replicas == 1:
            return (self.world_size,)
        return (self.shard_replicas, self.world_size // self.shard_replicas)

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

    def validate_shards(self) -> None:
        if self.shard_replicas < 1 or self.world_size % self.shard_replicas:
            raise ValueError(
                f"--shard-weights {self.shard_replicas}xS: the replicas ({self.shard_replicas}) must divide the number "
                f"of ranks ({self.world_size})"
            )

    def rank_of(self, cfg: int, ring: int, ulysses: int, tp: int) -> int:
        return ((cfg * self.ring_degree + ring) * self.ulysses_degree + ulysses) * self.tp_degree + tp

    def coordinates(self, rank: int) -> tuple[int, int, int, int]:
        """(cfg, ring, ulysses, tp) of `rank`."""
        tp, rest = rank % self.tp_degree, rank // self.tp_degree
        ulysses, rest = rest % self.ulysses_degree, rest // self.ulysses_degree
        return rest // self.ring_degree, rest % self.ring_degree, ulysses, tp
