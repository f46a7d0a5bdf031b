"""A rank's denoiser weights kept in shared memory (`/dev/shm`) for the group's next attempt (issue 31).

A heal restarts every rank (the elastic agent restarts all workers of a group), and each used to read its weights
from the checkpoint again and shard them: at SD3.5-medium size on 2 CPU ranks, 8.5 of the 12.5 s a heal took.
Here, once a rank has built its share of the denoiser (after the parallel layout sharded it), the share is written
to a file in a folder the launcher owns in shared memory, and the rank's parameters become read-only mappings of
that file (copy-on-write: the file never changes). A restarted rank builds the denoiser empty, lets the layout
shard the empty parameters, and maps its share back: no read of the checkpoint's weights, no copy.

Ranks whose shares are equal (the same tensor-parallel coordinate: CFG-parallel and Ulysses ranks hold whole
copies) share one file: the first to claim it writes it, the others map it, so that the node holds one copy.

The launcher makes the folder (`--keep-weights`, default /dev/shm) and removes it when it exits; a folder left
by a launcher that was killed is removed by the next one. Not kept: quantized weights (tensor subclasses),
offloaded or FSDP2-sharded ones (their storage moves), and weights with a LoRA fused in.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import logging
import os
import time
from pathlib import Path
from typing import Any

import torch

from diffusiond import __version__
from diffusiond.kernels.host import give_back
from diffusiond.kernels.process_folders import alive, new_folder, remove_dead

log = logging.getLogger(__name__)

# The folder the launcher made for this run's ranks (unset: nothing is kept, e.g. under plain torchrun).
FOLDER_ENV = "_DIFFUSIOND_KEPT_WEIGHTS"
PREFIX = "diffusiond-weights-"
# Each tensor starts on a page: writes into the middle of a page were 5x slower here (2 GB: 3.0 s vs 0.6 s).
ALIGN = 4096
# Shared memory a rank leaves free when it keeps its weights (or a tenth of the folder's size, if less).
SPARE = 1 << 30
# A writer that dies mid-write leaves its claim behind: the others stop waiting when its process is gone.
WAIT_S = 600.0


class KeptWeightsError(RuntimeError):
    """A kept file that does not fit the model built around it (another layout, another checkpoint)."""


def make_folder(root: str) -> Path | None:
    """The launcher's folder under `root` for this run (None where `root` is not a writable folder), after removing
    the folders of launchers that are gone."""
    base = Path(root)
    if not base.is_dir() or not os.access(base, os.W_OK):
        log.warning("--keep-weights %s: not a writable folder; a heal reloads every weight", root)
        return None
    remove_dead(base, PREFIX)
    return new_folder(base, PREFIX)


def local_of(tensor: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return tensor._local_tensor if isinstance(tensor, DTensor) else tensor


class KeptWeights:
    """One denoiser's share on this rank: `<folder>/<key>.bin` (the tensors, each on a page of its own) and
    `<key>.json` (their names, dtypes, shapes and offsets; written last, so that it exists only for a whole file)."""

    def __init__(self, folder: Path, key: str) -> None:
        self.folder, self.key = Path(folder), key
        self.data, self.index = self.folder / f"{key}.bin", self.folder / f"{key}.json"
        self.restored = 0  # tensors mapped by `restore`

    def ready(self) -> bool:
        return self.index.is_file()

    def store(self, module: torch.nn.Module) -> bool:
        """Write `module`'s parameters (their local shards) unless another rank with the same share did, then make
        them mappings of the file. False (and the parameters left as they are) where the folder has no room."""
        params = [(name, local_of(p)) for name, p in module.named_parameters()]
        claim = self.folder / f"{self.key}.claim"
        try:
            fd = os.open(claim, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600)
        except FileExistsError:
            if not self._wait(claim):
                return False
        else:
            with os.fdopen(fd, "w") as f:
                f.write(str(os.getpid()))
            try:
                written = self._write(params)
            except OSError as exc:  # the folder filled up meanwhile, or went away: a heal reloads, nothing more
                log.warning("not keeping the weights for a heal: %s", exc)
                written = False
            if not written:
                self.data.unlink(missing_ok=True)
                claim.unlink(missing_ok=True)  # the ranks waiting for this file stop waiting
                return False
        if all(t.device.type == "cpu" for _, t in params):  # on a GPU the file is a host copy, mapped by no one
            try:
                self._map_into(module, None)
            except KeptWeightsError as exc:  # another rank's model under the same key: keep this one's own
                log.warning("not mapping the kept weights: %s", exc)
                return False
        return True

    def _write(self, params: list[tuple[str, torch.Tensor]]) -> bool:
        entries, offset = [], 0
        for name, t in params:
            offset = -(-offset // ALIGN) * ALIGN
            nbytes = t.numel() * t.element_size()
            dtype = str(t.dtype).removeprefix("torch.")
            entries.append({"name": name, "dtype": dtype, "shape": list(t.shape), "offset": offset, "nbytes": nbytes})
            offset += nbytes
        # One writer at a time on a node (the room checked by each in turn): two ranks writing 2 GB each into
        # /dev/shm at once took 5.3 s each here, one after the other 0.6 s each.
        with open(self.folder / "write.lock", "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            stat = os.statvfs(self.folder)
            free = stat.f_bavail * stat.f_frsize
            # Room left for what else lives there: NCCL's intra-node buffers are in /dev/shm too.
            if offset + min(SPARE, stat.f_blocks * stat.f_frsize // 10) > free:
                log.warning(
                    "not keeping the weights for a heal: %s has %.1f GiB free, this rank's share needs %.1f GiB "
                    "(Docker: --shm-size; Kubernetes: an emptyDir with medium Memory)",
                    self.folder.parent,
                    free / 2**30,
                    offset / 2**30,
                )
                return False
            started = time.perf_counter()
            with open(self.data, "wb") as f:
                for (_, t), entry in zip(params, entries, strict=True):
                    f.seek(entry["offset"])
                    f.write(memoryview(t.detach().contiguous().view(-1).view(torch.uint8).cpu().numpy()))
                f.truncate(offset)
        tmp = self.index.with_suffix(".tmp")
        tmp.write_text(json.dumps({"key": self.key, "bytes": offset, "tensors": entries}))
        tmp.rename(self.index)
        log.info(
            "kept this rank's weights for a heal: %.2f GiB in %.1f s (%s)",
            offset / 2**30,
            time.perf_counter() - started,
            self.data,
        )
        return True

    def _wait(self, claim: Path) -> bool:
        """Until the rank that claimed the file has written it; False if it is gone first."""
        deadline = time.monotonic() + WAIT_S
        while not self.ready():
            try:
                if not alive(int(claim.read_text() or "0")):
                    return False
            except FileNotFoundError:  # its writer gave up
                return self.ready()
            except (OSError, ValueError):
                pass
            if time.monotonic() > deadline:
                return False
            time.sleep(0.05)
        return True

    def restore(self, module: torch.nn.Module, device: torch.device) -> int:
        """Every parameter of `module` (built empty, its layout applied) from the file, on `device`; how many.
        Raises KeptWeightsError, and removes the file, where the file's tensors are not the module's."""
        try:
            self.restored = self._map_into(module, device)
            return self.restored
        except KeptWeightsError:
            self.remove()
            raise

    def remove(self) -> None:
        for path in (self.index, self.data, self.folder / f"{self.key}.claim"):
            path.unlink(missing_ok=True)

    def _map_into(self, module: torch.nn.Module, device: torch.device | None) -> int:
        """`module`'s parameters over the file's pages: new parameters on `device` (replacing empty ones), or with
        None the same tensor objects (layouts and hooks hold them) given the file's pages as their storage."""
        header = json.loads(self.index.read_text())
        entries = {e["name"]: e for e in header["tensors"]}
        params = dict(module.named_parameters())
        if set(entries) != set(params):
            missing, extra = sorted(set(params) - set(entries)), sorted(set(entries) - set(params))
            raise KeptWeightsError(
                f"{self.data}: kept tensors do not match the model (missing {missing[:3]}, extra {extra[:3]})"
            )
        for name, param in params.items():  # every tensor checked before any is changed
            e, local = entries[name], local_of(param)
            if str(local.dtype).removeprefix("torch.") != e["dtype"] or list(local.shape) != e["shape"]:
                raise KeptWeightsError(
                    f"{self.data}: {name} is kept as {e['dtype']} {e['shape']}, the model "
                    f"has {str(local.dtype).removeprefix('torch.')} {list(local.shape)}"
                )
        # Copy-on-write (MAP_PRIVATE): pages are the file's until written, and a write never reaches the file.
        storage = torch.UntypedStorage.from_file(str(self.data), shared=False, nbytes=header["bytes"])
        whole = torch.empty(0, dtype=torch.uint8).set_(storage)
        with torch.no_grad():
            for name, param in params.items():
                e, local = entries[name], local_of(param)
                view = whole[e["offset"] : e["offset"] + e["nbytes"]].view(local.dtype).view(e["shape"])
                if device is not None:
                    _replace(module, name, param, view if device.type == "cpu" else view.to(device))
                else:
                    local.set_(view.untyped_storage(), view.storage_offset(), view.shape, view.stride())
        give_back()  # the private copies just let go
        return len(params)


def _replace(module: torch.nn.Module, name: str, param: torch.Tensor, value: torch.Tensor) -> None:
    from torch.distributed.tensor import DTensor

    if isinstance(param, DTensor):
        value = DTensor.from_local(
            value, param.device_mesh, param.placements, run_check=False, shape=param.shape, stride=param.stride()
        )
    owner_name, _, attr = name.rpartition(".")
    owner = module.get_submodule(owner_name) if owner_name else module
    owner._parameters[attr] = torch.nn.Parameter(value, requires_grad=False)


def identity(model: str, component: str) -> list[Any]:
    """What names a checkpoint's component: its folder and every file's size and modification time."""
    folder = Path(model) / component
    files = sorted(folder.iterdir()) if folder.is_dir() else []
    return [str(folder.resolve()), [(p.name, p.stat().st_size, p.stat().st_mtime_ns) for p in files if p.is_file()]]


def keepers(setup: Any, rank: int) -> dict[str, KeptWeights] | None:
    """This rank's KeptWeights per denoiser component of `setup.model` (None where nothing is kept: no folder from
    the launcher, or a setup whose weights do not stay as loaded)."""
    from diffusiond.models.loading.registry import adapter_for, read_model_index

    folder = os.environ.get(FOLDER_ENV)
    if not folder or not Path(folder).is_dir() or not Path(setup.model).is_dir():
        return None
    if setup.quantize != "none" or setup.offload != "none" or setup.layout.sharded or setup.lora_fuse is not None:
        return None
    index = read_model_index(setup.model)
    cls = adapter_for(index.get("_class_name", ""))
    components = [c for c in (cls.denoiser, *cls.extra_denoisers) if isinstance(index.get(c), list) and index[c][1]]
    tp = setup.layout.coordinates(rank)[3]
    out = {}
    for component in components:
        description = {
            "model": identity(setup.model, component),
            "dtype": setup.dtype,
            "device": torch.device(setup.device).type,
            "tp": [tp, setup.layout.tp_degree],
            "torch": torch.__version__,
            "diffusiond": __version__,
        }
        key = hashlib.sha256(json.dumps(description, sort_keys=True).encode()).hexdigest()[:24]
        out[component] = KeptWeights(Path(folder), f"{component}-tp{tp}-{key}")
    return out
