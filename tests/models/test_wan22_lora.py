"""Wan 2.2 A14B's LoRA per expert (its LoRAs ship in pairs, one per expert): each choice of a request applies in the
expert it names (`expert` 1: `transformer`, the high-noise steps, the default; 2: `transformer_2`), beside requests
with other adapters or none, in batches whose steps run both experts. The oracle: `WanPipeline` with the files
loaded by `load_lora_weights` (2: `load_into_transformer_2=True`) and `set_adapters`. Float32 on CPU; tolerance
max abs diff <= 1e-4 on the decoded frames."""

import asyncio
import warnings

import diffusers
import numpy as np
import pytest
from engines import run_staggered

from diffusiond.engine.outputs import Completed
from diffusiond.models.loading.loader import load_adapter
from diffusiond.models.params import LoraChoice, ParamError, SamplingParams
from diffusiond.models.tiny.lora import build_tiny_lora

TOLERANCE = 1e-4


def clip(prompt: str, seed: int, steps: int, lora=None) -> SamplingParams:
    return SamplingParams(
        prompt=prompt, seed=seed, width=48, height=32, num_frames=5, num_inference_steps=steps, guidance_scale=5.0,
        lora=lora,
    )  # fmt: skip


def frames(pipe, p: SamplingParams):
    import torch

    return pipe(
        prompt=p.prompt,
        width=p.width,
        height=p.height,
        num_frames=p.num_frames,
        num_inference_steps=p.num_inference_steps,
        guidance_scale=p.guidance_scale,
        generator=torch.Generator().manual_seed(p.seed),
        output_type="np",
    ).frames[0]


def test_each_choice_applies_in_the_expert_it_names(tiny_wan22, tmp_path):
    files = {
        n: build_tiny_lora(tiny_wan22, tmp_path / f"{n}.safetensors", seed=i + 1, std=0.1) for i, n in enumerate("ab")
    }
    adapter = load_adapter(tiny_wan22)
    registry = adapter.enable_lora(1 << 30)
    for name, path in files.items():
        registry.register(name, str(path))
    high, low = LoraChoice("a", 1.0, expert=1), LoraChoice("b", 0.7, expert=2)
    requests = [
        clip("a red cat", 1, 8, lora=(high, low)),  # a pair: one adapter per expert
        clip("a blue dog", 2, 7, lora=(LoraChoice("b", 1.0),)),  # the default: the high-noise expert only
        clip("a green bird", 3, 6, lora=(LoraChoice("a", 0.5, expert=2),)),  # the low-noise expert only
        clip("a white horse", 4, 6),
    ]
    handles, results, plans = asyncio.run(run_staggered(adapter, requests))
    assert max(len(p.advance) for p in plans) == 4
    pipe = diffusers.WanPipeline.from_pretrained(tiny_wan22)
    pipe.set_progress_bar_config(disable=True)
    with warnings.catch_warnings():  # no text encoder weights in these files
        warnings.simplefilter("ignore")
        for name, path in files.items():
            for expert in (1, 2):
                pipe.load_lora_weights(
                    str(path.parent), weight_name=path.name, adapter_name=f"{name}{expert}",
                    load_into_transformer_2=expert == 2,
                )  # fmt: skip
    for handle, result in zip(handles, results, strict=True):
        assert isinstance(result, Completed), result
        p = handle.params
        for transformer in (pipe.transformer, pipe.transformer_2):
            transformer.disable_lora()
        plain = frames(pipe, p)
        for expert, transformer in ((1, pipe.transformer), (2, pipe.transformer_2)):
            chosen = [c for c in p.lora or () if (c.expert or 1) == expert]
            if chosen:
                transformer.enable_lora()
                transformer.set_adapters([f"{c.name}{expert}" for c in chosen], [c.scale for c in chosen])
        expected = frames(pipe, p)
        diff = float(np.abs(result.image - expected).max())
        print(f"{p.prompt!r} {p.lora}: max abs diff {diff:.1e}, LoRA moved it {np.abs(expected - plain).max():.3f}")
        assert diff <= TOLERANCE, (p.prompt, diff)
        assert (float(np.abs(expected - plain).max()) > 1e-2) == bool(p.lora)


def test_expert_is_for_two_expert_checkpoints(tiny_wan, tiny_wan22, tmp_path):
    from diffusiond.models.lora.registry import LoraError

    path = build_tiny_lora(tiny_wan, tmp_path / "a.safetensors", seed=1)
    one = load_adapter(tiny_wan)
    one.enable_lora(1 << 30).register("a", str(path))
    with pytest.raises(ParamError, match="one denoiser") as info:
        one.resolve(clip("a cat", 1, 2, lora=(LoraChoice("a", expert=2),)))
    assert info.value.param == "lora"
    two = load_adapter(tiny_wan22)
    registry = two.enable_lora(1 << 30)
    registry.register("a", str(path))
    twice = (LoraChoice("a", expert=1), LoraChoice("a", expert=2))  # both experts: named once for each
    assert two.resolve(clip("a cat", 1, 2, lora=twice)).lora == twice
    with pytest.raises(ParamError, match="twice"):
        two.resolve(clip("a cat", 1, 2, lora=(LoraChoice("a"), LoraChoice("a", expert=1))))
    with pytest.raises((LoraError, ValueError), match="several denoisers"):
        registry.fuse("a", 1.0)
