"""Exact result cache (issue 34, part 5): a request identical in everything that decides its output is answered
with the result of the first, without a step.

What decides the output: the model (its source and family), every resolved parameter (prompt, size, steps,
guidance, seed, input images, ...), and the LoRA adapters it names, each by its registration (path, size, digest:
an adapter registered again under the same name is another adapter) and scale, plus an adapter fused into the
weights (`--lora-fuse`). Only requests whose client chose the seed are cached: a request without one asks for a
new image each time. Results are kept under a byte budget (`--result-cache-bytes`; 0, the default: off), the least
recently used forgotten first. Each tenant's results answer its own requests only. Event-loop thread only.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

import msgspec
import numpy as np

from diffusiond.engine.outputs import Completed, Sound
from diffusiond.models.params import SamplingParams


@dataclass(frozen=True)
class Kept:
    seed: int
    image: np.ndarray
    audio: Sound | None

    @property
    def nbytes(self) -> int:
        return self.image.nbytes + (self.audio.samples.nbytes if self.audio is not None else 0)


class ResultCache:
    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self.entries: OrderedDict[str, Kept] = OrderedDict()
        self.used = 0
        self.hits = 0
        self.misses = 0

    def key(self, model: str, params: SamplingParams, adapter: Any, tenant: str = "") -> str:
        """What decides a request's output, hashed, and whose it is. `adapter`: the model adapter (its LoRA
        registry). `tenant`: one tenant's results answer its own requests only (a hit takes milliseconds, a miss a
        whole generation: shared, the difference told one tenant what another had asked for)."""
        registry = getattr(adapter, "lora_registry", None)
        loras: list[Any] = []
        for lora in params.lora or ():
            entry = registry.entries.get(lora.name) if registry is not None else None
            version = None if entry is None else (entry.path, entry.nbytes, entry.sha256, id(entry))
            loras.append((lora.name, lora.scale, version))
        fused = registry.fused[:2] if registry is not None and registry.fused is not None else None
        h = hashlib.sha256(msgspec.json.encode([tenant, model, loras, fused]))
        h.update(msgspec.msgpack.encode(params))
        return h.hexdigest()

    def get(self, key: str) -> Kept | None:
        kept = self.entries.get(key)
        if kept is None:
            self.misses += 1
            return None
        self.entries.move_to_end(key)
        self.hits += 1
        return kept

    def put(self, key: str, event: Completed) -> None:
        audio = event.audio
        kept = Kept(event.seed, event.image.copy(), audio)
        if kept.nbytes > self.max_bytes or key in self.entries:
            return
        while self.used + kept.nbytes > self.max_bytes:
            _, old = self.entries.popitem(last=False)
            self.used -= old.nbytes
        self.entries[key] = kept
        self.used += kept.nbytes

    def answer(self, request_id: str, kept: Kept) -> Completed:
        return Completed(request_id, kept.seed, kept.image.copy(), {}, kept.audio, cached=True)
