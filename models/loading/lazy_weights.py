"""A denoiser whose weights are read from its checkpoint a part at a time, for layouts that shard them (issue 31).

`--tp` and `--shard-weights` exist for models that do not fit one device, yet loading the whole denoiser first and
sharding it after made each rank hold all of it at its peak (measured at SD3.5-medium size on 2 ranks: 6.9 and
4.7 GB under `--tp 2`, 1.3x and 0.9x one process). Here the denoiser is built with empty (meta) parameters;
`kernels/tensor_parallel.py` asks for each unit it is about to shard (a block) to be materialized just before, so
that a rank holds its shards, one unit whole, and nothing else. The file is mapped per unit and let go after it
(`safe_open`), so the pages read for one block do not stay resident.

Parameters get the dtype `from_pretrained` gives them (the model's `_keep_in_fp32_modules` stay float32);
persistent buffers are read from the checkpoint, the others keep the values the constructor computed.
`tests/models/test_lazy_weights.py` checks every family's result against `from_pretrained`, tensor for tensor.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch

from diffusiond.kernels.host import give_back

WEIGHTS = "diffusion_pytorch_model.safetensors"
INDEX = WEIGHTS + ".index.json"


def empty_model(cls: Any, folder: Path, dtype: torch.dtype) -> torch.nn.Module:
    """`cls` (a diffusers model class) built from `folder`'s config with its parameters and buffers on the meta
    device (LazyWeights reads or computes them), in `dtype` as the default dtype, as `from_pretrained` builds it."""

    model = _construct(cls, cls.load_config(folder), dtype, buffers=False)
    model._lazy_dtype = dtype
    for name, param in model.named_parameters():
        if param.is_floating_point():
            _set(model, name, torch.nn.Parameter(param.to(target_dtype(model, name, dtype)), requires_grad=False))
    return model.eval()


def _construct(cls: Any, config: Any, dtype: torch.dtype, buffers: bool) -> torch.nn.Module:
    """`cls` from `config` with empty parameters (and, unless `buffers`, empty buffers), as `from_pretrained` builds
    it: with `dtype` as the default dtype."""
    from accelerate import init_empty_weights

    default = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with init_empty_weights(include_buffers=not buffers):
            return cls.from_config(config)
    finally:
        torch.set_default_dtype(default)


def target_dtype(model: torch.nn.Module, name: str, dtype: torch.dtype) -> torch.dtype:
    """A floating tensor's dtype after `from_pretrained(dtype=...)`: `dtype`, or float32 in the model's
    `_keep_in_fp32_modules` (diffusers' `load_model_dict_into_meta`)."""
    keep = type(model)._keep_in_fp32_modules or []
    return torch.float32 if any(k in name.split(".") for k in keep) else dtype


class LazyWeights:
    """Where each tensor of a model's checkpoint is, and `materialize` to read a module's part of it."""

    def __init__(self, root: torch.nn.Module, folder: Path, device: torch.device) -> None:
        self.root, self.folder, self.device = root, Path(folder), torch.device(device)
        index = self.folder / INDEX
        if index.is_file():
            weight_map = json.loads(index.read_text())["weight_map"]
            self.files = {name: self.folder / file for name, file in weight_map.items()}
        else:
            from safetensors import safe_open

            with safe_open(str(self.folder / WEIGHTS), framework="pt") as f:
                self.files = dict.fromkeys(f.keys(), self.folder / WEIGHTS)
        self._names = {id(module): name for name, module in root.named_modules()}
        self.persistent = {
            f"{name}.{buffer}" if name else buffer
            for name, module in root.named_modules()
            for buffer in module._buffers
            if buffer not in module._non_persistent_buffers_set
        }
        self._buffers_read: set[str] = set()
        # Where the parameters come from instead of the checkpoint (models/loading/kept_weights.py): a rank's share kept
        # by the group's previous attempt, mapped once the layout has sharded the empty parameters (at the root).
        self.kept: Any = None
        self.params_read = 0
        # Buffers are built empty too (SD3.5's position table is 1 GB, computed in float64 on the way): those the
        # checkpoint holds are read from it; the others, and tensors kept as plain attributes (Wan's and
        # Qwen-Image's rotary tables; Qwen-Image 2.1 keeps a list of them), are computed by building the model once
        # more with real buffers, which costs only where there are any.
        computed = [name for name, b in root.named_buffers() if b.is_meta and name not in self.files]
        attributes = [
            (name, attr)
            for name, module in root.named_modules()
            for attr, value in vars(module).items()
            if attr not in ("_parameters", "_buffers")
            and any(
                isinstance(t, torch.Tensor) and t.is_meta
                for t in (value if isinstance(value, (list, tuple)) else (value,))
            )
        ]
        if computed or attributes:
            real = _construct(type(root), root.config, root._lazy_dtype, buffers=True)
            for name in computed:
                _set(root, name, real.get_buffer(name), buffer=True)
            for name, attr in attributes:
                setattr(root.get_submodule(name), attr, getattr(real.get_submodule(name), attr))

    @contextlib.contextmanager
    def _reading(self) -> Iterator[Callable[[str], torch.Tensor]]:
        from safetensors import safe_open

        with contextlib.ExitStack() as stack:
            opened: dict[Path, Any] = {}

            def get(name: str) -> torch.Tensor:
                path = self.files.get(name)
                if path is None:
                    raise KeyError(f"{self.folder}: the checkpoint has no tensor {name!r}")
                if path not in opened:
                    opened[path] = stack.enter_context(safe_open(str(path), framework="pt"))
                return opened[path].get_tensor(name)

            yield get

    def materialize(self, module: torch.nn.Module) -> int:
        """Read the parameters of `module` (a part of the root) that are still empty, and its persistent buffers,
        onto the device; how many tensors were read."""
        give_back()  # what the layout freed when it sharded the previous part
        prefix = self._names[id(module)]
        prefix = f"{prefix}." if prefix else ""
        count = 0
        if self.kept is not None and module is self.root:
            count += self.kept.restore(module, self.device)
        with self._reading() as get, torch.no_grad():
            for name, param in list(module.named_parameters()):
                if param.device.type != "meta" or self.kept is not None:
                    continue
                value = _copy(get(prefix + name), self.device, param.dtype)
                _set(module, name, torch.nn.Parameter(value, requires_grad=False))
                count += 1
                self.params_read += 1
            for name, buffer in list(module.named_buffers()):
                if prefix + name in self._buffers_read:
                    continue
                self._buffers_read.add(prefix + name)
                if prefix + name in self.persistent and prefix + name in self.files:
                    value = get(prefix + name)
                    dtype = target_dtype(self.root, prefix + name, self.root._lazy_dtype)
                    # A view of the mapped file where it can stay one: a table (SD3.5's 450 MB of positions) is read
                    # a few rows per image, and only those rows' pages become resident.
                    value = value.to(self.device, dtype if value.is_floating_point() else value.dtype)
                    _set(module, name, value, buffer=True)
                    count += 1
                elif buffer.device != self.device:
                    _set(module, name, buffer.to(self.device), buffer=True)
        return count

    def empty(self) -> list[str]:
        """Parameters and buffers never materialized (none, once the layout is wired)."""
        from diffusiond.models.loading.kept_weights import local_of

        tensors = [*self.root.named_parameters(), *self.root.named_buffers()]
        return [name for name, tensor in tensors if local_of(tensor).device.type == "meta"]


def _copy(tensor: torch.Tensor, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    """`tensor` (a view of the mapped file) in memory of its own: a view kept by a parameter or a shard would keep
    the whole file mapped, and every page read so far resident."""
    out = torch.empty(tensor.shape, dtype=dtype, device=device)
    out.copy_(tensor)
    return out


def _set(root: torch.nn.Module, name: str, value: torch.Tensor, buffer: bool = False) -> None:
    owner_name, _, attr = name.rpartition(".")
    owner = root.get_submodule(owner_name) if owner_name else root
    if buffer:
        owner._buffers[attr] = value
    else:
        owner._parameters[attr] = value
