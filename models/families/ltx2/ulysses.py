"""Ulysses for LTX-2 (models/families/ltx2/adapter.py): two sequences sharded at once, the video tokens and the audio
tokens.

Each rank holds a slice of both from the first block on, with the slices of every per-token tensor the blocks read:
the rotary angles of each modality's self-attention and of the audio <-> video cross-attention, and, for image to
video (a timestep per video token), the video's modulation embeddings. The four attentions whose keys are sharded
(video self, audio self, audio-to-video, video-to-audio) all-to-all their queries and keys to the whole sequences
for H/N heads and back (`kernels/ulysses.ulysses_cross`, each side with its own shard sizes); the cross-attentions
to the text need nothing (each rank's queries read the whole prompt). The last block's outputs are gathered.
"""

from __future__ import annotations

from typing import Any

import torch
from diffusers.models.transformers.transformer_ltx2 import apply_interleaved_rotary_emb, apply_split_rotary_emb

from diffusiond.kernels.ulysses import UlyssesGroup, ulysses_cross

# The block's per-token inputs, by the sequence they follow.
ROTARY = {"video_rotary_emb": "video", "ca_video_rotary_emb": "video", "audio_rotary_emb": "audio",
          "ca_audio_rotary_emb": "audio"}  # fmt: skip
MODULATION = {"temb": "video", "temb_ca_scale_shift": "video", "temb_ca_gate": "video", "temb_audio": "audio",
              "temb_ca_audio_scale_shift": "audio", "temb_ca_audio_gate": "audio"}  # fmt: skip
# The attentions over sharded keys: (query's sequence, key's sequence).
SHARDED_ATTENTION = {"attn1": ("video", "video"), "audio_attn1": ("audio", "audio"),
                     "audio_to_video_attn": ("video", "audio"), "video_to_audio_attn": ("audio", "video")}  # fmt: skip


class UlyssesLTX2AttnProcessor:
    """diffusers' `LTX2PerturbedAttnProcessor` (which is `LTX2AudioVideoAttnProcessor` where nothing is perturbed)
    with queries and keys sharded, each along its own sequence; the attention runs through `ulysses_cross`. STG's
    perturbation (the value in place of the attention, per row) and the per-head gates are per token: local."""

    _attention_backend = None
    _parallel_config = None

    def __init__(self, g: UlyssesGroup, shards: dict[str, list[int]], query: str, key: str) -> None:
        self.g, self.shards, self.query, self.key = g, shards, query, key

    def __call__(
        self,
        attn,
        hidden_states,
        encoder_hidden_states=None,
        attention_mask=None,
        query_rotary_emb=None,
        key_rotary_emb=None,
        perturbation_mask=None,
        all_perturbed=None,
    ):
        if attention_mask is not None:  # the pipelines pass none to these four (only IC-LoRA masks video)
            raise ValueError("LTX-2 under Ulysses takes no self- or cross-modal attention mask")
        context = hidden_states if encoder_hidden_states is None else encoder_hidden_states
        gate_logits = attn.to_gate_logits(hidden_states) if attn.to_gate_logits is not None else None
        value = attn.to_v(context)
        if all_perturbed is None:
            all_perturbed = perturbation_mask is not None and bool(torch.all(perturbation_mask == 0))
        if all_perturbed:
            out = value
        else:
            query, key = attn.norm_q(attn.to_q(hidden_states)), attn.norm_k(attn.to_k(context))
            if query_rotary_emb is not None:
                query = _rotate(attn, query, query_rotary_emb)
                key = _rotate(attn, key, key_rotary_emb if key_rotary_emb is not None else query_rotary_emb)
            # Explicit head sizes: a rank may hold no token of a one-token sequence (a one-frame clip's audio).
            q, k, v = (x.unflatten(2, (attn.heads, attn.head_dim)).transpose(1, 2) for x in (query, key, value))
            out = ulysses_cross(
                q, k, v, self.g, q_shards=self.shards[self.query], kv_shards=self.shards[self.key],
                backend=self._attention_backend,
            )  # fmt: skip
            out = out.transpose(1, 2).flatten(2, 3).to(query.dtype)
            if perturbation_mask is not None:
                out = torch.lerp(value, out, perturbation_mask)
        if gate_logits is not None:
            gates = 2.0 * torch.sigmoid(gate_logits)  # [B, S, H]
            out = (out.unflatten(2, (attn.heads, attn.head_dim)) * gates.unsqueeze(-1)).flatten(2, 3)
        return attn.to_out[1](attn.to_out[0](out))


def _rotate(attn, x: torch.Tensor, freqs: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """The processor's rotary embedding of x [B, S, D]; nothing to rotate in an empty shard (diffusers' reshapes
    cannot infer a size from zero elements)."""
    if x.shape[1] == 0:
        return x
    rotate = apply_interleaved_rotary_emb if attn.rope_type == "interleaved" else apply_split_rotary_emb
    return rotate(x, freqs)


def enable(transformer: Any, g: UlyssesGroup) -> None:
    """Shard `transformer`'s video and audio tokens across `g` (see the module's docstring)."""
    blocks = transformer.transformer_blocks
    shards: dict[str, list[int]] = {}
    spans: dict[str, slice] = {}

    def local(x: torch.Tensor, kind: str, dim: int, per_token: bool = True) -> torch.Tensor:
        # Whole-sequence tensors only: a modulation of one row per request ([B, 1, D]) serves every token (also
        # where the sequence is one token long, as an audio track of one frame is, and one rank holds none).
        span, whole = spans[kind], sum(shards[kind])
        if x.shape[dim] != whole or (whole == 1 and not per_token):
            return x
        return x.narrow(dim, span.start, span.stop - span.start)

    def shard(module, args, kwargs):
        kwargs = dict(kwargs)
        if module is blocks[0]:
            for kind, name in (("video", "hidden_states"), ("audio", "audio_hidden_states")):
                shards[kind] = g.split_sizes(kwargs[name].shape[1])
                spans[kind] = g.span(shards[kind])
            g.shards = shards["video"]  # what the shared bookkeeping (and the tests) read as this forward's split
            for kind, name in (("video", "hidden_states"), ("audio", "audio_hidden_states")):
                kwargs[name] = kwargs[name][:, spans[kind]]
        for name, kind in ROTARY.items():
            if kwargs.get(name) is not None:
                cos, sin = kwargs[name]
                dim = 1 if cos.dim() == 3 else 2  # interleaved [B, S, D]; split [B, H, S, D/2]
                kwargs[name] = (local(cos, kind, dim), local(sin, kind, dim))
        for name, kind in MODULATION.items():
            if kwargs.get(name) is not None:  # a timestep per video token (image to video): [B, S_v, D]
                kwargs[name] = local(kwargs[name], kind, 1, per_token=False)
        return args, kwargs

    def gather(module, args, kwargs, output):
        video, audio = output
        return g.gather_seq(video, shards=shards["video"]), g.gather_seq(audio, shards=shards["audio"])

    for block in blocks:
        for name, (query, key) in SHARDED_ATTENTION.items():
            getattr(block, name).set_processor(UlyssesLTX2AttnProcessor(g, shards, query, key))
        block.register_forward_pre_hook(shard, with_kwargs=True)
    blocks[-1].register_forward_hook(gather, with_kwargs=True)
