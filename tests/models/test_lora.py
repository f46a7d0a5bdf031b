"""LoRA per request (models/lora/registry.py, kernels/lora_rows.py): requests with different adapters, or none,
share one batched forward, and each image equals diffusers' pipeline with `load_lora_weights` +
`set_adapters(..., adapter_weights)` for the same seed. Tolerance 1e-4 (measured: at most 5e-6 on these
checkpoints, float32 on CPU)."""

from __future__ import annotations

import asyncio
import hashlib
import warnings
from pathlib import Path

import diffusers
import msgspec
import numpy as np
import pytest
import torch
from engines import reference
from pictures import decoded, picture
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from diffusiond.engine.engine import Engine
from diffusiond.engine.outputs import Completed, Progress
from diffusiond.kernels import lora_rows as lora_kernels
from diffusiond.models.loading.loader import load_adapter
from diffusiond.models.lora.files import LoraError
from diffusiond.models.params import LoraChoice, SamplingParams
from diffusiond.models.tiny.lora import build_tiny_lora

TOLERANCE = 1e-4
FAMILIES = {
    "sd3": "tiny_sd3",
    "flux": "tiny_flux",
    "sdxl": "tiny_sdxl",
    "qwen-image": "tiny_qwenimage",
    "z-image": "tiny_zimage",
    "flux2-klein": "tiny_flux2klein",
    "flux2": "tiny_flux2",
    "qwen-image-21": "tiny_qwenimage21",
    "qwen-image-edit-plus": "tiny_qwenimage_edit_plus",
    "qwen-image-layered": "tiny_qwenimage_layered",
    "flux-kontext": "tiny_kontext",
}
# Families that edit an image: every request edits one (and the pipeline is called with it).
EDITS = ("qwen-image-edit-plus", "qwen-image-layered", "flux-kontext")


def loras_for(model: str, folder: Path, names=("a", "b", "c")) -> dict[str, Path]:
    return {n: build_tiny_lora(model, folder / f"{n}.safetensors", seed=i + 1) for i, n in enumerate(names)}


def request(seed: int, *loras: tuple[str, float], prompt: str = "a shape", steps: int = 3) -> SamplingParams:
    choices = tuple(LoraChoice(name, scale) for name, scale in loras) or None
    return SamplingParams(prompt=prompt, seed=seed, width=64, height=64, num_inference_steps=steps, lora=choices)


# Three adapters and none: each LoRA row's factors gathered into one batched matmul (kernels/lora_rows._Gathered).
MIXED = [
    request(1, ("a", 1.0), prompt="a red shape"),
    request(2, ("b", 0.5), prompt="a blue shape"),
    request(3, ("c", 1.5)),
    request(4),
]
# Rows with two adapters, and one adapter at two scales: a pair of matmuls per (adapter, scale) group.
STACKED = [
    request(1, ("a", 1.0), ("b", 0.3), prompt="a red shape"),
    request(2, ("a", 0.5)),
    request(3, ("c", 1.5), ("a", -0.7)),
    request(4),
]


def run(adapter, requests, **engine_kwargs) -> tuple[list[np.ndarray], list[SamplingParams]]:
    async def go():
        engine = Engine(adapter, **{"max_batch": 8, "batch_wait": 0.5, **engine_kwargs})
        await engine.start()
        try:
            handles = [engine.add_request(p) for p in requests]
            results = [await h.result() for h in handles]
        finally:
            await engine.stop()
        assert all(isinstance(r, Completed) for r in results), results
        return [r.image for r in results], [h.params for h in handles]

    return asyncio.run(go())


def diffusers_images(model: str, family: str, files: dict[str, Path], resolved: list[SamplingParams], monkeypatch):
    """Each request through the pipeline with its adapters set (diffusers' own LoRA path), and without any."""
    pipe = getattr(diffusers, diffusers.DiffusionPipeline.load_config(model)["_class_name"]).from_pretrained(model)
    if family == "qwen-image-layered":  # its call takes no size: the requests' 64x64 stands in for it
        from diffusers.pipelines.qwenimage import pipeline_qwenimage_layered as layered

        monkeypatch.setattr(layered, "calculate_dimensions", lambda area, ratio: (64, 64))
    with warnings.catch_warnings():  # "no LoRA keys for the text encoders": these files have none
        warnings.simplefilter("ignore")
        for name, path in files.items():
            pipe.load_lora_weights(str(path.parent), weight_name=path.name, adapter_name=name)
    with_lora, without = [], []
    for params in resolved:
        image = {"image": decoded(params.image)} if params.image is not None else {}  # an edit's
        if family == "qwen-image-layered":  # its layers, as arguments by name
            image = {"image": decoded(params.image).convert("RGBA")}
        if family == "flux-kontext":  # at the request's size (else the pipeline scales the output to 1 Mpx)
            image["max_area"] = params.width * params.height
        pipe.disable_lora()
        without.append(reference(pipe, family, params, **image))
        if params.lora:
            pipe.enable_lora()
            pipe.set_adapters([c.name for c in params.lora], adapter_weights=[c.scale for c in params.lora])
        with_lora.append(reference(pipe, family, params, **image))
    return with_lora, without


@pytest.mark.parametrize(
    ("family", "batch"), [*((family, "mixed") for family in FAMILIES), ("sd3", "stacked"), ("flux", "stacked")]
)
def test_mixed_batch_matches_diffusers(family, batch, request, tmp_path, monkeypatch):
    model = request.getfixturevalue(FAMILIES[family])
    files = loras_for(model, tmp_path)
    adapter = load_adapter(model)
    registry = adapter.enable_lora(1 << 30)
    for name, path in files.items():
        registry.register(name, str(path))
    # What the forwards saw: requests per denoise call, and rows per call of one linear that every adapter targets.
    forwards, rows = [], []
    real = adapter.denoise
    adapter.denoise = lambda states: forwards.append(len(states)) or real(states)
    linear = adapter.loras.layers.linear(next(iter(registry.entries["a"].lora.layers)))
    linear.register_forward_pre_hook(lambda module, args: rows.append(args[0].shape[0]))

    gathered = []  # per linear call with LoRA rows: whether the rows' factors were gathered
    real_delta = lora_kernels._Gathered.delta
    monkeypatch.setattr(lora_kernels._Gathered, "delta", lambda self, *a: gathered.append(1) or real_delta(self, *a))

    requests = MIXED if batch == "mixed" else STACKED
    if (
        family == "qwen-image-21"
    ):  # its rows share a call when their texts have one layout (models/families/qwenimage21.py)
        requests = [msgspec.structs.replace(p, prompt="a shape") for p in requests]
    if family in EDITS:
        requests = [msgspec.structs.replace(p, image=picture(64, 64, seed=p.seed)) for p in requests]
    images, resolved = run(adapter, requests)

    assert bool(gathered) == (batch == "mixed")

    assert forwards == [4] * 3  # every step: one forward for all four requests
    assert rows and len(set(rows)) == 1 and rows[0] % 4 == 0, rows  # the base linear over the whole batch at once
    expected, plain = diffusers_images(model, family, files, resolved, monkeypatch)
    for params, image, want, base in zip(resolved, images, expected, plain, strict=True):
        assert np.abs(image - want).max() < TOLERANCE, (params.seed, np.abs(image - want).max())
        if params.lora:  # the adapter changed this image (a no-op LoRA path would pass the line above for none)
            assert np.abs(want - base).max() > 1e-2


def test_requests_without_lora_pay_nothing(tiny_sd3, tmp_path):
    """No hooks until an adapter is loaded; a batch without LoRA rows gives exactly the images of a model without
    any adapter registered."""
    adapter = load_adapter(tiny_sd3)
    registry = adapter.enable_lora(1 << 30)
    assert adapter.loras.layers.hooked == 0
    plain, _ = run(adapter, [request(1), request(2)])
    registry.register("a", str(loras_for(tiny_sd3, tmp_path, ("a",))["a"]))
    assert adapter.loras.layers.hooked > 0
    again, _ = run(adapter, [request(1), request(2)])
    for x, y in zip(plain, again, strict=True):
        assert np.array_equal(x, y)


def test_bad_files_are_refused_and_change_nothing(tiny_sd3, tiny_flux, tmp_path):
    adapter = load_adapter(tiny_sd3)
    registry = adapter.enable_lora(1 << 30)
    good = loras_for(tiny_sd3, tmp_path / "sd3", ("a", "b"))
    registry.register("a", str(good["a"]))
    hooked = adapter.loras.layers.hooked
    (tmp_path / "garbage.safetensors").write_bytes(b"not a safetensors file at all")
    (tmp_path / "x.bin").write_bytes(b"\x80\x04pickle")
    wrong = tmp_path / "wrong.safetensors"  # one factor 3 columns wider than the linear it targets
    tensors = load_file(good["b"])
    with safe_open(good["b"], "pt") as f:
        metadata = f.metadata()
    key = next(k for k in tensors if "lora_A" in k)
    tensors[key] = torch.zeros(tensors[key].shape[0], tensors[key].shape[1] + 3)
    save_file(tensors, wrong, metadata=metadata)
    other = loras_for(tiny_flux, tmp_path / "flux", ("f",))["f"]  # FLUX's single blocks: no place in SD3
    cases = {
        tmp_path / "garbage.safetensors": "not a safetensors file",
        tmp_path / "x.bin": "must be .safetensors",
        tmp_path / "missing.safetensors": "no such file",
        wrong: "size mismatch",
        other: "no place for: single_transformer_blocks",
    }
    for path, message in cases.items():
        with pytest.raises(LoraError, match=message):
            registry.register("x", str(path))
    with pytest.raises(LoraError, match="already loaded"):
        registry.register("a", str(good["b"]))
    with pytest.raises(LoraError, match="letters, digits"):
        registry.register("../a", str(good["b"]))
    assert list(registry.entries) == ["a"] and adapter.loras.layers.hooked == hooked
    assert registry.loads == 0 and registry.resident_bytes == registry.entries["a"].nbytes


def test_eviction_never_takes_an_adapter_in_use(tiny_sd3, tmp_path):
    """A budget of two adapters and three registered. A long request holds "a"; "b" joins it; "c" must wait until
    "b"'s request ends (a and c then fit), and no adapter a request holds is ever evicted. Every image equals the
    same request run alone with all three resident."""
    files = loras_for(tiny_sd3, tmp_path)
    long, b, c = request(1, ("a", 1.0), steps=8), request(2, ("b", 1.0)), request(3, ("c", 1.0))
    adapter = load_adapter(tiny_sd3)
    registry = adapter.enable_lora(1 << 30)
    for name, path in files.items():
        registry.register(name, str(path))
    alone = [run(adapter, [p])[0][0] for p in (long, b, c)]
    size = max(e.nbytes for e in registry.entries.values())

    adapter = load_adapter(tiny_sd3)
    registry = adapter.enable_lora(2 * size)
    for name, path in files.items():
        registry.register(name, str(path))
    assert registry.evictions == 1 and registry.entries["a"].lora is None  # c's registration made room
    evicted_in_use = []
    make_room = registry._make_room

    def checked(nbytes):
        fits = make_room(nbytes)
        evicted_in_use.extend(n for n, e in registry.entries.items() if e.users and e.lora is None)
        return fits

    registry._make_room = checked

    async def go():
        engine = Engine(adapter, max_batch=8)
        plans = []
        execute = engine.executor.execute
        engine.executor.execute = lambda plan: plans.append(plan) or execute(plan)
        await engine.start()
        try:
            first = engine.add_request(long)
            async for event in first.events():
                if isinstance(event, Progress):
                    break
            handles = [first, engine.add_request(b), engine.add_request(c)]
            return [await h.result() for h in handles], [h.request_id for h in handles], plans
        finally:
            await engine.stop()

    results, (id_a, id_b, id_c), plans = asyncio.run(go())
    assert all(isinstance(r, Completed) for r in results), results
    for got, want in zip(results, alone, strict=True):
        assert np.abs(got.image - want).max() < 1e-5
    admitted = {new.request_id: i for i, plan in enumerate(plans) for new in plan.new}
    last_b = max(i for i, plan in enumerate(plans) if id_b in plan.advance)
    assert admitted[id_b] < admitted[id_c] and admitted[id_c] > last_b  # c waited for b's adapter to be free
    assert any(id_a in plan.advance for plan in plans[admitted[id_c] :])  # while a's request still ran
    assert not evicted_in_use
    assert registry.evictions >= 2 and registry.loads >= 1  # b went for c, and a or c came back from disk
    assert registry.resident_bytes <= registry.budget


def test_fused_adapter_matches_unfused_and_unfuses_exactly(tiny_sd3, tmp_path):
    path = loras_for(tiny_sd3, tmp_path, ("a",))["a"]
    adapter = load_adapter(tiny_sd3)
    before = {k: v.clone() for k, v in adapter.transformer.state_dict().items()}
    registry = adapter.enable_lora(1 << 30)
    registry.register("a", str(path))
    unfused, _ = run(adapter, [request(1, ("a", 0.8)), request(2, ("a", 0.8))])
    registry.fuse("a", 0.8)
    assert adapter.loras.layers.hooked == 0  # in the weights now: no per-step work
    fused, _ = run(adapter, [request(1, ("a", 0.8)), request(2)])  # every request gets it
    for x, y in zip(unfused, fused, strict=True):
        assert np.abs(x - y).max() < TOLERANCE
    registry.unregister("a")
    after = adapter.transformer.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)


def test_step_cache_sub_batches_keep_each_request_s_adapter(tiny_sd3, tmp_path):
    """First-block cache: requests that reuse skip the blocks, the others run them in a sub-batch, whose LoRA plan
    narrows to their rows. Each image equals the request run alone (its cache decisions are its own)."""
    files = loras_for(tiny_sd3, tmp_path)
    adapter = load_adapter(tiny_sd3)
    adapter.enable_step_cache("fbcache", 0.0)
    registry = adapter.enable_lora(1 << 30)
    for name, path in files.items():
        registry.register(name, str(path))
    requests = [
        SamplingParams(
            prompt="a shape",
            seed=i,
            width=64,
            height=64,
            num_inference_steps=6,
            cache_threshold=threshold,
            lora=(LoraChoice(name, 1.0),) if name else None,
        )
        for i, (name, threshold) in enumerate([("a", 0.0), ("b", 10.0), ("c", 0.0), (None, 10.0)])
    ]
    narrowed = []
    real = adapter.loras.layers.narrow
    adapter.loras.layers.narrow = lambda index: narrowed.append(index) or real(index)
    together, _ = run(adapter, requests)
    assert any(index is not None for index in narrowed)  # some steps ran a sub-batch
    for params, image in zip(requests, together, strict=True):
        alone, _ = run(adapter, [params])
        assert np.abs(image - alone[0]).max() < 1e-5


def test_every_read_is_of_the_bytes_registered(tiny_sd3, tmp_path):
    """Issue 30: a file swapped after it was registered (or between rank 0's read and another rank's) is refused,
    never served as other weights: a follower that reads other bytes than rank 0 did refuses the registration (its
    requests are then dropped on every rank, engine/executor.py), and a reload after eviction refuses a changed file."""
    files = loras_for(tiny_sd3, tmp_path)
    adapter = load_adapter(tiny_sd3)
    registry = adapter.enable_lora(1 << 30)
    entry = registry.register("a", str(files["a"]))
    assert entry.public()["sha256"] == hashlib.sha256(files["a"].read_bytes()).hexdigest()
    with pytest.raises(LoraError, match="changed since it was registered"):  # another rank, another file
        registry.register("b", str(files["b"]), sha256=entry.sha256)
    assert list(registry.entries) == ["a"]
    registry.register("b", str(files["b"]), sha256=hashlib.sha256(files["b"].read_bytes()).hexdigest())
    size = registry.entries["a"].nbytes
    registry = load_adapter(tiny_sd3).enable_lora(size)  # room for one: registering b evicts a
    registry.register("a", str(files["a"]))
    registry.register("b", str(files["b"]))
    assert registry.entries["a"].lora is None
    files["a"].write_bytes(files["c"].read_bytes())  # a valid LoRA, other weights
    with pytest.raises(LoraError, match="changed since it was registered"):
        registry.acquire((LoraChoice("a", 1.0),), object())
