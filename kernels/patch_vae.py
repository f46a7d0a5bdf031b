"""Patch-parallel VAE decoding: one image's decode split into horizontal strips across the ranks of a group, with
results equal to the whole decode (to float rounding), gathered on every rank.

A 2D VAE decoder (diffusers' `Decoder`: 3x3 convolutions, group norms, nearest upsampling, one attention at latent
resolution) is made strip-aware in place, and only while a `StripGroup` is active:
- each 3x3 convolution gets its missing neighbour rows (the halo: padding rows) from the ranks above and below,
  and zeros at the image's edges, exactly the zero padding the whole decode sees;
- each group norm computes its statistics over every strip (sums and squared sums all-reduced, in float64);
- the attention (latent resolution, the cheapest place) runs over the whole image, gathered, and keeps its strip;
- nearest upsampling and 1x1 convolutions are local already.
The decoder's input is cut into strips of latent rows (shares differ by at most one row) and its output strips are
all-gathered. Inactive, the decoder is the one it was (previews, the shared decode of several requests).

A video VAE's causal 3-D decoder (Wan's, Qwen-Image's: `make_video_strip_aware`) splits the same way, frame by frame
as it decodes: its 3-D convolutions take their halo after joining the previous chunk's cached frames, its norms are
over channels (local), and its per-frame attention runs over the gathered frame.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
import torch.nn.functional as F

from diffusiond.kernels.collectives import collective


@dataclass
class StripGroup:
    group: dist.ProcessGroup
    rank: int
    size: int
    active: bool = False
    # Rows each rank holds at the current layer's resolution: set at the decoder's input, scaled by upsampling.
    rows: list[int] = field(default_factory=list)
    # (rows, width) of the last strip this rank decoded (its share of the image).
    last_strip: tuple[int, int] = (0, 0)

    def _p2p(self, ops: list) -> None:
        if ops:
            with collective("vae halo send/recv"):
                for work in dist.batch_isend_irecv(ops):
                    work.wait()

    def halo(self, x: torch.Tensor, width: int, dim: int = 2) -> torch.Tensor:
        """x [B, C, rows, W] (a video's [B, C, T, rows, W]: `dim` 3) with `width` rows of each neighbour's strip
        above and below (zeros past the edges)."""
        shape = list(x.shape)
        shape[dim] = width
        above = x.new_zeros(shape)
        below = torch.zeros_like(above)
        ops = []
        if self.rank > 0:
            first = x.narrow(dim, 0, width).contiguous()
            ops.append(dist.P2POp(dist.isend, first, group=self.group, group_peer=self.rank - 1))
            ops.append(dist.P2POp(dist.irecv, above, group=self.group, group_peer=self.rank - 1))
        if self.rank < self.size - 1:
            last = x.narrow(dim, x.shape[dim] - width, width).contiguous()
            ops.append(dist.P2POp(dist.isend, last, group=self.group, group_peer=self.rank + 1))
            ops.append(dist.P2POp(dist.irecv, below, group=self.group, group_peer=self.rank + 1))
        self._p2p(ops)
        return torch.cat([above, x, below], dim=dim)

    def gather_rows(self, x: torch.Tensor, dim: int = 2) -> torch.Tensor:
        """Every rank's strip [B, C, rows_r, W] (`dim` 3: [B, C, T, rows_r, W]) -> the whole image on every rank."""
        scale = x.shape[dim] // self.rows[self.rank] if self.rows[self.rank] else 1
        sizes = [r * scale for r in self.rows]
        longest = max(sizes)
        shape = list(x.shape)
        shape[dim] = longest - x.shape[dim]
        padded = torch.cat([x, x.new_zeros(shape)], dim=dim).contiguous()
        parts = [torch.empty_like(padded) for _ in range(self.size)]
        with collective("vae all_gather"):
            dist.all_gather(parts, padded, group=self.group)
        return torch.cat([p.narrow(dim, 0, n) for p, n in zip(parts, sizes, strict=True)], dim=dim)

    def all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        with collective("vae all_reduce"):
            dist.all_reduce(t, group=self.group)
        return t


class HaloConv2d(torch.nn.Module):
    """A stride-1 convolution with (k - 1) / 2 padding, fed its neighbours' rows instead of zero padding inside the
    image while the group is active."""

    def __init__(self, conv: torch.nn.Conv2d, g: StripGroup) -> None:
        super().__init__()
        self.conv, self.g = conv, g
        self.pad = conv.padding[0]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.g.active or self.pad == 0:
            return self.conv(x)
        extended = self.g.halo(x, self.pad)
        return F.conv2d(extended, self.conv.weight, self.conv.bias, 1, (0, self.conv.padding[1]))


class SyncGroupNorm(torch.nn.Module):
    """GroupNorm whose statistics cover every rank's strip while the group is active."""

    def __init__(self, norm: torch.nn.GroupNorm, g: StripGroup) -> None:
        super().__init__()
        self.norm, self.g = norm, g

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.g.active:
            return self.norm(x)
        n = self.norm
        b, c = x.shape[:2]
        grouped = x.reshape(b, n.num_groups, -1).double()  # [B, G, C/G * rows * W]
        count = grouped.new_full((b, n.num_groups), grouped.shape[-1])
        stats = torch.stack([grouped.sum(-1), (grouped * grouped).sum(-1), count])  # [3, B, G]
        stats = self.g.all_reduce(stats)
        mean = stats[0] / stats[2]
        var = stats[1] / stats[2] - mean * mean
        out = ((grouped - mean[..., None]) / torch.sqrt(var[..., None] + n.eps)).to(x.dtype).reshape(x.shape)
        if n.affine:
            out = out * n.weight.view(1, c, 1, 1) + n.bias.view(1, c, 1, 1)
        return out


class WholeImage(torch.nn.Module):
    """A module run over the whole image (gathered) while the group is active; each rank keeps its strip. `dim`: the
    rows' (2 for images, 3 for videos [B, C, T, H, W])."""

    def __init__(self, module: torch.nn.Module, g: StripGroup, dim: int = 2) -> None:
        super().__init__()
        self.module, self.g, self.dim = module, g, dim

    def forward(self, x: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        if not self.g.active:
            return self.module(x, *args, **kwargs)
        whole = self.module(self.g.gather_rows(x, self.dim), *args, **kwargs)
        start = sum(self.g.rows[: self.g.rank])
        return whole.narrow(self.dim, start, self.g.rows[self.g.rank])


class HaloCausalConv3d(torch.nn.Module):
    """A video VAE's causal 3-D convolution (diffusers' `WanCausalConv3d`, `QwenImageCausalConv3d`: it pads itself,
    with the cached frames of the previous chunk first in time) fed its neighbours' rows instead of zero padding
    inside the image while the group is active: the halo is taken after the cached frames are joined, so the rows
    it gets are the neighbour's frames too."""

    def __init__(self, conv: torch.nn.Conv3d, g: StripGroup) -> None:
        super().__init__()
        self.conv, self.g = conv, g
        self.rows = conv._padding[2]  # (w, w, h, h, 2t, 0): its height padding

    def forward(self, x: torch.Tensor, cache_x: torch.Tensor | None = None) -> torch.Tensor:
        if not self.g.active or self.rows == 0:
            return self.conv(x, cache_x)
        conv = self.conv
        padding = list(conv._padding)
        if cache_x is not None and padding[4] > 0:
            x = torch.cat([cache_x.to(x.device), x], dim=2)
            padding[4] -= cache_x.shape[2]
        x = self.g.halo(x, self.rows, dim=3)
        padding[2] = padding[3] = 0
        return torch.nn.Conv3d.forward(conv, F.pad(x, padding))


def make_strip_aware(decoder: torch.nn.Module, g: StripGroup) -> None:
    """Rewire `decoder` (diffusers' 2D `Decoder`) in place for strip decoding under `g`."""
    attentions = decoder.mid_block.attentions if hasattr(decoder.mid_block, "attentions") else []
    whole: set[int] = set()  # what runs over the whole image: left as it is
    for index, attention in enumerate(attentions):
        if attention is not None:
            whole.update(id(m) for m in attention.modules())
            attentions[index] = WholeImage(attention, g)
    for name, module in list(decoder.named_modules()):
        if id(module) in whole or isinstance(module, WholeImage):
            continue
        for child_name, child in list(module.named_children()):
            if isinstance(child, torch.nn.Conv2d) and child.kernel_size[0] > 1:
                if child.stride != (1, 1) or child.padding[0] * 2 + 1 != child.kernel_size[0]:
                    raise ValueError(f"{name}.{child_name}: only stride-1 'same' convolutions split into strips")
                setattr(module, child_name, HaloConv2d(child, g))
            elif isinstance(child, torch.nn.GroupNorm):
                setattr(module, child_name, SyncGroupNorm(child, g))

    def cut(module, args):
        if not g.active:
            return None
        (z, *rest) = args
        base, extra = divmod(z.shape[2], g.size)
        g.rows = [base + (1 if r < extra else 0) for r in range(g.size)]
        start = sum(g.rows[: g.rank])
        return (z[:, :, start : start + g.rows[g.rank]], *rest)

    def join(module, args, output):
        if not g.active:
            return None
        g.last_strip = (output.shape[2], output.shape[3])
        return g.gather_rows(output)

    decoder.register_forward_pre_hook(cut)
    decoder.register_forward_hook(join)


def make_video_strip_aware(decoder: torch.nn.Module, g: StripGroup) -> None:
    """Rewire `decoder` (diffusers' `WanDecoder3d` or `QwenImageDecoder3d`: causal 3-D convolutions, RMS norms over
    channels, nearest upsampling with 2-D convolutions over each frame, one attention per frame at latent
    resolution) in place for strip decoding under `g`: the decoder runs a latent frame at a time, each call cut into
    strips of latent rows (dim 3) and its frame gathered. Its RMS norms and 1x1 convolutions are local already."""
    mid = decoder.mid_block
    for index, attention in enumerate(mid.attentions):
        if attention is not None:
            mid.attentions[index] = WholeImage(attention, g, dim=3)
    for name, module in list(decoder.named_modules()):
        if isinstance(module, WholeImage) or name.startswith("mid_block.attentions"):
            continue
        for child_name, child in list(module.named_children()):
            if isinstance(child, torch.nn.Conv3d) and hasattr(child, "_padding"):
                if child.stride != (1, 1, 1) or child._padding[2] * 2 + 1 != child.kernel_size[1]:
                    raise ValueError(f"{name}.{child_name}: only stride-1 'same' convolutions split into strips")
                setattr(module, child_name, HaloCausalConv3d(child, g))
            elif isinstance(child, torch.nn.Conv2d) and child.kernel_size[0] > 1:
                if child.stride != (1, 1) or child.padding[0] * 2 + 1 != child.kernel_size[0]:
                    raise ValueError(f"{name}.{child_name}: only stride-1 'same' convolutions split into strips")
                setattr(module, child_name, HaloConv2d(child, g))
            elif isinstance(child, torch.nn.GroupNorm):
                raise ValueError(f"{name}.{child_name}: a video decoder's group norms do not split yet")

    def cut(module, args):
        if not g.active:
            return None
        (z, *rest) = args
        base, extra = divmod(z.shape[3], g.size)
        g.rows = [base + (1 if r < extra else 0) for r in range(g.size)]
        start = sum(g.rows[: g.rank])
        return (z[:, :, :, start : start + g.rows[g.rank]], *rest)

    def join(module, args, output):
        if not g.active:
            return None
        g.last_strip = (output.shape[3], output.shape[4])
        return g.gather_rows(output, dim=3)

    decoder.register_forward_pre_hook(cut)
    decoder.register_forward_hook(join)


@contextlib.contextmanager
def active(g: StripGroup, latent_rows: int) -> Iterator[bool]:
    """Strip decoding for what runs inside, when every rank gets at least two latent rows; yields whether it is on
    (every rank must then decode the same latents)."""
    g.active = latent_rows >= 2 * g.size
    try:
        yield g.active
    finally:
        g.active = False
