"""A model's prompts: encoded by the family's encoder, kept by text (bounded in bytes) for every request that repeats
one, and encoded once for a group of ranks. A family's adapter holds one (`FlowMatchAdapter.prompts`)."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import Any

import torch

from diffusiond.models.params import SamplingParams


class PromptCache:
    """Encoded prompts by text, least recently used first out, bounded in bytes. Prompts repeat: every CFG request
    without a negative prompt encodes "", the n images of one OpenAI request share theirs, users regenerate. A
    cached text skips the text encoders (measured: 8 of 16 encodings per batch of 8 CFG requests are the same "").
    Rows are what the family's encoder gives for that text alone, so a request's conditioning does not depend on
    what else was encoded with it."""

    def __init__(self, budget_bytes: int) -> None:
        self.budget = budget_bytes
        self.bytes = 0
        self.hits = 0
        self.misses = 0
        self._entries: OrderedDict[str, tuple[torch.Tensor, ...]] = OrderedDict()

    def lookup(self, texts: Sequence[str], encode) -> dict[str, tuple[torch.Tensor, ...]]:
        """Tensors per text; `encode(missing texts)` -> one tuple of row tensors [1, ...] per text, in order."""
        found: dict[str, tuple[torch.Tensor, ...]] = {}
        missing: list[str] = []
        for text in dict.fromkeys(texts):
            entry = self._entries.get(text)
            if entry is None:
                missing.append(text)
            else:
                self._entries.move_to_end(text)
                found[text] = entry
        self.hits += len(found)
        self.misses += len(missing)
        if missing:
            for text, entry in zip(missing, encode(missing), strict=True):
                found[text] = entry
                self._put(text, entry)
        return found

    def _put(self, text: str, entry: tuple[torch.Tensor, ...]) -> None:
        size = sum(t.numel() * t.element_size() for t in entry)
        if size > self.budget:
            return
        self._entries[text] = entry
        self.bytes += size
        while self.bytes > self.budget:
            _, old = self._entries.popitem(last=False)
            self.bytes -= sum(t.numel() * t.element_size() for t in old)


# Encoded prompts kept per model: 64 MiB is ~12 prompts of real SD3 (T5 at 4096 x 333 floats) and thousands of a
# small model's.
PROMPT_CACHE_BYTES = 64 << 20


class Prompts:
    """A model's prompts, encoded by the family's encoder through the cache: `encode(texts)` gives one tuple of
    tensors per text (the family's `_encode`), `uses_cfg(params)` says whose negative prompt is encoded too. In a
    group of ranks, once enabled (`share`), rank 0 encodes every prompt of a plan before prepare and the others
    receive the tensors (kernels/collectives.SharedEncoding), kept until the plan is prepared."""

    def __init__(self, encode: Callable[[list[str]], list[tuple[torch.Tensor, ...]]], uses_cfg: Callable) -> None:
        self.encode, self.uses_cfg = encode, uses_cfg
        self.cache = PromptCache(PROMPT_CACHE_BYTES)
        self.shared: Any = None
        self._shared_texts: dict[str, tuple[torch.Tensor, ...]] = {}

    def keys(self, params: Sequence[SamplingParams]) -> tuple[list[bool], list[str]]:
        """Which requests use CFG, and the cache's keys of their prompts and (with CFG) negative prompts: the texts
        themselves (`PromptsWithImages`: and the images they are read beside)."""
        cfg = [self.uses_cfg(p) for p in params]
        keys = [self.key(p.prompt, p) for p in params]
        keys += [self.negative_key(p.negative_prompt or "", p) for p, c in zip(params, cfg, strict=True) if c]
        return cfg, keys

    def key(self, text: str, params: SamplingParams) -> str:
        """The cache's key of `text`, one of the request's prompts."""
        return text

    def negative_key(self, text: str, params: SamplingParams) -> str:
        """The cache's key of the request's negative prompt `text` (as a prompt's, unless a family reads it apart)."""
        return self.key(text, params)

    def lookup(self, params: Sequence[SamplingParams]) -> tuple[list[bool], dict[str, tuple[torch.Tensor, ...]]]:
        """Which requests use CFG, and the encoded prompts (and negative prompts of those) by key, through the cache:
        one encoder call for the texts it misses."""
        cfg, texts = self.keys(params)
        if self.shared is None:
            return cfg, self.cache.lookup(texts, self.encode)
        # In a group the encodings were shared before prepare (`encode_together`): prepare runs no collective.
        missing = [t for t in texts if t not in self._shared_texts]
        if missing:
            raise RuntimeError(f"no shared encoding of {len(missing)} prompt(s) on this rank")
        return cfg, {t: self._shared_texts[t] for t in texts}

    def share(self, shared: Any) -> None:
        """Prompts encoded once for the group: rank 0 encodes, the others receive (`shared`: SharedEncoding)."""
        self.shared = shared

    def encode_together(self, params: Sequence[SamplingParams]) -> None:
        """A group's stage before prepare, run by every rank together: the prompts of these requests encoded once
        (rank 0) and shared, through the cache, and kept for the next prepare. No-op on one rank."""
        if self.shared is None:
            return
        _, texts = self.keys(params)
        self._shared_texts.update(self.cache.lookup(texts, self._encode_shared))

    def _encode_shared(self, texts: list[str]) -> list[tuple[torch.Tensor, ...]]:
        return self.shared.run("\x00".join(texts), lambda: self.encode(texts))

    def prepared(self) -> None:
        """After prepare: the shared encodings of that plan are no longer needed here (the cache keeps its own)."""
        self._shared_texts.clear()


class PromptsWithImages(Prompts):
    """Prompts of a family whose encoding reads the request's images: each keyed by `context(params)` (a digest of
    the images, and whatever else of the request the encoding reads: LongCat-Image-Edit's output size) and its text;
    what the encoder needs of those requests (`inputs(params)`: the files, decoded only when a key of theirs misses
    the cache) waits in `pending` by context. A request without an image: its text alone."""

    def __init__(
        self,
        encode: Callable[[list[str]], list[tuple[torch.Tensor, ...]]],
        uses_cfg: Callable,
        context: Callable[[SamplingParams], str],
        inputs: Callable[[SamplingParams], Any],
    ) -> None:
        super().__init__(encode, uses_cfg)
        self.context, self.inputs = context, inputs
        self.pending: dict[str, Any] = {}

    def key(self, text: str, params: SamplingParams) -> str:
        """The cache's key of `text` read beside the request's images (none: the text alone)."""
        if params.image is None:
            return text
        return f"{self.context(params)}\x00{text}"

    def keys(self, params: Sequence[SamplingParams]) -> tuple[list[bool], list[str]]:
        """Which requests use CFG, and the keys of their prompts (and negative prompts), until the next plan's."""
        self.pending = {self.context(p): self.inputs(p) for p in params if p.image is not None}
        return super().keys(params)
