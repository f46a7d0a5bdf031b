"""One model setup: what to load and how (family, dtype, device, attention, compile, quantization, offload, step
cache, parallel layout, LoRA), resolved once into a frozen `ModelSetup` (daemon/startup.py `model_setup` from the
serving configuration; `generate` and the tools from their flags), checked once, and built by one function.

- `check_setup`: every rule about which settings go together and what the family can do, with the messages users
  see at start, from the family's declarations (models/families/specs.py) and the checkpoint's files; no torch.
- `check_kernels`: what only torch can tell (a backend, quantization or offload this device cannot run).
- `build_adapter`: on every rank's step thread (the thread that owns torch), the adapter loaded, checked again
  against what loaded (a hub id's family, the heads), and wired: LoRA, the parallel layout, step cache, attention,
  compile.
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

import msgspec

from diffusiond.kernels.layout import ParallelLayout
from diffusiond.models.families.specs import FAMILIES, GENERIC, KNOWN_CHECKPOINTS, Family
from diffusiond.models.loading.registry import attention_heads, family_of_checkpoint
from diffusiond.models.lora.files import LoraError, check_safetensors, startup_specs
from diffusiond.models.stepcache.settings import default_cache_threshold

if TYPE_CHECKING:
    from diffusiond.models.base import ModelAdapter

log = logging.getLogger(__name__)

DEFAULT_LORA_BUDGET = 2 << 30
# Attention kernels for fp16/bf16 tensors only (kernels/attention.py `_HALF_ONLY`; a test keeps them equal).
HALF_ONLY_ATTENTION = ("flash", "flash3", "sage")


class SetupError(ValueError):
    """Settings that cannot be served together, or that the model's family cannot serve; the message says why and
    names the flags."""


class ModelSetup(msgspec.Struct, frozen=True, kw_only=True):
    # A local diffusers folder or a hub id.
    model: str
    device: str = "cpu"
    dtype: str = "auto"  # DTYPES; "auto" is resolved when the setup is made (`resolve_dtype`)
    # kernels/attention.py CHOICES.
    attention: str = "auto"
    compile: bool = False
    # Inductor's cache folder (None: <cache dir>/inductor, models/default.py).
    compile_cache: str | None = None
    quantize: str = "none"
    # Comma-separated fnmatch patterns of layers left unquantized (None: kernels/quantize.py DEFAULT_SKIP).
    quantize_skip: str | None = None
    offload: str = "none"
    # Settings of the checkpoint's scheduler changed at load (models/loading/loader.py `change_scheduler`).
    scheduler_config: dict[str, Any] = {}
    # "auto": the pipeline's dedicated family, else the generic path; "generic": the generic path (models/generic/).
    adapter: str = "auto"
    # Step cache method (models/stepcache/methods.py METHODS) and the threshold of requests that send none (None: the
    # method's, `default_cache_threshold`).
    cache: str = "none"
    cache_threshold: float | None = None
    # The method's settings (`--cache-config`, models/stepcache/methods.SETTINGS), e.g. DBCache's {"fn": 2, "bn": 1}.
    cache_config: dict[str, Any] = {}
    layout: ParallelLayout = msgspec.field(default_factory=lambda: ParallelLayout(1))
    # LoRA adapters registered at start (NAME=PATH each, and every .safetensors file of lora_dir), the bytes resident
    # adapters may take, and the scale the one adapter is fused into the weights at (None: per request).
    lora: tuple[str, ...] = ()
    lora_dir: str | None = None
    lora_budget: int = DEFAULT_LORA_BUDGET
    lora_fuse: float | None = None

    def __post_init__(self) -> None:
        if self.dtype == "auto":  # resolved once, where the setup is made: every reader sees a torch dtype's name
            msgspec.structs.force_setattr(self, "dtype", resolve_dtype(self.dtype, self.device))


# `--dtype auto`: what runs well where the model runs. GPUs compute in bfloat16 (flash-attn and fp8 need a half
# type); the CPU in float32 (the parity tests' dtype, and CPUs without bf16 units are slower in it).
DTYPES = ("auto", "float32", "float16", "bfloat16")


def resolve_dtype(dtype: str, device: str) -> str:
    """`dtype` ("auto": bfloat16 on a CUDA device, float32 elsewhere) as a torch dtype's name."""
    if dtype != "auto":
        return dtype
    return "bfloat16" if device.startswith("cuda") else "float32"


def lora_refusal(setup: ModelSetup) -> str | None:
    """The setting LoRA per request does not compose with yet (None: none): tensor parallel and sharded weights
    split the linears its deltas add to, offloading moves them between devices, and compiled blocks would recompile
    for every batch's mix of adapters."""
    layout = setup.layout
    for on, flag in (
        (layout.tp_degree > 1, "--tp"),
        (layout.sharded, "--shard-weights"),
        (setup.offload != "none", "--offload"),
        (setup.compile, "--compile"),
    ):
        if on:
            return f"not with {flag} yet"
    return None


def check_setup(setup: ModelSetup, *, family: Family | None = None, heads: int | None = None) -> Family | None:
    """Every rule of `setup`, without torch; raises SetupError. `family` and `heads`: the loaded model's, else read
    from a local checkpoint (a hub id's family is checked when it loads). Returns the family checked against."""
    _check_combinations(setup)
    _check_loras(setup)
    if family is None and setup.adapter == "generic":
        family = GENERIC
    elif family is None and os.path.isdir(setup.model):
        try:
            family = family_of_checkpoint(setup.model)
        except (ValueError, FileNotFoundError) as exc:
            raise SetupError(str(exc)) from None
        heads = heads or _heads(setup.model)
    elif family is None and setup.model in KNOWN_CHECKPOINTS:  # a hub id: checked before any download
        pipeline_class, known_heads = KNOWN_CHECKPOINTS[setup.model]
        family, heads = FAMILIES[pipeline_class], heads or known_heads
    if family is GENERIC:
        _check_generic(setup)
    elif family is not None:
        _check_family(setup, family, heads)
    try:
        setup.layout.validate()
    except ValueError as exc:
        raise SetupError(str(exc)) from None
    return family


def _check_combinations(setup: ModelSetup) -> None:
    layout, compiled = setup.layout, setup.compile
    if compiled and setup.offload == "group":
        # Its hooks move each layer's weights inside the blocks --compile would trace.
        raise SetupError("--compile does not run with --offload group; use --offload model, or drop one")
    if compiled and layout.ulysses_degree > 1:
        # Ulysses runs its all-to-alls inside the attention of the blocks --compile would trace.
        raise SetupError("--compile does not run with --ulysses yet; drop one (CFG-parallel ranks compile)")
    if layout.ring_degree > 1 and (compiled or setup.attention not in ("auto", "sdpa")):
        # Ring attention merges blocks by the log-sum-exp that only its SDPA kernels return.
        raise SetupError("--ring runs its own SDPA kernels: drop --compile and --attention other than sdpa")
    on_gpu = setup.device.startswith("cuda")  # elsewhere the device is what to fix (check_kernels says so)
    if on_gpu and setup.quantize == "fp8" and setup.dtype != "bfloat16":
        # torchao's float8 matmuls take bfloat16 activations (an assertion deep in the first forward otherwise).
        raise SetupError(f"--quantize fp8 runs in bfloat16: use --dtype bfloat16 (or auto), not {setup.dtype}")
    if on_gpu and setup.attention in HALF_ONLY_ATTENTION and setup.dtype not in ("float16", "bfloat16"):
        raise SetupError(
            f"--attention {setup.attention} runs in float16 or bfloat16 only: use --dtype bfloat16 (or auto on a "
            f"GPU), not {setup.dtype}"
        )
    plain = not compiled and setup.quantize == "none" and setup.offload == "none"
    if layout.tp_degree > 1 and not plain:
        raise SetupError("--tp shards plain weights: drop --compile, --quantize and --offload with it")
    if layout.vae_degree > layout.world_size:
        raise SetupError(
            f"--vae-parallel {layout.vae_degree} decodes on that many ranks: it needs --nproc x --nnodes >= "
            f"{layout.vae_degree}"
        )
    if layout.shard_weights:
        layout.validate_shards()
        if layout.world_size < 2:
            raise SetupError("--shard-weights splits the weights over the ranks: it needs --nproc 2 or more")
        if layout.tp_degree > 1 or not plain:
            raise SetupError("--shard-weights: drop --tp, --compile, --quantize and --offload with it")


def _check_loras(setup: ModelSetup) -> None:
    """The NAME=PATH pairs, --lora-dir, each file's header, --lora-fuse, and what LoRA does not compose with."""
    if not setup.lora and setup.lora_dir is None:
        if setup.lora_fuse is not None:
            raise SetupError("--lora-fuse adds an adapter into the weights: give it one with --lora NAME=PATH")
        return
    if (refusal := lora_refusal(setup)) is not None:
        raise SetupError(f"LoRA adapters (--lora, --lora-dir): {refusal}")
    try:
        specs = startup_specs(setup.lora, setup.lora_dir)
        for _, path in specs:
            check_safetensors(path)
    except LoraError as exc:
        raise SetupError(str(exc)) from None
    if setup.lora_fuse is not None and setup.quantize != "none":
        # The adapter's product would be added to weights torchao has already turned into integers or fp8.
        raise SetupError(
            f"--lora-fuse adds the adapter into the weights, which --quantize {setup.quantize} quantizes: drop one"
        )
    if setup.lora_fuse is not None and len(specs) != 1:
        raise SetupError(
            f"--lora-fuse adds one adapter into the weights; --lora and --lora-dir give {len(specs)}: give exactly one"
        )


def _supports(family: Family, strategy: str, flag: str, what: str) -> None:
    if strategy not in family.parallel:
        raise SetupError(
            f"{flag}: the {family.family} family ({family.pipeline_class}) does not support {what}; it supports: "
            f"{', '.join(family.parallel)}"
        )


def _heads(model: str) -> int | None:
    """The transformer's attention heads from its config.json; None if unknown."""
    config = Path(model) / "transformer" / "config.json"
    return attention_heads(json.loads(config.read_text())) if config.is_file() else None


def _check_family(setup: ModelSetup, family: Family, heads: int | None) -> None:
    """What the family declares it can run: the parallel layout, the step cache, LoRA."""
    layout, cache = setup.layout, setup.cache
    ulysses, ring, tp, vae = layout.ulysses_degree, layout.ring_degree, layout.tp_degree, layout.vae_degree
    if (setup.lora or setup.lora_dir) and not family.lora:
        raise SetupError(f"--lora: the {family.family} family ({family.pipeline_class}) does not serve LoRA adapters")
    if ulysses > 1:
        _supports(family, "ulysses", f"--ulysses {ulysses}", "Ulysses sequence parallelism")
        if heads and heads % ulysses:
            raise SetupError(f"--ulysses {ulysses} must divide the number of attention heads ({heads})")
    if ring > 1:
        _supports(family, "ring", f"--ring {ring}", "ring attention")
    if tp > 1:
        _supports(family, "tp", f"--tp {tp}", "tensor parallelism")
        if heads and heads % (tp * ulysses):
            raise SetupError(f"--tp {tp} x --ulysses {ulysses} must divide the number of attention heads ({heads})")
        if cache != "none":
            raise SetupError(f"--cache {cache} with --tp {tp}: step caching does not run with tensor parallelism yet")
    if vae > 1 and "vae-parallel" not in family.parallel:
        raise SetupError(
            f"--vae-parallel {vae}: the {family.family} family's VAE ({family.pipeline_class}) does not decode in "
            "strips (a video VAE other than Wan's and Qwen-Image's causal ones)"
        )
    if layout.shard_weights:
        if "shard-weights" not in family.parallel:
            raise SetupError(
                f"--shard-weights: the {family.family} family ({family.pipeline_class}) does not support it"
            )
        if cache != "none" and layout.sharded:
            raise SetupError(f"--cache {cache} with --shard-weights: step caching does not run on sharded weights yet")
    if cache != "none" and ring > 1:
        raise SetupError(f"--cache {cache} with --ring {ring}: step caching does not run with ring attention yet")
    if cache != "none" and ulysses > 1 and not family.cache_with_ulysses:
        raise SetupError(
            f"--cache {cache} with --ulysses {ulysses}: the {family.family} family cannot combine them yet"
        )
    if cache != "none" and layout.cfg_degree > 1 and not family.cache_with_cfg_parallel:
        raise SetupError(
            f"--cache {cache} with --cfg-parallel: the {family.family} family cannot combine them yet (a request's "
            "rows move between ranks as requests come and go, and their caches would stay behind)"
        )
    if cache != "none" and cache not in family.cache_methods:
        offered = ", ".join(family.cache_methods) or "none"
        raise SetupError(f"--cache {cache}: the {family.family} family implements {offered}")


def _check_generic(setup: ModelSetup) -> None:
    """The generic path runs the pipeline's own call on one process: what the dedicated families add to a call
    (the parallel menu, step caches, LoRA per request, compiled blocks, quantized or offloaded weights) it refuses,
    saying so."""
    why = "the generic path (the pipeline's own call, a step at a time; models/generic/) runs on one rank"
    if setup.layout.world_size > 1:
        raise SetupError(
            f"--nproc/--nnodes and the parallel strategies: {why}, and diffusers' own context parallelism is not "
            "wired into it; serve a dedicated family for them (diffusiond serve --help lists them)"
        )
    for on, flag in (
        (setup.cache != "none", f"--cache {setup.cache}"),
        (bool(setup.lora or setup.lora_dir), "--lora"),
        (setup.compile, "--compile"),
        (setup.quantize != "none", f"--quantize {setup.quantize}"),
        (setup.offload != "none", f"--offload {setup.offload}"),
    ):
        if on:
            raise SetupError(f"{flag}: not on the generic path yet (it runs the pipeline's own call); drop {flag}")


def check_kernels(setup: ModelSetup, ranks_here: int = 1) -> None:
    """What only torch can tell: the device, the attention backend, quantization and offload on it (SetupError).
    `ranks_here`: the ranks this node starts (--nproc), one GPU each."""
    import torch

    from diffusiond.kernels import offload, quantize
    from diffusiond.kernels.attention import AttentionUnavailable, resolve

    if setup.device.startswith("cuda"):
        visible = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if visible == 0:
            raise SetupError(f"--device {setup.device}: no CUDA device is visible (torch {torch.__version__})")
        if ranks_here > visible:
            raise SetupError(
                f"--nproc {ranks_here}: each rank needs a GPU of its own and {visible} are visible here; start at "
                f"most {visible} (CUDA_VISIBLE_DEVICES says which)"
            )
    try:
        resolve(setup.attention, setup.device, getattr(torch, setup.dtype))
        quantize.check(setup.quantize, setup.device)
        offload.check(setup.offload, setup.device)
    except (AttentionUnavailable, quantize.QuantizationUnavailable, offload.OffloadUnavailable) as exc:
        raise SetupError(str(exc)) from None


def build_adapter(setup: ModelSetup, rank: int = 0) -> ModelAdapter:
    """The adapter `setup` describes, on the thread that owns torch in this process. With several ranks
    (torch.distributed initialised, `setup.device` this rank's device), its share of the parallel layout."""
    from diffusiond.models.loading.kept_weights import keepers
    from diffusiond.models.loading.loader import load_adapter
    from diffusiond.models.lora.registry import same_on_every_rank, setup_loras

    layout = setup.layout
    sharded = layout.world_size > 1 and (layout.tp_degree > 1 or layout.sharded)
    # A group's later attempt (a heal) maps what the previous one kept in shared memory
    # (models/loading/kept_weights.py).
    kept = keepers(setup, rank) if layout.world_size > 1 else None
    restoring = kept is not None and all(k.ready() for k in kept.values())
    adapter = load_adapter(
        setup.model,
        adapter=setup.adapter,
        device=setup.device,
        dtype=setup.dtype,
        quantize=setup.quantize,
        quantize_skip=setup.quantize_skip,
        offload=setup.offload,
        scheduler_config=setup.scheduler_config,
        # Layouts that shard the denoiser read it a part at a time: no rank holds it whole
        # (models/loading/lazy_weights.py).
        lazy_denoiser=sharded or restoring,
    )
    if restoring:
        adapter.use_kept(kept, now=layout.tp_degree == 1)
    check_setup(setup, family=adapter.spec, heads=adapter.attention_heads())
    if adapter.quantized is not None:
        log.info("quantized %d linear layers of the transformer (%s)", adapter.quantized[1], adapter.quantized[0])
    # Before the parallel layout: read through the whole model, as every rank's registry will keep doing.
    specs = startup_specs(setup.lora, setup.lora_dir)
    registry = setup_loras(adapter, specs, setup.lora_budget, setup.lora_fuse, lora_refusal(setup))
    if registry is not None and setup.layout.world_size > 1 and (setup.lora or setup.lora_dir):
        same_on_every_rank(registry, setup.device)
    if setup.layout.world_size > 1:
        _wire_parallel(adapter, setup, rank)
    if kept is not None and restoring:
        adapter.kept_restored = sum(k.restored for k in kept.values())
        log.info("%d weights mapped from what the group's previous attempt kept", adapter.kept_restored)
    elif kept is not None:
        from diffusiond.kernels.host import drop_file_pages

        for name, module in adapter.denoisers().items():
            if kept[name].store(module):
                # Writing read every weight through the checkpoint's mapping (diffusers maps safetensors on the
                # CPU), whose pages then stayed in this rank's resident set beside the kept file's: 9.4 GB at
                # SD3.5-medium size under --cfg-parallel 2, not 5.1.
                drop_file_pages(str(Path(setup.model) / name))
    threshold = default_cache_threshold(setup.cache) if setup.cache_threshold is None else setup.cache_threshold
    adapter.enable_step_cache(setup.cache, threshold, setup.cache_config)  # before any request resolves
    backend = adapter.set_attention(setup.attention)
    if backend != "sdpa":
        log.info("attention: %s", backend)
    if setup.compile:  # compiled at their first calls: the warm-up runs them (on every rank)
        from diffusiond.kernels.compile import use_cache_dir
        from diffusiond.models.default import cache_dir

        cache = use_cache_dir(setup.compile_cache or cache_dir() / "inductor")
        log.info("compiling %d transformer blocks during the warm-up (cache %s)", adapter.enable_compile(), cache)
    return adapter


def _wire_parallel(adapter: ModelAdapter, setup: ModelSetup, rank: int) -> None:
    """This rank's part of the layout: tensor parallel first (sharding replaces the linears the other strategies'
    processors call), then sharded weights, strip decoding, prompt encoding once, CFG-parallel rows, Ulysses."""
    import torch
    import torch.distributed as dist

    from diffusiond.kernels.collectives import SharedEncoding
    from diffusiond.kernels.parallel import build_groups

    layout, device = setup.layout, torch.device(setup.device)
    groups = build_groups(layout, rank, device.type)
    if groups.tp is not None:
        adapter.enable_tp(groups.tp)
    # HSDP Rx1 is R whole copies: nothing to shard (and FSDP2 fails on a shard group of one rank under inference
    # mode, torch 2.14: "Inference tensors do not track version counter").
    if layout.sharded:
        from torch.distributed.device_mesh import init_device_mesh

        # HSDP: a 2-D mesh, FSDP2's (replicate, shard) dimensions; the weights are gathered over a replica's ranks.
        names = ("replicate", "shard") if layout.shard_replicas > 1 else ("shard",)
        adapter.enable_shard_weights(init_device_mesh(device.type, layout.shard_mesh, mesh_dim_names=names))
    if groups.vae is not None:
        adapter.enable_vae_parallel(groups.vae)
    # Prompts: rank 0 encodes, the others receive the embeddings and free their text encoders.
    adapter.enable_encode_once(SharedEncoding(dist.group.WORLD, rank, device))
    if groups.cfg is not None:
        adapter.enable_cfg_parallel(groups.cfg)
    if groups.sequence is not None:
        adapter.enable_ulysses(groups.sequence)
