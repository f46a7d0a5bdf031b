"""LoRA adapters of the served model: files read through diffusers' own LoRA loading, names registered by the
operator, and the adapters resident in memory under a byte budget (kernels/lora_rows.py applies them per request).

Reading a file (`read_lora`) goes the way `pipeline.load_lora_weights` goes, so what diffusers accepts we accept and
the numbers are the same: the pipeline class's `lora_state_dict` (its format conversions: kohya, XLabs, ... to
diffusers' names; safetensors only, never a pickle), then the denoiser's `load_lora_adapter` into an empty copy of it
(meta tensors: no memory), which checks every target module and shape and computes PEFT's `alpha / r` per module
from the file's metadata or alphas. The factors themselves come from the state dict. Weights for other components (a
text encoder), DoRA, LoRA biases and LoRA on convolutions are refused with the reason.

The registry (`LoraRegistry`) maps names to files. An adapter is resident (its factors in memory) or not; a request
that names a non-resident one loads it when it is prepared, evicting the least recently used adapters that no
request in flight holds. The budget is checked before admission (`fits`), so eviction never needs an adapter in use.
Registration reads the file once to validate it; failures change nothing.
"""

from __future__ import annotations

import hashlib
import logging
import os
import warnings
import weakref
from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from diffusiond.kernels.lora_rows import Lora, LoraLayers, LoraWeights, Selection, fuse, unfuse
from diffusiond.models.lora.files import MAX_HEADER_BYTES, LoraError, check_name, check_safetensors, file_digest

log = logging.getLogger(__name__)

DEFAULT_BUDGET_BYTES = 2 << 30
# Registered adapters (each a row of the listing and a label value of the LoRA metrics).
MAX_ADAPTERS = 256


def file_limit(budget_bytes: int) -> int:
    """The largest file whose factors may fit in `budget_bytes`: they take at least half of it (float32 factors
    served in half precision), besides its header."""
    return 2 * budget_bytes + MAX_HEADER_BYTES + 8


def read_lora(
    name: str,
    path: str,
    pipeline_class: type,
    component: str,
    denoiser: torch.nn.Module,
    dtype: torch.dtype,
    max_bytes: int | None = None,
) -> Lora:
    """The adapter in `path` for `denoiser` (the pipeline's `component`, "transformer" or "unet"); LoraError if it
    does not fit this model, or if the file is larger than `max_bytes` (checked before it is read whole)."""
    from accelerate import init_empty_weights
    from diffusers.utils import convert_unet_state_dict_to_peft
    from peft.tuners.lora import LoraLayer

    check_safetensors(path, max_bytes)
    kwargs: dict[str, Any] = dict(
        weight_name=os.path.basename(path), use_safetensors=True, local_files_only=True, return_lora_metadata=True
    )
    if "return_alphas" in _parameters(pipeline_class.lora_state_dict):
        kwargs["return_alphas"] = True
    try:
        out = pipeline_class.lora_state_dict(os.path.dirname(os.path.abspath(path)), **kwargs)
    except Exception as exc:  # diffusers' own conversion refused it
        raise LoraError(f"{path}: not a LoRA file diffusers can read for {pipeline_class.__name__}: {exc}") from None
    state, alphas, metadata = (
        (out[0], out[1] if len(out) == 3 else None, out[-1]) if isinstance(out, tuple) else (out, None, None)
    )
    prefix = f"{component}."
    others = sorted({key.split(".")[0] for key in state if not key.startswith(prefix)})
    if any(other.startswith("text_encoder") for other in others):
        raise LoraError(f"{path}: has text encoder weights ({', '.join(others)}); only {component} LoRA is served")
    if others:
        raise LoraError(
            f"{path}: has weights for {', '.join(others)}, which this model has not (a LoRA for another model)"
        )
    if not state:
        raise LoraError(f"{path}: no LoRA weights")
    # diffusers' own test in `load_lora_weights`: every key of a LoRA names it.
    if (bad := next((key for key in state if "lora" not in key), None)) is not None:
        raise LoraError(f"{path}: {bad} is not a LoRA weight (full weights, or a Control LoRA, are not served)")
    with init_empty_weights():
        skeleton = type(denoiser).from_config(denoiser.config)
    # Copying into meta tensors is a no-op that PyTorch warns about, and diffusers then reports every key missing:
    # both are expected here (the factors come from the state dict below).
    quiet = [logging.getLogger(name) for name in ("diffusers.utils.peft_utils", "diffusers.loaders.peft")]
    levels = [logger.level for logger in quiet]
    for logger in quiet:  # they would log what the LoraError below says
        logger.setLevel(logging.CRITICAL)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            skeleton.load_lora_adapter(
                dict(state),
                prefix=component,
                network_alphas=alphas or None,
                metadata=metadata or None,
                adapter_name=name,
            )
    except Exception as exc:  # peft: a target module this model lacks, a shape that does not match
        raise LoraError(f"{path}: does not fit this {type(denoiser).__name__}: {_first_line(exc)}") from None
    finally:
        for logger, level in zip(quiet, levels, strict=True):
            logger.setLevel(level)
    tensors = {key.removeprefix(prefix): value for key, value in state.items()}
    if "lora_A" not in next(iter(tensors)):
        tensors = convert_unet_state_dict_to_peft(tensors)
    layers: dict[str, LoraWeights] = {}
    for module_name, module in skeleton.named_modules():
        if not isinstance(module, LoraLayer) or name not in module.lora_A:
            continue
        if not isinstance(module.get_base_layer(), torch.nn.Linear):
            raise LoraError(f"{path}: LoRA on {module_name} ({type(module.get_base_layer()).__name__}): only linears")
        if module.use_dora.get(name):
            raise LoraError(f"{path}: DoRA ({module_name}) is not served")
        if f"{module_name}.lora_B.bias" in tensors:
            raise LoraError(f"{path}: LoRA biases ({module_name}) are not served")
        down = tensors.pop(f"{module_name}.lora_A.weight")
        up = tensors.pop(f"{module_name}.lora_B.weight")
        device = denoiser.get_submodule(module_name).weight.device
        scaled = up.float() * float(module.scaling[name])  # PEFT's alpha / r, folded into B once
        layers[module_name] = LoraWeights(down.to(device, dtype).contiguous(), scaled.to(device, dtype).contiguous())
    if tensors:
        raise LoraError(f"{path}: weights this model has no place for: {', '.join(sorted(tensors)[:5])}")
    if not layers:
        raise LoraError(f"{path}: no LoRA weights for the {component}")
    return Lora(name, layers)


def _parameters(fn: Callable) -> set[str]:
    import inspect

    return set(inspect.signature(fn).parameters)


def _first_line(exc: BaseException) -> str:
    """The gist of a loading error: its lines that say something, shortened (PyTorch's size mismatch report starts
    with a header line)."""
    lines = [line.strip() for line in str(exc).strip().splitlines() if line.strip()]
    lines = [line for line in lines if not line.startswith("Error(s) in loading state_dict")] or lines
    text = "; ".join(lines) or type(exc).__name__
    return text if len(text) <= 400 else text[:400] + "..."


@dataclass(eq=False)
class Entry:
    """A registered adapter: its file, its resident bytes, and (when resident) its factors."""

    name: str
    path: str
    nbytes: int
    # The file's SHA-256 when it was registered: every later read (another rank, a reload after eviction) must match.
    sha256: str = ""
    lora: Lora | None = None
    # Requests in flight (on this rank) that hold it.
    users: int = 0
    requests: int = 0

    def public(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "path": self.path,
            "bytes": self.nbytes,
            "sha256": self.sha256,
            "resident": self.lora is not None,
        }


class LoraRegistry:
    """Names -> files, and the resident adapters. Mutated on the step thread only; `entries` is read by the event
    loop (names for validation, the listing), which only ever sees whole dict operations."""

    def __init__(self, reader: Callable[[str, str], Lora], layers: LoraLayers, budget_bytes: int) -> None:
        self.reader = reader
        self.layers = layers
        self.budget = budget_bytes
        self.entries: dict[str, Entry] = {}
        self._resident: OrderedDict[str, Entry] = OrderedDict()  # least recently used first
        self.loads = 0
        self.evictions = 0
        # (name, scale, original weights) when an adapter is fused into the weights (`fuse`).
        self.fused: tuple[str, float, dict[str, torch.Tensor]] | None = None
        # Unregistered while requests held them: their hooks stay until the last one ends.
        self._draining: list[Entry] = []

    @property
    def resident_bytes(self) -> int:
        return sum(entry.nbytes for entry in list(self._resident.values()))  # a snapshot: read off the step thread too

    def register(self, name: str, path: str, sha256: str | None = None) -> Entry:
        """Reads and checks the file now (LoraError: nothing changes); it stays resident if the budget allows.
        `sha256`: the digest rank 0 read (another rank must read the same bytes)."""
        check_name(name)
        if name in self.entries:
            raise LoraError(f"a LoRA named {name!r} is already loaded; delete it first")
        if self.fused is not None:
            raise LoraError(f"this server fused {self.fused[0]!r} into its weights (--lora-fuse): no other adapters")
        if len(self.entries) >= MAX_ADAPTERS:
            raise LoraError(f"{len(self.entries)} LoRA adapters are registered, the most there may be; delete some")
        lora, digest = self._read(name, path, sha256)
        if lora.nbytes > self.budget:
            raise LoraError(
                f"{path}: {lora.nbytes} bytes, more than the LoRA budget of {self.budget} (--lora-cache-bytes)"
            )
        entry = Entry(name, path, lora.nbytes, digest)
        self.entries[name] = entry
        if self._make_room(lora.nbytes):
            self._keep(entry, lora)
        log.info("LoRA %s registered from %s (%d bytes, %d linears)", name, path, lora.nbytes, len(lora.layers))
        return entry

    def unregister(self, name: str) -> Entry:
        """Forgets the name; requests in flight that hold it keep its factors until they end."""
        entry = self.entries.pop(name, None)
        if entry is None:
            raise LoraError(f"no LoRA named {name!r}")
        if self.fused is not None and self.fused[0] == name:
            unfuse(self.layers, self.fused[2])
            self.fused = None
        if self._resident.pop(name, None) is not None and entry.users:
            self._draining.append(entry)
        else:
            entry.lora = None
        self._rehook()
        return entry

    def fuse(self, name: str, scale: float) -> None:
        """Adds the adapter into the weights for every request (the server's only adapter), at `scale`."""
        entry = self.entries[name]
        if len(self.entries) != 1:
            raise LoraError("--lora-fuse needs exactly one adapter")
        lora = self._load(entry)
        self.fused = (name, scale, fuse(self.layers, lora, scale))
        self._resident.pop(name, None)
        entry.lora = None
        self._rehook()

    def fits(self, names: Iterable[str]) -> bool:
        """Whether these adapters (those of the requests in flight and one more) fit in the budget together."""
        entries = [self.entries.get(n) for n in set(names)]  # the step thread may unregister one meanwhile
        return sum(entry.nbytes for entry in entries if entry is not None) <= self.budget

    def acquire(self, choices: Sequence[Any], owner: object) -> Selection:
        """The resident adapters of a request's `lora` choices (loaded now if needed), held until `owner` (its
        state) is freed. LoraError when a name is no longer registered."""
        selection = []
        for choice in choices:
            if self.fused is not None and choice.name == self.fused[0]:
                continue  # in the weights already
            entry = self.entries.get(choice.name)
            if entry is None:
                raise LoraError(f"LoRA {choice.name!r} was deleted")
            lora = entry.lora or self._load(entry)
            self._resident.move_to_end(entry.name)
            entry.users += 1
            entry.requests += 1
            weakref.finalize(owner, _release, entry)
            selection.append((lora, float(choice.scale)))
        return tuple(selection)

    def _read(self, name: str, path: str, sha256: str | None) -> tuple[Lora, str]:
        """The adapter and the digest of the bytes it was read from: those `sha256` names, when given (a file
        replaced since rank 0 read it, or since it was registered, is refused rather than served differently)."""
        # A path, a header and a size worth hashing (the hash reads the file whole; refused with the reason).
        check_safetensors(path, file_limit(self.budget))
        digest = file_digest(path)
        if sha256 and digest != sha256:
            raise LoraError(
                f"{path}: its bytes changed since it was registered (sha256 {digest[:12]}..., registered "
                f"{sha256[:12]}...); delete and register it again"
            )
        lora = self.reader(name, path)
        if file_digest(path) != digest:
            raise LoraError(f"{path}: changed while it was read; register it again")
        return lora, digest

    # ---- residency ----

    def _load(self, entry: Entry) -> Lora:
        if not self._make_room(entry.nbytes):
            log.warning("LoRA %s: over the budget beside the adapters in use; loading it anyway", entry.name)
        lora, _ = self._read(entry.name, entry.path, entry.sha256)
        self.loads += 1
        self._keep(entry, lora)
        return lora

    def _keep(self, entry: Entry, lora: Lora) -> None:
        entry.lora = lora
        self._resident[entry.name] = entry
        self.layers.hook(list(lora.layers))

    def _make_room(self, nbytes: int) -> bool:
        """Evicts unused adapters, least recently used first, until `nbytes` more fit; False if they cannot."""
        for name in list(self._resident):
            if self.resident_bytes + nbytes <= self.budget:
                break
            entry = self._resident[name]
            if entry.users == 0:
                del self._resident[name]
                entry.lora = None
                self.evictions += 1
                log.info("LoRA %s evicted (%d bytes)", name, entry.nbytes)
        self._rehook()
        return self.resident_bytes + nbytes <= self.budget

    def _rehook(self) -> None:
        for entry in [e for e in self._draining if e.users == 0]:
            self._draining.remove(entry)
            entry.lora = None
        held = [*self._resident.values(), *self._draining]
        self.layers.unhook({layer for entry in held if entry.lora is not None for layer in entry.lora.layers})


def _release(entry: Entry) -> None:
    entry.users -= 1


def resolve_loras(adapter: Any, params: Any) -> tuple | None:
    """A request's `lora`, checked against the served model's registry (ParamError naming `lora`)."""
    from diffusiond.models.params import ParamError

    if not params.lora:
        return None
    registry = adapter.lora_registry
    if registry is None:
        why = "does not serve LoRA" if not adapter.lora else "was started without LoRA support"
        raise ParamError("lora", f"this server's model ({adapter.family}) {why}")
    names = [choice.name for choice in params.lora]
    experts = len(getattr(adapter, "experts", ())) or 1
    if experts == 1 and any(choice.expert is not None for choice in params.lora):
        raise ParamError("lora", f"this {adapter.family} checkpoint has one denoiser; expert is for two-expert ones")
    targets = [(choice.name, choice.expert or 1) for choice in params.lora]
    if len(set(targets)) != len(targets):
        raise ParamError("lora", f"lora names an adapter twice for one denoiser: {', '.join(names)}")
    for choice in params.lora:
        if choice.name not in registry.entries:
            known = ", ".join(sorted(registry.entries)) or "none"
            raise ParamError("lora", f"unknown LoRA adapter {choice.name!r} (registered: {known})")
        if registry.fused is not None and registry.fused[1] != choice.scale:
            raise ParamError(
                "lora",
                f"{choice.name!r} is fused into the weights at scale {registry.fused[1]:g} (--lora-fuse): a request "
                "may only name it at that scale",
            )
    if experts > 1 and registry.fused is not None:
        raise ParamError("lora", "an adapter is fused into the weights: no per-expert choices")
    if not registry.fits(names):
        raise ParamError("lora", f"these adapters together exceed the LoRA budget of {registry.budget} bytes")
    return tuple(params.lora)


def setup_loras(
    adapter: Any,
    specs: Sequence[tuple[str, str]],
    budget_bytes: int,
    fuse_scale: float | None,
    refuse: str | None = None,
) -> LoraRegistry | None:
    """On the step thread after loading: LoRA enabled where the family serves it (and nothing in `refuse`, a
    feature it does not compose with yet), the start-up adapters registered, and with `fuse_scale`, the one adapter
    fused. Raises LoraError (a start-up error) on any bad file. The registry, or None where LoRA is not served."""
    if not adapter.lora or refuse is not None:
        if specs:
            why = (
                refuse
                or getattr(adapter, "lora_unavailable", None)
                or f"the {adapter.family} family does not serve them"
            )
            raise LoraError(f"LoRA adapters cannot be served: {why}")
        return None
    registry = adapter.enable_lora(budget_bytes)
    for name, path in specs:
        registry.register(name, path)
    if fuse_scale is not None:
        if len(specs) != 1:
            raise LoraError(f"--lora-fuse needs exactly one adapter, got {len(specs)}")
        registry.fuse(specs[0][0], fuse_scale)
    return registry


def same_on_every_rank(registry: LoraRegistry, device: Any) -> None:
    """Start-up adapters are read by each rank on its own: every rank must have read the same names and bytes (a file
    replaced while the ranks loaded, or nodes whose --lora-dir differ, would serve other weights on some rows).
    A collective: every rank of the group calls it. LoraError on every rank when they differ."""
    from diffusiond.kernels.collectives import gather_digests

    mine = hashlib.sha256()
    for name in sorted(registry.entries):
        mine.update(f"{name}\0{registry.entries[name].sha256}\n".encode())
    digests = gather_digests(mine.digest(), device)
    differ = [rank for rank, digest in enumerate(digests) if digest != digests[0]]
    if differ:
        here = ", ".join(f"{e.name}={e.path} (sha256 {e.sha256[:12]}...)" for e in registry.entries.values())
        raise LoraError(
            f"ranks {differ} read other start-up LoRA adapters than rank 0 (a file changed while the ranks loaded, "
            f"or their --lora-dir differ); this rank read: {here or 'none'}"
        )
