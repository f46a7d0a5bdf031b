"""Run as a rank of a group (tests/spmd_runs.py `launch`, with torchrun's variables): rank 0 drives an Engine over a
TorchComm, the others follow. Rank 0 writes each request's image to OUT/<index>.npy; every rank writes
OUT/forwards<rank>.json, what each of its transformer forwards saw (requests, rows, tokens in and tokens per block)
and how many images it decoded, so that a test can tell a real split from one that computes everything everywhere.
SPMD_LORA=[[NAME, PATH], ...] registers LoRA adapters on every rank at start. Arguments: MODEL OUT CFG_PARALLEL
ULYSSES REQUESTS_JSON [CACHE]; with CACHE (fbcache or teacache), step caching is on and each rank writes
OUT/reuse<rank>.json, its decisions. With SPMD_ATTENTION=NAME in the environment, every rank selects that attention
backend (kernels/attention.py) and writes OUT/attention<rank>.json, how many attention calls went through it. With
SPMD_COMPILE=1, every rank compiles the transformer's blocks (kernels/compile.py) and writes OUT/graphs<rank>.json,
how many graphs dynamo compiled."""

import asyncio
import json
import math
import os
import sys
from pathlib import Path

import msgspec
import numpy as np
import torch
import torch.distributed as dist

from diffusiond.daemon.ranks import join_group, leave
from diffusiond.engine.engine import Engine
from diffusiond.engine.follower import run_follower
from diffusiond.engine.outputs import Completed, Progress
from diffusiond.kernels.layout import ParallelLayout
from diffusiond.models.loading.setup import ModelSetup
from diffusiond.models.params import SamplingParams


async def drive(rank, requests, out: Path) -> None:
    engine = Engine(rank.adapter, max_batch=8, comm=rank.comm)
    # What these runs check is the split of each step, so its batches must not depend on this machine's timings: the
    # engine admits new requests in chunks of a step's measured worth of encoding while others run (engine/deadlines.py,
    # tested in tests/engine/test_scheduler.py), which would spread the joining requests over 1-7 steps by load.
    engine.scheduler.costs = None
    await engine.start()
    try:
        # Staggered: the first request runs a step alone, then the others join its running batch (those that should
        # finish together, for shared decoding, still arrive together).
        handles = [engine.add_request(requests[0])]
        async for event in handles[0].events():
            if isinstance(event, Progress | Completed):
                break
        handles += [engine.add_request(p) for p in requests[1:]]
        for i, handle in enumerate(handles):
            result = await handle.result()
            assert isinstance(result, Completed), result
            np.save(out / f"{i}.npy", result.image)
            if result.audio is not None:
                np.save(out / f"{i}.audio.npy", result.audio.samples)
    finally:
        await engine.stop()


def record_forwards(adapter) -> list[dict]:
    """One entry per denoise call: its requests, whether they use CFG, and per transformer call the rows and image
    tokens it got and the tokens its first block saw."""
    forwards: list[dict] = []
    real = adapter.denoise
    patch = getattr(adapter.transformer.config, "patch_size", 2)  # Z-Image patches by 2 (`all_patch_size`)

    def denoise(states):
        # Two-expert checkpoints: how many experts this step runs (one transformer call each).
        experts = len({adapter.expert_of(s) for s in states}) if hasattr(adapter, "expert_of") else 1
        forwards.append(
            {
                "requests": len(states),
                "cfg": adapter.requests.uses_cfg(states[0].params),
                "calls": [],
                "experts": experts,
            }
        )
        if hasattr(adapter, "step_rows"):  # several passes per step (LTX-2): the rows one rank alone would compute
            forwards[-1]["rows"] = len(adapter.step_rows(states))
        return real(states)

    def on_transformer(module, args, kwargs):
        # SD3: [B, C, H, W] latents; FLUX, Qwen-Image: [B, S, C] packed tokens; Z-Image: a list of [C, 1, H, W]
        hs = kwargs["hidden_states"] if "hidden_states" in kwargs else args[0]
        first = hs[0]
        if isinstance(patch, (list, tuple)):  # Wan: [C, T, H, W] and a (t, h, w) patch
            tokens = math.prod(n // p for n, p in zip(first.shape[1:], patch, strict=True))
        else:
            tokens = first.shape[0] if first.dim() == 2 else (first.shape[-2] // patch) * (first.shape[-1] // patch)
        forwards[-1]["calls"].append({"rows": len(hs), "tokens": tokens})
        if "audio_hidden_states" in kwargs:  # LTX-2: the audio tokens, sharded with the video's
            forwards[-1]["calls"][-1]["audio"] = kwargs["audio_hidden_states"].shape[1]

    def on_block(module, args, kwargs):
        hs = kwargs["hidden_states"] if "hidden_states" in kwargs else args[0]  # [B, S_local, D]
        if not forwards[-1]["calls"]:  # the step cache's forward calls the blocks, not the transformer's forward
            forwards[-1]["calls"].append({"rows": hs.shape[0], "tokens": None})
        forwards[-1]["calls"][-1].setdefault("block_tokens", hs.shape[1])
        if "audio_hidden_states" in kwargs:
            forwards[-1]["calls"][-1].setdefault("audio_block_tokens", kwargs["audio_hidden_states"].shape[1])
        group = adapter.ranks.ulysses
        if group is not None:  # the whole sequence the shards make (Z-Image's: image and caption tokens)
            forwards[-1]["calls"][-1].setdefault("block_total", sum(group.shards))
            # What every rank holds whole beside its shard in the blocks' sequence (Qwen-Image 2.1's prefix).
            forwards[-1]["calls"][-1].setdefault("block_replicated", group.text_len)

    real_decode, real_strips, real_pieces = adapter.decode_latents, adapter.decode_strips, adapter.decode_in_pieces

    def decode_latents(states):
        forwards[-1].setdefault("decoded", []).append(len(states))
        return real_decode(states)

    def decode_in_pieces(states):  # a clip decoded in pieces over the next steps: counted as it starts
        forwards[-1].setdefault("decoded", []).append(len(states))
        return real_pieces(states)

    def decode_strips(states):  # the rows x columns of the strip this rank decoded
        images = real_strips(states)
        forwards[-1].setdefault("strips", []).append(list(adapter.vae_strips.last_strip))
        return images

    adapter.denoise = denoise
    adapter.decode_latents = decode_latents
    adapter.decode_in_pieces = decode_in_pieces
    adapter.decode_strips = decode_strips
    for transformer in getattr(adapter, "experts", (adapter.transformer,)):
        # prepend: before the Ulysses hook that shards FLUX inputs, so that "tokens" counts the whole image.
        transformer.register_forward_pre_hook(on_transformer, with_kwargs=True, prepend=True)
        # Z-Image's are `layers`, Wan's `blocks`; a UNet has no token blocks (and no Ulysses to check).
        blocks = next(
            (
                getattr(transformer, name)
                for name in ("transformer_blocks", "layers", "blocks")
                if hasattr(transformer, name)
            ),
            None,
        )
        if blocks:
            blocks[0].register_forward_pre_hook(on_block, with_kwargs=True)
    return forwards


def record_ring_keys() -> list[list[int]]:
    """Per ring attention kernel call on this rank: [keys it attended over, keys of the whole joint sequence] (a
    ring that gathered everything everywhere would show them equal)."""
    from diffusiond.kernels import ring, ulysses

    calls: list[list[int]] = []
    whole = [0]
    real_kernel, real_ring = ring.attention_lse, ulysses.ring_attention

    def counted(q, k, v, bias=None):
        calls.append([k.shape[2], whole[0]])
        return real_kernel(q, k, v, bias)

    def ringed(q, k, v, **kwargs):
        whole[0] = kwargs["replicated"] + sum(kwargs["blocks"])
        return real_ring(q, k, v, **kwargs)

    ring.attention_lse = counted
    ulysses.ring_attention = ringed
    return calls


def kept_mappings(adapter, folder: str) -> dict:
    """How many of the denoisers' parameters were mapped from the kept folder, and how many lie in a mapping of a
    file there now (/proc/self/maps)."""
    from diffusiond.models.loading.kept_weights import local_of

    spans = []
    for line in Path("/proc/self/maps").read_text().splitlines():
        fields = line.split(maxsplit=5)
        if len(fields) == 6 and fields[5].startswith(folder):
            start, end = (int(x, 16) for x in fields[0].split("-"))
            spans.append((start, end))
    params = [local_of(p) for d in adapter.denoisers().values() for p in d.parameters()]
    held = [p for p in params if p.numel()]
    mapped = sum(any(a <= p.data_ptr() < b for a, b in spans) for p in held)
    return {"restored": adapter.kept_restored, "params": len(params), "held": len(held), "mapped": mapped}


def main() -> None:
    torch.set_num_threads(1)
    model, out, cfg, ulysses, requests_json = sys.argv[1:6]
    requests = msgspec.json.decode(requests_json, type=list[SamplingParams])
    layout = ParallelLayout(
        int(os.environ["WORLD_SIZE"]),
        cfg_degree=int(cfg),
        ulysses_degree=int(ulysses),
        ring_degree=int(os.environ.get("SPMD_RING", "1")),
        tp_degree=int(os.environ.get("SPMD_TP", "1")),
        shard_weights=bool(os.environ.get("SPMD_SHARD")),
        vae_degree=int(os.environ.get("SPMD_VAE", "1")),
        # "RxS": HSDP's replicas ("1": FSDP over every rank)
        shard_replicas=int(os.environ.get("SPMD_SHARD", "1").split("x")[0]),
    )
    # "{rank}" in a path: each rank reads its own file (a test of ranks that read different bytes).
    loras = tuple(
        f"{name}={path.replace('{rank}', os.environ['RANK'])}"
        for name, path in json.loads(os.environ.get("SPMD_LORA", "[]"))
    )
    rank = join_group(ModelSetup(model=model, layout=layout, lora=loras))
    forwards = record_forwards(rank.adapter)
    encodings = [0]  # text encoder calls on this rank
    real_encode = rank.adapter.prompts.encode

    def counted_encode(texts):
        encodings[0] += 1
        return real_encode(texts)

    rank.adapter.prompts.encode = counted_encode
    ring_keys = record_ring_keys() if os.environ.get("SPMD_RING", "1") != "1" else None
    decisions: list[list] = []
    attention_calls = None
    if backend := os.environ.get("SPMD_ATTENTION"):
        from diffusers.models.attention_dispatch import AttentionBackendName, _AttentionBackendRegistry

        from diffusiond.kernels.attention import BACKENDS

        rank.adapter.set_attention(backend)
        name = AttentionBackendName(BACKENDS[backend])
        kernel = _AttentionBackendRegistry._backends[name]
        attention_calls = [0]

        def counted(*args, **kwargs):
            attention_calls[0] += 1
            return kernel(*args, **kwargs)

        _AttentionBackendRegistry._backends[name] = counted
    if len(sys.argv) > 6:
        from diffusiond.models.stepcache import methods as stepcache

        name, _, config = sys.argv[6].partition(":")
        rank.adapter.enable_step_cache(name, 0.0, json.loads(config) if config else None)
        original = stepcache.reuse

        def recording(state, change):
            decision = original(state, change)
            decisions.append([state.request_id, state.step_index, change, decision])
            return decision

        stepcache.reuse = recording
    compiled = os.environ.get("SPMD_COMPILE") == "1"
    if compiled:
        rank.adapter.enable_compile()
    if rank.rank == 0:
        asyncio.run(drive(rank, requests, Path(out)))
    else:
        run_follower(rank.adapter, rank.comm)
    Path(out, f"forwards{rank.rank}.json").write_text(json.dumps(forwards))
    shared = rank.adapter.prompts.shared
    sent = shared.sent if shared is not None else 0
    Path(out, f"encode{rank.rank}.json").write_text(json.dumps({"calls": encodings[0], "sent": sent}))
    if ring_keys is not None:
        Path(out, f"ring{rank.rank}.json").write_text(json.dumps(ring_keys))
    if rank.adapter.weight_bytes is not None:
        Path(out, f"weights{rank.rank}.json").write_text(json.dumps(rank.adapter.weight_bytes))
    if kept := os.environ.get("_DIFFUSIOND_KEPT_WEIGHTS"):
        Path(out, f"kept{rank.rank}.json").write_text(json.dumps(kept_mappings(rank.adapter, kept)))
    if decisions:
        Path(out, f"reuse{rank.rank}.json").write_text(json.dumps(decisions))
    if attention_calls is not None:
        Path(out, f"attention{rank.rank}.json").write_text(json.dumps(attention_calls[0]))
    if compiled:
        from torch._dynamo.utils import counters

        Path(out, f"graphs{rank.rank}.json").write_text(json.dumps(counters["stats"]["unique_graphs"]))
    dist.destroy_process_group()
    leave(0)


if __name__ == "__main__":
    main()
