"""The daemon's configuration: one msgspec Struct that CLI flags, `DIFFUSIOND_*` environment variables and a TOML
file all decode into (precedence: CLI > environment > file > defaults).

Each layer is decoded on its own first, so an error names the key and where it came from: an unknown key in the
file, an unknown `DIFFUSIOND_*` variable, a value of the wrong type or out of range. Environment values are strings
converted by msgspec ("4" -> 4); an empty one counts as unset, so an env file may list every variable.
"""

from __future__ import annotations

import difflib
import json
import math
import re
import tomllib
from collections.abc import Mapping
from typing import Annotated, Any, Literal, get_args

import msgspec

from diffusiond.daemon.webhooks import WEBHOOK_SECRET, WEBHOOK_URL
from diffusiond.models.params import MAX_IMAGE_BYTES, MAX_STEPS

# The most images one OpenAI request may ask for (`n`): OpenAI's own limit.
MAX_N = 10
Positive = Annotated[int, msgspec.Meta(ge=1)]
ShardMesh = Annotated[str, msgspec.Meta(pattern=r"^[1-9][0-9]{0,3}x[1-9][0-9]{0,3}$")]
NonNegative = Annotated[int, msgspec.Meta(ge=0)]
# A name the model is served under: what a client writes in `model` (no spaces, no commas: lists are comma-separated).
ModelName = Annotated[str, msgspec.Meta(min_length=1, max_length=256, pattern=r"^[^\s,]+$")]


# kernels/attention.py CHOICES (a test keeps them equal; that module imports torch, this one must not).
AttentionChoice = Literal["auto", "sdpa", "math", "efficient", "cudnn", "flash", "flash3", "sage", "xformers", "flex"]
ATTENTION_CHOICES: tuple[str, ...] = get_args(AttentionChoice)
QuantizeChoice = Literal["none", "int8", "int8-dynamic", "fp8"]
QUANTIZE_CHOICES: tuple[str, ...] = get_args(QuantizeChoice)


class ServeConfig(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    model: str | None = None
    # The names clients see (`/v1/models`, `model` in requests): the first is the model's own in answers that name
    # no request's, the others aliases (`gpt-image-1` for applications written for OpenAI). Default: the name the
    # checkpoint declares (diffusiond.json; the bundled model is "diffusiond-shapes"), else its folder name or hub
    # id. The TOML key takes a name or a list of names, DIFFUSIOND_SERVED_MODEL_NAME comma-separated names.
    served_model_name: tuple[ModelName, ...] = ()
    host: Annotated[str, msgspec.Meta(min_length=1)] = "127.0.0.1"
    port: Annotated[int, msgspec.Meta(ge=0, le=65535)] = 8000
    api_key: str | None = None
    # Tenants with their keys (as SHA-256 hashes) and quotas, a TOML file read again on SIGHUP (daemon/tenants.py).
    api_keys_file: str | None = None
    # Binding anything but loopback without an API key must be asked for (daemon/auth.py `check_exposure`).
    allow_unauthenticated: bool = False
    max_batch: Positive = 8
    # Priority classes (engine/scheduler.py): the class of a request that names none (within its tenant's range),
    # and the steps served to higher classes that a waiting request sits out to rise one class (aging: a class p
    # waits at most (t - p) * this many steps of higher classes before it competes with the top class t).
    default_priority: Annotated[int, msgspec.Meta(ge=0, le=9)] = 0
    priority_aging_steps: Positive = 20
    # Preemption (engine/scheduler.py): a running request of a lower class is paused at a step boundary for one of a
    # higher class that finds no free slot; on a GPU paused states wait in host memory, at most this many bytes.
    # The deadline of a request of class P that names none (`deadline_ms`), as P=MS pairs: its client is assumed to
    # wait MS milliseconds (refused at once when the estimate is later; earliest deadline first within a class).
    class_deadlines: tuple[str, ...] = ()
    preemption: bool = True
    # For this long after a request of a higher class was in flight, a lower class's steps carry only the rows that
    # fit in about one of its lone steps (measured), so that its next request waits about that long for a step in
    # progress (engine/scheduler.py `_rows`); 0: off.
    class_window_ms: Annotated[int, msgspec.Meta(ge=0)] = 2000
    paused_bytes: Annotated[int, msgspec.Meta(ge=0)] = 8 << 30  # engine/parking.py's PAUSED_BYTES
    # Finished results answered again to identical requests whose client chose the seed (engine/result_cache.py),
    # at most this many bytes of them; 0: off.
    result_cache_bytes: Annotated[int, msgspec.Meta(ge=0)] = 0
    # Admission window: an idle engine waits up to this long for a burst of requests to start together. It stops at
    # max_batch, or after 1/40 of it without a new request (all a lone request pays: 0.5 ms), 1/4 while clients of
    # requests that finished together are coming back (engine/admission.py).
    batch_wait_ms: Annotated[float, msgspec.Meta(ge=0, le=1000)] = 20.0
    max_queue: NonNegative = 64
    # What one request may ask for. None: from the model (4x its default image area, up to its largest sides; 4x
    # its default step count, at least 50). max_n: images per OpenAI request.
    max_pixels: Positive | None = None
    # Video models: the most frames one clip may have (default: the most the model makes).
    max_frames: Positive | None = None
    max_steps: Annotated[int, msgspec.Meta(ge=1, le=MAX_STEPS)] | None = None
    max_n: Annotated[int, msgspec.Meta(ge=1, le=MAX_N)] = 10
    # Seconds without an event after which an SSE stream gets a comment line, so proxies keep it open.
    sse_keepalive: Annotated[float, msgspec.Meta(gt=0)] = 5.0
    # Seconds a native stream's events are kept for its client to come back with Last-Event-ID (daemon/replay.py):
    # after it goes away (past them the request is cancelled; 0: at once) and after the stream ends.
    reconnect_window: Annotated[float, msgspec.Meta(ge=0, le=600)] = 5.0
    device: str = "cpu"
    # auto: bfloat16 on a CUDA device, float32 elsewhere (models/loading/setup.py resolve_dtype).
    dtype: Literal["auto", "float32", "float16", "bfloat16"] = "auto"
    threads: Positive | None = None
    max_body_bytes: Positive = 1 << 20
    # The HTTP edge (daemon/edge.py, daemon/connections.py). keepalive_timeout: seconds a connection may go without a
    # whole request head (idle between requests, or sending its head slowly) before it is closed. max_connections:
    # open connections (also kept below the open-file limit); past it the longest idle are closed, and when none is
    # idle a new one reaches only /health, /ready and /metrics. max_reading_bytes: request body bytes held while
    # being read, over all requests (what has arrived, not what a body declares; past it, 503). min_body_rate: bytes
    # a second a body must arrive at, on average, after its first 5 s (0: no deadline); a slower one is cut (408) and
    # its share of the budget returned. write_timeout: seconds one write may wait for a
    # client to read before its stream is cut and its request cancelled. send_buffer_bytes: the kernel's send buffer
    # of each connection (SO_SNDBUF; 0: the kernel's own, which grows to tcp_wmem's largest, 4 MiB on most Linux):
    # what a client that reads nothing pins in kernel memory (charged to the container under cgroup v2) and how much
    # of an answer leaves before its writes wait.
    keepalive_timeout: Annotated[float, msgspec.Meta(gt=0, le=3600)] = 15.0
    max_connections: Annotated[int, msgspec.Meta(ge=16)] = 1000
    max_reading_bytes: Positive = 256 << 20
    min_body_rate: NonNegative = 32 << 10
    write_timeout: Annotated[float, msgspec.Meta(gt=0)] = 30.0
    send_buffer_bytes: Annotated[int, msgspec.Meta(ge=0, le=64 << 20)] = 0
    # Browsers: the host names clients call this server by, besides IP addresses and localhost ("*": any;
    # ".example.com": it and its subdomains), against DNS rebinding; the web origins allowed to call it (CORS).
    allowed_hosts: tuple[str, ...] = ()
    cors_origins: tuple[str, ...] = ()
    # The input image bytes one request may bring, all its files together (image, mask, references): multipart parts,
    # or base64 in JSON bodies, whose limit grows by what they take.
    max_image_bytes: Annotated[int, msgspec.Meta(ge=1, le=MAX_IMAGE_BYTES)] = 16 << 20
    # Video jobs (`/v1/videos`): the folder finished videos are kept in (default: a temporary folder of this process,
    # removed when it exits; a folder given here keeps them across restarts), the bytes they may take there (the
    # oldest finished go first), the seconds each is kept after it finishes (its `expires_at`), and how many jobs,
    # finished or not, are remembered (a running job is never dropped).
    video_dir: str | None = None
    # Durable video jobs (daemon/job_db.py): DIR/diffusiond.db (SQLite), and DIR/videos unless video_dir says.
    state_dir: str | None = None
    # Video jobs in PostgreSQL, shared by replicas (their videos in state_dir or video_dir, a folder all of them
    # mount); this replica's name in the jobs' leases (default: host:port), and how long a lease lasts unrenewed.
    state_url: str | None = None
    replica_id: str | None = None
    job_lease: Annotated[float, msgspec.Meta(ge=1.0, le=3600.0)] = 30.0
    video_store_bytes: Positive = 1 << 30
    video_ttl: Annotated[float, msgspec.Meta(gt=0)] = 3600.0
    # Images answered by URL (daemon/files.py): the key their URLs are signed with (default: random per start),
    # and the address clients reach the daemon at, when a proxy is in front (default: the request's own).
    # At least 32 characters (`openssl rand -hex 32`): a key anyone could guess signs URLs for anyone's images.
    url_secret: Annotated[str, msgspec.Meta(min_length=32)] | None = None
    public_base_url: str | None = None
    video_max_jobs: Positive = 1024
    # Jobs' webhooks (daemon/webhooks.py): where a tenant without its own (its `webhook_url` in the tenants file)
    # is told that its jobs ended, and the Standard Webhooks secret they are signed with (whsec_ + base64).
    webhook_url: Annotated[str, msgspec.Meta(pattern=WEBHOOK_URL)] | None = None
    webhook_secret: Annotated[str, msgspec.Meta(pattern=WEBHOOK_SECRET)] | None = None
    log_level: Literal["DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL"] = "INFO"
    log_format: Literal["text", "json"] = "text"
    # Seconds that running requests get to finish after SIGTERM/SIGINT before they are cancelled.
    drain_timeout: Annotated[float, msgspec.Meta(ge=0)] = 30.0
    # Seconds between SIGTERM turning /ready to 503 and the drain refusing new requests: a balancer that polls
    # /ready takes the replica out of its pool first, so nothing it routes in that window is refused. Set it above
    # the balancer's check interval x failures to mark a server down (HAProxy `inter` x `fall`).
    unready_delay: Annotated[float, msgspec.Meta(ge=0, le=300)] = 0.0
    # SPMD: ranks, parallel degrees (their product must equal nproc), restarts of the whole group by the agent.
    nproc: Positive = 1
    cfg_parallel: Positive = 1
    ulysses: Positive = 1
    # Ring attention over the sharded sequence (kernels/ring.py), alone or with Ulysses: U x R ranks per sequence.
    ring: Positive = 1
    # Tensor parallelism (kernels/tensor_parallel.py): each rank holds 1/tp of the transformer's block linears.
    tp: Positive = 1
    # FSDP2 over every rank (kernels/tensor_parallel.py): each keeps 1/N of the transformer's weights and gathers a
    # block's just before it runs. On top of a layout (CFG-parallel, Ulysses, ring), not a degree of its own. "RxS":
    # HSDP, R replicas of the weights, each sharded over S ranks (R x S = the ranks; "1xN" is true).
    shard_weights: bool | ShardMesh = False
    # Patch-parallel decoding (kernels/patch_vae.py): an image that finishes with fewer others than there are ranks
    # is decoded in horizontal strips by ranks 0..V-1 (several finishing together are spread over the ranks anyway).
    vae_parallel: Positive = 1
    max_restarts: NonNegative = 3
    # Where each rank's share of the denoiser is kept for the group's next attempt (models/loading/kept_weights.py): a
    # folder in shared memory; a heal then maps it instead of reading the checkpoint. "none": a heal reloads.
    keep_weights: str = "/dev/shm"
    # Step caching with a decision per request (models/stepcache/methods.py): "fbcache" reuses a request's remaining
    # blocks while its first block's residual changes by less than cache_threshold; "teacache" reuses all blocks
    # while the accumulated rescaled change of its first block's modulated input stays below it (requests may send
    # their own; 0 is exact); "dbcache" is fbcache with more blocks always computed first (fn) and last (bn) and a
    # warm-up (and TaylorSeer), set in cache_config (a JSON object, `cache_settings`; every method: "scm", the requests'
    # default step mask). Families that declare it; under several ranks the ranks agree on every decision.
    cache: Literal["none", "fbcache", "teacache", "dbcache", "x0cache", "magcache"] = "none"
    cache_config: str | None = None
    # Attention kernel (kernels/attention.py), through diffusers' attention dispatch: auto = flash-attn on a CUDA
    # device where it is installed, SDPA otherwise. One that cannot run here stops the start with a clear error.
    attention: AttentionChoice = "auto"
    # torch.compile the transformer's repeated blocks (kernels/compile.py), with dynamic shapes; the warm-up compiles
    # them for one and several rows. compile_cache: inductor's cache folder (default: <model cache>/inductor).
    compile: bool = False
    compile_cache: str | None = None
    # Quantize the transformer's linear layers with torchao (kernels/quantize.py) after loading: int8 weights,
    # int8 weights and activations, or fp8 (CUDA, compute capability >= 8.9). quantize_skip: comma-separated fnmatch
    # patterns of layer names left as loaded (default: the embedders, the final norm and the output projection).
    quantize: QuantizeChoice = "none"
    quantize_skip: str = "*embed*,norm_out.*,proj_out"
    # Offload (kernels/offload.py), for GPUs with less memory than the model: "model" keeps one stage's components
    # (text encoders, transformer, VAE) on the device at a time; "group" streams the transformer's layers to it.
    offload: Literal["none", "model", "group"] = "none"
    # Which adapter serves the model: "auto" (its pipeline's dedicated family, else the generic path, which runs the
    # pipeline's own call a step at a time) or "generic" (the generic path whatever the pipeline; models/generic/).
    adapter: Literal["auto", "generic"] = "auto"
    # Settings of the checkpoint's scheduler changed at load, as a JSON object (`scheduler_changes`), e.g.
    # '{"shift": 3.0}' or, for the bundled model's step cache, '{"stochastic_sampling": false}'.
    scheduler_config: str | None = None
    # None: the method's own (models/loading/setup.py `default_cache_threshold`).
    cache_threshold: Annotated[float, msgspec.Meta(ge=0, le=10)] | None = None
    # LoRA per request (models/lora/registry.py, families that declare it): adapters registered at start, NAME=PATH
    # each (a .safetensors file), plus every *.safetensors file of lora_dir by its name without the suffix; lora_dir
    # is also the only folder `POST /v1/loras` loads from (without it, adapters cannot be added at run time). Resident
    # adapters share lora_cache_bytes (least recently used ones that no request holds are evicted, reloaded on use).
    # lora_fuse: the one adapter is added into the weights at this scale for every request (no per-step cost).
    lora: tuple[str, ...] = ()
    lora_dir: str | None = None
    lora_cache_bytes: Positive = 2 << 30
    lora_fuse: Annotated[float, msgspec.Meta(ge=-10, le=10)] | None = None
    # Several nodes, one group: nproc ranks on each of nnodes nodes, which meet at the c10d rendezvous at
    # rdzv_endpoint (HOST:PORT; the agent on HOST serves it, and it must be up for the group to heal). rdzv_timeout:
    # how long a group waits for all its nodes, at start and after losing one, before it gives up. node_addr: the
    # address the others reach this node at (default: its FQDN); the node whose address sorts first runs global
    # rank 0, the one that serves HTTP.
    nnodes: Positive = 1
    rdzv_endpoint: Annotated[str, msgspec.Meta(pattern=r"^\S+:\d{1,5}$")] | None = None
    rdzv_id: Annotated[str, msgspec.Meta(pattern=r"^[A-Za-z0-9_.-]{1,64}$")] = "diffusiond"
    rdzv_timeout: Annotated[float, msgspec.Meta(gt=0)] = 900.0
    node_addr: str | None = None


FIELDS: tuple[str, ...] = tuple(f.name for f in msgspec.structs.fields(ServeConfig))
ENV_PREFIX = "DIFFUSIOND_"
CONFIG_ENV = "DIFFUSIOND_CONFIG"
# Variables with the prefix that are not fields: the config file path, and the model cache (models/default.py).
ENV_NOT_FIELDS = frozenset({CONFIG_ENV, "DIFFUSIOND_CACHE"})
SECRET_FIELDS = frozenset({"api_key", "url_secret", "state_url", "webhook_secret"})
LIST_FIELDS = frozenset({"lora", "allowed_hosts", "cors_origins", "class_deadlines", "served_model_name"})
HIDDEN = "<hidden>"


class ConfigError(ValueError):
    """A configuration that cannot be used; the message names the key and its source."""


def flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def env_var(name: str) -> str:
    return ENV_PREFIX + name.upper()


def load_config(
    cli: Mapping[str, Any], env: Mapping[str, str], path: str | None = None
) -> tuple[ServeConfig, dict[str, str]]:
    """The effective configuration, and where each field's value came from (a flag, a variable, the file, default).

    `cli` holds only the flags that were given (argparse with `default=SUPPRESS`); keys that are not fields (the
    subcommand, `config`) are ignored. `path` is the config file (`--config`, else `$DIFFUSIOND_CONFIG`)."""
    path = path or env.get(CONFIG_ENV) or None
    from_file = _decode(_read_file(path), lambda key: f"in {path}", strict=True) if path else {}
    env_layer = _env_layer(env)
    from_env = _decode(env_layer, lambda key: f"from {env_var(key)}={env_layer[key]!r}", strict=False)
    cli_layer = {k: v for k, v in cli.items() if k in FIELDS and v is not None}
    from_cli = _decode(cli_layer, lambda key: f"from {flag(key)} {cli_layer[key]!r}", strict=True)

    sources = dict.fromkeys(FIELDS, "default")
    sources.update(dict.fromkeys(from_file, path))
    sources.update({key: env_var(key) for key in from_env})
    sources.update({key: flag(key) for key in from_cli})
    merged = {**from_file, **from_env, **from_cli}
    return ServeConfig(**merged), sources


def _read_file(path: str) -> dict[str, Any]:
    try:
        with open(path, "rb") as f:
            data = tomllib.load(f)
    except OSError as exc:
        raise ConfigError(f"cannot read config file {path}: {exc.strerror or exc}") from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"{path} is not valid TOML: {exc}") from None
    for key in data:
        if key not in FIELDS:
            raise ConfigError(f"unknown key {key!r} in {path}{_did_you_mean(key.replace('-', '_'), FIELDS)}")
    return data


def _env_layer(env: Mapping[str, str]) -> dict[str, str]:
    layer = {}
    for var, value in env.items():
        if not var.startswith(ENV_PREFIX) or var in ENV_NOT_FIELDS:
            continue
        key = var.removeprefix(ENV_PREFIX).lower()
        if key not in FIELDS:
            known = [env_var(f) for f in FIELDS]
            raise ConfigError(f"unknown environment variable {var}{_did_you_mean(var, known)}")
        if value != "":
            # A list (`lora`: NAME=PATH pairs) is comma-separated in one variable.
            layer[key] = [v.strip() for v in value.split(",") if v.strip()] if key in LIST_FIELDS else value
    return layer


def _decode(layer: dict[str, Any], describe, *, strict: bool) -> dict[str, Any]:
    """Type-checks one layer alone (fields it lacks take defaults) and returns its typed values."""
    if isinstance(layer.get("log_level"), str):
        layer = {**layer, "log_level": layer["log_level"].upper()}
    if isinstance(layer.get("served_model_name"), str):  # the TOML file's one name
        layer = {**layer, "served_model_name": [layer["served_model_name"]]}
    shard = layer.get("shard_weights")
    if isinstance(shard, str) and shard.lower() in ("true", "false", "1", "0"):  # (an environment variable's)
        layer = {**layer, "shard_weights": shard.lower() in ("true", "1")}
    try:
        config = msgspec.convert(layer, ServeConfig, strict=strict)
    except msgspec.ValidationError as exc:
        message = str(exc)
        match = re.search(r" - at `\$\.(\w+)(?:\[\d+\])?`", message)  # a list's item: its key
        if match is None:
            raise ConfigError(message) from None
        key = match.group(1)
        reason = message[: match.start()]
        raise ConfigError(f"bad value for {key} {describe(key)}: {reason[:1].lower()}{reason[1:]}") from None
    return {key: getattr(config, key) for key in layer}


def _did_you_mean(word: str, choices) -> str:
    close = difflib.get_close_matches(word, list(choices), n=1)
    return f" (did you mean {close[0]!r}?)" if close else ""


# ---- printing (`diffusiond config`) ----


def public_dict(config: ServeConfig) -> dict[str, Any]:
    """The configuration as plain values, secrets hidden."""
    data = msgspec.structs.asdict(config)
    for key in SECRET_FIELDS:
        if data[key] is not None:
            data[key] = HIDDEN
    return data


def to_json(config: ServeConfig) -> str:
    return json.dumps(public_dict(config), indent=2) + "\n"


def to_toml(config: ServeConfig, sources: Mapping[str, str] | None = None) -> str:
    """A TOML file that loads back into the same configuration (secrets and unset values become comments)."""
    lines = ["# diffusiond: effective configuration (CLI > environment > file > defaults)"]
    for key, value in msgspec.structs.asdict(config).items():
        source = sources[key] if sources else ""
        if value is None:
            lines.append(f"# {key}: not set" + (f" ({source})" if source else ""))
        elif key in SECRET_FIELDS:
            lines.append(f"# {key}: set, hidden" + (f" ({source})" if source else ""))
        else:
            lines.append(f"{key} = {_toml_value(value)}" + (f"  # {source}" if source else ""))
    return "\n".join(lines) + "\n"


def _toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, float) and not math.isfinite(value):
        return "nan" if math.isnan(value) else ("inf" if value > 0 else "-inf")
    if isinstance(value, int | float):
        return repr(value)
    if isinstance(value, tuple | list):
        return "[" + ", ".join(_toml_value(item) for item in value) + "]"
    # JSON string escapes are valid in TOML basic strings.
    return json.dumps(str(value), ensure_ascii=False)
