"""A step cache inside a transformer's own forward, for families whose forward does more around its blocks than is
worth writing again (LTX-2's two sequences, HunyuanVideo-1.5's text reordering) and whose rows per request vary
between a step's calls or from step to step.

`spanned(transformer, run)`: for one call, the transformer's block list is one `Span`; what the forward hands its
first block goes to `run` with the real blocks (which runs them through `methods.cached_blocks`), and what `run`
returns is what the last block would have. Everything before and after the blocks is the forward's own, so with
every row computing the call is the uncached one.

`RowState`: one row of a request as the cache reads it (the request's parameters and step, the row's own cache).
Where a request's rows are not the same at every step (a pass of their own, a negative row only on the guided
steps), each row keeps its own cache and decides from its own change; the request's primary row keeps
`RequestState.cache` (what its reuse count reads), the others `RequestState.row_caches`.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import torch


class RowState:
    """One transformer row of a request (`key`: which; `primary`: the row whose cache is the request's)."""

    __slots__ = ("key", "primary", "state")

    def __init__(self, state: Any, key: Hashable, primary: bool) -> None:
        self.state, self.key, self.primary = state, key, primary

    @property
    def params(self) -> Any:
        return self.state.params

    @property
    def step_index(self) -> int:
        return self.state.step_index

    @property
    def total_steps(self) -> int:
        return self.state.total_steps

    @property
    def sigma(self) -> torch.Tensor:
        """The request's noise level at this step (x0cache's prediction, x0 = x - sigma * v)."""
        sampler = self.state.sampler
        return sampler.device_sigmas[sampler.index]

    @property
    def cache(self) -> Any:
        return self.state.cache if self.primary else self.state.row_caches.get(self.key)

    @cache.setter
    def cache(self, value: Any) -> None:
        if self.primary:
            self.state.cache = value
        else:
            self.state.row_caches[self.key] = value


class Span(torch.nn.Module):
    """Stands in for a transformer's blocks for one call (see the module's docstring)."""

    def __init__(self, blocks: Sequence[Any], run: Callable[..., Any]) -> None:
        super().__init__()
        self._blocks = list(blocks)  # a plain list: the blocks stay the transformer's modules
        self._run = run

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self._run(self._blocks, *args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        """What a forward reads of its blocks besides calling them (Qwen-Image 2.1: their attention processors),
        from the first block."""
        try:
            return super().__getattr__(name)
        except AttributeError:
            blocks = self.__dict__.get("_blocks")
            if not blocks:
                raise
            return getattr(blocks[0], name)


class TextFirst:
    """A block that returns (image, text) as `cached_blocks` calls blocks: (text, image) out (HunyuanVideo-1.5's,
    GLM-Image's); its other attributes its own (TeaCache reads its `norm1`)."""

    def __init__(self, block: Any) -> None:
        self.block = block

    def __getattr__(self, name: str) -> Any:
        return getattr(self.block, name)

    def __call__(self, **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
        image, text = self.block(**kwargs)
        return text, image


def sigmas(states: Sequence[RowState]) -> torch.Tensor:
    """Each row's noise level [R]."""
    return torch.stack([s.sigma for s in states])


@contextmanager
def spanned(transformer: Any, run: Callable[..., Any]) -> Iterator[None]:
    blocks = transformer.transformer_blocks
    transformer.transformer_blocks = torch.nn.ModuleList([Span(blocks, run)])
    try:
        yield
    finally:
        transformer.transformer_blocks = blocks
