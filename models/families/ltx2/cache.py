"""Step caches on LTX-2 (models/stepcache/methods.py): fbcache, DBCache (with TaylorSeer and SCM's step mask) and
x0cache, over its video and audio tokens together.

A block of LTX-2 updates two sequences, the video's and the audio's (each attends to the other); the cache treats
them as one: each row's video and audio tokens flattened and laid end to end ([R, S_v * D_v + S_a * D_a]), so a
row's change signal reads both streams and a reusing row adds the residual both got. Everything around the blocks
is the transformer's own forward (its embeddings, modulations, rotary angles, masks and output layers): for the
call, its block list is one span (models/stepcache/span.py) that runs the real blocks through `cached_blocks`, so
threshold 0 is the same blocks in the same order as the uncached call.

Decisions are per row, not per request: a request's rows run in several calls of one step (its CFG rows in the
first, its STG and modality rows in calls of their own, each beside other requests' rows), so each row (request,
pass, prompt: `RowState`) keeps a cache of its own and decides from its own change. The positive row of the CFG pass
keeps the request's cache (what its reuse count reads). Not with CFG-parallel (a row's pass moves between ranks as
requests come and go, and its cache would stay behind) nor with Ulysses (the blocks' hooks shard the tokens the span
hands them): refused at start.
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import partial
from typing import Any

import torch

from diffusiond.models.stepcache.forwards import lora_narrows
from diffusiond.models.stepcache.methods import Batch, Method, cached_blocks, settle
from diffusiond.models.stepcache.span import sigmas, spanned


def pack(video: torch.Tensor, audio: torch.Tensor) -> torch.Tensor:
    """Video [R, S_v, D_v] and audio [R, S_a, D_a] tokens as one row each: [R, S_v * D_v + S_a * D_a]."""
    return torch.cat([video.flatten(1), audio.flatten(1)], dim=1)


def unpack(packed: torch.Tensor, shapes: tuple[torch.Size, torch.Size]) -> tuple[torch.Tensor, torch.Tensor]:
    cut = shapes[0].numel()
    return packed[:, :cut].unflatten(1, shapes[0]), packed[:, cut:].unflatten(1, shapes[1])


class _Joint:
    """An LTX-2 block as `cached_blocks` calls blocks (`block(hidden_states, encoder_hidden_states, temb, **rows)`,
    returning the text and the tokens): the rows' video and audio tokens packed in and out, the video's text read and
    returned unchanged, the rotary angles (pairs) passed as two row arguments each. `perturbed`: an STG call's block
    whose self-attention every row perturbs (the pipeline's mask of zeros)."""

    def __init__(self, block: Any, shapes: tuple[torch.Size, torch.Size], perturbed: bool) -> None:
        self.block, self.shapes, self.perturbed = block, shapes, perturbed

    def __call__(
        self, hidden_states: torch.Tensor, encoder_hidden_states: torch.Tensor, temb: torch.Tensor, **kwargs: Any
    ):
        video, audio = unpack(hidden_states, self.shapes)
        pairs = {name[:-4] for name in kwargs if name.endswith(":cos")}
        for name in pairs:
            kwargs[name] = (kwargs.pop(f"{name}:cos"), kwargs.pop(f"{name}:sin"))
        mask = video.new_zeros(video.shape[0], 1, 1) if self.perturbed else None
        video, audio = self.block(
            hidden_states=video,
            audio_hidden_states=audio,
            encoder_hidden_states=encoder_hidden_states,
            temb=temb,
            perturbation_mask=mask,
            all_perturbed=self.perturbed,
            **kwargs,
        )
        return encoder_hidden_states, pack(video, audio)


def _blocks(method: Method, states: Sequence[Any], stg: set[int], narrows, blocks: Sequence[Any], **kwargs: Any):
    """What the transformer's forward hands its first block, through every block with a decision per row
    (`states`: `RowState`s): the video and audio tokens after the last."""
    video, audio = kwargs.pop("hidden_states"), kwargs.pop("audio_hidden_states")
    enc, temb = kwargs.pop("encoder_hidden_states"), kwargs.pop("temb")
    kwargs.pop("perturbation_mask"), kwargs.pop("all_perturbed")  # per block: `_Joint.perturbed`
    count = video.shape[0]
    rows: dict[str, torch.Tensor | None] = {}
    fixed: dict[str, Any] = {}
    for name, value in kwargs.items():
        if isinstance(value, tuple):  # rotary angles (cos, sin), a row each
            rows[f"{name}:cos"], rows[f"{name}:sin"] = value
        elif value is None or (torch.is_tensor(value) and value.dim() > 0 and value.shape[0] == count):
            rows[name] = value
        else:
            fixed[name] = value
    shapes = (video.shape[1:], audio.shape[1:])
    joints = [_Joint(block, shapes, i in stg) for i, block in enumerate(blocks)]
    batch = Batch(pack(video, audio), enc, temb, 1, states, rows, narrows, fixed, context=True)
    return unpack(cached_blocks(method, joints, batch), shapes)


@torch.inference_mode()
def ltx2_forward(
    method: Method,
    batched: dict[str, Any],
    shared: dict[str, Any],
    rows: int,
    states: Sequence[Any],
    *,
    transformer: Any,
) -> torch.Tensor:
    """One LTX-2 transformer call (`batched`: its arguments) with a cache decision per row: the float32 outputs
    packed ([R, S_v * C_v + S_a * C_a]); x0cache predicts with each row's noise level (`RowState.sigma`)."""
    stg = set(batched.get("spatio_temporal_guidance_blocks") or ())
    with spanned(transformer, partial(_blocks, method, states, stg, lora_narrows(transformer))):
        video, audio = transformer(**batched)
    x = pack(batched["hidden_states"].float(), batched["audio_hidden_states"].float())
    return settle(method, pack(video.float(), audio.float()), x, sigmas(states), rows, states)
