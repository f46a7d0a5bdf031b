"""Ring attention: the sequence stays sharded across a ring of ranks; key/value blocks travel around the ring and
each rank merges its queries' attention over every block by log-sum-exp (online softmax), so no rank ever holds the
whole sequence's keys or a score matrix wider than one block.

Used inside `ulysses.ulysses_sdpa` when the sequence group has a ring (`--ring R`, composed with `--ulysses U`: the
unified sequence-parallel layout, U x R ranks per sequence). Replicated tokens (the text of joint attention, the
same on every rank) join the keys of one block only, and their queries' partial results are all-gathered and merged
in ring order, so every rank gets them bit-identical.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from diffusiond.kernels.collectives import collective


def attention_lse(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bias: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax attention of q [B, H, Sq, d] over k, v [B, H, Sk, d]: (out [B, H, Sq, d] in q's dtype, log-sum-exp of
    the scaled scores [B, H, Sq], float32). `bias`: [B, 1, 1, Sk] added to the scores (-inf: a key masked out; every
    query keeps at least one key). SDPA kernels that return the log-sum-exp where the device has one (CPU: the flash
    kernel; CUDA: the memory-efficient kernel), else the math."""
    if k.shape[2] == 0 or q.shape[2] == 0:  # a ring block (or a query shard) of a short sequence may be empty
        return torch.zeros_like(q), q.new_full(q.shape[:3], float("-inf"), dtype=torch.float32)
    if bias is not None:
        bias = bias.to(q.dtype)
    if q.device.type == "cpu":
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, attn_mask=bias)
        return out, lse.float()
    if q.device.type == "cuda":
        if bias is not None:
            bias = bias.expand(q.shape[0], q.shape[1], q.shape[2], k.shape[2])
        out, lse, *_ = torch.ops.aten._scaled_dot_product_efficient_attention(q, k, v, bias, True)
        return out, lse[..., : q.shape[2]].float()  # lse may be padded along the queries
    scores = torch.einsum("bhqd,bhkd->bhqk", q.float(), k.float()) * q.shape[-1] ** -0.5
    if bias is not None:
        scores = scores + bias.float()
    lse = torch.logsumexp(scores, dim=-1)
    out = torch.einsum("bhqk,bhkd->bhqd", torch.exp(scores - lse[..., None]), v.float())
    return out.to(q.dtype), lse


def merge(
    out: torch.Tensor, lse: torch.Tensor, other: torch.Tensor, other_lse: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention over the union of two key sets from the attention over each (float32 out). Two empty key sets
    (both log-sum-exps -inf: ring blocks of a short sequence) merge to nothing, not NaN."""
    total = torch.logaddexp(lse, other_lse)
    mine, theirs = (torch.nan_to_num(torch.exp(x - total), nan=0.0)[..., None] for x in (lse, other_lse))
    return out.float() * mine + other.float() * theirs, total


def _exchange(block: torch.Tensor, recv_tokens: int, group: dist.ProcessGroup, rank: int, size: int) -> torch.Tensor:
    """Send `block` [2, B, H, S, d] (keys and values) to the next rank of the ring and receive the previous rank's."""
    incoming = block.new_empty((*block.shape[:3], recv_tokens, block.shape[-1]))
    ops = [
        dist.P2POp(dist.isend, block.contiguous(), group=group, group_peer=(rank + 1) % size),
        dist.P2POp(dist.irecv, incoming, group=group, group_peer=(rank - 1) % size),
    ]
    with collective("ring send/recv"):
        for work in dist.batch_isend_irecv(ops):
            work.wait()
    return incoming


def ring_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    group: dist.ProcessGroup,
    rank: int,
    size: int,
    blocks: list[int],
    replicated: int,
    replicated_first: bool,
    key_mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """q, k, v [B, H, T + S_r, d]: `replicated` tokens (identical on every ring rank) before or after this rank's
    block of the sharded sequence; `blocks` the sharded tokens each ring rank holds. Returns attention over all
    T + sum(blocks) keys for this rank's queries, in q's layout and dtype. `key_mask`: [B, T], the replicated keys
    attended to (False: a text's padding, masked out wherever those keys join); the sharded keys all are."""
    t = replicated
    bias = None
    if key_mask is not None:  # [B, 1, 1, T + S_r]: the replicated keys' mask, then this block's keys, all kept
        masked = torch.zeros(key_mask.shape, dtype=torch.float32, device=q.device).masked_fill(~key_mask, -torch.inf)
        own = masked.new_zeros((key_mask.shape[0], q.shape[2] - t))
        bias = torch.cat([masked, own], dim=1)[:, None, None, :]

    def split(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if replicated_first:
            return x[:, :, :t], x[:, :, t:]
        return x[:, :, x.shape[2] - t :], x[:, :, : x.shape[2] - t]

    (q_rep, q_own), (k_rep, k_own), (v_rep, v_own) = split(q), split(k), split(v)
    # This rank's queries: its own block with the replicated keys, then every other block as it comes round.
    out, lse = attention_lse(q_own, torch.cat([k_rep, k_own], dim=2), torch.cat([v_rep, v_own], dim=2), bias)
    travelling = torch.stack([k_own, v_own])  # [2, B, H, S_r, d]
    for step in range(1, size):
        travelling = _exchange(travelling, blocks[(rank - step) % size], group, rank, size)
        out, lse = merge(out, lse, *attention_lse(q_own, travelling[0], travelling[1]))
    out = out.to(q.dtype)
    if not t:
        return out
    # Replicated queries: each rank attends over its own block (the replicated keys on ring rank 0 only); the
    # partial results are gathered and merged in ring order, the same order on every rank.
    keys = torch.cat([k_rep, k_own], dim=2) if rank == 0 else k_own
    values = torch.cat([v_rep, v_own], dim=2) if rank == 0 else v_own
    part, part_lse = attention_lse(q_rep, keys, values, bias if rank == 0 else None)
    packed = torch.cat([part.float(), part_lse[..., None]], dim=-1).contiguous()  # [B, H, T, d + 1]
    parts = [torch.empty_like(packed) for _ in range(size)]
    with collective("ring all_gather"):
        dist.all_gather(parts, packed, group=group)
    rep, rep_lse = parts[0][..., :-1], parts[0][..., -1]
    for other in parts[1:]:
        rep, rep_lse = merge(rep, rep_lse, other[..., :-1], other[..., -1])
    rep = rep.to(q.dtype)
    return torch.cat([rep, out] if replicated_first else [out, rep], dim=2)
