"""How a model runs on several ranks: tensor-parallel and sharded weights (read a part at a time when the denoisers
were built empty), patch-parallel decoding (VAE strips), and each transformer call's rows: both CFG rows of every
request on the two ranks of a CFG group, or halves of a batch without CFG. Ulysses is each family's own (its
attention processors, in its file); prompts encoded once for the group are models/flowmatch/prompts.py's.

A family's adapter holds one (`FlowMatchAdapter.ranks`), made with its denoisers, its VAE, its step cache (every
call runs through it) and its LoRA rows.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist

from diffusiond.kernels.collectives import collective
from diffusiond.kernels.host import give_back
from diffusiond.kernels.parallel import CFGGroup


class RankWiring:
    """`denoisers`: every denoiser of the checkpoint by component name, the first the one that denoises every
    step; `lazy`: those built empty (models/loading/lazy_weights.py) by name; `cache`: the step cache
    (models/stepcache/cache.py); `loras`: the LoRA rows (models/lora/rows.py)."""

    def __init__(self, *, denoisers: dict[str, Any], vae: Any, cache: Any, loras: Any, lazy: dict[str, Any]) -> None:
        self.denoisers, self.vae, self.cache, self.loras = denoisers, vae, cache, loras
        self.lazy = dict(lazy)
        self.cfg_group: CFGGroup | None = None
        # Sequence parallel attention's group, once a family enables Ulysses (its cached forward reads it).
        self.ulysses: Any = None

    @property
    def first(self) -> Any:
        return next(iter(self.denoisers.values()))

    # ---- weights ----

    def shard_tp(self, mesh: Any, plan: dict[str, Any]) -> tuple[int, int]:
        """The first denoiser's block linears sharded over the tensor-parallel `mesh` by `plan` (diffusers'
        `_tp_plan` format; kernels/tensor_parallel.py), its adaptive norms too; (bytes here, bytes before). The text
        encoders and the VAE stay whole on every rank (they run once per request)."""
        from diffusiond.kernels.tensor_parallel import shard

        name = next(iter(self.denoisers))
        sizes = shard(self.first, {**self._modulation_plan(), **plan}, mesh, self._materialize(name))
        give_back()  # the whole weights each part was read as, freed as it was sharded
        return sizes

    def shard_weights(self, mesh: Any) -> tuple[int, int]:
        """Every denoiser's weights sharded over `mesh` with FSDP2, gathered block by block as each runs
        (kernels/tensor_parallel.py): for a model that does not fit one device, at the cost of an all-gather of
        every block's weights per forward. Text encoders and the VAE stay whole. Every rank runs the denoisers its
        step needs in the same order, as FSDP requires. (bytes here, bytes before)."""
        from diffusiond.kernels.host import map_large_allocations
        from diffusiond.kernels.tensor_parallel import fully_shard_blocks

        map_large_allocations()  # the weights gathered per block, freed to the system after it (kernels/host.py)
        sharded = [fully_shard_blocks(m, mesh, self._materialize(n)) for n, m in self.denoisers.items()]
        give_back()
        return sum(local for local, _ in sharded), sum(whole for _, whole in sharded)

    def use_kept(self, kept: dict[str, Any], now: bool) -> int:
        """Parameters from the weights the group's previous attempt kept (models/loading/kept_weights.py) instead of
        the checkpoint's, for the denoisers built empty: mapped `now` (a layout that does not shard them), else once
        tensor parallelism has sharded the empty parameters (at the root's `materialize`). Tensors mapped now."""
        count = 0
        for name, lazy in self.lazy.items():
            lazy.kept = kept[name]
            count += lazy.materialize(lazy.root) if now else 0
        if now:
            self.lazy = {}
        return count

    def _materialize(self, name: str) -> Any:
        """What reads the parts of a denoiser built empty just before they are sharded, and checks afterwards that
        every part was; None for a denoiser loaded whole. Read once, by the layout that shards it."""
        lazy = self.lazy.pop(name, None)
        if lazy is None:
            return None

        def materialize(part: Any) -> None:
            lazy.materialize(part)
            if part is lazy.root and (left := lazy.empty()):
                raise RuntimeError(f"parameters the layout never read: {', '.join(left[:5])}")

        return materialize

    def _modulation_plan(self) -> dict[str, str]:
        """The blocks' adaptive norms (`AdaLayerNorm*`: a linear from the timestep embedding to 6 or 9 x the width,
        a third of SD3.5's and FLUX's weights), column-wise with their small outputs all-gathered: left whole, they
        kept two thirds of the weights on every rank under `--tp 2` (measured at SD3.5-medium size)."""
        from diffusiond.kernels.tensor_parallel import GATHERED

        plan = {}
        for name, child in self.first.named_children():
            if not isinstance(child, torch.nn.ModuleList):
                continue
            for path, module in child.named_modules():
                linear = getattr(module, "linear", None)
                if type(module).__name__.startswith(("AdaLayerNorm", "SD35AdaLayerNorm")) and isinstance(
                    linear, torch.nn.Linear
                ):
                    plan[f"{name}.{path}.linear"] = GATHERED
        return plan

    def vae_strips(self, group: Any, family: str) -> Any:
        """One image decoded in horizontal strips across `group`'s ranks (a 2D VAE decoder: AutoencoderKL's; or a
        causal video decoder, Wan's and Qwen-Image's, frame by frame); the strip group. ValueError for another."""
        from diffusers.models.autoencoders.vae import Decoder

        from diffusiond.kernels.patch_vae import make_strip_aware, make_video_strip_aware

        if type(getattr(self.vae, "decoder", None)).__name__ in ("WanDecoder3d", "QwenImageDecoder3d"):
            make_video_strip_aware(self.vae.decoder, group)
        elif isinstance(getattr(self.vae, "decoder", None), Decoder):
            make_strip_aware(self.vae.decoder, group)
        else:
            raise ValueError(f"the {family} family's VAE does not decode in strips")
        return group

    # ---- a transformer call's rows ----

    def rows(
        self, rows: int, batched: dict[str, torch.Tensor], shared: dict[str, Any], states: Sequence[Any]
    ) -> torch.Tensor:
        """One transformer call over B requests x `rows` rows (interleaved per request); returns [B, rows, ...].

        With CFG-parallel and two rows per request, each rank of the CFG group computes one row of every request
        and the halves are all-gathered."""
        n = batched["hidden_states"].shape[0] // rows
        if rows == 2 and self.cfg_group is not None:
            local = {name: t[self.cfg_group.rank :: 2] for name, t in batched.items()}
            with self.loras.plan(states):
                out = self.cache.forward(local, shared, 1, states)  # [B, ...]
            return torch.stack(self.gathered(out), dim=1)
        if self.cfg_group is not None and n > 1 and not self.cache.on:
            # No CFG in this batch: the two ranks split the requests instead of both computing all of them. (Not with
            # step caching: a request's cache lives on the rank that computed it, and the split moves requests.)
            return self.split_requests(n, batched, shared, states).unflatten(0, (n, 1))
        with self.loras.plan(states, rows):
            return self.cache.forward(batched, shared, rows, states).unflatten(0, (n, rows))

    def members(self, n: int, rows: int, predict: Callable[[list[tuple[int, int]]], torch.Tensor]) -> torch.Tensor:
        """A step of n requests x `rows` rows whose family runs its own calls (a call per text layout: Qwen-Image 2.1,
        GLM-Image): `predict(members)` gives the outputs [len, ...] of (request, row) pairs in their order; returns
        [n, rows, ...]. With CFG-parallel and two rows, each rank of the CFG group computes one row of every request
        (gathered); without CFG the two ranks split the requests; else every pair here."""
        g = self.cfg_group
        if g is not None and rows == 2:
            return torch.stack(self.gathered(predict([(i, g.rank) for i in range(n)])), dim=1)
        if g is not None and n > 1:
            return self.split_by(n, lambda lo, hi: predict([(i, 0) for i in range(lo, hi)])).unsqueeze(1)
        return predict([(i, r) for i in range(n) for r in range(rows)]).unflatten(0, (n, rows))

    def split_requests(
        self, n: int, batched: dict[str, torch.Tensor], shared: dict[str, Any], states: Sequence[Any]
    ) -> torch.Tensor:
        """Rows [0, k) on CFG rank 0 and [k, n) on rank 1 (k = ceil(n / 2)), all-gathered; returns [n, ...]."""

        def compute(lo: int, hi: int) -> torch.Tensor:
            local = {name: t[lo:hi] for name, t in batched.items()}
            with self.loras.plan(states[lo:hi]):
                return self.cache.forward(local, shared, 1, states[lo:hi])

        return self.split_by(n, compute)

    def split_by(self, n: int, compute: Callable[[int, int], torch.Tensor]) -> torch.Tensor:
        """n requests split between the two CFG ranks, [0, k) on rank 0 and [k, n) on rank 1 (k = ceil(n / 2)):
        `compute(lo, hi)` gives this rank's outputs [hi - lo, ...]; all-gathered, [n, ...]."""
        assert self.cfg_group is not None
        k = (n + 1) // 2
        lo, hi = (0, k) if self.cfg_group.rank == 0 else (k, n)
        out = compute(lo, hi)
        if out.shape[0] < k:  # odd n: rank 1 pads its half to k rows for the gather
            out = torch.cat([out, out.new_zeros((k - out.shape[0], *out.shape[1:]))])
        halves = self.gathered(out)
        return torch.cat([halves[0], halves[1][: n - k]])

    def gathered(self, out: torch.Tensor) -> list[torch.Tensor]:
        """This rank's outputs and the other CFG rank's (the same shape), all-gathered: [rank 0's, rank 1's]."""
        assert self.cfg_group is not None
        halves = [torch.empty_like(out) for _ in range(2)]
        with collective("cfg-parallel all_gather"):
            dist.all_gather(halves, out.contiguous(), group=self.cfg_group.group)
        return halves
