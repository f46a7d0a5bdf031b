"""What every flow-matching family shares, the step itself: loading through the diffusers pipeline class, the
capabilities, per-request samplers and first latents, the batched transformer call, the batched Euler step,
inpainting's blend, x0 prediction, decoding and previews; and how the model runs (attention, compile, offload).

The adapter holds its parts, each with a narrow interface, and hands each what it reads: request resolution
(`requests`, models/flowmatch/requests.py), its prompts (`prompts`, models/flowmatch/prompts.py), the step cache
(`cache`, models/stepcache/cache.py), the ranks (`ranks`, models/flowmatch/ranks.py), LoRA rows (`loras`,
models/lora/rows.py) and a video family's clips (`clips`, models/flowmatch/clips.py). A family's file holds what its
pipeline does differently: its own step, and the parts it makes otherwise (`_request_rules`, `_step_cache`, ...).

The pipeline object is only a holder for the components and their helpers (`encode_prompt`, `prepare_latents`);
its `__call__` never runs while serving.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence
from typing import Any, ClassVar

import numpy as np
import torch
from diffusers.pipelines.flux.pipeline_flux_img2img import retrieve_latents

from diffusiond.kernels.lora_rows import Lora, LoraLayers
from diffusiond.models import preview as preview_maps
from diffusiond.models.base import Capabilities, ModelAdapter, RequestState, UnsupportedLayout, decodes_alpha
from diffusiond.models.declared import read_declared
from diffusiond.models.flowmatch import running
from diffusiond.models.flowmatch.clips import VideoClips
from diffusiond.models.flowmatch.decoding import decode_within
from diffusiond.models.flowmatch.images import ImageStart
from diffusiond.models.flowmatch.prompts import Prompts
from diffusiond.models.flowmatch.ranks import RankWiring
from diffusiond.models.flowmatch.requests import RequestRules
from diffusiond.models.flowmatch.sampler import FlowMatchSampler, check_order, step_batch
from diffusiond.models.loading.lazy_weights import LazyWeights
from diffusiond.models.loading.pipelines import load_pipeline
from diffusiond.models.loading.registry import attention_heads
from diffusiond.models.lora.registry import LoraRegistry, file_limit, read_lora, resolve_loras
from diffusiond.models.lora.rows import LoraRows
from diffusiond.models.params import SamplingParams
from diffusiond.models.stepcache.cache import StepCache

log = logging.getLogger(__name__)


class FlowMatchAdapter(ModelAdapter):
    family: ClassVar[str]
    # Whose VAE the family uses, for published preview factors (models/preview.py); None: its own.
    vae_family: ClassVar[str | None] = None
    default_steps: ClassVar[int] = 28
    default_guidance: ClassVar[float]
    # A checkpoint whose every request animates an image (saved as an image-to-video pipeline).
    requires_image: ClassVar[bool] = False

    # The pipeline component that denoises.
    denoiser: ClassVar[str] = "transformer"
    # Further denoisers a checkpoint may have (Wan 2.2 A14B's `transformer_2`), built empty like the first when a
    # layout shards them.
    extra_denoisers: ClassVar[tuple[str, ...]] = ()

    TEXT_ENCODERS: ClassVar[tuple[str, ...]] = ("text_encoder", "text_encoder_2", "text_encoder_3")
    # The transformer's repeated block classes, where it does not name them itself (`_repeated_blocks`).
    repeated_blocks: ClassVar[tuple[str, ...]] = ()
    attention_backend: str = "sdpa"
    compiled: bool = False
    offload: str = "none"
    _stages: Any = None  # kernels/offload.StageOffload with `model` offload

    def __init__(self, pipe: Any, *, source: str, lazy: dict[str, LazyWeights] | None = None) -> None:
        check_order(pipe.scheduler)
        self.pipe, self.source = pipe, source
        self.transformer = getattr(pipe, self.denoiser)  # named so whatever it is (a UNet for UNet families)
        # Every denoiser the steps run (Wan 2.2 A14B has two experts): what quantization and attention change.
        self.experts: tuple[Any, ...] = self._experts()
        self.vae = pipe.vae
        lazy = lazy or {}
        self.device = lazy[self.denoiser].device if self.denoiser in lazy else self.transformer.device
        self.dtype = self.transformer.dtype
        self.vae_scale_factor: int = self._vae_scale_factor(pipe)
        self.latent_rgb = self._load_preview_map(source)
        self.declared = read_declared(source)
        # The parts, each made with what it reads.
        self.clips: VideoClips | None = self._clips()
        self.loras: LoraRows = self._lora_rows()
        self.cache: StepCache = self._step_cache()
        self.requests: RequestRules = self._request_rules(
            self._capabilities(),
            self.declared,
            cache=self.cache,
            clips=self.clips,
            loras=lambda params: resolve_loras(self, params),
        )
        self.capabilities = self.requests.caps
        self.prompts: Prompts = self._prompts()
        self.images = self._image_start()
        names = (self.denoiser, *self.extra_denoisers)[: len(self.experts)]
        self.ranks = RankWiring(
            denoisers=dict(zip(names, self.experts, strict=True)),
            vae=self.vae,
            cache=self.cache,
            loras=self.loras,
            lazy=lazy,
        )
        self._cond_cache: tuple[tuple[str, ...], dict[str, Any]] | None = None
        # LoRA per request, once enabled (`enable_lora`).
        self.lora_registry: LoraRegistry | None = None

    @classmethod
    def from_pretrained(
        cls, path: str, *, device: str = "cpu", dtype: torch.dtype = torch.float32, lazy_denoiser: bool = False
    ) -> FlowMatchAdapter:
        """`lazy_denoiser`: the denoisers built empty, for a layout that shards them (loading/lazy_weights.py)."""
        lazy = (cls.denoiser, *cls.extra_denoisers) if lazy_denoiser else ()
        pipe, path, lazies = load_pipeline(cls.pipeline_class, path, device=device, dtype=dtype, lazy=lazy)
        try:
            return cls(pipe, source=path, lazy=lazies)
        except UnsupportedLayout as why:
            if lazies:  # built empty for a parallel layout, which the generic path does not run
                raise
            from diffusiond.models.generic.adapter import GenericAdapter

            log.warning("%s: %s; serving it on the generic path (the pipeline's own call)", path, why)
            return GenericAdapter.of_pipeline(pipe, path, reason=str(why))

    # ---- the parts: a family makes its own where it differs ----

    @property
    def capabilities(self) -> Capabilities:
        return self._capabilities_now

    @capabilities.setter
    def capabilities(self, caps: Capabilities) -> None:
        """New capabilities (another device after offloading, what the family learns after loading) reach the request
        rules too."""
        self._capabilities_now = caps
        if hasattr(self, "requests"):
            self.requests.caps = caps

    def _experts(self) -> tuple[Any, ...]:
        return (self.transformer,)

    def _clips(self) -> VideoClips | None:
        """A video family's clips (frame rules, clip outputs); None for an image family."""
        return None

    def _lora_rows(self) -> LoraRows:
        return LoraRows()

    def _step_cache(self) -> StepCache:
        """The step cache, with the family's plain call and (where it implements step caching) its cached forward."""
        return StepCache(self.family, self.cache_methods, self._call)

    def _request_rules(self, caps: Capabilities, declared: Any, **parts: Any) -> RequestRules:
        return RequestRules(caps, declared, **parts)

    def _prompts(self) -> Prompts:
        return Prompts(self._encode, self.requests.uses_cfg)

    def _image_start(self) -> ImageStart:
        """An input image's first latents (img2img, inpainting), by the family's VAE encoding."""
        processor = getattr(self.pipe, "image_processor", None)
        size_multiple = self.capabilities.size_multiple
        return ImageStart(processor, self._encode_image, stage=self._stage, size_multiple=size_multiple)

    def _encode(self, texts: list[str]) -> list[tuple[torch.Tensor, ...]]:
        """The family's prompt encoder: one tuple of tensors per text, as that text alone gives them."""
        raise NotImplementedError

    # ---- requests ----

    def resolve(self, params: SamplingParams) -> SamplingParams:
        return self.requests.resolve(params)

    def batch_key(self, params: SamplingParams) -> Any:
        return self.requests.batch_key(params)

    def encode_prompts(self, params: Sequence[SamplingParams]) -> list[None]:
        self.prompts.encode_together(params)
        return [None] * len(params)

    def prepared(self) -> None:
        self.prompts.prepared()

    # ---- how the model runs ----

    def enable_encode_once(self, shared: Any) -> None:
        """Rank 0 encodes every prompt and broadcasts the embeddings; the other ranks receive them and free their
        text encoders (unless weights are offloaded: then the stages own them)."""
        self.prompts.share(shared)
        if shared.rank != 0 and self.offload == "none":
            for name in self.TEXT_ENCODERS:
                module = getattr(self.pipe, name, None)
                if isinstance(module, torch.nn.Module):
                    module.to("meta")  # frees the weights; this rank never runs it

    def enable_cfg_parallel(self, group: Any) -> None:
        """The two CFG branches of every request run on the two ranks of `group`; outputs are all-gathered."""
        self.ranks.cfg_group = group

    def enable_tp(self, mesh: Any) -> None:
        """Shard the transformer's block linears over the tensor-parallel `mesh` by the family's plan."""
        plan = self._tp_plan()
        if "tp" not in self.parallel or not plan:
            raise ValueError(f"the {self.family} family does not support tensor parallelism")
        self.weight_bytes = self.ranks.shard_tp(mesh, plan)
        self._after_tp(mesh.size())

    def _tp_plan(self) -> dict[str, Any]:
        """The transformer's plan in diffusers' `_tp_plan` format (diffusers ships FLUX's, FLUX.2's, Qwen-Image's)."""
        return dict(getattr(self.transformer, "_tp_plan", None) or {})

    def _after_tp(self, degree: int) -> None:
        """Attention processors that count heads from `attn.heads` now see 1/degree of them."""

    def enable_shard_weights(self, mesh: Any) -> None:
        """The denoisers' weights sharded over `mesh` with FSDP2 (models/flowmatch/ranks.py)."""
        self.weight_bytes = self.ranks.shard_weights(mesh)

    def denoisers(self) -> dict[str, Any]:
        """Every denoiser this checkpoint has, by pipeline component name."""
        extra = {name: getattr(self.pipe, name, None) for name in self.extra_denoisers}
        return {self.denoiser: self.transformer, **{name: m for name, m in extra.items() if m is not None}}

    def use_kept(self, kept: dict[str, Any], now: bool) -> int:
        return self.ranks.use_kept(kept, now)

    def enable_vae_parallel(self, group: Any) -> None:
        """Decode one image in horizontal strips across `group`'s ranks (models/flowmatch/ranks.py `vae_strips`)."""
        if "vae-parallel" not in self.parallel:
            raise ValueError(f"the {self.family} family's VAE does not decode in strips")
        self.vae_strips = self.ranks.vae_strips(group, self.family)

    @torch.inference_mode()
    def decode_strips(self, states: Sequence[RequestState]) -> list[np.ndarray]:
        """`decode`, each rank of the strip group decoding its strip of each image (all call it); all get them."""
        from diffusiond.kernels.patch_vae import active

        self._stage("vae")
        latents = self._final_latents(states)  # [B, C, h, w] (a clip's [B, C, T, h, w])
        with active(self.vae_strips, latents.shape[-2]):
            return self.postprocess(self._decode(latents))

    def enable_lora(self, budget_bytes: int) -> LoraRegistry:
        """LoRA per request: adapters of the denoiser, registered by name (models/lora/registry.py)."""
        if not self.lora:
            raise ValueError(f"the {self.family} family does not serve LoRA adapters")
        self.loras.layers = LoraLayers(self.transformer)

        max_bytes = file_limit(budget_bytes)  # every read, registration or reload, checks the size first

        def read(name: str, path: str) -> Lora:
            return read_lora(name, path, type(self.pipe), self.denoiser, self.transformer, self.dtype, max_bytes)

        self.lora_registry = LoraRegistry(read, self.loras.layers, budget_bytes)
        return self.lora_registry

    def enable_step_cache(self, method: str, threshold: float, config: dict[str, Any] | None = None) -> None:
        """Server-wide: the method, the threshold of requests that send none and `--cache-config`'s settings."""
        t = self.transformer
        blocks = len(getattr(t, "transformer_blocks", ())) + len(getattr(t, "single_transformer_blocks", ()))
        blocks = blocks or len(getattr(t, "blocks", ())) or len(getattr(t, "layers", ()))  # Wan's, Z-Image's
        self.cache.enable(
            method,
            threshold,
            config,
            blocks=blocks,
            source=self.source if os.path.isdir(self.source) else None,
            stochastic=self.pipe.scheduler.config.get("stochastic_sampling", False),
        )

    def attention_heads(self) -> int | None:
        return attention_heads(self.transformer.config)

    def _vae_scale_factor(self, pipe: Any) -> int:
        """Pixels per latent along each side."""
        return pipe.vae_scale_factor

    def _default_size(self) -> tuple[int, int]:
        """The pipeline's own default: its `default_sample_size` latents, square."""
        side = self.pipe.default_sample_size * self.vae_scale_factor
        return side, side

    def _size_multiple(self) -> int:
        raise NotImplementedError

    def _max_side(self) -> int:
        return 4096

    def _unpack(self, latents: torch.Tensor, params: SamplingParams) -> torch.Tensor:
        """Model-space latents [B, ...] -> VAE-shaped latents [B, C, h, w]."""
        return latents

    def _capabilities(self) -> Capabilities:
        width, height = self._default_size()
        overrides = self.declared
        styles = self._guidance_styles()
        caps = Capabilities(
            family=self.family,
            pipeline_class=self.pipeline_class,
            default_width=overrides.width or width,
            default_height=overrides.height or height,
            default_steps=overrides.num_inference_steps or self.default_steps,
            default_guidance=(
                overrides.guidance_scale if overrides.guidance_scale is not None else self.default_guidance
            ),
            size_multiple=self._size_multiple(),
            max_side=self._max_side(),
            # Guidance-distilled families have no negative branch for one to steer.
            supports_negative_prompt=overrides.negative_prompt
            and bool({"cfg", "true-cfg", "skip-layer"} & set(styles)),
            dtype=str(self.dtype).removeprefix("torch."),
            device=str(self.device),
            sizes=tuple(tuple(size) for size in overrides.sizes) if overrides.sizes else None,
            steps=overrides.steps,
            guidance=overrides.guidance,
            vocabulary=overrides.vocabulary,
            draws=overrides.draws,
            name=overrides.name,
            guidance_styles=styles,
            parallel=self.parallel,
            ulysses_degrees=self._ulysses_degrees(),
            cache_methods=self.cache_methods,
            image_inputs=self.image_inputs,
            lora=self.lora,
            alpha=decodes_alpha(self.vae),
            layers=self.layers,
        )
        return self.clips.capabilities(caps) if self.clips is not None else caps

    def _ulysses_degrees(self) -> tuple[int, ...]:
        if "ulysses" not in self.parallel:
            return ()
        heads = self.attention_heads() or 1
        return tuple(d for d in range(2, heads + 1) if heads % d == 0)

    def _guidance_styles(self) -> tuple[str, ...]:
        """This checkpoint's: a family with a guidance embedding may have checkpoints without one."""
        if "distilled" in self.guidance_styles and not getattr(self.transformer.config, "guidance_embeds", False):
            return tuple(s for s in self.guidance_styles if s != "distilled")
        return self.guidance_styles

    def enable_offload(self, mode: str, device: str) -> None:
        """Weights kept in CPU memory, brought to `device` as they run (models/flowmatch/running.py `offload`)."""
        self._stages = running.offload(mode, device, self.pipe.components, self.experts)
        self.offload = mode
        self.device = torch.device(device)  # where inputs are made: the execution device, not the weights' home
        self.capabilities = self._capabilities()

    def _stage(self, *names: str) -> None:
        """Before a stage runs (encoding, denoising, decoding): with `model` offload, its components come to the
        device and the others leave it."""
        if self._stages is not None:
            self._stages.stage(names)

    def enable_compile(self) -> int:
        """The experts' repeated blocks compiled at their first call (the warm-up's); how many."""
        count = running.compile_experts(self.experts, self.repeated_blocks)
        self.compiled = True
        return count

    def set_attention(self, choice: str) -> str:
        """Every attention layer routed to the backend `choice` means on this device; the resolved name."""
        self.attention_backend = running.route_attention(
            choice, self.experts, self.device, self.dtype, masked=self.spec.attention_masks, family=self.family
        )
        return self.attention_backend

    def _sampler(self, params: SamplingParams, generator: torch.Generator, **kwargs: Any) -> FlowMatchSampler:
        """The request's own copy of the scheduler, at the request's first step; a stochastic scheduler draws its
        noise from the request's `generator`."""
        return FlowMatchSampler(
            self.pipe.scheduler,
            params.num_inference_steps,
            self.device,
            start=params.start_step,
            generator=generator,
            **kwargs,
        )

    def _encode_image(self, image: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
        """Preprocessed images [B, 3, H, W] in [-1, 1] -> model-space latents [B, C, h, w] (`_decode`'s inverse)."""
        latents = retrieve_latents(self.vae.encode(image.to(self.vae.dtype)), generator=generator)
        return (latents - self.vae.config.shift_factor) * self.vae.config.scaling_factor

    def _batched_cond(self, states: Sequence[RequestState]) -> dict[str, Any]:
        """Conditioning tensors concatenated along the batch, and the family's batched `rows`
        (`_batched_rows`), reused while the batch keeps the same members."""
        ids = tuple(s.request_id for s in states)
        if self._cond_cache is not None and self._cond_cache[0] == ids:
            return self._cond_cache[1]
        names = states[0].cond.keys()
        cond = {name: torch.cat([s.cond[name] for s in states]) for name in names}
        cond.update(self._batched_rows(states))
        self._cond_cache = (ids, cond)
        return cond

    def _batched_rows(self, states: Sequence[RequestState]) -> dict[str, Any]:
        """The batch's conditioning of varying length (`RequestState.rows`) as the family's transformer takes it."""
        return {}

    def _call(self, batched: dict[str, Any], shared: dict[str, Any]) -> torch.Tensor:
        """The pipeline's own transformer call over `batched` rows; [rows, ...]."""
        return self.transformer(**batched, **shared, return_dict=False)[0]

    def forget(self, request_ids: Sequence[str]) -> None:
        """States were freed: drop cached batch tensors that hold them."""
        if self._cond_cache is not None and set(request_ids) & set(self._cond_cache[0]):
            self._cond_cache = None

    def step(self, states: Sequence[RequestState], model_output: torch.Tensor) -> None:
        sample = torch.cat([s.latents for s in states])
        out = step_batch([s.sampler for s in states], sample, model_output)
        for i, state in enumerate(states):
            state.latents = out[i : i + 1]
            if state.inpaint is not None:
                state.latents = state.inpaint.blend(state.latents, state.sampler)
            state.step_index += 1

    def predicted_x0(self, state: RequestState, model_output: torch.Tensor) -> torch.Tensor:
        sigma = state.sampler.device_sigmas[state.sampler.index].to(torch.float32)
        x0 = state.latents.to(torch.float32) - sigma * model_output.to(torch.float32)
        return self._unpack(x0.view_as(state.latents), state.params)[0]

    @torch.inference_mode()
    def decode_latents(self, states: Sequence[RequestState]) -> torch.Tensor:
        self._stage("vae")
        p = states[0].params  # one batch key: one size
        return self._decode_within(self._final_latents(states), p.width * p.height * (p.num_frames or 1))

    def _final_latents(self, states: Sequence[RequestState]) -> torch.Tensor:
        """What the VAE decodes for `states` (one batch key), in model space, VAE-shaped."""
        return self._unpack(torch.cat([s.latents for s in states]), states[0].params)

    def _decode_within(self, latents: torch.Tensor, pixels_each: int) -> torch.Tensor:
        """`_decode` of a batch, in calls of bounded size (models/flowmatch/decoding.py)."""
        return decode_within(self._decode, latents, pixels_each, self.vae)

    def _decode(self, latents: torch.Tensor) -> torch.Tensor:
        """Model-space VAE-shaped latents [B, C, h, w] -> the VAE's output [B, 3, H, W] in [-1, 1]."""
        latents = latents / self.vae.config.scaling_factor + self.vae.config.shift_factor
        return self.vae.decode(latents.to(self.vae.dtype), return_dict=False)[0]

    @torch.inference_mode()
    def preview_vae(self, x0: torch.Tensor) -> list[np.ndarray]:
        """Predicted clean latents [B, C, h, w] (`predicted_x0`, one size) decoded by the VAE: uint8 [H, W, 3] each;
        a clip's [B, C, T, h, w]: its frames at latent-frame positions side by side."""
        self._stage("vae")
        if self.clips is not None:
            videos = self.postprocess(self._decode_within(x0, self.clips.pixels(x0, self.vae_scale_factor)))
            return self.clips.strips(videos)
        images = self._decode_within(x0, x0.shape[-2] * x0.shape[-1] * self.vae_scale_factor**2)
        return [(image * 255).round().astype(np.uint8) for image in self.postprocess(images)]

    def postprocess(self, images: torch.Tensor) -> list[np.ndarray]:
        if self.clips is not None:
            return self.clips.postprocess(images)  # [F, H, W, 3] float32 in [0, 1] each
        return list(self.pipe.image_processor.postprocess(images, output_type="np"))  # [H, W, 3] float32 in [0, 1]

    def preview(self, x0: torch.Tensor) -> np.ndarray:
        return self.clips.preview(x0) if self.clips is not None else self.latent_rgb.to_uint8(x0)

    def _load_preview_map(self, source: str) -> preview_maps.LatentRGB:
        # Latents where the family's decode takes them: the transformer's device and dtype (the VAE may be on a GPU).
        return preview_maps.preview_map(
            source, self.vae_family or self.family, self._latent_channels(), self._decode_rgb, self.vae_scale_factor,
            device=self.device, dtype=self.dtype,
        )  # fmt: skip

    def _decode_rgb(self, latents: torch.Tensor) -> torch.Tensor:
        """`_decode`'s colour channels [B, 3, H, W] (Qwen-Image 2.1's VAE decodes RGBA): what preview maps fit."""
        return self._decode(latents)[:, :3]

    def _latent_channels(self) -> int:
        return self.vae.config.latent_channels
