"""Weights split across ranks, with PyTorch's own APIs: tensor parallelism (`shard`) and FSDP2 sharding
(`fully_shard_blocks`).

Tensor parallelism with PyTorch's own API (`torch.distributed.tensor.parallel`): a transformer's linears sharded
over a DeviceMesh by a plan in diffusers' `_tp_plan` format ({"blocks.*.attn.to_q": "colwise", ...}; diffusers 0.42
ships plans for FLUX, FLUX.2 and Qwen-Image, and families in models/ write their own).

Column-wise linears keep 1/T of their output features (heads, MLP hidden units), row-wise ones 1/T of their input
features and all-reduce their output: one all-reduce per attention and per MLP. diffusers' own `apply_tensor_parallel`
refuses CPU meshes; its plan resolution and packed styles (FLUX's single blocks concatenate attention and MLP before
one linear) are reused here as they are, on any device gloo or NCCL serves.
"""

from __future__ import annotations

import torch


def param_bytes(module: torch.nn.Module) -> int:
    """Bytes of `module`'s parameters held on this rank (a sharded parameter counts its local shard only)."""
    from torch.distributed.tensor import DTensor

    total = 0
    for p in module.parameters():
        local = p.to_local() if isinstance(p, DTensor) else p
        total += local.numel() * local.element_size()
    return total


def shard(module: torch.nn.Module, plan: dict, mesh) -> tuple[int, int]:
    """Shard `module`'s planned linears over `mesh` (1-D); returns (bytes on this rank, bytes before)."""
    from diffusers.hooks.tensor_parallel import _resolve_tp_plan, _styles, resolve_tp_shard_specs
    from torch.distributed.tensor.parallel import parallelize_module

    before = param_bytes(module)
    resolve_tp_shard_specs(module, plan, mesh.size())  # every planned split is even, checked before any is made
    for submodule, relative in _resolve_tp_plan(module, plan):
        parallelize_module(submodule, mesh, _styles(relative))
    return param_bytes(module), before


def fully_shard_blocks(module: torch.nn.Module, mesh) -> tuple[int, int]:
    """FSDP2 (`torch.distributed.fsdp.fully_shard`) over `mesh`: every element of `module`'s block lists (its
    ModuleList children) is a unit whose weights are all-gathered just before it runs and freed just after, the
    rest (embedders, output layers) one more unit. Each rank keeps 1/N of the weights between forwards; all ranks
    must run the same units in the same order, which SPMD steps do. Returns (bytes on this rank, bytes before)."""
    from torch.distributed.fsdp import fully_shard

    before = param_bytes(module)
    for child in module.children():
        if isinstance(child, torch.nn.ModuleList):
            for block in child:
                fully_shard(block, mesh=mesh, reshard_after_forward=True)
    fully_shard(module, mesh=mesh, reshard_after_forward=True)
    return param_bytes(module), before
