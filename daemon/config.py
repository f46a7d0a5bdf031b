"""The daemon's configuration: one msgspec Struct that CLI flags, `DIFFUSIOND_*` environment variables and a TOML
file all decode into (precedence: CLI > environment > file > defaults)."""

from __future__ import annotations

import msgspec


class ServeConfig(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    model: str | None = None
    host: str = "127.0.0.1"
    port: int = 8000
    api_key: str | None = None
    max_batch: int = 8
    max_queue: int = 64
    device: str = "cpu"
    dtype: str = "float32"
    threads: int | None = None
    max_body_bytes: int = 1 << 20
    log_level: str = "INFO"
    log_format: str = "text"
    # Seconds that running requests get to finish after SIGTERM/SIGINT before they are cancelled.
    drain_timeout: float = 30.0
    # SPMD: ranks, parallel degrees (their product must equal nproc), restarts of the whole group by the agent.
    nproc: int = 1
    cfg_parallel: int = 1
    ulysses: int = 1
    max_restarts: int = 3
