"""LoRA per request inside one batched forward: the multi-LoRA trick of LLM servers, applied to a DiT's linears.

Every linear that some loaded adapter targets gets a forward hook. The base linear runs once for the whole batch, as
without LoRA; the hook then adds `scale * alpha / r * (x A^T) B^T` to the rows of each request, with its own
adapters and scales. With one adapter in the batch: a pair of small matmuls over its rows. With several, one each
per row: every row's factors gathered and two batched matmuls, whatever the number of adapters (`_Gathered`). Rows
with several adapters: a pair of matmuls per (adapter, scale) group. LoRA rows are gathered and their deltas
scattered back; a batch without LoRA rows costs one attribute test per hooked linear; a model without loaded
adapters has no hooks.

Which rows belong to which request is the caller's to say: `LoraLayers.rows(selections)` around the transformer call,
one selection per batch row (the requests' CFG rows included), and `narrow(index)` around a call over a subset of
those rows (step caching's sub-batches). A hooked linear that sees another number of rows than the plan holds
raises: a delta applied to the wrong rows would change images silently.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch

from diffusiond.kernels.host import to_device


@dataclass(frozen=True, eq=False)
class LoraWeights:
    """One adapter's factors for one linear: `down` (A) [r, in] and `up` (B) [out, r] times PEFT's `alpha / r` (or
    `alpha / sqrt(r)` with rsLoRA) as the checkpoint's configuration gives it, so that a row's delta is its
    request's scale times `(x A^T) up^T`, whatever adapter the row has."""

    down: torch.Tensor
    up: torch.Tensor


@dataclass(eq=False)
class Lora:
    """A loaded adapter: its weights per linear (by module name within the denoiser) and their bytes."""

    name: str
    layers: dict[str, LoraWeights]
    nbytes: int = field(init=False)

    def __post_init__(self) -> None:
        self.nbytes = sum(w.down.nbytes + w.up.nbytes for w in self.layers.values())


# A request's adapters and their scales; () for none.
Selection = tuple[tuple[Lora, float], ...]


class RowPlan:
    """The adapters of each row of one transformer call, grouped: (lora, scale, rows) per group, rows None when
    the group is every row."""

    def __init__(self, selections: Sequence[Selection], device: torch.device) -> None:
        self.selections = list(selections)
        self.num_rows = len(selections)
        self.device = device
        members: dict[tuple[int, float], tuple[Lora, float, list[int]]] = {}
        for row, selection in enumerate(selections):
            for lora, scale in selection:
                members.setdefault((id(lora), scale), (lora, scale, []))[2].append(row)
        self.groups = [
            (lora, scale, None if len(rows) == self.num_rows else to_device(rows, device))
            for lora, scale, rows in members.values()
        ]
        self.gathered = _Gathered.of(list(members.values()), self.num_rows, device) if len(members) > 1 else None

    def narrow(self, index: Sequence[int]) -> RowPlan | None:
        """The plan of a call over rows `index` of this one (in that order); None when none of them has LoRA."""
        selections = [self.selections[i] for i in index]
        return RowPlan(selections, self.device) if any(selections) else None

    def apply(self, name: str, x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """`out` (the base linear's output for input `x`, rows first) with each group's delta added to its rows."""
        if x.shape[0] != self.num_rows:
            raise RuntimeError(
                f"LoRA: {name} got {x.shape[0]} rows, the batch plan has {self.num_rows} (a call over a subset of "
                "the batch must narrow the plan)"
            )
        if self.gathered is not None and (delta := self.gathered.delta(name, x)) is not None:
            rows = self.gathered.index
            return out + delta.to(out.dtype) if rows is None else out.index_add(0, rows, delta.to(out.dtype))
        for lora, scale, rows in self.groups:
            weights = lora.layers.get(name)
            if weights is None:
                continue
            mine = x if rows is None else x.index_select(0, rows)
            delta = torch.nn.functional.linear(
                torch.nn.functional.linear(mine.to(weights.down.dtype), weights.down), weights.up
            )
            delta = (delta * scale).to(out.dtype)  # [k, ..., out]
            out = out + delta if rows is None else out.index_add(0, rows, delta)
        return out


class _Gathered:
    """Several adapters in one call, one per LoRA row: every row's factors gathered and applied in two batched
    matmuls, so the cost per linear does not grow with the number of adapters (the group loop runs 4 kernels per
    adapter). Linears where the adapters' ranks differ, or some adapter has no factors, take the group loop."""

    def __init__(self, loras: list[Lora], row_group: list[int], index: torch.Tensor | None, scales: torch.Tensor):
        self.loras = loras
        self.row_group = row_group  # per LoRA row (in row order): its adapter in `loras`
        self.index = index  # the LoRA rows, None when every row has one
        self.scales = scales  # [k, 1, 1]: each row's request scale

    @staticmethod
    def of(members: list[tuple[Lora, float, list[int]]], num_rows: int, device: torch.device) -> _Gathered | None:
        owner: dict[int, int] = {}
        for g, (_, _, rows) in enumerate(members):
            for row in rows:
                if row in owner:  # a row with two adapters: the group loop adds both
                    return None
                owner[row] = g
        rows = sorted(owner)
        index = None if len(rows) == num_rows else to_device(rows, device)
        scales = to_device([members[owner[r]][1] for r in rows], device).view(-1, 1, 1)
        return _Gathered([lora for lora, _, _ in members], [owner[r] for r in rows], index, scales)

    def delta(self, name: str, x: torch.Tensor) -> torch.Tensor | None:
        """The LoRA rows' deltas [k, ..., out] for linear `name` on input `x`, or None (take the group loop)."""
        weights = [lora.layers.get(name) for lora in self.loras]
        if any(w is None for w in weights) or len({w.down.shape for w in weights}) != 1:
            return None
        mine = x if self.index is None else x.index_select(0, self.index)  # [k, ..., in]
        flat = mine.reshape(mine.shape[0], -1, mine.shape[-1]).to(weights[0].down.dtype)  # [k, L, in]
        down = torch.stack([weights[g].down for g in self.row_group])  # [k, r, in]
        up = torch.stack([weights[g].up for g in self.row_group])  # [k, out, r]
        delta = torch.bmm(torch.bmm(flat, down.transpose(1, 2)), up.transpose(1, 2)) * self.scales  # [k, L, out]
        return delta.reshape(*mine.shape[:-1], delta.shape[-1])


class LoraLayers:
    """The hooks on one denoiser's linears and the row plan of the call running now."""

    def __init__(self, module: torch.nn.Module) -> None:
        self.module = module
        self._plan: RowPlan | None = None
        self._hooks: dict[str, torch.utils.hooks.RemovableHandle] = {}
        self._linears = {name: m for name, m in module.named_modules() if isinstance(m, torch.nn.Linear)}
        module._diffusiond_lora = self  # found again by `of()` (step caching's sub-batches)

    @staticmethod
    def of(module: torch.nn.Module) -> LoraLayers | None:
        return getattr(module, "_diffusiond_lora", None)

    def linear(self, name: str) -> torch.nn.Linear | None:
        return self._linears.get(name)

    def hook(self, names: Sequence[str]) -> None:
        """Hooks on these linears (idempotent)."""
        for name in names:
            if name in self._hooks:
                continue
            linear = self._linears[name]
            self._hooks[name] = linear.register_forward_hook(self._hook_for(name))

    def unhook(self, keep: set[str]) -> None:
        """Removes the hooks of linears that no loaded adapter targets any more."""
        for name in [n for n in self._hooks if n not in keep]:
            self._hooks.pop(name).remove()

    @property
    def hooked(self) -> int:
        return len(self._hooks)

    def _hook_for(self, name: str):
        def hook(module: torch.nn.Module, args: tuple, output: torch.Tensor) -> torch.Tensor | None:
            plan = self._plan
            if plan is None:
                return None
            return plan.apply(name, args[0], output)

        return hook

    @contextmanager
    def rows(self, selections: Sequence[Selection | None]) -> Iterator[None]:
        """The transformer calls inside run over these rows, one selection per row."""
        resolved = [s or () for s in selections]
        plan = RowPlan(resolved, next(self.module.parameters()).device) if any(resolved) else None
        previous, self._plan = self._plan, plan
        try:
            yield
        finally:
            self._plan = previous

    @contextmanager
    def narrow(self, index: Sequence[int] | None) -> Iterator[None]:
        """Calls inside run over rows `index` of the current plan (None: all of them)."""
        previous = self._plan
        if index is not None and previous is not None:
            self._plan = previous.narrow(index)
        try:
            yield
        finally:
            self._plan = previous


class LoraLayerSet:
    """The hooks of several denoisers of the same architecture (Wan 2.2 A14B's two experts) for one registry: an
    adapter's linears are hooked in each; which adapters apply where is the calls' row plans' business (each
    denoiser's own `LoraLayers.rows`)."""

    def __init__(self, members: Sequence[LoraLayers]) -> None:
        self.members = list(members)

    def linear(self, name: str) -> torch.nn.Linear | None:
        raise ValueError("an adapter cannot be fused into the weights of several denoisers (--lora-fuse)")

    def hook(self, names: Sequence[str]) -> None:
        for member in self.members:
            member.hook(names)

    def unhook(self, keep: set[str]) -> None:
        for member in self.members:
            member.unhook(keep)

    @property
    def hooked(self) -> int:
        return sum(member.hooked for member in self.members)


def fuse(layers: LoraLayers, lora: Lora, scale: float) -> dict[str, torch.Tensor]:
    """Adds `scale * (alpha / r) B A` into each targeted linear's weight; returns the original weights (on CPU) that
    `unfuse` puts back exactly."""
    saved = {}
    with torch.no_grad():
        for name, weights in lora.layers.items():
            linear = layers.linear(name)
            assert linear is not None
            saved[name] = linear.weight.detach().to("cpu", copy=True)
            delta = (weights.up.float() @ weights.down.float()) * scale
            linear.weight.add_(delta.to(linear.weight.dtype))
    return saved


def unfuse(layers: LoraLayers, saved: dict[str, torch.Tensor]) -> None:
    with torch.no_grad():
        for name, weight in saved.items():
            linear = layers.linear(name)
            assert linear is not None
            linear.weight.copy_(weight.to(linear.weight.device))
