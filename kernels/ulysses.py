"""Ulysses sequence parallelism for MMDiT transformers over any process group, gloo included.

Image tokens are sharded across the group (rank j holds a contiguous slice, sizes differ by at most one token, so
any image size works); text tokens stay replicated. Around each attention call, an all-to-all trades the sequence
shard for a head shard: every rank attends over the whole sequence for H/N heads, then a second all-to-all trades
back. The replicated text part only needs its heads sliced before and all-gathered after.

Why our own and not diffusers' `enable_parallelism`: in diffusers 0.42 SD3 has no `_cp_plan` and its
`JointAttnProcessor2_0` calls SDPA directly, and `enable_parallelism` computes
`rank % torch.accelerator.device_count()`, which divides by zero on a CPU-only host (gloo). Each family's file in
models/ holds its processor: its own diffusers processor step by step, the attention call replaced by `ulysses_sdpa`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from diffusiond.kernels.attention import attention
from diffusiond.kernels.collectives import collective
from diffusiond.kernels.ring import ring_attention


@dataclass
class UlyssesGroup:
    """The ranks that shard one sequence: U (Ulysses degree) x R (ring degree). Rank i of the group holds shard i of
    the sequence; i = ring_rank * U + ulysses_rank, so each Ulysses subgroup's shards are contiguous (one ring block)
    and the ring passes blocks in sequence order. Without a ring (R = 1) `group` is the Ulysses group."""

    group: dist.ProcessGroup
    rank: int
    size: int
    # Replicated prefix length of the current forward (single-stream blocks see [text, image] concatenated).
    text_len: int = 0
    # Shard sizes of the current forward's image sequence, per rank.
    shards: list[int] = field(default_factory=list)
    # Ring attention (kernels/ring.py): the subgroups of this rank (None without a ring).
    ring: dist.ProcessGroup | None = None
    ring_size: int = 1
    ulysses: dist.ProcessGroup | None = None

    @property
    def ulysses_size(self) -> int:
        return self.size // self.ring_size

    @property
    def ulysses_rank(self) -> int:
        return self.rank % self.ulysses_size

    @property
    def ring_rank(self) -> int:
        return self.rank // self.ulysses_size

    @property
    def ulysses_group(self) -> dist.ProcessGroup:
        return self.ulysses if self.ulysses is not None else self.group

    def block(self, ring_rank: int) -> list[int]:
        """Shard sizes of ring rank `ring_rank`'s Ulysses subgroup (its block of the sequence)."""
        u = self.ulysses_size
        return self.shards[ring_rank * u : (ring_rank + 1) * u]

    def split(self, total: int) -> tuple[int, int]:
        """Set this forward's shard sizes; returns (start, stop) of this rank's slice."""
        self.shards = self.split_sizes(total)
        span = self.span()
        return span.start, span.stop

    def span(self, shards: list[int] | None = None) -> slice:
        """This rank's slice of a sequence sharded as `shards` (default: this forward's)."""
        shards = self.shards if shards is None else shards
        start = sum(shards[: self.rank])
        return slice(start, start + shards[self.rank])

    def split_sizes(self, total: int) -> list[int]:
        """Shard sizes of a sequence of `total` tokens, per rank (the first ranks take one more)."""
        base, extra = divmod(total, self.size)
        return [base + (1 if j < extra else 0) for j in range(self.size)]

    def gather_seq(self, x: torch.Tensor, dim: int = 1, shards: list[int] | None = None) -> torch.Tensor:
        """Inverse of the shard slicing: every rank gets the whole sequence (`shards`: of another sequence than this
        forward's image, LTX-2's audio). gloo's all_gather needs equal sizes, so shards are padded to the largest and
        trimmed after."""
        shards = self.shards if shards is None else shards
        longest = max(shards)
        if x.shape[dim] < longest:
            pad = list(x.shape)
            pad[dim] = longest - x.shape[dim]
            x = torch.cat([x, x.new_zeros(pad)], dim=dim)
        x = x.contiguous()
        parts = [torch.empty_like(x) for _ in shards]
        with collective("ulysses all_gather"):
            dist.all_gather(parts, x, group=self.group)
        return torch.cat([p.narrow(dim, 0, size) for p, size in zip(parts, shards, strict=True)], dim=dim)


def _seq_to_heads(x: torch.Tensor, g: UlyssesGroup, shards: list[int] | None = None) -> torch.Tensor:
    """[B, H, S_local, d] (my sequence shard, all heads) -> [B, H/U, S_block, d] (my Ulysses subgroup's whole
    block of the sequence: the whole sequence without a ring; my heads). `shards`: every rank's shard of a sequence
    other than this forward's image (no ring)."""
    n = g.ulysses_size
    if n == 1:
        return x
    b, h, s_local, d = x.shape
    shards = g.block(g.ring_rank) if shards is None else shards
    send = x.reshape(b, n, h // n, s_local, d).transpose(0, 1).contiguous()  # [N, B, H/N, S_local, d]
    recv = [x.new_empty(b, h // n, s, d) for s in shards]
    sizes_out = [t.numel() for t in recv]
    out = x.new_empty(sum(sizes_out))
    with collective("ulysses all_to_all"):
        dist.all_to_all_single(out, send.view(-1), sizes_out, [send[0].numel()] * n, group=g.ulysses_group)
    chunks = [c.view(b, h // n, s, d) for c, s in zip(out.split(sizes_out), shards, strict=True)]
    return torch.cat(chunks, dim=2)


def _heads_to_seq(x: torch.Tensor, g: UlyssesGroup, shards: list[int] | None = None) -> torch.Tensor:
    """[B, H/U, S_block, d] -> [B, H, S_local, d]: the inverse of `_seq_to_heads`."""
    n = g.ulysses_size
    if n == 1:
        return x
    b, hn, _, d = x.shape
    block = g.block(g.ring_rank) if shards is None else shards
    parts = [p.contiguous() for p in x.split(block, dim=2)]  # part j goes back to rank j
    send = torch.cat([p.view(-1) for p in parts])
    s_local = block[g.ulysses_rank]  # this rank's shard (its ring block's U sizes, or the given ones)
    out = x.new_empty(n * b * hn * s_local * d)
    with collective("ulysses all_to_all"):
        dist.all_to_all_single(out, send, [b * hn * s_local * d] * n, [p.numel() for p in parts], group=g.ulysses_group)
    return out.view(n, b, hn, s_local, d).transpose(0, 1).reshape(b, n * hn, s_local, d)


def ulysses_sdpa(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: UlyssesGroup,
    *,
    replicated: int,
    replicated_first: bool,
    backend: object = None,
    attn_mask: torch.Tensor | None = None,
    attend: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor] | None = None,
) -> torch.Tensor:
    """Attention over the whole sequence from per-rank shards. q, k, v: [B, H, L_local, d] where `replicated` tokens
    (text, identical on every rank) sit before (`replicated_first`) or after this rank's image shard. `backend`: the
    attention kernel (kernels/attention.py; None: SDPA). `attn_mask`: over the whole joint sequence, in the same
    order ([B, 1, 1, T + S] key padding: every rank attends over every key). `attend`: the family's own attention
    over the whole sequence for this rank's heads ([B, H/U, T + S, d] each, Qwen-Image 2.1's block-causal
    segments), in place of one masked call."""
    h, u = q.shape[1], g.ulysses_size
    heads = slice(g.ulysses_rank * h // u, (g.ulysses_rank + 1) * h // u)

    def split(x):
        if replicated_first:
            return x[:, :, :replicated], x[:, :, replicated:]
        return x[:, :, x.shape[2] - replicated :], x[:, :, : x.shape[2] - replicated]

    def full(x):
        rep, img = split(x)
        rep, img = rep[:, heads], _seq_to_heads(img, g)
        return torch.cat([rep, img] if replicated_first else [img, rep], dim=2)  # [B, H/N, T + S, d]

    if g.ring_size > 1:
        if attend is not None:
            raise ValueError("ring attention takes no block-causal segments")
        out = ring_attention(
            full(q), full(k), full(v), group=g.ring, rank=g.ring_rank, size=g.ring_size,
            blocks=[sum(g.block(r)) for r in range(g.ring_size)], replicated=replicated,
            replicated_first=replicated_first, key_mask=_replicated_mask(attn_mask, replicated, replicated_first),
        )  # fmt: skip
    elif attend is not None:
        out = attend(full(q), full(k), full(v))
    else:
        out = attention(full(q), full(k), full(v), backend, attn_mask)
    total_img = out.shape[2] - replicated
    if replicated_first:
        rep, img = out[:, :, :replicated], out[:, :, replicated:]
    else:
        rep, img = out[:, :, total_img:], out[:, :, :total_img]
    img = _heads_to_seq(img.contiguous(), g)  # [B, H, S_local, d]
    if not replicated:  # the whole sequence is sharded (Z-Image's unified stream)
        return img
    if u > 1:
        gathered = [torch.empty_like(rep) for _ in range(u)]
        with collective("ulysses all_gather"):
            dist.all_gather(gathered, rep.contiguous(), group=g.ulysses_group)
        rep = torch.cat(gathered, dim=1)  # [B, H, T, d]
    return torch.cat([rep, img] if replicated_first else [img, rep], dim=2)


def _replicated_mask(attn_mask: torch.Tensor | None, replicated: int, first: bool) -> torch.Tensor | None:
    """A key-padding mask over the joint sequence ([B, 1, 1, T + S], bool) as ring attention takes it: the replicated
    tokens' part [B, T]. Ring attention masks those only (a text's padding); a masked sharded key is refused."""
    if attn_mask is None:
        return None
    keys = attn_mask.reshape(attn_mask.shape[0], -1).bool()
    rep = keys[:, :replicated] if first else keys[:, keys.shape[1] - replicated :]
    rest = keys[:, replicated:] if first else keys[:, : keys.shape[1] - replicated]
    if not bool(rest.all()):
        raise ValueError("ring attention masks the replicated tokens only (a text's padding)")
    return rep


def ulysses_cross(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: UlyssesGroup,
    *,
    q_shards: list[int],
    kv_shards: list[int],
    backend: object = None,
) -> torch.Tensor:
    """Attention of one sharded sequence over another, each with its own shard sizes (LTX-2: video over audio and
    audio over video; a self-attention passes the same sizes twice). q: [B, H, Sq_local, d], k, v:
    [B, H, Skv_local, d] -> [B, H, Sq_local, d]. Both go to their Ulysses subgroup's whole block for H/U heads (the
    whole sequences without a ring); with a ring the key blocks travel round it (`ring_attention`, nothing
    replicated, each block its own size: a ring rank may hold none of a short sequence) and the output comes back to
    the query's shard. No mask."""
    u, r = g.ulysses_size, g.ring_rank
    q_block, kv_block = q_shards[r * u : (r + 1) * u], kv_shards[r * u : (r + 1) * u]
    k, v = _seq_to_heads(k, g, kv_block), _seq_to_heads(v, g, kv_block)
    q = _seq_to_heads(q, g, q_block)
    if g.ring_size > 1:
        blocks = [sum(kv_shards[i * u : (i + 1) * u]) for i in range(g.ring_size)]
        assert g.ring is not None
        out = ring_attention(
            q, k, v, group=g.ring, rank=r, size=g.ring_size, blocks=blocks, replicated=0, replicated_first=True
        )
    else:
        out = attention(q, k, v, backend)
    return _heads_to_seq(out.contiguous(), g, q_block)


def shard_output(module: torch.nn.Module, g: UlyssesGroup, dim: int = 1) -> None:
    """After `module`, keep only this rank's slice of the sequence (dim `dim`)."""

    def hook(module, args, output):
        start, stop = g.split(output.shape[dim])
        return output.narrow(dim, start, stop - start)

    module.register_forward_hook(hook)


def gather_output(module: torch.nn.Module, g: UlyssesGroup, dim: int = 1) -> None:
    """After `module`, reassemble the whole sequence from every rank's slice."""

    def hook(module, args, output):
        return g.gather_seq(output, dim=dim)

    module.register_forward_hook(hook)
