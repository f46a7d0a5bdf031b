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
# still shows. (logger, text it contains)
NOISE: tuple[tuple[str, str], ...] = (
    # The PIL image processors serve our pipelines; torchvision is not a dependency (its wheels are CUDA builds).
    ("transformers.utils.import_utils", "requires torchvision (not installed)"),
)


class _DropNoise(logging.Filter):
    def __init__(self, text: str) -> None:
        super().__init__()
        self.text = text

    def filter(self, record: logging.LogRecord) -> bool:
        return self.text not in record.getMessage()


def quiet_library_noise() -> None:
    """Installed before the libraries are imported (their loggers are the same objects, looked up by name)."""
    for name, text in NOISE:
        logger = logging.getLogger(name)
        if not any(isinstance(f, _DropNoise) and f.text == text for f in logger.filters):
            logger.addFilter(_DropNoise(text))
