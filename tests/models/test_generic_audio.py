"""Sound alone on the generic path: Stable Audio Open (`StableAudioPipeline`, the reference design's audio row), its
old-style step callback (`callback`, `callback_steps`), each request's waveform equal to the pipeline's own call;
through the native API as WAV and FLAC (tests/daemon/test_generic_http.py serves it)."""

from __future__ import annotations

import asyncio

import diffusers
import numpy as np
import pytest
import torch
from engines import run_staggered

from diffusiond.daemon.audio_encoding import decode_wav, encode_sound
from diffusiond.engine.outputs import Completed, Sound
from diffusiond.models.generic.adapter import GenericAdapter
from diffusiond.models.loading.loader import load_adapter
from diffusiond.models.params import SamplingParams
from diffusiond.models.tiny.audio import AUDIO_SAMPLE_RATE


@pytest.fixture(scope="module")
def stable_audio(tiny_stable_audio):
    pipe = diffusers.StableAudioPipeline.from_pretrained(tiny_stable_audio)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def reference(pipe, p: SamplingParams) -> np.ndarray:
    return pipe(
        p.prompt,
        negative_prompt=p.negative_prompt,
        num_inference_steps=p.num_inference_steps,
        generator=torch.Generator().manual_seed(p.seed),
        output_type="np",
        **(p.arguments or {}),
    ).audios[0]


def test_sound_requests_equal_the_pipeline_s_own_call(tiny_stable_audio, stable_audio):
    adapter = load_adapter(tiny_stable_audio, adapter="generic")  # its dedicated family: test_stable_audio.py
    assert isinstance(adapter, GenericAdapter)
    caps = adapter.capabilities
    assert (caps.modality, caps.audio_sample_rate) == ("audio", AUDIO_SAMPLE_RATE)
    assert "audio_end_in_s" in caps.fields and caps.public()["audio_sample_rate"] == AUDIO_SAMPLE_RATE
    requests = [
        SamplingParams(prompt="a dog barking", seed=1, num_inference_steps=4),
        SamplingParams(prompt="a piano note", seed=2, num_inference_steps=3, negative_prompt="noise"),
        SamplingParams(prompt="rain on a roof", seed=3, num_inference_steps=4, arguments={"audio_end_in_s": 0.5}),
    ]
    _, results, _ = asyncio.run(run_staggered(adapter, requests))
    for p, result in zip(requests, results, strict=True):
        assert isinstance(result, Completed), result
        expected = reference(stable_audio, p)
        assert result.audio is not None and result.audio.sample_rate == AUDIO_SAMPLE_RATE
        assert result.audio.samples.shape == expected.shape  # [channels, samples]
        diff = float(np.abs(result.audio.samples - expected).max())
        print(f"{p.prompt!r}: {expected.shape}, max abs diff {diff:.2e}")
        assert diff <= 1e-4
    assert results[2].audio.samples.shape[1] == AUDIO_SAMPLE_RATE // 2  # audio_end_in_s reached the call


def test_wav_and_flac_hold_the_waveform():
    t = np.linspace(0, 1, 64, dtype=np.float32)
    wave = np.stack([np.sin(2 * np.pi * 3 * t), 0.5 * np.cos(2 * np.pi * 5 * t)])
    sound = Sound(wave, 64)
    wav = encode_sound(sound, "wav")
    assert (wav.channels, wav.samples, wav.sample_rate) == (2, 64, 64) and wav.data[:4] == b"RIFF"
    back = decode_wav(wav.data)
    assert back.sample_rate == 64 and float(np.abs(back.samples - wave).max()) <= 1 / 32767
    flac = encode_sound(sound, "flac")
    assert flac.data[:4] == b"fLaC" and flac.samples == 64
    with pytest.raises(ValueError):
        encode_sound(sound, "mp3")
