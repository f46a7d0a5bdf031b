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

from collections.abc import Callable

import torch


def param_bytes(module: torch.nn.Module) -> int:
    """Bytes of `module`'s parameters held on this rank (a sharded parameter counts its local shard only)."""
    from torch.distributed.tensor import DTensor

    total = 0
    for p in module.parameters():
        local = p.to_local() if isinstance(p, DTensor) else p
        total += local.numel() * local.element_size()
    return total


# `materialize(part)`: reads the weights of a part of a module built empty (models/loading/lazy_weights.py) just before
# the part is sharded, so that no rank ever holds the whole module; None when the module was loaded whole.
Materialize = Callable[[torch.nn.Module], object] | None


def shard(module: torch.nn.Module, plan: dict, mesh, materialize: Materialize = None) -> tuple[int, int]:
    """Shard `module`'s planned linears over `mesh` (1-D); returns (bytes on this rank, bytes before). Every rank
    holds the same whole weights, so each keeps its own slice (`src_data_rank=None`), without a scatter from rank 0
    (which would make rank 0 read every weight)."""
    from diffusers.hooks.tensor_parallel import _resolve_tp_plan, _styles, resolve_tp_shard_specs
    from torch.distributed.tensor.parallel import parallelize_module

    before = param_bytes(module)
    # "gathered": column-wise, the output all-gathered (Replicate) for layers whose whole output every rank needs
    # (the adaptive norms' modulation linears: a small vector per request, from a large weight).
    checked = {path: "colwise" if style == GATHERED else style for path, style in plan.items()}
    resolve_tp_shard_specs(module, checked, mesh.size())  # every planned split is even, checked before any is made
    for submodule, relative in _per_block(module, plan, _resolve_tp_plan):
        if materialize is not None:
            materialize(submodule)
        plain = {path: style for path, style in relative.items() if style != GATHERED}
        styles = {**_styles(plain), **{path: _gathered() for path, style in relative.items() if style == GATHERED}}
        parallelize_module(submodule, mesh, styles, src_data_rank=None)
    if materialize is not None:
        materialize(module)  # what no plan shards: embedders, norms, the output layers
    return param_bytes(module), before


GATHERED = "gathered"


def _gathered():
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import ColwiseParallel

    return ColwiseParallel(output_layouts=Replicate())


def _per_block(module: torch.nn.Module, plan: dict, resolve) -> list[tuple[torch.nn.Module, dict]]:
    """diffusers' grouping of a plan by block (`_resolve_tp_plan`), with explicit keys ("blocks.3.attn.to_q") put
    in their block too, not all in one group at the root: each block is then read (and sharded) alone."""
    grouped: dict[int, tuple[torch.nn.Module, dict]] = {}
    rest: dict = {}  # wildcard and root-level keys: diffusers groups those
    for pattern, style in plan.items():
        owner, container, atoms = None, module, pattern.split(".")
        if "*" not in pattern:
            for i, atom in enumerate(atoms[:-1]):
                if isinstance(container, torch.nn.ModuleList):
                    owner, relative = container[int(atom)], ".".join(atoms[i + 1 :])
                    break
                container = getattr(container, atom)
        if owner is None:
            rest[pattern] = style
        else:
            grouped.setdefault(id(owner), (owner, {}))[1][relative] = style
    for block, relative in resolve(module, rest):
        grouped.setdefault(id(block), (block, {}))[1].update(relative)
    return list(grouped.values())


def fully_shard_blocks(module: torch.nn.Module, mesh, materialize: Materialize = None) -> tuple[int, int]:
    """FSDP2 (`torch.distributed.fsdp.fully_shard`) over `mesh`: every element of `module`'s block lists (its
    ModuleList children) is a unit whose weights are all-gathered just before it runs and freed just after, the
    rest (embedders, output layers) one more unit. Each rank keeps 1/N of the weights between forwards; all ranks
    must run the same units in the same order, which SPMD steps do. Returns (bytes on this rank, bytes before)."""
    from torch.distributed.fsdp import fully_shard

    before = param_bytes(module)
    for child in module.children():
        if isinstance(child, torch.nn.ModuleList):
            for block in child:
                if materialize is not None:
                    materialize(block)
                fully_shard(block, mesh=mesh, reshard_after_forward=True)
    if materialize is not None:
        materialize(module)
    fully_shard(module, mesh=mesh, reshard_after_forward=True)
    return param_bytes(module), before
