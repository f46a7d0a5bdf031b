"""What every flow-matching family shares, the step itself: loading through the diffusers pipeline class, the
capabilities, per-request samplers and first latents, the batched transformer call, the batched Euler step,
inpainting's blend, x0 prediction, decoding and previews; and how the model runs (LoRA rows, step cache, offload,
compile, attention). Request resolution is models/flowmatch/requests.py's part of the class, running on several ranks
models/flowmatch/ranks.py's. Families override what their pipelines do differently (SDXL: a UNet and its
scheduler's own step).

The pipeline object is only a holder for the components and their helpers (`encode_prompt`, `prepare_latents`);
its `__call__` never runs while serving.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence
from contextlib import nullcontext
from pathlib import Path
from typing import Any, ClassVar

import diffusers
import numpy as np
import torch
from diffusers.pipelines.flux.pipeline_flux import calculate_shift
from diffusers.pipelines.flux.pipeline_flux_img2img import retrieve_latents
from diffusers.utils.torch_utils import randn_tensor

from diffusiond.kernels import attention
from diffusiond.kernels.lora_rows import Lora, LoraLayers
from diffusiond.kernels.parallel import CFGGroup
from diffusiond.models import preview as preview_maps
from diffusiond.models.base import Capabilities, ModelAdapter, RequestState
from diffusiond.models.declared import read_declared
from diffusiond.models.flowmatch.prompts import PROMPT_CACHE_BYTES, PromptCache
from diffusiond.models.flowmatch.ranks import ParallelWiring
from diffusiond.models.flowmatch.requests import RequestResolution
from diffusiond.models.flowmatch.sampler import FlowMatchSampler, step_batch
from diffusiond.models.inputs import open_mask, open_rgb
from diffusiond.models.loading.lazy_weights import LazyWeights, empty_model
from diffusiond.models.loading.registry import attention_heads, read_model_index
from diffusiond.models.lora.registry import LoraRegistry, file_limit, read_lora
from diffusiond.models.params import SamplingParams
from diffusiond.models.stepcache import methods as stepcache

log = logging.getLogger(__name__)
# Output pixels (x frames) one VAE call decodes at most: 4 images of 1024 x 1024, 16 of 512 x 512; a larger image or
# clip is decoded alone.
DECODE_PIXELS = 4 << 20
# On the CPU, the bytes of a VAE call's widest full-size activation (images x pixels x channels): under glibc's
# largest arena allocation (kernels/host.py `keep_freed_memory`), so that its buffers are reused, not mapped and
# faulted in again at each call. Measured here (tiny SD3, 256x256: 4 MB an image, 8 finishing together, on a
# thread of their own with freed memory kept): 8 in one call 89-98 ms with 11,000-18,000 faults, 4 a call 67-69 ms
# and none, 2 68-70 ms, 1 89-92 ms.
CPU_DECODE_BYTES = 16 << 20


def channels_last_vae(vae: torch.nn.Module) -> None:
    """On the CPU, a 2-D VAE's convolution weights in channels-last layout (its activations follow them): oneDNN
    then splits one image's convolutions over the threads as well as a batch's. Measured here (2 threads, one image
    a call): an SD3-sized VAE (128-512 channels) decoding 256x256 2.11 -> 1.72 s and 512x512 10.2-10.5 -> 7.7-8.0 s,
    tiny SD3 at 256x256 15-20 -> 11-13 ms, the bundled model 4.7-5.3 -> 3.6 ms; two or more images a call: the same
    (0.97-1.03x), but the bundled model's 8 in 0.67-0.74x. Results differ by float rounding (2e-5 of [-1, 1]). 3-D
    (video) VAEs are left as they are, and GPUs too: neither was measured."""
    if all(p.dim() != 5 for p in vae.parameters()):
        vae.to(memory_format=torch.channels_last)


def null_components(source: str) -> dict[str, None]:
    """Components the checkpoint saved as None (`[null, null]` in model_index.json, e.g. SD3 without T5), to pass
    as None again: diffusers drops them on load and then insists on every required component being there."""
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


class FlowMatchAdapter(RequestResolution, ParallelWiring, ModelAdapter):
    family: ClassVar[str]

    # Whose VAE the family uses, for published preview factors (models/preview.py); None: its own.
    vae_family: ClassVar[str | None] = None

    default_steps: ClassVar[int] = 28

    default_guidance: ClassVar[float]

    # `true_cfg_scale` when a request sends none (families with true CFG beside a guidance embedding).
    default_true_cfg: ClassVar[float] = 1.0

    # The pipeline component that denoises.
    denoiser: ClassVar[str] = "transformer"
    # Further denoisers a checkpoint may have (Wan 2.2 A14B's `transformer_2`), built empty like the first when a
    # layout shards them.
    extra_denoisers: ClassVar[tuple[str, ...]] = ()

    def __init__(self, pipe: Any, *, source: str, lazy: LazyWeights | None = None) -> None:
        self.pipe = pipe
        self.source = source
        self.transformer = getattr(pipe, self.denoiser)  # named so whatever it is (a UNet for UNet families)
        # Every denoiser of the checkpoint (Wan 2.2 A14B has two experts): what quantization and attention change.
        self.experts: tuple[Any, ...] = (self.transformer,)
        self.vae = pipe.vae
        # A denoiser built empty (`lazy`), its weights read a part at a time as the parallel layout shards them.
        self.lazy_weights = lazy
        # The further denoisers built empty, by component name (set by `from_pretrained`).
        self.lazy_extra: dict[str, LazyWeights] = {}
        self.device = lazy.device if lazy is not None else self.transformer.device
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
    def from_pretrained(
        cls, path: str, *, device: str = "cpu", dtype: torch.dtype = torch.float32, lazy_denoiser: bool = False
    ) -> FlowMatchAdapter:
        """`lazy_denoiser`: the denoiser built empty, for a layout that shards it (models/loading/lazy_weights.py)."""
        pipeline_cls = getattr(diffusers, cls.pipeline_class)
        components: dict[str, Any] = null_components(path)
        lazies: dict[str, LazyWeights] = {}
        if lazy_denoiser:
            root = Path(path if os.path.isdir(path) else pipeline_cls.download(path))
            index = read_model_index(str(root))
            for name in (cls.denoiser, *cls.extra_denoisers):
                entry = index.get(name)
                if not isinstance(entry, list) or entry[1] is None:  # a checkpoint without it (Wan 2.1)
                    continue
                components[name] = empty_model(getattr(diffusers, entry[1]), root / name, dtype)
                lazies[name] = LazyWeights(components[name], root / name, torch.device(device))
            path = str(root)
        pipe = pipeline_cls.from_pretrained(path, dtype=dtype, **components)
        for name, module in pipe.components.items():
            if isinstance(module, torch.nn.Module):
                if name not in lazies:
                    module.to(device)
                module.eval().requires_grad_(False)
        if torch.device(device).type == "cpu":
            channels_last_vae(pipe.vae)
        pipe.set_progress_bar_config(disable=True)
        adapter = cls(pipe, source=path, lazy=lazies.pop(cls.denoiser, None))
        adapter.lazy_extra = lazies
        return adapter

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
        overrides = self.declared = read_declared(self.source)
        styles = self._guidance_styles()
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
        )

    def _guidance_styles(self) -> tuple[str, ...]:
        """This checkpoint's: a family with a guidance embedding may have checkpoints without one."""
        if "distilled" in self.guidance_styles and not getattr(self.transformer.config, "guidance_embeds", False):
            return tuple(s for s in self.guidance_styles if s != "distilled")
        return self.guidance_styles

    step_cache: str = "none"

    default_cache_threshold: float = 0.0
    # --cache-config's "scm": the steps that compute for requests that send no cache_steps (None: no mask).
    default_cache_steps: Any = None

    # TeaCache's rescaling polynomial when the checkpoint has no calibration of its own (tools/calibrate.py).
    teacache_coefficients: ClassVar[tuple[float, ...]] = stepcache.IDENTITY

    def magcache_ratios(self) -> tuple[float, ...] | None:
        """MagCache's magnitude ratios when the checkpoint has no calibration of its own (None: none known)."""
        return None

    def enable_lora(self, budget_bytes: int) -> LoraRegistry:
        """LoRA per request: adapters of the denoiser, registered by name (models/lora/registry.py)."""
        if not self.lora:
            raise ValueError(f"the {self.family} family does not serve LoRA adapters")
        self.lora_layers = LoraLayers(self.transformer)

        max_bytes = file_limit(budget_bytes)  # every read, registration or reload, checks the size first

        def read(name: str, path: str) -> Lora:
            return read_lora(name, path, type(self.pipe), self.denoiser, self.transformer, self.dtype, max_bytes)

        self.lora_registry = LoraRegistry(read, self.lora_layers, budget_bytes)
        return self.lora_registry

    def _lora_of(self, state: RequestState) -> Any:
        """The adapters that apply to `state`'s rows in the call running now (`RequestState.lora`)."""
        return state.lora

    def _lora_rows(self, selections: Sequence[Any]) -> Any:
        """The LoRA plan of a transformer call over rows with these selections (`RequestState.lora`)."""
        return self.lora_layers.rows(selections) if self.lora_layers is not None else nullcontext()

    def enable_step_cache(self, method: str, threshold: float, config: dict[str, Any] | None = None) -> None:
        """Server-wide: the method, the threshold of requests that send none and `--cache-config`'s settings
        (stepcache.SETTINGS). Families implement the forward."""
        if method not in stepcache.METHODS:
            raise ValueError(f"unknown cache method {method!r}; choose from {', '.join(stepcache.METHODS)}")
        if method != "none" and method not in self.cache_methods:
            raise ValueError(f"--cache {method} is not implemented for the {self.family} family yet")
        stochastic = self.pipe.scheduler.config.get("stochastic_sampling", False)
        if method not in ("none", "x0cache") and stochastic:  # x0cache reads what stays smooth under the noise
            log.warning(
                "--cache %s: the scheduler samples with fresh noise at every step (stochastic_sampling), so the "
                "blocks' input changes too much between steps to reuse their residuals; to sample deterministically, "
                "add --scheduler-config '{\"stochastic_sampling\": false}'",
                method,
            )
        t = self.transformer
        blocks = len(getattr(t, "transformer_blocks", ())) + len(getattr(t, "single_transformer_blocks", ()))
        blocks = blocks or len(getattr(t, "blocks", ()))  # Wan's
        coefficients, ratios = stepcache.load_calibration(self.source) if os.path.isdir(self.source) else (None, None)
        coefficients = coefficients or self.teacache_coefficients
        self.cache_method = stepcache.method_of(
            method, config or {}, blocks, coefficients, ratios or self.magcache_ratios()
        )
        self.step_cache = method
        self.default_cache_threshold = threshold if method != "none" else 0.0
        self.default_cache_steps = (config or {}).get("scm")

    attention_backend: str = "sdpa"

    compiled: bool = False

    # The transformer's repeated block classes, where it does not name them itself (`_repeated_blocks`).
    repeated_blocks: ClassVar[tuple[str, ...]] = ()

    offload: str = "none"

    _stages: Any = None  # kernels/offload.StageOffload with `model` offload

    TEXT_ENCODERS: ClassVar[tuple[str, ...]] = ("text_encoder", "text_encoder_2", "text_encoder_3")

    def enable_offload(self, mode: str, device: str) -> None:
        """Keep weights in CPU memory and bring them to `device` as they run (kernels/offload.py); the adapter was
        loaded to CPU memory. `model`: one stage's components at a time (a two-expert checkpoint: the expert a step
        runs); `group`: the transformer (every expert) streamed layer by layer, the rest on the device."""
        from diffusiond.kernels import offload

        if mode == "model":
            self._stages = offload.StageOffload(self.pipe.components, device)
        elif mode == "group":
            experts = {id(expert) for expert in self.experts}
            for module in self.pipe.components.values():
                if isinstance(module, torch.nn.Module) and id(module) not in experts:
                    module.to(device)
            for expert in self.experts:  # never moved whole: each streamed layer by layer
                offload.group_offload(expert, device)
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

        count = sum(compile_blocks(expert, self.repeated_blocks) for expert in self.experts)
        self.compiled = True
        return count

    def set_attention(self, choice: str) -> str:
        """Route every attention layer (Ulysses ones included, so call it after the group is set up) to the backend
        `choice` means on this device (kernels/attention.py); the resolved name. Python objects only, no torch work."""
        backend = attention.resolve(choice, self.device, self.dtype)
        routed = sum(attention.apply(expert, backend, masked=self.spec.attention_masks) for expert in self.experts)
        if not routed and backend != "sdpa":
            # No layer dispatches its attention (SDXL's UNet calls SDPA itself).
            if choice != "auto":
                from diffusiond.models.loading.setup import SetupError

                raise SetupError(f"--attention {choice}: the {self.family} family's attention runs SDPA only")
            backend = "sdpa"
        self.attention_backend = backend
        return backend

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
        latents = self._unpack(torch.cat([s.latents for s in states]), p)
        return self._decode_within(latents, p.width * p.height * (p.num_frames or 1))

    def _decode_within(self, latents: torch.Tensor, pixels_each: int) -> torch.Tensor:
        """`_decode` of a batch, in calls of at most DECODE_PIXELS output pixels (x frames) each, one image or clip
        at least: a VAE's activations grow with what it decodes at once (8 images of 2048 x 2048 in one call ran a
        GPU out of memory, which inside a group is a fault of the group)."""
        per_call = max(1, DECODE_PIXELS // max(1, pixels_each))
        if latents.device.type == "cpu":
            per_call = min(per_call, self._cpu_decode_calls(pixels_each))
        if latents.shape[0] <= per_call:
            return self._decode(latents)
        return torch.cat([self._decode(latents[i : i + per_call]) for i in range(0, latents.shape[0], per_call)])

    def _cpu_decode_calls(self, pixels_each: int) -> int:
        """Images (or clips) a VAE call decodes at most on the CPU: CPU_DECODE_BYTES of its decoder's widest
        full-size activation (the last up block's channels or the ones upsampled into it); one where the VAE's
        config does not say."""
        config = self.vae.config
        widths = config.get("decoder_block_out_channels") or config.get("block_out_channels")
        if widths:
            widest = max(widths[:2])
        elif config.get("base_dim"):  # Wan's and Qwen-Image's VAEs
            widest = (config.get("decoder_base_dim") or config["base_dim"]) * max(config.get("dim_mult", [1])[:2])
        else:
            return 1
        return max(1, CPU_DECODE_BYTES // (pixels_each * widest * self.vae.dtype.itemsize))

    def _decode(self, latents: torch.Tensor) -> torch.Tensor:
        """Model-space VAE-shaped latents [B, C, h, w] -> the VAE's output [B, 3, H, W] in [-1, 1]."""
        latents = latents / self.vae.config.scaling_factor + self.vae.config.shift_factor
        return self.vae.decode(latents.to(self.vae.dtype), return_dict=False)[0]

    @torch.inference_mode()
    def preview_vae(self, x0: torch.Tensor) -> list[np.ndarray]:
        """Predicted clean latents [B, C, h, w] (`predicted_x0`, one size) decoded by the VAE: uint8 [H, W, 3] each."""
        self._stage("vae")
        images = self._decode_within(x0, x0.shape[-2] * x0.shape[-1] * self.vae_scale_factor**2)
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
        # Latents where the family's decode takes them: the transformer's device and dtype (the VAE may be on a GPU).
        return preview_maps.fit_decoder(
            self._decode_rgb, channels, self.vae_scale_factor, device=self.device, dtype=self.dtype
        )

    def _decode_rgb(self, latents: torch.Tensor) -> torch.Tensor:
        """`_decode`'s colour channels [B, 3, H, W] (Qwen-Image 2.1's VAE decodes RGBA): what preview maps fit."""
        return self._decode(latents)[:, :3]

    def attention_heads(self) -> int | None:
        return attention_heads(self.transformer.config)

    def _latent_channels(self) -> int:
        return self.vae.config.latent_channels
