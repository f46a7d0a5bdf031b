"""Which LoRA adapters apply to which rows of a transformer call: a model holds one (`FlowMatchAdapter.loras`), its
layers set once LoRA is enabled; the parallel wiring and the families' own calls ask it for each call's plan."""

from __future__ import annotations

from collections.abc import Sequence
from contextlib import nullcontext
from typing import Any

from diffusiond.kernels.lora_rows import LoraLayers


class LoraRows:
    """The denoiser's LoRA layers (kernels/lora_rows.LoraLayers), None until LoRA is enabled."""

    def __init__(self) -> None:
        self.layers: LoraLayers | None = None

    def of(self, state: Any) -> Any:
        """The adapters that apply to `state`'s rows in the call running now (`RequestState.lora`)."""
        return state.lora

    def rows(self, selections: Sequence[Any]) -> Any:
        """The LoRA plan of a transformer call over rows with these selections, as a context."""
        return self.layers.rows(selections) if self.layers is not None else nullcontext()

    def plan(self, states: Sequence[Any], per_state: int = 1) -> Any:
        """The plan of a call over `per_state` rows of each of `states`, in order."""
        return self.rows([self.of(s) for s in states for _ in range(per_state)])


class ExpertLoraRows(LoraRows):
    """Two experts (Wan 2.2 A14B): each choice applies in the expert it names (`LoraChoice.expert`); `expert` is the
    one whose call runs now (set by the family before each), `experts` each one's layers."""

    def __init__(self) -> None:
        super().__init__()
        self.expert = 0
        self.experts: list[LoraLayers] = []

    def of(self, state: Any) -> Any:
        if len(self.experts) < 2 or not state.lora:
            return state.lora
        choices = state.params.lora or ()
        return tuple(
            selected for selected, c in zip(state.lora, choices, strict=True) if (c.expert or 1) - 1 == self.expert
        )

    def rows(self, selections: Sequence[Any]) -> Any:
        if not self.experts:
            return super().rows(selections)
        return self.experts[self.expert].rows(selections)
