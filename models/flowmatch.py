"""What every family shares: loading through the diffusers pipeline class, request validation (sizes, strengths,
masks, edit images), per-request samplers, the batched Euler step, inpainting's blend, CFG-parallel rows, x0
prediction, decoding and previews. Families override what their pipelines do differently (SDXL: a UNet and its
scheduler's own step).

The pipeline object is only a holder for the components and their helpers (`encode_prompt`, `prepare_latents`);
its `__call__` never runs while serving.
"""

from __future__ import annotations

import logging
import math
import os
from collections.abc import Hashable, Sequence
from contextlib import nullcontext
from typing import Any, ClassVar

import diffusers
import numpy as np
import torch
import torch.distributed as dist
from diffusers.pipelines.flux.pipeline_flux import calculate_shift
from diffusers.pipelines.flux.pipeline_flux_img2img import retrieve_latents
from diffusers.utils.torch_utils import randn_tensor

from diffusiond.kernels import attention
from diffusiond.kernels.collectives import collective
from diffusiond.kernels.lora_rows import Lora, LoraLayers
from diffusiond.kernels.parallel import CFGGroup
from diffusiond.models import preview as preview_maps
from diffusiond.models import stepcache
from diffusiond.models.base import Capabilities, ModelAdapter, RequestState
from diffusiond.models.declared import check_declared, read_declared
from diffusiond.models.inputs import image_size, open_mask, open_rgb
from diffusiond.models.lora_registry import LoraRegistry, read_lora, resolve_loras
from diffusiond.models.params import MAX_GUIDANCE, MAX_PROMPT_CHARS, MAX_SEED, MAX_STEPS, ParamError, SamplingParams
from diffusiond.models.prompts import PROMPT_CACHE_BYTES, PromptCache
from diffusiond.models.sampler import FlowMatchSampler, step_batch

log = logging.getLogger(__name__)


def null_components(source: str) -> dict[str, None]:
    """Components the checkpoint saved as None (`[null, null]` in model_index.json, e.g. SD3 without T5), to pass
    as None again: diffusers drops them on load and then insists on every required component being there."""
    from diffusiond.models.registry import read_model_index

    index = read_model_index(source)
    return {name: None for name, value in index.items() if isinstance(value, list) and value == [None, None]}


class Inpaint:
    """One inpainting request's image latents, the noise it started from and its latent mask (1: repainted), in
    the family's latent layout."""

    __slots__ = ("image", "mask", "noise")

    def __init__(self, image: torch.Tensor, noise: torch.Tensor, mask: torch.Tensor) -> None:
        self.image, self.noise, self.mask = image, noise, mask

    def map(self, fn) -> Inpaint:
        """The same with each tensor mapped (a family's packing)."""
        return Inpaint(fn(self.image), fn(self.noise), fn(self.mask))

    def blend(self, latents: torch.Tensor, sampler: Any) -> torch.Tensor:
        """After a step, as the Inpaint pipelines: outside the mask, the image noised to the step the sampler
        reached (`renoise`; after the last step, the image itself)."""
        proper = sampler.renoise(self.image, self.noise)
        return (1 - self.mask) * proper + self.mask * latents


class FlowMatchAdapter(ModelAdapter):
    family: ClassVar[str]
    # Whose VAE the family uses, for published preview factors (models/preview.py); None: its own.
    vae_family: ClassVar[str | None] = None
    default_steps: ClassVar[int] = 28
    default_guidance: ClassVar[float]
    # `true_cfg_scale` when a request sends none (families with true CFG beside a guidance embedding).
    default_true_cfg: ClassVar[float] = 1.0
    # The pipeline component that denoises.
    denoiser: ClassVar[str] = "transformer"

    def __init__(self, pipe: Any, *, source: str) -> None:
        self.pipe = pipe
        self.source = source
        self.transformer = getattr(pipe, self.denoiser)  # named so whatever it is (a UNet for UNet families)
        self.vae = pipe.vae
        self.device = self.transformer.device
        self.dtype = self.transformer.dtype
        self.vae_scale_factor: int = self._vae_scale_factor(pipe)
        self.latent_rgb = self._load_preview_map(source)
        self.capabilities = self._capabilities()
        self._cond_cache: tuple[tuple[str, ...], dict[str, Any]] | None = None
        self.cfg_group: CFGGroup | None = None
        self.prompts = PromptCache(PROMPT_CACHE_BYTES)
        # LoRA per request, once enabled (`enable_lora`).
        self.lora_registry: LoraRegistry | None = None
        self.lora_layers: LoraLayers | None = None

    @classmethod
    def from_pretrained(cls, path: str, *, device: str = "cpu", dtype: torch.dtype = torch.float32) -> FlowMatchAdapter:
        pipeline_cls = getattr(diffusers, cls.pipeline_class)
        pipe = pipeline_cls.from_pretrained(path, dtype=dtype, **null_components(path))
        pipe.to(device)
        pipe.set_progress_bar_config(disable=True)
        for module in pipe.components.values():
            if isinstance(module, torch.nn.Module):
                module.eval().requires_grad_(False)
        return cls(pipe, source=path)

    # ---- family hooks ----

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

    # ---- contract ----

    def _capabilities(self) -> Capabilities:
        width, height = self._default_size()
        overrides = self.declared = read_declared(self.source)
        return Capabilities(
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
            supports_negative_prompt=overrides.negative_prompt,
            dtype=str(self.dtype).removeprefix("torch."),
            device=str(self.device),
            sizes=tuple(tuple(size) for size in overrides.sizes) if overrides.sizes else None,
            steps=overrides.steps,
            guidance=overrides.guidance,
            vocabulary=overrides.vocabulary,
            draws=overrides.draws,
            name=overrides.name,
            guidance_styles=self._guidance_styles(),
            parallel=self.parallel,
            ulysses_degrees=self._ulysses_degrees(),
            cache_methods=self.cache_methods,
            image_inputs=self.image_inputs,
            lora=self.lora,
        )

    def _guidance_styles(self) -> tuple[str, ...]:
        """This checkpoint's: a family with a guidance embedding may have checkpoints without one."""
        if "distilled" in self.guidance_styles and not getattr(self.transformer.config, "guidance_embeds", False):
            return tuple(s for s in self.guidance_styles if s != "distilled")
        return self.guidance_styles

    def _ulysses_degrees(self) -> tuple[int, ...]:
        if "ulysses" not in self.parallel:
            return ()
        heads = self.transformer.config.num_attention_heads
        return tuple(d for d in range(2, heads + 1) if heads % d == 0)

    def enable_ulysses(self, group: Any) -> None:
        raise ValueError(f"the {self.family} family does not support Ulysses sequence parallelism")

    # (bytes of the transformer's parameters on this rank, before) once tensor parallel or sharded.
    weight_bytes: tuple[int, int] | None = None

    def enable_tp(self, mesh: Any) -> None:
        """Shard the transformer's block linears over the tensor-parallel `mesh` (kernels/tensor_parallel.py) by the
        family's plan. The text encoders and the VAE stay whole on every rank (they run once per request)."""
        from diffusiond.kernels.tensor_parallel import shard

        plan = self._tp_plan()
        if "tp" not in self.parallel or not plan:
            raise ValueError(f"the {self.family} family does not support tensor parallelism")
        heads = self.transformer.config.num_attention_heads
        if heads % mesh.size():
            raise ValueError(f"--tp {mesh.size()} must divide the number of attention heads ({heads})")
        self.weight_bytes = shard(self.transformer, plan, mesh)
        self._after_tp(mesh.size())

    def enable_shard_weights(self, mesh: Any) -> None:
        """The transformer's (or UNet's) weights sharded over `mesh` with FSDP2, gathered block by block as each
        runs (kernels/tensor_parallel.py): for a model that does not fit one device, at the cost of an all-gather of
        every block's weights per forward. Text encoders and the VAE stay whole."""
        from diffusiond.kernels.tensor_parallel import fully_shard_blocks

        self.weight_bytes = fully_shard_blocks(self.transformer, mesh)

    # Patch-parallel decoding (kernels/patch_vae.py) once enabled.
    vae_strips: Any = None

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

    def _after_tp(self, degree: int) -> None:
        """Attention processors that count heads from `attn.heads` now see 1/degree of them."""

    def resolve(self, params: SamplingParams) -> SamplingParams:
        caps = self.capabilities
        if not isinstance(params.prompt, str) or not params.prompt.strip():
            raise ParamError("prompt", "prompt must be a non-empty string")
        for name in ("prompt", "negative_prompt"):
            text = getattr(params, name)
            if text is not None and len(text) > MAX_PROMPT_CHARS:
                raise ParamError(name, f"{name} is {len(text)} characters long; the limit is {MAX_PROMPT_CHARS}")
        check_declared(self.declared, params)
        strength = self._strength(params)
        width, height = self._size(params)
        for name, side in (("width", width), ("height", height)):
            if side < caps.size_multiple or side > caps.max_side or side % caps.size_multiple:
                raise ParamError(
                    name,
                    f"{name} must be a multiple of {caps.size_multiple} between {caps.size_multiple} and "
                    f"{caps.max_side} for this model, got {side}",
                )
        steps = params.num_inference_steps if params.num_inference_steps is not None else caps.default_steps
        if not 1 <= steps <= MAX_STEPS:
            raise ParamError(
                "num_inference_steps", f"num_inference_steps must be between 1 and {MAX_STEPS}, got {steps}"
            )
        guidance = params.guidance_scale if params.guidance_scale is not None else caps.default_guidance
        if not math.isfinite(guidance) or guidance < 0 or guidance > MAX_GUIDANCE:
            raise ParamError("guidance_scale", f"guidance_scale must be between 0 and {MAX_GUIDANCE:g}, got {guidance}")
        true_cfg = params.true_cfg_scale if params.true_cfg_scale is not None else self.default_true_cfg
        if not math.isfinite(true_cfg) or true_cfg < 0 or true_cfg > MAX_GUIDANCE:
            raise ParamError("true_cfg_scale", f"true_cfg_scale must be between 0 and {MAX_GUIDANCE:g}, got {true_cfg}")
        seed = params.seed
        if seed is None:
            # Random seeds stay below 2**53, so JavaScript clients (JSON numbers are doubles) can reuse them exactly.
            seed = int.from_bytes(os.urandom(8), "little") & (2**53 - 1)
        elif not 0 <= seed <= MAX_SEED:
            raise ParamError("seed", f"seed must be between 0 and {MAX_SEED}, got {seed}")
        if params.preview_every < 0:
            raise ParamError("preview_every", f"preview_every must be >= 0, got {params.preview_every}")
        if params.image is not None and params.skip_guidance_layers is not None:
            # As diffusers: its SD3 Img2Img pipeline has no skip-layer guidance.
            raise ParamError("skip_guidance_layers", "skip-layer guidance is for requests without an input image")
        resolved = SamplingParams(
            prompt=params.prompt,
            negative_prompt=params.negative_prompt,
            seed=seed,
            width=width,
            height=height,
            num_inference_steps=steps,
            guidance_scale=float(guidance),
            true_cfg_scale=float(true_cfg),
            preview_every=params.preview_every,
            stream_latents=params.stream_latents,
            preview=params.preview,
            cache_threshold=self._cache_threshold(params),
            **self._skip_layer_guidance(params),
            image=params.image,
            strength=strength,
            mask=self._mask(params),
            reference_images=self._references(params),
            start_step=self._start_step(steps, strength),
            **self._video(params),
            lora=resolve_loras(self, params),
        )
        if resolved.steps_to_run < 1:
            raise ParamError(
                "strength", f"strength {strength} leaves none of the {steps} steps to run; raise either of them"
            )
        return resolved

    def _video(self, params: SamplingParams) -> dict[str, Any]:
        """The resolved video fields (`num_frames`, `fps`); image families refuse them."""
        for name in ("num_frames", "fps"):
            if getattr(params, name) is not None:
                raise ParamError(name, f"the {self.family} family makes images; {name} is for video models")
        return {}

    # Img2img's strength when a request with an image sends none (the Img2Img pipelines' default), and with a mask
    # (the Inpaint pipelines').
    default_strength: ClassVar[float] = 0.6
    default_inpaint_strength: ClassVar[float] = 0.6

    def _start_step(self, steps: int, strength: float | None) -> int:
        """Img2img's first schedule position, as the flow-matching Img2Img pipelines' `get_timesteps` computes
        `t_start` (in floats: 50 steps at strength 0.56 start at 21, so 29 run)."""
        if strength is None:
            return 0
        return int(max(steps - min(steps * strength, steps), 0))

    def _strength(self, params: SamplingParams) -> float | None:
        """The resolved strength: None without an input image."""
        if params.image is None:
            if params.strength is not None:
                raise ParamError("strength", "strength applies to requests with an input image")
            return None
        if "edit" in self.image_inputs:  # instruction editing: the image conditions every step, no strength
            if params.strength is not None:
                raise ParamError("strength", f"the {self.family} family edits by instruction; strength does not apply")
            self.context_size(params)  # a file that is not an image (or too small) is refused here, naming it
            return None
        if "img2img" not in self.image_inputs:
            raise ParamError("image", f"the {self.family} family takes no input image")
        default = self.default_inpaint_strength if params.mask is not None else self.default_strength
        strength = params.strength if params.strength is not None else default
        if not 0 <= strength <= 1:
            raise ParamError("strength", f"strength must be between 0 and 1, got {strength}")
        return float(strength)

    def _references(self, params: SamplingParams) -> tuple[bytes, ...] | None:
        if not params.reference_images:
            return None
        if "references" not in self.image_inputs:
            raise ParamError("reference_images", f"the {self.family} family edits one image; it takes no references")
        if params.image is None:
            raise ParamError("reference_images", "reference images follow the image to edit (image)")
        for data in params.reference_images:
            image_size(data, "reference_images")
        return tuple(params.reference_images)

    def _mask(self, params: SamplingParams) -> bytes | None:
        if params.mask is None:
            return None
        if "mask" not in self.image_inputs:
            raise ParamError("mask", f"the {self.family} family edits whole images; it takes no mask")
        if params.image is None:
            raise ParamError("mask", "a mask needs the image it masks (image)")
        image_size(params.mask, "mask")
        return params.mask

    def _size(self, params: SamplingParams) -> tuple[int, int]:
        """The requested size; a side not given is the model's default, or with an input image, the image's aspect
        ratio at the model's default area (so that an edit's cost does not depend on the file's resolution)."""
        caps = self.capabilities
        if params.image is None or params.width is not None or params.height is not None:
            width = params.width if params.width is not None else caps.default_width
            height = params.height if params.height is not None else caps.default_height
            return width, height
        image_width, image_height = image_size(params.image)
        area, ratio, m = caps.default_width * caps.default_height, image_width / image_height, caps.size_multiple
        if caps.sizes:  # a checkpoint that draws some sizes only: the one closest in aspect
            return min(caps.sizes, key=lambda size: abs(math.log(size[0] / size[1] / ratio)))
        width = max(m, min(caps.max_side, round(math.sqrt(area * ratio) / m) * m))
        height = max(m, min(caps.max_side, round(math.sqrt(area / ratio) / m) * m))
        return width, height

    # The pipeline's defaults (StableDiffusion3Pipeline.__call__).
    SKIP_LAYER_DEFAULTS: ClassVar[dict[str, float]] = {
        "skip_layer_guidance_scale": 2.8,
        "skip_layer_guidance_start": 0.01,
        "skip_layer_guidance_stop": 0.2,
    }

    def _skip_layer_guidance(self, params: SamplingParams) -> dict[str, Any]:
        """The resolved skip-layer guidance fields: all set when the request skips layers, else none."""
        layers = params.skip_guidance_layers
        if layers is None:
            return {}
        if "skip-layer" not in self.guidance_styles:
            raise ParamError("skip_guidance_layers", f"the {self.family} family has no skip-layer guidance")
        blocks = self.transformer.config.num_layers
        if max(layers) >= blocks:
            raise ParamError(
                "skip_guidance_layers", f"this model's transformer has blocks 0 to {blocks - 1}, got {max(layers)}"
            )
        resolved: dict[str, Any] = {"skip_guidance_layers": tuple(sorted(set(layers)))}
        for name, default in self.SKIP_LAYER_DEFAULTS.items():
            value = getattr(params, name)
            resolved[name] = float(value if value is not None else default)
        return resolved

    # ---- step caching (models/stepcache.py) ----

    step_cache: str = "none"
    default_cache_threshold: float = 0.0
    # TeaCache's rescaling polynomial when the checkpoint has no calibration of its own (tools/calibrate.py).
    teacache_coefficients: ClassVar[tuple[float, ...]] = stepcache.IDENTITY

    def enable_lora(self, budget_bytes: int) -> LoraRegistry:
        """LoRA per request: adapters of the denoiser, registered by name (models/lora_registry.py)."""
        if not self.lora:
            raise ValueError(f"the {self.family} family does not serve LoRA adapters")
        self.lora_layers = LoraLayers(self.transformer)

        def read(name: str, path: str) -> Lora:
            return read_lora(name, path, type(self.pipe), self.denoiser, self.transformer, self.dtype)

        self.lora_registry = LoraRegistry(read, self.lora_layers, budget_bytes)
        return self.lora_registry

    def _lora_rows(self, selections: Sequence[Any]) -> Any:
        """The LoRA plan of a transformer call over rows with these selections (`RequestState.lora`)."""
        return self.lora_layers.rows(selections) if self.lora_layers is not None else nullcontext()

    def enable_step_cache(self, method: str, threshold: float) -> None:
        """Server-wide: the method, and the threshold of requests that send none. Families implement the forward."""
        if method not in stepcache.METHODS:
            raise ValueError(f"unknown cache method {method!r}; choose from {', '.join(stepcache.METHODS)}")
        if method != "none" and method not in self.cache_methods:
            raise ValueError(f"--cache {method} is not implemented for the {self.family} family yet")
        if method != "none" and self.pipe.scheduler.config.get("stochastic_sampling", False):
            log.warning(
                "--cache %s: the scheduler samples with fresh noise at every step (stochastic_sampling), so the "
                "blocks' input changes too much between steps to reuse their residuals; to sample deterministically, "
                "add --scheduler-config '{\"stochastic_sampling\": false}'",
                method,
            )
        self.step_cache = method
        self.default_cache_threshold = threshold if method != "none" else 0.0
        coefficients = stepcache.load_coefficients(self.source) if os.path.isdir(self.source) else None
        self.cache_method = stepcache.Method(method, coefficients or self.teacache_coefficients)

    attention_backend: str = "sdpa"
    compiled: bool = False
    # The transformer's repeated block classes, where it does not name them itself (`_repeated_blocks`).
    repeated_blocks: ClassVar[tuple[str, ...]] = ()
    offload: str = "none"
    _stages: Any = None  # kernels/offload.StageOffload with `model` offload
    TEXT_ENCODERS: ClassVar[tuple[str, ...]] = ("text_encoder", "text_encoder_2", "text_encoder_3")

    def enable_offload(self, mode: str, device: str) -> None:
        """Keep weights in CPU memory and bring them to `device` as they run (kernels/offload.py); the adapter was
        loaded to CPU memory. `model`: one stage's components at a time; `group`: the transformer streamed layer by
        layer, the rest on the device."""
        from diffusiond.kernels import offload

        if mode == "model":
            self._stages = offload.StageOffload(self.pipe.components, device)
        elif mode == "group":
            for name, module in self.pipe.components.items():
                if isinstance(module, torch.nn.Module) and name != self.denoiser:
                    module.to(device)
            offload.group_offload(self.transformer, device)
        elif mode != "none":
            raise offload.OffloadUnavailable(f"unknown offload {mode!r}")
        self.offload = mode
        self.device = torch.device(device)  # where inputs are made: the execution device, not the weights' home
        self.capabilities = self._capabilities()

    def _stage(self, *names: str) -> None:
        """Before a stage runs (encoding, denoising, decoding): with `model` offload, its components come to the
        device and the others leave it."""
        if self._stages is not None:
            self._stages.stage(names)

    def enable_compile(self) -> int:
        """torch.compile the transformer's repeated blocks (kernels/compile.py); they compile at their first call,
        which the warm-up makes. How many blocks."""
        from diffusiond.kernels.compile import compile_blocks

        count = compile_blocks(self.transformer, self.repeated_blocks)
        self.compiled = True
        return count

    def set_attention(self, choice: str) -> str:
        """Route every attention layer (Ulysses ones included, so call it after the group is set up) to the backend
        `choice` means on this device (kernels/attention.py); the resolved name. Python objects only, no torch work."""
        backend = attention.resolve(choice, self.device)
        attention.apply(self.transformer, backend)
        self.attention_backend = backend
        return backend

    def _cache_threshold(self, params: SamplingParams) -> float:
        if params.cache_threshold is None:
            return self.default_cache_threshold
        if params.cache_threshold > 0 and self.step_cache == "none":
            raise ParamError("cache_threshold", "this server runs without step caching (start it with --cache)")
        return params.cache_threshold

    def batch_key(self, params: SamplingParams) -> Hashable:
        # An edit's image tokens are part of every forward's sequence: edits batch with edits of the same context.
        return (params.width, params.height, self._uses_cfg(params), self.context_size(params))

    def context_size(self, params: SamplingParams) -> Hashable:
        """Instruction-edit families: the size(s) the request's image(s) are conditioned at; None without one."""
        return None

    def _uses_cfg(self, params: SamplingParams) -> bool:
        raise NotImplementedError

    def _lookup_prompts(
        self, params: Sequence[SamplingParams]
    ) -> tuple[list[bool], dict[str, tuple[torch.Tensor, ...]]]:
        """Which requests use CFG, and the encoded prompts (and negative prompts of those) by text, through the
        prompt cache: one encoder call for the texts it misses."""
        cfg = [self._uses_cfg(p) for p in params]
        negatives = [p.negative_prompt or "" for p, c in zip(params, cfg, strict=True) if c]
        texts = [p.prompt for p in params] + negatives
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
        cfg = [self._uses_cfg(p) for p in params]
        texts = [p.prompt for p in params] + [p.negative_prompt or "" for p, c in zip(params, cfg, strict=True) if c]
        self._shared_texts.update(self.prompts.lookup(texts, self._encode_shared))
        return [None] * len(params)

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

    def _shift_mu(self, image_seq_len: int, max_shift: float = 1.15) -> float:
        """The dynamic shift for `image_seq_len` tokens from the scheduler's config, as the pipelines compute it
        (`max_shift`: the pipeline's default when the config has none; SD3's is 1.16)."""
        config = self.pipe.scheduler.config
        return calculate_shift(
            image_seq_len,
            config.get("base_image_seq_len", 256),
            config.get("max_image_seq_len", 4096),
            config.get("base_shift", 0.5),
            config.get("max_shift", max_shift),
        )

    def _packed_latent_size(self, params: SamplingParams) -> tuple[int, int]:
        """Latent height and width of a family that packs 2x2 latent patches: even, as its pipelines'
        `prepare_latents` round them."""
        m = self.vae_scale_factor * 2
        return 2 * (params.height // m), 2 * (params.width // m)

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

    def _noised_image(
        self, p: SamplingParams, sampler: FlowMatchSampler, generator: torch.Generator, dtype
    ) -> tuple[torch.Tensor, Inpaint | None]:
        """Img2img's first latents, VAE-shaped [1, C, h, w], as the Img2Img and Inpaint pipelines' `prepare_latents`
        make them: the image resized by the pipeline's image processor, its latent distribution sampled with the
        request's generator, then the noise drawn from the same generator and mixed in at the starting sigma. With a
        mask, also what pins the unmasked region (VAE-shaped too; the family maps it to its layout)."""
        self._stage("vae")
        image = self.pipe.image_processor.preprocess(open_rgb(p.image), height=p.height, width=p.width)
        latents = self._encode_image(image.to(self.device, dtype), generator)
        noise = randn_tensor(latents.shape, generator=generator, device=self.device, dtype=dtype)
        noised = self._start_latents(p, sampler, latents, noise)
        if p.mask is None:
            return noised, None
        # The Inpaint pipelines' mask: binarized at the output size, then nearest-resized to the latents'.
        mask = self._mask_processor().preprocess(open_mask(p.mask), height=p.height, width=p.width)
        mask = torch.nn.functional.interpolate(mask, size=latents.shape[-2:], mode="nearest")
        mask = mask.view([1] * (latents.dim() - 2) + list(latents.shape[-2:])).expand_as(latents)
        return noised, Inpaint(latents, noise, mask.to(self.device, dtype).contiguous())

    def _start_latents(self, p: SamplingParams, sampler: Any, image_latents: torch.Tensor, noise: torch.Tensor):
        """The image's latents noised to the request's first step (the scheduler's own noising)."""
        return sampler.noise_image(image_latents, noise)

    def _mask_processor(self) -> Any:
        """The Inpaint pipelines' `mask_processor` (the text-to-image pipeline we load has none)."""
        from diffusers.image_processor import VaeImageProcessor

        return VaeImageProcessor(
            vae_scale_factor=self.capabilities.size_multiple,
            do_normalize=False,
            do_binarize=True,
            do_convert_grayscale=True,
        )

    def _encode_image(self, image: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
        """Preprocessed images [B, 3, H, W] in [-1, 1] -> model-space latents [B, C, h, w] (`_decode`'s inverse)."""
        latents = retrieve_latents(self.vae.encode(image.to(self.vae.dtype)), generator=generator)
        return (latents - self.vae.config.shift_factor) * self.vae.config.scaling_factor

    def _generator(self, params: SamplingParams) -> torch.Generator:
        # A CPU generator on every device: the same seed gives the same image on CPU and GPU, as in diffusers when
        # it is handed a CPU generator.
        assert params.seed is not None
        return torch.Generator(device="cpu").manual_seed(params.seed)

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

    def enable_cfg_parallel(self, group: CFGGroup) -> None:
        """The two CFG branches of every request run on the two ranks of `group`; outputs are all-gathered."""
        self.cfg_group = group

    def _forward(
        self, batched: dict[str, torch.Tensor], shared: dict[str, torch.Tensor], rows: int, states: Sequence[Any]
    ) -> torch.Tensor:
        """One transformer call over this rank's rows (`rows` per request of `states`): the family's cached forward
        when step caching is on, else the pipeline's own."""
        if self.step_cache != "none":
            return self._cached_forward(batched, shared, rows, states)
        return self._call(batched, shared)

    def _call(self, batched: dict[str, Any], shared: dict[str, torch.Tensor]) -> torch.Tensor:
        """The pipeline's own transformer call over `batched` rows; [rows, ...]."""
        return self.transformer(**batched, **shared, return_dict=False)[0]

    def _cached_forward(self, batched, shared, rows, states) -> torch.Tensor:
        raise NotImplementedError

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
            with self._lora_rows([s.lora for s in states]):
                out = self._forward(local, shared, 1, states).contiguous()  # [B, ...]
            halves = [torch.empty_like(out) for _ in range(2)]
            with collective("cfg-parallel all_gather"):
                dist.all_gather(halves, out, group=self.cfg_group.group)
            return torch.stack(halves, dim=1)
        if self.cfg_group is not None and n > 1 and self.step_cache == "none":
            # No CFG in this batch: the two ranks split the requests instead of both computing all of them. (Not with
            # step caching: a request's cache lives on the rank that computed it, and the split moves requests.)
            return self._split_requests(n, batched, shared, states).unflatten(0, (n, 1))
        with self._lora_rows([s.lora for s in states for _ in range(rows)]):
            return self._forward(batched, shared, rows, states).unflatten(0, (n, rows))

    def _split_requests(
        self, n: int, batched: dict[str, torch.Tensor], shared: dict[str, torch.Tensor], states: Sequence[Any]
    ) -> torch.Tensor:
        """Rows [0, k) on CFG rank 0 and [k, n) on rank 1 (k = ceil(n / 2)), all-gathered; returns [n, ...]."""
        assert self.cfg_group is not None
        k = (n + 1) // 2
        lo, hi = (0, k) if self.cfg_group.rank == 0 else (k, n)
        local = {name: t[lo:hi] for name, t in batched.items()}
        with self._lora_rows([s.lora for s in states[lo:hi]]):
            out = self._call(local, shared).contiguous()  # [hi - lo, ...]
        if out.shape[0] < k:  # odd n: rank 1 pads its half to k rows for the gather
            out = torch.cat([out, out.new_zeros((k - out.shape[0], *out.shape[1:]))])
        halves = [torch.empty_like(out) for _ in range(2)]
        with collective("cfg-parallel all_gather"):
            dist.all_gather(halves, out, group=self.cfg_group.group)
        return torch.cat([halves[0], halves[1][: n - k]])

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
        return self._decode(self._unpack(torch.cat([s.latents for s in states]), states[0].params))

    def _decode(self, latents: torch.Tensor) -> torch.Tensor:
        """Model-space VAE-shaped latents [B, C, h, w] -> the VAE's output [B, 3, H, W] in [-1, 1]."""
        latents = latents / self.vae.config.scaling_factor + self.vae.config.shift_factor
        return self.vae.decode(latents.to(self.vae.dtype), return_dict=False)[0]

    @torch.inference_mode()
    def preview_vae(self, x0: torch.Tensor) -> list[np.ndarray]:
        """Predicted clean latents [B, C, h, w] (`predicted_x0`, one size) decoded by the VAE: uint8 [H, W, 3] each."""
        self._stage("vae")
        images = self._decode(x0)
        return [(image * 255).round().astype(np.uint8) for image in self.postprocess(images)]

    def postprocess(self, images: torch.Tensor) -> list[np.ndarray]:
        return list(self.pipe.image_processor.postprocess(images, output_type="np"))  # [H, W, 3] float32 in [0, 1]

    def preview(self, x0: torch.Tensor) -> np.ndarray:
        return self.latent_rgb.to_uint8(x0)

    def _load_preview_map(self, source: str) -> preview_maps.LatentRGB:
        """A map written beside the checkpoint (fitted for our own models) wins over published factors; a
        checkpoint with neither gets one fitted against its VAE now."""
        if os.path.isdir(source):
            fitted = preview_maps.load_preview_factors(source)
            if fitted is not None:
                return fitted
        published = preview_maps.published(self.vae_family or self.family)
        channels = self._latent_channels()
        if published is not None and len(published.factors) == channels:
            return published
        return preview_maps.fit_decoder(self._decode, channels, self.vae_scale_factor)

    def _latent_channels(self) -> int:
        return self.vae.config.latent_channels
