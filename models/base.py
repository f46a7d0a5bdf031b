"""The adapter contract: everything the engine may ask of a model family, and nothing it may assume beyond it.

Core code never tests model names; it asks the adapter for its capabilities, batch key and the five step verbs.
Tensors stay inside `RequestState`s, which only the adapter reads or writes.
"""

from __future__ import annotations

import abc
import dataclasses
from collections.abc import Generator, Hashable, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar

import numpy as np
import torch

from diffusiond.models.families.specs import Family
from diffusiond.models.params import SamplingParams


class UnsupportedLayout(ValueError):
    """A checkpoint of a served pipeline class whose configuration its family's adapter does not read (the message
    says what): it is served on the generic path instead (models/flowmatch/adapter.py `from_pretrained`)."""


@dataclass(frozen=True)
class Capabilities:
    family: str
    pipeline_class: str
    default_width: int
    default_height: int
    default_steps: int
    default_guidance: float
    # Width and height must be multiples of this (VAE downsampling times patch size).
    size_multiple: int
    max_side: int
    supports_negative_prompt: bool
    dtype: str
    device: str
    # What the checkpoint declares it serves well (models/declared.py); None: the limits above.
    sizes: tuple[tuple[int, int], ...] | None = None
    steps: tuple[int, int] | None = None
    guidance: tuple[float, float] | None = None
    # Words it knows (unknown ones are reported to the client); None: open vocabulary.
    vocabulary: frozenset[str] | None = None
    draws: str | None = None
    name: str | None = None
    # What the family declares (ModelAdapter's class declarations), as served at `/v1/models`.
    guidance_styles: tuple[str, ...] = ()
    parallel: tuple[str, ...] = ()
    ulysses_degrees: tuple[int, ...] = ()
    cache_methods: tuple[str, ...] = ()
    image_inputs: tuple[str, ...] = ()
    # "image", or "video": then requests are clips of `num_frames` frames (1 + frame_step * k, at most max_frames),
    # decoded to float32 [F, H, W, 3] and played at `fps`; or "audio" (the generic path): a waveform [channels,
    # samples] at `audio_sample_rate`.
    modality: str = "image"
    # LoRA per request (`lora` in requests; adapters at /v1/loras).
    lora: bool = False
    default_num_frames: int | None = None
    max_num_frames: int | None = None
    frame_step: int | None = None
    default_fps: int | None = None
    # Video with sound: the waveform's samples per second (`ModelAdapter.decode_audio`); None: silent clips.
    audio_sample_rate: int | None = None
    # "dedicated" (a family of models/families/), or "generic" (the pipeline's own call, models/generic/): then
    # `fields` lists what a request may add to the call (`arguments`, `images`).
    mode: str = "dedicated"
    fields: tuple[str, ...] = ()
    # A dedicated family's own call switches a request may set by name in `arguments` (LongCat-Image's prompt rewrite).
    call_arguments: tuple[str, ...] = ()
    # Its images have an alpha channel (its VAE decodes RGBA: Qwen-Image 2.1): OpenAI's `background` keeps it.
    alpha: bool = False
    # Its answer to a request is several images, one per layer ([layers, H, W, C]: Qwen-Image-Layered).
    layers: bool = False

    def public(self) -> dict:
        """What `/v1/models` and the playground show (not the vocabulary's every word: its size)."""
        return {
            "family": self.family,
            "pipeline": self.pipeline_class,
            "default_size": f"{self.default_width}x{self.default_height}",
            "default_steps": self.default_steps,
            "default_guidance_scale": self.default_guidance,
            "sizes": [f"{w}x{h}" for w, h in self.sizes] if self.sizes else None,
            "size_multiple": self.size_multiple,
            "max_side": self.max_side,
            "steps": list(self.steps) if self.steps else None,
            "guidance_scale": list(self.guidance) if self.guidance else None,
            "negative_prompt": self.supports_negative_prompt,
            "vocabulary": sorted(self.vocabulary) if self.vocabulary is not None else None,
            "draws": self.draws,
            "guidance_styles": list(self.guidance_styles),
            "parallel": list(self.parallel),
            "ulysses_degrees": list(self.ulysses_degrees),
            "cache_methods": list(self.cache_methods),
            "image_inputs": list(self.image_inputs),
            "modality": self.modality,
            "lora": self.lora,
            "mode": self.mode,
            "alpha": self.alpha,
            "layers": self.layers,
            **({"fields": list(self.fields)} if self.mode == "generic" else {}),
            **({"arguments": list(self.call_arguments)} if self.call_arguments else {}),
            **(
                {
                    "default_num_frames": self.default_num_frames,
                    "max_num_frames": self.max_num_frames,
                    "frame_step": self.frame_step,
                    "default_fps": self.default_fps,
                    "audio_sample_rate": self.audio_sample_rate,
                }
                if self.modality == "video"
                else {}
            ),
            **({"audio_sample_rate": self.audio_sample_rate} if self.modality == "audio" else {}),
        }


@dataclass(eq=False)
class RequestState:
    """One request's tensors and sampler position on one rank. Owned by the adapter; the engine only reads the
    bookkeeping fields."""

    request_id: str
    params: SamplingParams
    # Model-space latents as the transformer sees them (packed for FLUX), batch dim 1.
    latents: torch.Tensor
    sampler: Any
    step_index: int = 0
    # Family-specific conditioning (prompt embeddings, ids, ...).
    cond: dict[str, torch.Tensor] = field(default_factory=dict)
    # Conditioning of varying length that the family's transformer takes as a list (one tensor per row).
    rows: list[torch.Tensor] = field(default_factory=list)
    # Conditioning that is identical across a batch (same batch key) and passed once, not concatenated.
    shared: dict[str, Any] = field(default_factory=dict)
    # Step cache state of this request (models/stepcache/methods.py), freed with it.
    cache: Any = None
    # Inpainting: what pins the region outside the mask after each step (models/flowmatch/images.Inpaint).
    inpaint: Any = None
    # Its LoRA adapters and scales, resident while it lives (kernels/lora_rows.Selection; () for none).
    lora: tuple = ()
    # Step caches of its other rows, where its rows run in several calls of a step (LTX-2's passes: by pass and prompt).
    row_caches: dict = field(default_factory=dict)
    # Step cache reuses of histories it left (`models/stepcache/core.py restart`: a two-expert checkpoint's switch).
    reused_before: int = 0
    # Its steps where they are not its parameters' (`steps_to_run`): a generic call's, once its pipeline set its
    # timesteps (models/generic/); the executor reports them to the scheduler.
    steps: int | None = None

    @property
    def cache_reuses(self) -> int:
        """Steps whose blocks it skipped so far (counted by models/stepcache/methods.py)."""
        return self.reused_before + (self.cache.reused if self.cache is not None else 0)

    @property
    def total_steps(self) -> int:
        return self.steps if self.steps is not None else self.params.steps_to_run

    @property
    def finished(self) -> bool:
        return self.step_index >= self.total_steps


class ModelAdapter(abc.ABC):
    """A family's adapter. What it supports is its `spec` (models/families/specs.py, readable without torch: start-up
    validation, README's table), copied onto the class as attributes (`parallel`, `lora`, ...); `capabilities`
    narrows them to the loaded checkpoint."""

    spec: ClassVar[Family]
    pipeline_class: ClassVar[str]
    family: ClassVar[str]
    guidance_styles: ClassVar[tuple[str, ...]]
    parallel: ClassVar[tuple[str, ...]]
    cache_methods: ClassVar[tuple[str, ...]]
    cache_with_ulysses: ClassVar[bool]
    cache_with_cfg_parallel: ClassVar[bool]
    image_inputs: ClassVar[tuple[str, ...]]
    modality: ClassVar[str]
    layers: ClassVar[bool]
    lora: ClassVar[bool]
    needs: ClassVar[tuple[str, ...]]
    capabilities: Capabilities
    # The folder or hub id it was loaded from.
    source: str
    # Registered LoRA adapters (models/lora/registry.LoraRegistry), once enabled.
    lora_registry: Any = None
    # (choice, layers converted) when models/loading/loader.py quantized the transformer (kernels/quantize.py).
    quantized: tuple[str, int] | None = None
    # The strip group (kernels/patch_vae.StripGroup) once patch-parallel decoding is enabled: the executor then has
    # images that finish with fewer others than there are ranks decoded by `decode_strips`.
    vae_strips: Any = None
    # (bytes of the denoiser's parameters on this rank, before) once tensor parallel or sharded.
    weight_bytes: tuple[int, int] | None = None
    # Denoiser tensors mapped from what the group's previous attempt kept (models/loading/kept_weights.py), not read.
    kept_restored: int = 0
    # Whether `decode_in_pieces` yields between pieces (stages of a clip's frames): the executor then decodes each
    # finished request in pieces between steps; else finished requests decode together, whole, when they finish.
    decodes_in_pieces: ClassVar[bool] = False
    # Whether requests admitted together may share one computation from their first step to their last (the generic
    # path's calls): the scheduler then advances, pauses and resumes them together (engine/scheduler.py).
    shares_calls: ClassVar[bool] = False

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        spec = cls.__dict__.get("spec")
        if spec is not None:  # a family's class (the shared bases declare none)
            for field in dataclasses.fields(spec):
                if field.name != "adapter":  # where the class is, not what it supports
                    setattr(cls, field.name, getattr(spec, field.name))

    @classmethod
    @abc.abstractmethod
    def from_pretrained(
        cls, path: str, *, device: str = "cpu", dtype: torch.dtype = torch.float32, lazy_denoiser: bool = False
    ) -> ModelAdapter:
        """Load from a local diffusers folder or a hub id, through the components' own `from_pretrained`;
        `lazy_denoiser`: the denoiser built empty, its weights read as a parallel layout shards them."""

    @abc.abstractmethod
    def resolve(self, params: SamplingParams) -> SamplingParams:
        """Fill defaults and validate; raises ParamError naming the field. The result is what every rank runs."""

    @abc.abstractmethod
    def batch_key(self, params: SamplingParams) -> Hashable:
        """What must match for two requests to share one forward."""

    def encode_prompts(self, params: Sequence[SamplingParams]) -> list[None]:
        """In a group, before `prepare`, on every rank together (collectives inside): what the ranks compute once
        and share. One None per request. Families without shared work do nothing."""
        return [None] * len(params)

    def prepared(self) -> None:  # noqa: B027 - optional hook, a no-op unless the family shares work
        """After `prepare`: what `encode_prompts` kept for it may go."""

    @abc.abstractmethod
    def prepare(self, requests: Sequence[tuple[str, SamplingParams]]) -> list[RequestState]:
        """Encode prompts, draw initial latents from each request's seed, and set each request's own timesteps."""

    @abc.abstractmethod
    def denoise(self, states: Sequence[RequestState]) -> torch.Tensor:
        """One batched transformer call; returns the guided model output for each state, stacked in order."""

    @abc.abstractmethod
    def step(self, states: Sequence[RequestState], model_output: torch.Tensor) -> None:
        """Advance each state by its own sampler; updates `latents` and `step_index`."""

    @abc.abstractmethod
    def predicted_x0(self, state: RequestState, model_output: torch.Tensor) -> torch.Tensor:
        """The clean latent predicted from the state's current latents and its model output ([C, h, w])."""

    @abc.abstractmethod
    def decode_latents(self, states: Sequence[RequestState]) -> torch.Tensor:
        """The VAE's output for finished states of one batch key, [B, 3, H, W] on the model's device. Ranks may
        decode shares of the finished requests and gather these tensors (`postprocess` runs on rank 0 only)."""

    def preview_vae(self, x0: torch.Tensor) -> list[np.ndarray]:
        """Predicted clean latents [B, C, h, w] decoded by the model's own decoder: full-size uint8 [H, W, 3]
        previews ("vae" previews). Families without one keep the fast previews."""
        return [self.preview(x) for x in x0]

    @abc.abstractmethod
    def postprocess(self, images: torch.Tensor) -> list[np.ndarray]:
        """`decode_latents` output -> float32 [H, W, 3] in [0, 1], as diffusers' `output_type="np"` gives them."""

    def decode(self, states: Sequence[RequestState]) -> list[np.ndarray]:
        """Final images of `states` (one batch key)."""
        return self.outputs_of(states, self.decode_latents(states))

    def outputs_of(self, states: Sequence[RequestState], decoded: torch.Tensor) -> list[np.ndarray]:
        """`decode_latents`' output for `states` (in order) as their results: `postprocess`, unless a family's results
        read their requests (Stable Audio's sound, cut to each request's seconds)."""
        return self.postprocess(decoded)

    def decode_in_pieces(self, states: Sequence[RequestState]) -> Generator[None, None, list[np.ndarray]]:
        """`decode` as a generator that yields between pieces of its work, so that the executor can run a few
        pieces a step and a long clip's decode does not hold up a step of a higher class (engine/executor.py).
        Default: one piece."""
        yield from ()
        return self.decode(states)

    def decode_audio(self, states: Sequence[RequestState]) -> list[np.ndarray]:
        """Video with sound (`capabilities.audio_sample_rate`): the waveform of each finished state, float32
        [channels, samples] in [-1, 1], as its pipeline returns it. Rank 0 only."""
        raise NotImplementedError(f"the {self.family} family makes no sound")

    @abc.abstractmethod
    def preview(self, x0: torch.Tensor) -> np.ndarray | None:
        """A small uint8 RGB image [h, w, 3] of a predicted clean latent; None where there is none to make (a
        generic pipeline's latents that are no image grid): progress still goes out."""

    # ---- optional hooks of the step (defaults: nothing to share, nothing cached) ----

    def forget(self, request_ids: Sequence[str]) -> None:  # noqa: B027 - optional hook
        """States were freed: drop whatever the adapter keeps for them (batched conditioning)."""

    def decode_strips(self, states: Sequence[RequestState]) -> list[np.ndarray]:
        """`decode`, every rank of `vae_strips` decoding its strip of each image (all of them call it together)."""
        raise NotImplementedError(f"the {self.family} family does not decode in strips")

    def attention_heads(self) -> int | None:
        """The denoiser's attention heads (what Ulysses and tensor parallel degrees must divide); None if it has
        no such count."""
        return None

    # ---- how the model runs: models/loading/setup.py `build_adapter` calls these, after loading and in this order ----
    # Each default refuses: the family does not have it (start-up validation refused the setting before).

    def enable_lora(self, budget_bytes: int) -> Any:
        """LoRA per request: a registry of adapters of the denoiser (models/lora/registry.LoraRegistry)."""
        raise ValueError(f"the {self.family} family does not serve LoRA adapters")

    def denoisers(self) -> dict[str, Any]:
        """Every denoiser this checkpoint has, by pipeline component name."""
        raise NotImplementedError

    def use_kept(self, kept: dict[str, Any], now: bool) -> int:
        """A heal: the denoisers' parameters from what the group's previous attempt kept
        (models/loading/kept_weights.py)."""
        raise NotImplementedError

    def enable_tp(self, mesh: Any) -> None:
        """Shard the denoiser's block linears over the tensor-parallel `mesh`."""
        raise ValueError(f"the {self.family} family does not support tensor parallelism")

    def enable_shard_weights(self, mesh: Any) -> None:
        """FSDP2: the denoiser's weights sharded over `mesh`, gathered block by block."""
        raise ValueError(f"the {self.family} family does not support sharded weights")

    def enable_vae_parallel(self, group: Any) -> None:
        """Decode one image in strips across `group` (sets `vae_strips`)."""
        raise ValueError(f"the {self.family} family's VAE does not decode in strips")

    def enable_encode_once(self, shared: Any) -> None:  # noqa: B027 - optional hook
        """In a group: prompts encoded once on rank 0 and shared (kernels/collectives.SharedEncoding), through
        `encode_prompts`. Default: every rank encodes its own."""

    def enable_cfg_parallel(self, group: Any) -> None:
        """The two CFG rows of every request on the two ranks of `group` (kernels/parallel.CFGGroup)."""
        raise ValueError(f"the {self.family} family does not support CFG-parallel")

    def enable_ulysses(self, group: Any) -> None:
        """Sequence-parallel attention over `group` (kernels/ulysses.UlyssesGroup)."""
        raise ValueError(f"the {self.family} family does not support Ulysses sequence parallelism")

    def enable_step_cache(self, method: str, threshold: float, config: dict[str, Any] | None = None) -> None:
        """Step caching (models/stepcache/methods.py) with `threshold` for requests that send none and `config` (the
        method's settings, `--cache-config`); "none": off."""
        if method != "none":
            raise ValueError(f"--cache {method} is not implemented for the {self.family} family yet")

    def set_attention(self, choice: str) -> str:
        """Route attention to the backend `choice` means on this device (kernels/attention.py); the backend."""
        return "sdpa"

    def enable_compile(self) -> int:
        """torch.compile the denoiser's repeated blocks; how many."""
        raise ValueError(f"--compile: the {self.family} family has no compiled blocks")


def decodes_alpha(vae: Any) -> bool:
    """Whether a VAE decodes RGBA: its config's `out_channels` is 4 (Qwen-Image 2.1's), or where it has none, its
    `input_channels` (Qwen-Image's VAE decodes as many channels as it reads: Qwen-Image-Layered's, 4)."""
    config = getattr(vae, "config", None)
    return getattr(config, "out_channels", getattr(config, "input_channels", 3)) == 4
