"""How a flow-matching family runs on several ranks: tensor-parallel and sharded weights, patch-parallel decoding
(VAE strips), CFG rows on the two ranks of a CFG group (or halves of a batch without CFG), and prompts encoded once
for the group. Ulysses is each family's own (its attention processors, in its file).

A part of `FlowMatchAdapter` (models/flowmatch/adapter.py), which provides what this reads: `transformer`, `vae`,
`parallel`, `family`, `cfg_group`, `prompts`, `step_cache`, `offload`, `pipe`, `_forward`, `_call`, `_encode`,
`_decode`, `_unpack`, `_uses_cfg`, `_lora_of`, `_lora_rows`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from diffusiond.kernels.collectives import collective
from diffusiond.kernels.host import give_back
from diffusiond.kernels.parallel import CFGGroup
from diffusiond.models.base import RequestState
from diffusiond.models.params import SamplingParams


class ParallelWiring:
    """`FlowMatchAdapter`'s parallel wiring (a part of the class: the families override its hooks, `_tp_plan`,
    `_after_tp`, `enable_ulysses`)."""

    def _ulysses_degrees(self) -> tuple[int, ...]:
        if "ulysses" not in self.parallel:
            return ()
        heads = self.attention_heads() or 1
        return tuple(d for d in range(2, heads + 1) if heads % d == 0)

    def enable_tp(self, mesh: Any) -> None:
        """Shard the transformer's block linears over the tensor-parallel `mesh` (kernels/tensor_parallel.py) by the
        family's plan. The text encoders and the VAE stay whole on every rank (they run once per request)."""
        from diffusiond.kernels.tensor_parallel import shard

        plan = self._tp_plan()
        if "tp" not in self.parallel or not plan:
            raise ValueError(f"the {self.family} family does not support tensor parallelism")
        plan = {**self._modulation_plan(), **plan}
        self.weight_bytes = shard(self.transformer, plan, mesh, self._materialize())
        give_back()  # the whole weights each part was read as, freed as it was sharded
        self._after_tp(mesh.size())

    def enable_shard_weights(self, mesh: Any) -> None:
        """The transformer's (or UNet's; every expert's) weights sharded over `mesh` with FSDP2, gathered block by
        block as each runs (kernels/tensor_parallel.py): for a model that does not fit one device, at the cost of an
        all-gather of every block's weights per forward. Text encoders and the VAE stay whole. Every rank runs the
        experts its step needs in the same order, as FSDP requires."""
        from diffusiond.kernels.host import map_large_allocations
        from diffusiond.kernels.tensor_parallel import fully_shard_blocks

        map_large_allocations()  # the weights gathered per block, freed to the system after it (kernels/host.py)
        # Every expert (Wan 2.2 A14B: `transformer_2` as well), each read a block at a time when built empty.
        names = (None, *self.extra_denoisers)
        sharded = [fully_shard_blocks(e, mesh, self._materialize(n)) for e, n in zip(self.experts, names, strict=False)]
        self.weight_bytes = (sum(local for local, _ in sharded), sum(whole for _, whole in sharded))
        give_back()

    def denoisers(self) -> dict[str, Any]:
        """Every denoiser this checkpoint has, by pipeline component name."""
        extra = {name: getattr(self.pipe, name, None) for name in self.extra_denoisers}
        return {self.denoiser: self.transformer, **{name: m for name, m in extra.items() if m is not None}}

    def use_kept(self, kept: dict[str, Any], now: bool) -> int:
        """Parameters from the weights the group's previous attempt kept (models/loading/kept_weights.py) instead of the
        checkpoint's, for a denoiser built empty: mapped `now` (a layout that does not shard them), else once
        tensor parallelism has sharded the empty parameters (at the root's `materialize`). Tensors mapped now."""
        lazies = {self.denoiser: self.lazy_weights, **self.lazy_extra}
        count = 0
        for name, lazy in lazies.items():
            if lazy is not None:
                lazy.kept = kept[name]
                count += lazy.materialize(lazy.root) if now else 0
        if now:
            self.lazy_weights, self.lazy_extra = None, {}
        return count

    def _materialize(self, expert: str | None = None) -> Any:
        """What reads the parts of a denoiser built empty just before they are sharded (models/loading/lazy_weights.py),
        and checks afterwards that every part was; None for a denoiser loaded whole. `expert`: a further denoiser's
        component name (`extra_denoisers`), else the first's."""
        if expert is None:
            lazy, self.lazy_weights = self.lazy_weights, None  # read once, by the layout that shards it
        else:
            lazy = self.lazy_extra.pop(expert, None)
        if lazy is None:
            return None

        def materialize(part: Any) -> None:
            lazy.materialize(part)
            if part is lazy.root and (left := lazy.empty()):
                raise RuntimeError(f"parameters the layout never read: {', '.join(left[:5])}")

        return materialize

    def enable_vae_parallel(self, group: Any) -> None:
        """Decode one image in horizontal strips across `group`'s ranks (a 2D VAE decoder: AutoencoderKL's)."""
        from diffusers.models.autoencoders.vae import Decoder

        from diffusiond.kernels.patch_vae import make_strip_aware

        if "vae-parallel" not in self.parallel or not isinstance(getattr(self.vae, "decoder", None), Decoder):
            raise ValueError(f"the {self.family} family's VAE does not decode in strips")
        make_strip_aware(self.vae.decoder, group)
        self.vae_strips = group

    @torch.inference_mode()
    def decode_strips(self, states: Sequence[RequestState]) -> list[np.ndarray]:
        """`decode`, every rank of the strip group decoding its strip of each image (all of them call it together);
        every rank gets the images."""
        from diffusiond.kernels.patch_vae import active

        self._stage("vae")
        latents = self._unpack(torch.cat([s.latents for s in states]), states[0].params)  # [B, C, h, w]
        with active(self.vae_strips, latents.shape[-2]):
            return self.postprocess(self._decode(latents))

    def _tp_plan(self) -> dict[str, Any]:
        """The transformer's plan in diffusers' `_tp_plan` format (diffusers ships FLUX's, FLUX.2's, Qwen-Image's)."""
        return dict(getattr(self.transformer, "_tp_plan", None) or {})

    def _modulation_plan(self) -> dict[str, str]:
        """The blocks' adaptive norms (`AdaLayerNorm*`: a linear from the timestep embedding to 6 or 9 x the width,
        a third of SD3.5's and FLUX's weights), column-wise with their small outputs all-gathered: left whole, they
        kept two thirds of the weights on every rank under `--tp 2` (measured at SD3.5-medium size)."""
        from diffusiond.kernels.tensor_parallel import GATHERED

        plan = {}
        for name, child in self.transformer.named_children():
            if not isinstance(child, torch.nn.ModuleList):
                continue
            for path, module in child.named_modules():
                linear = getattr(module, "linear", None)
                if type(module).__name__.startswith(("AdaLayerNorm", "SD35AdaLayerNorm")) and isinstance(
                    linear, torch.nn.Linear
                ):
                    plan[f"{name}.{path}.linear"] = GATHERED
        return plan

    def _after_tp(self, degree: int) -> None:
        """Attention processors that count heads from `attn.heads` now see 1/degree of them."""

    def _lookup_prompts(
        self, params: Sequence[SamplingParams]
    ) -> tuple[list[bool], dict[str, tuple[torch.Tensor, ...]]]:
        """Which requests use CFG, and the encoded prompts (and negative prompts of those) by text, through the
        prompt cache: one encoder call for the texts it misses."""
        cfg, texts = self._prompt_texts(params)
        if self.shared_encoding is None:
            return cfg, self.prompts.lookup(texts, self._encode)
        # In a group the encodings were shared before prepare (`encode_prompts`): prepare runs no collective.
        missing = [t for t in texts if t not in self._shared_texts]
        if missing:
            raise RuntimeError(f"no shared encoding of {len(missing)} prompt(s) on this rank")
        return cfg, {t: self._shared_texts[t] for t in texts}

    def encode_prompts(self, params: Sequence[SamplingParams]) -> list[None]:
        """A group's stage before prepare, run by every rank together: the prompts of these requests encoded once
        (rank 0) and shared, through the prompt cache, and kept for the next prepare. No-op on one rank."""
        if self.shared_encoding is None:
            return [None] * len(params)
        _, texts = self._prompt_texts(params)
        self._shared_texts.update(self.prompts.lookup(texts, self._encode_shared))
        return [None] * len(params)

    def _prompt_texts(self, params: Sequence[SamplingParams]) -> tuple[list[bool], list[str]]:
        """Which requests use CFG, and the prompt cache's keys of their prompts and (with CFG) negative prompts: the
        texts themselves, unless the family's encoding depends on more (Qwen-Image-Edit: the images)."""
        cfg = [self._uses_cfg(p) for p in params]
        texts = [p.prompt for p in params] + [p.negative_prompt or "" for p, c in zip(params, cfg, strict=True) if c]
        return cfg, texts

    def prepared(self) -> None:
        """After prepare: the shared encodings of that plan are no longer needed here (the prompt cache keeps its
        own)."""
        if self.shared_encoding is not None:
            self._shared_texts.clear()

    # Prompt encoding once for a group of ranks (kernels/collectives.SharedEncoding), once enabled, and the
    # encodings shared for the plan being prepared.
    shared_encoding: Any = None

    _shared_texts: dict[str, tuple[torch.Tensor, ...]]

    def enable_encode_once(self, shared: Any) -> None:
        """Rank 0 encodes every prompt and broadcasts the embeddings; the other ranks receive them and free their
        text encoders (unless weights are offloaded: then the stages own them)."""
        self.shared_encoding = shared
        self._shared_texts = {}
        if shared.rank != 0 and self.offload == "none":
            for name in self.TEXT_ENCODERS:
                module = getattr(self.pipe, name, None)
                if isinstance(module, torch.nn.Module):
                    module.to("meta")  # frees the weights; this rank never runs it

    def _encode_shared(self, texts: list[str]) -> list[tuple[torch.Tensor, ...]]:
        return self.shared_encoding.run("\x00".join(texts), lambda: self._encode(texts))

    def enable_cfg_parallel(self, group: CFGGroup) -> None:
        """The two CFG branches of every request run on the two ranks of `group`; outputs are all-gathered."""
        self.cfg_group = group

    def _transformer_rows(
        self,
        rows: int,
        batched: dict[str, torch.Tensor],
        shared: dict[str, torch.Tensor],
        states: Sequence[RequestState],
    ) -> torch.Tensor:
        """One transformer call over B requests x `rows` rows (interleaved per request); returns [B, rows, ...].

        With CFG-parallel and two rows per request, each rank of the CFG group computes one row of every request
        and the halves are all-gathered."""
        n = batched["hidden_states"].shape[0] // rows
        if rows == 2 and self.cfg_group is not None:
            local = {name: t[self.cfg_group.rank :: 2] for name, t in batched.items()}
            with self._lora_rows([self._lora_of(s) for s in states]):
                out = self._forward(local, shared, 1, states)  # [B, ...]
            return torch.stack(self._cfg_gathered(out), dim=1)
        if self.cfg_group is not None and n > 1 and self.step_cache == "none":
            # No CFG in this batch: the two ranks split the requests instead of both computing all of them. (Not with
            # step caching: a request's cache lives on the rank that computed it, and the split moves requests.)
            return self._split_requests(n, batched, shared, states).unflatten(0, (n, 1))
        with self._lora_rows([self._lora_of(s) for s in states for _ in range(rows)]):
            return self._forward(batched, shared, rows, states).unflatten(0, (n, rows))

    def _split_requests(
        self, n: int, batched: dict[str, torch.Tensor], shared: dict[str, torch.Tensor], states: Sequence[Any]
    ) -> torch.Tensor:
        """Rows [0, k) on CFG rank 0 and [k, n) on rank 1 (k = ceil(n / 2)), all-gathered; returns [n, ...]."""

        def compute(lo: int, hi: int) -> torch.Tensor:
            local = {name: t[lo:hi] for name, t in batched.items()}
            with self._lora_rows([self._lora_of(s) for s in states[lo:hi]]):
                return self._call(local, shared)

        return self._split_requests_by(n, compute)

    def _split_requests_by(self, n: int, compute: Callable[[int, int], torch.Tensor]) -> torch.Tensor:
        """n requests split between the two CFG ranks, [0, k) on rank 0 and [k, n) on rank 1 (k = ceil(n / 2)):
        `compute(lo, hi)` gives this rank's outputs [hi - lo, ...]; all-gathered, [n, ...]."""
        assert self.cfg_group is not None
        k = (n + 1) // 2
        lo, hi = (0, k) if self.cfg_group.rank == 0 else (k, n)
        out = compute(lo, hi)
        if out.shape[0] < k:  # odd n: rank 1 pads its half to k rows for the gather
            out = torch.cat([out, out.new_zeros((k - out.shape[0], *out.shape[1:]))])
        halves = self._cfg_gathered(out)
        return torch.cat([halves[0], halves[1][: n - k]])

    def _cfg_gathered(self, out: torch.Tensor) -> list[torch.Tensor]:
        """This rank's outputs and the other CFG rank's (the same shape), all-gathered: [rank 0's, rank 1's]."""
        assert self.cfg_group is not None
        halves = [torch.empty_like(out) for _ in range(2)]
        with collective("cfg-parallel all_gather"):
            dist.all_gather(halves, out.contiguous(), group=self.cfg_group.group)
        return halves
