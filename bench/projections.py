"""Wan's cross-attention projection reuse, side by side in one process and one run: the same batch of requests
stepped with the projections reused (computed once per request at admission) and projected at every step, steps
interleaved (A, B, A, B...) so that machine noise hits both alike. Random weights in Wan 2.1 1.3B's widths (dim 1536,
12 heads, ffn 8960, 4096-wide text context of 512 tokens) with fewer blocks; per block both paths scale alike.

Also prints the share of a step's multiply-adds the projections are, at this size and at Wan's 832x480, 81 frames,
so the measured saving can be read for real sizes.

    python -m diffusiond.bench.projections [--layers 4] [--size 128x128] [--frames 5] [--batch 2] [--steps 6]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time


def build(out: str, layers: int, dim: int, heads: int, ffn: int, text_dim: int) -> None:
    import torch
    from diffusers import WanPipeline, WanTransformer3DModel
    from transformers import UMT5Config, UMT5EncoderModel

    from diffusiond.models.tiny.text import make_t5_tokenizer
    from diffusiond.models.tiny.wan import wan_scheduler, wan_vae

    tok = make_t5_tokenizer()
    encoder = UMT5EncoderModel(
        UMT5Config(
            vocab_size=len(tok), d_model=text_dim, d_kv=64, d_ff=256, num_layers=1, num_heads=4,
            feed_forward_proj="gated-gelu", pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id,
            decoder_start_token_id=tok.pad_token_id,
        )
    )  # fmt: skip
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        transformer = WanTransformer3DModel(
            patch_size=(1, 2, 2), num_attention_heads=heads, attention_head_dim=dim // heads, in_channels=16,
            out_channels=16, text_dim=text_dim, freq_dim=256, ffn_dim=ffn, num_layers=layers,
        )  # fmt: skip
    pipe = WanPipeline(
        tokenizer=tok, text_encoder=encoder, vae=wan_vae(), scheduler=wan_scheduler(), transformer=transformer
    )
    pipe.save_pretrained(out)


def projection_share(dim: int, ffn: int, tokens: int, text: int = 512) -> float:
    """Multiply-adds of the text key/value projections over those of one block's forward for one row."""
    projections = 2 * text * dim * dim
    linears = tokens * (4 * dim * dim + 2 * dim * dim + 2 * dim * ffn)  # self q,k,v,o; cross q,o; feed-forward
    attention = 2 * tokens * tokens * dim + 2 * tokens * text * dim
    return projections / (projections + linears + attention)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--dim", type=int, default=1536)
    parser.add_argument("--heads", type=int, default=12)
    parser.add_argument("--ffn", type=int, default=8960)
    parser.add_argument("--text-dim", type=int, default=4096)
    parser.add_argument("--size", default="128x128")
    parser.add_argument("--frames", type=int, default=5)
    parser.add_argument("--batch", type=int, default=2, help="requests in the batch (each with CFG: 2 rows)")
    parser.add_argument("--steps", type=int, default=6, help="timed steps per path")
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args(argv)

    import torch

    torch.set_num_threads(args.threads)
    from diffusiond.models.loading.loader import load_adapter
    from diffusiond.models.params import SamplingParams

    width, height = (int(x) for x in args.size.split("x"))
    with tempfile.TemporaryDirectory() as out:
        build(out, args.layers, args.dim, args.heads, args.ffn, args.text_dim)
        adapter = load_adapter(out)
    requests = [
        SamplingParams(
            prompt=f"a red cat {i}",
            seed=i,
            width=width,
            height=height,
            num_frames=args.frames,
            num_inference_steps=2 * args.steps + 2,
            guidance_scale=5.0,
        )
        for i in range(args.batch)
    ]
    cache = adapter.projections
    times: dict[str, list[float]] = {"reused": [], "projected": []}
    with torch.inference_mode():
        states = adapter.prepare([(f"r{i}", adapter.resolve(p)) for i, p in enumerate(requests)])
        adapter.denoise(states)  # warm-up
        for step in range(2 * args.steps):
            path = "reused" if step % 2 == 0 else "projected"
            adapter.projections = cache if path == "reused" else None
            plan_rows = [s.rows for s in states]
            if path == "projected":
                for s in states:
                    s.rows = [None] * len(s.rows)  # every row projected in the forward
            adapter.forget([s.request_id for s in states])  # rebuild the batch's rows for this path
            t0 = time.perf_counter()
            out = adapter.denoise(states)
            times[path].append(time.perf_counter() - t0)
            for s, rows in zip(states, plan_rows, strict=True):
                s.rows = rows
            adapter.step(states, out)
    tokens = (args.frames - 1) // 4 + 1
    tokens *= (height // 16) * (width // 16)
    reused, projected = (statistics.median(times[k]) * 1000 for k in ("reused", "projected"))
    print(f"Wan-shaped transformer: {args.layers} blocks, dim {args.dim}, {args.batch} requests x 2 CFG rows")
    print(f"{width}x{height}, {args.frames} frames: {tokens} video tokens per row, 512 text tokens")
    print(f"per step: projected every step {projected:.1f} ms, reused {reused:.1f} ms, ratio {projected / reused:.3f}x")
    print(
        f"projections' share of a block's multiply-adds: {100 * projection_share(args.dim, args.ffn, tokens):.1f}% "
        f"here; {100 * projection_share(args.dim, args.ffn, 21 * 30 * 52):.2f}% at 832x480, 81 frames (32760 tokens)"
    )


if __name__ == "__main__":
    main()
