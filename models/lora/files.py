"""LoRA files and names, checked without torch (start-up validation runs these before anything loads): a name
requests may use, a readable .safetensors file (never a pickle), the adapters to register at start (`--lora`,
`--lora-dir`), and the one folder run-time loading reads from. Reading an adapter's factors is
models/lora/registry.py's `read_lora`."""

from __future__ import annotations

import hashlib
import json
import os
import re
import struct
from collections.abc import Sequence

from diffusiond.models.params import LORA_NAME

NAME = re.compile(LORA_NAME)
# A safetensors header larger than this is not a LoRA file (the format allows 100 MB; a LoRA of 10,000 tensors has
# ~1.5 MB), and it is parsed before anything else is read.
MAX_HEADER_BYTES = 8 << 20


class LoraError(ValueError):
    """A LoRA file or name that cannot be used; the message says why (HTTP 400, a start-up error)."""


def check_name(name: str) -> str:
    if not NAME.match(name):
        raise LoraError(
            f"LoRA name {name!r}: use 1-64 letters, digits, '.', '_' or '-', starting with a letter or digit"
        )
    return name


def file_digest(path: str) -> str:
    """The file's SHA-256 (hex): what every rank checks it read the same bytes by."""
    try:
        with open(path, "rb") as f:
            return hashlib.file_digest(f, "sha256").hexdigest()
    except OSError as exc:
        raise LoraError(f"{path}: cannot be read: {exc.strerror or exc}") from None


def check_safetensors(path: str, max_bytes: int | None = None) -> None:
    """A readable file whose header is safetensors' (8-byte length, then a JSON object), before anything parses it,
    and of at most `max_bytes` (it is read whole on every rank)."""
    if not path.endswith(".safetensors"):
        raise LoraError(f"{path}: LoRA files must be .safetensors (pickled checkpoints are never loaded)")
    if "\x00" in path:
        raise LoraError(f"{path!r}: a path has no NUL characters")
    try:
        with open(path, "rb") as f:
            if max_bytes is not None and (size := os.fstat(f.fileno()).st_size) > max_bytes:
                raise LoraError(f"{path}: {size} bytes, more than fits in the LoRA budget (--lora-cache-bytes)")
            head = f.read(8)
            size = struct.unpack("<Q", head)[0] if len(head) == 8 else -1
            if not 2 <= size <= MAX_HEADER_BYTES:
                raise LoraError(f"{path}: not a safetensors file")
            header = json.loads(f.read(size))
    except FileNotFoundError:
        raise LoraError(f"{path}: no such file") from None
    except IsADirectoryError:
        raise LoraError(f"{path}: is a directory") from None
    except PermissionError:
        raise LoraError(f"{path}: not readable") from None
    except (UnicodeDecodeError, json.JSONDecodeError):
        raise LoraError(f"{path}: not a safetensors file") from None
    if not isinstance(header, dict):
        raise LoraError(f"{path}: not a safetensors file")


def startup_specs(pairs: Sequence[str], directory: str | None) -> list[tuple[str, str]]:
    """(name, path) of the adapters to register at start: each NAME=PATH, then every .safetensors file of
    `directory` by its name without the suffix (pure Python: start-up validation runs it before loading)."""
    specs: list[tuple[str, str]] = []
    for pair in pairs:
        name, sep, path = pair.partition("=")
        if not sep or not name or not path:
            raise LoraError(f"--lora {pair!r}: expected NAME=PATH")
        specs.append((check_name(name), os.path.abspath(os.path.expanduser(path))))
    if directory is not None:
        if not os.path.isdir(directory):
            raise LoraError(f"--lora-dir {directory}: not a directory")
        for entry in sorted(os.listdir(directory)):
            if entry.endswith(".safetensors"):
                # The rule run-time loading follows: no symlink out of the folder.
                specs.append((check_name(entry.removesuffix(".safetensors")), in_directory(directory, entry)))
    names = [name for name, _ in specs]
    if duplicate := next((n for n in names if names.count(n) > 1), None):
        raise LoraError(f"two LoRA adapters are named {duplicate!r}")
    return specs


def in_directory(directory: str | None, path: str) -> str:
    """`path` (relative to `directory`, or absolute) resolved, if it lies inside `directory` (run-time loading reads
    nothing else); LoraError otherwise."""
    if directory is None:
        raise LoraError("adding adapters at run time needs --lora-dir: the folder they may be loaded from")
    if "\x00" in path:
        raise LoraError(f"{path!r}: a path has no NUL characters")
    root = os.path.realpath(directory)
    full = os.path.realpath(os.path.join(root, path))
    if os.path.commonpath([root, full]) != root:
        raise LoraError(f"{path}: outside --lora-dir")
    return full
