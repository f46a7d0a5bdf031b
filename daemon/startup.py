"""What the configuration means at start-up: the model setup it asks for (`model_setup`: what to load and how it
runs, models/loading/setup.py) and every start-up rule (`check_serving`), before any rank starts or torch is
imported; the JSON settings flags carry (`--cache-config`, `--scheduler-config`), decoded and checked."""

from __future__ import annotations

import json
import os
from typing import Any

from diffusiond.daemon.config import ConfigError, ServeConfig
from diffusiond.kernels.layout import ParallelLayout
from diffusiond.models.loading.setup import ModelSetup


def shard_replicas(value: bool | str, world: int) -> int:
    """The replicas of `--shard-weights RxS` (1 for plain FSDP); ConfigError unless R x S is the number of ranks."""
    if not isinstance(value, str):
        return 1
    replicas, shards = (int(v) for v in value.split("x"))
    if replicas * shards != world:
        raise ConfigError(
            f"--shard-weights {value}: {replicas} replicas x {shards} ranks each = {replicas * shards} must equal the "
            f"number of ranks ({world}: --nproc x --nnodes)"
        )
    return replicas


def cache_settings(method: str, text: str | None) -> dict[str, Any]:
    """`cache_config`'s JSON object for `--cache method` (empty when unset); ConfigError naming an unknown key or a
    bad value (models/loading/setup.check_cache_config); whether the transformer has blocks left to reuse is checked at
    load."""
    from diffusiond.models.stepcache.settings import check_cache_config

    if not text:
        return {}
    settings = _json_object("--cache-config", text, '{"fn": 2, "bn": 1}')
    try:
        check_cache_config(method, settings)
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    return settings


def scheduler_changes(text: str | None) -> dict[str, Any]:
    """`scheduler_config`'s JSON object (empty when unset); ConfigError unless it is one. Whether the scheduler has
    those settings is checked when it loads (models/loading/loader.change_scheduler)."""
    if not text:
        return {}
    return _json_object("--scheduler-config", text, '{"shift": 3.0}')


def _json_object(flag: str, text: str, example: str) -> dict[str, Any]:
    """`text` decoded as a JSON object; ConfigError naming `flag` (with `example`) otherwise."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ConfigError(f"{flag}: not JSON ({exc}): {text!r}") from None
    if not isinstance(value, dict):
        raise ConfigError(f"{flag}: give a JSON object such as '{example}', not {text!r}")
    return value


def in_launched_group() -> bool:
    """True under torchrun or our elastic launch (the agent sets these for every worker)."""
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ and "MASTER_ADDR" in os.environ


def model_setup(config: ServeConfig) -> ModelSetup:
    """What the served model is and how it runs, from the configuration (the bundled model when none is named).
    The layout's ranks: the launched group's (torchrun may start more than --nproc says), else --nproc x --nnodes.
    ConfigError for a --scheduler-config that is not a JSON object."""
    from diffusiond.models.default import default_model

    world = int(os.environ["WORLD_SIZE"]) if in_launched_group() else config.nproc * config.nnodes
    layout = ParallelLayout(
        world,
        cfg_degree=config.cfg_parallel,
        ulysses_degree=config.ulysses,
        ring_degree=config.ring,
        tp_degree=config.tp,
        shard_weights=bool(config.shard_weights),
        vae_degree=config.vae_parallel,
        shard_replicas=shard_replicas(config.shard_weights, world),
    )
    return ModelSetup(
        model=config.model or default_model(),
        device=config.device,
        dtype=config.dtype,
        attention=config.attention,
        compile=config.compile,
        compile_cache=config.compile_cache,
        quantize=config.quantize,
        quantize_skip=config.quantize_skip,
        offload=config.offload,
        scheduler_config=scheduler_changes(config.scheduler_config),
        adapter=config.adapter,
        cache=config.cache,
        cache_threshold=config.cache_threshold,
        cache_config=cache_settings(config.cache, config.cache_config),
        layout=layout,
        lora=config.lora,
        lora_dir=config.lora_dir,
        lora_budget=config.lora_cache_bytes,
        lora_fuse=config.lora_fuse,
    )


def class_deadlines(config: ServeConfig) -> dict[int, int]:
    """`--class-deadline P=MS` pairs as {class: milliseconds}; ConfigError naming a bad one."""
    out: dict[int, int] = {}
    for pair in config.class_deadlines:
        priority, _, ms = pair.partition("=")
        try:
            p, m = int(priority), int(ms)
        except ValueError:
            p = m = -1
        if not 0 <= p <= 9 or not 1 <= m <= 86_400_000 or p in out:
            raise ConfigError(
                f"--class-deadline {pair!r}: expected P=MS, a class 0-9 (once each) and milliseconds 1-86400000"
            )
        out[p] = m
    return out


def check_serving(config: ServeConfig) -> ModelSetup:
    """Every start-up rule, before any rank starts or torch is imported: the daemon's own (exposure, several nodes,
    the video folder) and the model setup's (models/loading/setup.py `check_setup`). ConfigError or SetupError, saying
    why; the checked setup."""
    from diffusiond.daemon.auth import check_exposure
    from diffusiond.models.loading.setup import check_setup

    check_exposure(config)
    class_deadlines(config)
    if (config.webhook_url is None) != (config.webhook_secret is None):
        raise ConfigError("--webhook-url and --webhook-secret go together: events are always signed")
    if config.nnodes > 1 and not config.rdzv_endpoint:
        raise ConfigError(f"--nnodes {config.nnodes} needs --rdzv-endpoint HOST:PORT, the same on every node")
    from diffusiond.daemon.video_store import folder_problem

    for flag, folder in (("--video-dir", config.video_dir), ("--state-dir", config.state_dir)):
        if folder is not None and (problem := folder_problem(folder)) is not None:
            raise ConfigError(f"{flag} {folder}: {problem}")
    if config.state_url is not None:
        if not config.state_url.startswith(("postgresql://", "postgres://")):
            scheme = config.state_url.split(":")[0]
            raise ConfigError(f"--state-url must be a PostgreSQL URL (postgresql://...); got {scheme}:...")
        if config.state_dir is None and config.video_dir is None:
            raise ConfigError(
                "--state-url needs --state-dir or --video-dir: the folder the replicas keep their videos in, one "
                "that all of them mount (a ReadWriteMany volume on Kubernetes)"
            )
    setup = model_setup(config)
    check_setup(setup)
    return setup
