"""Logging setup: human-readable lines, or one JSON object per line (`--log-format json`) for log shippers.

Structured fields passed as `extra={"fields": {...}}` (the per-request line carries request_id, outcome, steps and
timings) become top-level JSON keys.
"""

from __future__ import annotations

import logging
import time

import msgspec


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        entry = {
            "ts": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created)) + f".{int(record.msecs):03d}Z",
            "level": record.levelname.lower(),
            "logger": record.name,
            "message": record.getMessage(),
        }
        fields = getattr(record, "fields", None)
        if isinstance(fields, dict):
            entry.update(fields)
        if record.exc_info:
            entry["exception"] = self.formatException(record.exc_info)
        return msgspec.json.encode(entry).decode()


def configure_logging(level: str = "INFO", fmt: str = "text") -> None:
    handler = logging.StreamHandler()
    if fmt == "json":
        handler.setFormatter(JsonFormatter())
    else:
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())


# Library messages that tell an operator of diffusiond nothing, dropped where they are logged; every other warning
# still shows. (logger, text it contains, dropped only on hosts without CUDA)
NOISE: tuple[tuple[str, str, bool], ...] = (
    # The PIL image processors serve our pipelines; torchvision is not a dependency (its wheels are CUDA builds).
    ("transformers.utils.import_utils", "requires torchvision (not installed)", False),
    # torchao (the quant extra), at import: its CUDA kernel libraries and triton cannot load on a host without CUDA
    # (on a GPU host these still show); a deprecation addressed to torchao's own code; and diffusers' note on
    # loading torchao-serialized checkpoints, which diffusiond never loads (it quantizes after loading).
    ("torchao", "Failed to load", True),
    ("torchao.kernel.intmm", "Detected no triton", True),
    ("torch.utils._pytree", "is an Enum subclass and is now natively supported", False),
    ("diffusers.quantizers.torchao.torchao_quantizer", "Unable to import `torchao` Tensor objects", False),
)


class _DropNoise(logging.Filter):
    def __init__(self, text: str, without_cuda_only: bool = False) -> None:
        super().__init__()
        self.text = text
        self.without_cuda_only = without_cuda_only

    def filter(self, record: logging.LogRecord) -> bool:
        if self.text not in record.getMessage():
            return True
        if self.without_cuda_only:
            import torch  # imported by whoever logs this

            return torch.cuda.is_available()
        return False


def quiet_library_noise() -> None:
    """Installed before the libraries are imported (their loggers are the same objects, looked up by name)."""
    for name, text, without_cuda_only in NOISE:
        logger = logging.getLogger(name)
        if not any(isinstance(f, _DropNoise) and f.text == text for f in logger.filters):
            logger.addFilter(_DropNoise(text, without_cuda_only))
