"""`diffusiond serve` and `diffusiond config` flags, grouped as `serve --help` shows them. Each flag is also a
config file key and a DIFFUSIOND_* variable (daemon/config.py decodes all three into one ServeConfig)."""

from __future__ import annotations

import argparse


def add_serve_args(parser: argparse.ArgumentParser) -> None:
    """`serve` and `config` flags. Their parsers have `argument_default=SUPPRESS`: a flag that is not given must not
    override the environment or the config file (CLI > environment > file > defaults, see daemon/config.py).
    Every flag is also a config file key and a DIFFUSIOND_* variable (`--max-batch`: max_batch,
    DIFFUSIOND_MAX_BATCH)."""
    from diffusiond.daemon.config import ATTENTION_CHOICES, QUANTIZE_CHOICES, ServeConfig
    from diffusiond.models.stepcache.settings import CACHE_THRESHOLDS, DEFAULT_CACHE_THRESHOLD

    d = ServeConfig()
    parser.add_argument("--config", metavar="FILE", help="TOML file of the settings below (or set DIFFUSIOND_CONFIG)")

    add = parser.add_argument_group("model").add_argument
    add("--model", help="diffusers checkpoint folder or hub id (default: the bundled default model)")
    add(
        "--served-model-name",
        nargs="+",
        action="extend",
        metavar="NAME",
        help="the model's names in the API: the first its own, the others aliases a request may name as well (e.g. "
        "gpt-image-1 for applications written for OpenAI) (default: the name the checkpoint declares, else its "
        "folder name)",
    )
    add("--device", help=f"torch device: cpu, cuda, cuda:1 ... (default: {d.device})")
    add(
        "--dtype",
        choices=["auto", "float32", "float16", "bfloat16"],
        help=f"weights and activations; auto: bfloat16 on a GPU, float32 on the CPU (default: {d.dtype})",
    )
    add("--threads", type=int, help="torch threads (default: OMP_NUM_THREADS, else all cores; cores/N per rank)")

    add = parser.add_argument_group("HTTP").add_argument
    add("--host", help=f"bind address (default: {d.host}, loopback only)")
    add("--port", type=int, help=f"port to listen on (default: {d.port}; 0 picks a free port)")
    add("--api-key", help="require 'Authorization: Bearer KEY' (or set DIFFUSIOND_API_KEY)")
    add("--state-dir", metavar="DIR", help="durable video jobs: a SQLite database and the videos (DIR/videos)")
    add(
        "--state-url",
        metavar="URL",
        help="video jobs in PostgreSQL (postgresql://...), shared by replicas; the videos in --state-dir or "
        "--video-dir, a folder they all mount",
    )
    add("--replica-id", help="this replica's name in job leases (default: HOST:PORT; keep it across restarts)")
    add(
        "--job-lease",
        type=float,
        metavar="S",
        help=f"seconds a replica's claim on a video job lasts unrenewed (default: {d.job_lease:g})",
    )
    add(
        "--url-secret",
        help="the key image URLs are signed with, at least 32 characters, e.g. `openssl rand -hex 32` (response_format "
        "url; default: random per start)",
    )
    add("--public-base-url", metavar="URL", help="the daemon's address as clients reach it, for image URLs")
    add(
        "--api-keys-file",
        metavar="FILE",
        help="tenants: [tenants.NAME] tables with key_sha256 and quotas (TOML); read again on SIGHUP",
    )
    add(
        "--allow-unauthenticated",
        action="store_const",
        const=True,
        help="allow a non-loopback --host without --api-key (something in front authenticates)",
    )
    add("--max-body-bytes", type=int, help=f"largest request body; larger ones get 413 (default: {d.max_body_bytes})")
    add(
        "--max-image-bytes",
        type=int,
        help=f"input image bytes per request, all files together; bodies may grow by it (default: {d.max_image_bytes})",
    )
    add(
        "--keepalive-timeout",
        type=float,
        metavar="S",
        help=f"close a connection S seconds without a whole request head (default: {d.keepalive_timeout:g})",
    )
    add(
        "--max-connections",
        type=int,
        help=f"open connections; past it the longest idle are closed (default: {d.max_connections})",
    )
    add(
        "--max-reading-bytes",
        type=int,
        help=f"body bytes held while being read, over all requests; past it 503 (default: {d.max_reading_bytes})",
    )
    add(
        "--min-body-rate",
        type=int,
        metavar="BYTES",
        help="bytes a second a request body must arrive at on average after its first 5 s, else it is cut with 408 "
        f"(default: {d.min_body_rate}; 0: no deadline)",
    )
    add(
        "--write-timeout",
        type=float,
        metavar="S",
        help=f"cut a client that reads nothing for S seconds of one write (default: {d.write_timeout:g})",
    )
    add(
        "--send-buffer-bytes",
        type=int,
        metavar="N",
        help="each connection's kernel send buffer (SO_SNDBUF), what a client that reads nothing pins in kernel "
        "memory (default: 0, the kernel's own, up to tcp_wmem's largest)",
    )
    add(
        "--allowed-hosts",
        action="append",
        metavar="NAME",
        help="a Host name clients use besides IP addresses and localhost ('*': any; '.example.com': its "
        "subdomains); repeat for more (DIFFUSIOND_ALLOWED_HOSTS: comma-separated)",
    )
    add(
        "--cors-origins",
        action="append",
        metavar="ORIGIN",
        help="a web origin (https://app.example.com) allowed to call from a browser; repeat for more "
        "(DIFFUSIOND_CORS_ORIGINS: comma-separated)",
    )
    add(
        "--webhook-url",
        metavar="URL",
        help="told (POST, signed) when a video or sound job ends completed or failed, for tenants without a "
        "webhook_url of their own (docs/http-api.md, Webhooks)",
    )
    add(
        "--webhook-secret",
        metavar="whsec_...",
        help="the Standard Webhooks secret the events are signed with (DIFFUSIOND_WEBHOOK_SECRET keeps it out of ps)",
    )
    add(
        "--reconnect-window",
        type=float,
        metavar="S",
        help="seconds a native stream waits for its client to come back (Last-Event-ID) before its request is "
        f"cancelled, and keeps its events after it ends (default: {d.reconnect_window:g}; 0: cancel at once)",
    )
    add(
        "--sse-keepalive",
        type=float,
        metavar="S",
        help=f"SSE comment after S seconds without an event, for proxies (default: {d.sse_keepalive:g})",
    )

    add = parser.add_argument_group("batching and limits").add_argument
    add("--max-batch", type=int, help=f"requests per batched forward (default: {d.max_batch})")
    add("--max-queue", type=int, help=f"waiting requests before answering 429 (default: {d.max_queue})")
    add(
        "--default-priority",
        type=int,
        metavar="P",
        help=f"class (0-9, higher first) of requests naming none, in the tenant range (default: {d.default_priority})",
    )
    add(
        "--result-cache-bytes",
        type=int,
        metavar="N",
        help="answer a request identical to a finished one (seed chosen) from its result; N bytes (default: 0, off)",
    )
    add(
        "--priority-aging-steps",
        type=int,
        metavar="N",
        help=f"higher-class steps a waiting request sits out to rise one class (default: {d.priority_aging_steps})",
    )
    add(
        "--class-deadline",
        dest="class_deadlines",
        action="append",
        metavar="P=MS",
        help="requests of class P naming no deadline_ms get MS; repeat for more classes (default: none)",
    )
    add(
        "--no-preemption",
        dest="preemption",
        action="store_const",
        const=False,
        help="never pause a running request for a higher class (default: the lowest class running is paused)",
    )
    add(
        "--class-window-ms",
        type=int,
        metavar="MS",
        help="for MS after a higher class was in flight, lower classes' steps carry only the rows that fit in about "
        f"one of its lone steps, so that its next request waits that long at most for one (default: {d.class_window_ms}"
        "; 0: off)",
    )
    add(
        "--paused-bytes",
        type=int,
        metavar="N",
        help=f"GPU: host memory for paused requests' states, beyond which they stay on it (default: {d.paused_bytes})",
    )
    add(
        "--batch-wait-ms",
        type=float,
        metavar="MS",
        help=f"admission window: how long an idle engine lets a burst gather (default: {d.batch_wait_ms:g}; 0: off)",
    )
    add("--max-pixels", type=int, help="largest width x height of one image (default: 4x the model's default area)")
    add("--max-steps", type=int, help="most denoising steps per request (default: 4x the model's default, >= 50)")
    add("--max-frames", type=int, help="video models: most frames per clip (default: the most the model makes)")
    add("--max-n", type=int, help=f"most images per OpenAI request (default: {d.max_n})")

    add = parser.add_argument_group("video jobs (/v1/videos)").add_argument
    add(
        "--video-dir",
        metavar="DIR",
        help="folder finished videos are kept in, across restarts (default: a temporary folder removed at exit)",
    )
    add(
        "--video-store-bytes",
        type=int,
        metavar="BYTES",
        help=f"bytes the finished videos may take; the oldest finished go first (default: {d.video_store_bytes})",
    )
    add(
        "--video-ttl",
        type=float,
        metavar="S",
        help=f"seconds a finished video is kept, its expires_at (default: {d.video_ttl:g})",
    )
    add(
        "--video-max-jobs",
        type=int,
        help=f"video jobs remembered, finished or not; a running job is never dropped (default: {d.video_max_jobs})",
    )

    add = parser.add_argument_group("acceleration").add_argument
    add(
        "--cache",
        choices=["none", "fbcache", "teacache", "dbcache", "x0cache", "magcache"],
        help="step caching, decided per request: fbcache = first-block cache, teacache = TeaCache (its polynomial: "
        "`python -m diffusiond.tools.calibrate`, or the family's published one), dbcache = dual block cache "
        "(--cache-config), x0cache = holds a request's predicted clean image through a step (for samplers that add "
        "noise at every step, as the bundled model's), magcache = MagCache (the checkpoint's magnitude ratios: "
        "`python -m diffusiond.tools.calibrate --method magcache`, or the family's published ones) "
        f"(default: {d.cache})",
    )
    add(
        "--cache-config",
        metavar="JSON",
        help="the method's settings as a JSON object; dbcache: fn (blocks always computed first, default 1), bn "
        "(always computed last, default 0), warmup (steps before any reuse, default 0), taylorseer (forecast the "
        "reused blocks' residuals, default false) and taylorseer_order (1 or 2), e.g. "
        '\'{"fn": 2, "bn": 1, "warmup": 4}\'; x0cache: max_run (steps reused in a row at most, default 1); magcache: '
        "max_skip (steps reused in a row at most, default 3), retention (share of first steps always computed, "
        "default 0.2), ratios (the magnitude ratio per step); every "
        'method: scm (the steps that always compute for requests that send no cache_steps: "fast", "medium", '
        '"slow" or step indices)',
    )
    add(
        "--cache-threshold",
        type=float,
        metavar="X",
        help="change below which a request reuses its cached blocks (fbcache: relative change of its first-block "
        "residual; teacache: accumulated rescaled change of its modulated input); requests may send cache_threshold "
        f"(default: {DEFAULT_CACHE_THRESHOLD:g}, x0cache {CACHE_THRESHOLDS['x0cache']:g}; 0: exact)",
    )

    add(
        "--attention",
        choices=ATTENTION_CHOICES,
        help="attention kernel, through diffusers' attention dispatch: auto = flash-attn on a CUDA device where it is "
        f"installed, else sdpa (default: {d.attention})",
    )

    add(
        "--compile",
        action="store_true",
        help="torch.compile the transformer's repeated blocks with dynamic shapes; the warm-up compiles them "
        "(default: off)",
    )
    add(
        "--compile-cache",
        metavar="DIR",
        help="inductor's cache folder, kept between restarts (default: <cache>/inductor)",
    )
    add(
        "--quantize",
        choices=QUANTIZE_CHOICES,
        help="quantize the transformer's linear layers with torchao after loading: int8 = int8 weights, "
        "int8-dynamic = int8 weights and activations, fp8 = fp8 weights and activations (CUDA, compute capability "
        f">= 8.9); needs the quant extra (default: {d.quantize})",
    )
    add(
        "--quantize-skip",
        metavar="PATTERNS",
        help=f"comma-separated fnmatch patterns of layer names left unquantized (default: {d.quantize_skip})",
    )
    add(
        "--offload",
        choices=["none", "model", "group"],
        help="keep weights in CPU memory for a GPU smaller than the model: model = one stage's components (text "
        "encoders, transformer, VAE) on the GPU at a time, group = the transformer's layers streamed to it with "
        f"prefetch (default: {d.offload})",
    )
    add(
        "--adapter",
        choices=["auto", "generic"],
        help="auto = the pipeline's dedicated family, else the generic path (its own call, a step at a time); "
        f"generic = the generic path for any pipeline (default: {d.adapter})",
    )
    add(
        "--scheduler-config",
        metavar="JSON",
        help="change settings of the checkpoint's scheduler at load, as a JSON object: e.g. '{\"shift\": 3.0}', or "
        "'{\"stochastic_sampling\": false}' for the bundled model with --cache (default: the checkpoint's)",
    )

    add = parser.add_argument_group(
        "LoRA per request",
        "requests name adapters in `lora`; GET, POST /v1/loras and DELETE /v1/loras/NAME manage them",
    ).add_argument
    add(
        "--lora",
        action="append",
        metavar="NAME=PATH",
        help="register the .safetensors LoRA file PATH as NAME at start; repeat for more (DIFFUSIOND_LORA: "
        "comma-separated) (default: none)",
    )
    add(
        "--lora-dir",
        metavar="DIR",
        help="register every *.safetensors file of DIR at start, by its name without the suffix; POST /v1/loras "
        "loads only from DIR (default: none, so adapters cannot be added at run time)",
    )
    add(
        "--lora-cache-bytes",
        type=int,
        metavar="BYTES",
        help="bytes the adapters held in memory may take; past it, the least recently used that no request holds "
        f"are evicted, and read again on use (default: {d.lora_cache_bytes})",
    )
    add(
        "--lora-fuse",
        type=float,
        nargs="?",
        const=1.0,
        metavar="SCALE",
        help="add the one adapter into the weights at SCALE (1 when omitted) for every request: no per-step cost, "
        "no other adapters (default: off)",
    )

    add = parser.add_argument_group("stopping (SIGTERM, SIGINT)").add_argument
    add(
        "--unready-delay",
        type=float,
        metavar="S",
        help="/ready fails S seconds before new requests are refused, so balancers stop sending first "
        f"(default: {d.unready_delay:g})",
    )
    add(
        "--drain-timeout",
        type=float,
        metavar="S",
        help=f"seconds requests in flight get to finish before they are cancelled (default: {d.drain_timeout:g})",
    )

    add = parser.add_argument_group(
        "several ranks (SPMD, under torch.distributed's elastic agent)",
        "cfg-parallel x ulysses x ring x tp = nproc x nnodes; global rank 0 serves HTTP",
    ).add_argument
    add("--nproc", type=int, help=f"ranks on this node, one per device (default: {d.nproc})")
    add("--cfg-parallel", type=int, help=f"CFG-parallel degree, 1 or 2 (default: {d.cfg_parallel})")
    add("--ulysses", type=int, help=f"Ulysses sequence-parallel degree (default: {d.ulysses})")
    add("--ring", type=int, help=f"ring attention degree, composes with --ulysses (default: {d.ring})")
    add("--tp", type=int, help=f"tensor-parallel degree: each rank holds 1/tp of the block weights (default: {d.tp})")
    add(
        "--shard-weights",
        nargs="?",
        const=True,
        metavar="RxS",
        help="FSDP2: each rank keeps 1/N of the transformer's weights, gathered block by block as it runs; RxS: HSDP, "
        "R replicas of the weights, each sharded over S ranks (R x S = the ranks; default 1xN)",
    )
    add("--vae-parallel", type=int, help="ranks that decode one image together, in strips (default: 1)")
    add(
        "--max-restarts",
        type=int,
        help=f"restarts of the rank group after a failure, per agent (default: {d.max_restarts})",
    )
    add(
        "--keep-weights",
        metavar="DIR",
        help="shared-memory folder where each rank keeps its share of the denoiser, so that a heal maps it instead "
        f"of reloading; none: reload (default: {d.keep_weights})",
    )
    add("--nnodes", type=int, help=f"nodes in the group, --nproc ranks on each (default: {d.nnodes})")
    add("--rdzv-endpoint", metavar="HOST:PORT", help="c10d rendezvous every node joins (required with --nnodes > 1)")
    add("--rdzv-id", metavar="ID", help=f"names the group at the rendezvous (default: {d.rdzv_id})")
    add(
        "--rdzv-timeout",
        type=float,
        metavar="S",
        help=f"seconds a group waits for all its nodes, at start and after losing one (default: {d.rdzv_timeout:g})",
    )
    add("--node-addr", metavar="ADDR", help="address the other nodes reach this one at (default: its FQDN)")
    add_log_args(parser)


def add_log_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("logging")
    group.add_argument(
        "--log-level", type=str.upper, default=argparse.SUPPRESS, help="DEBUG, INFO, WARNING, ERROR (default: INFO)"
    )
    group.add_argument(
        "--log-format", choices=["text", "json"], default=argparse.SUPPRESS, help="json: one object per line"
    )
