"""Train the demo text-to-image model from nothing, on procedural scenes, into a standard SD3 diffusers checkpoint.

    python -m diffusiond.tools.demo.train --out models/demo/weights [--minutes 46] [--vae-minutes 10]

Two phases, both on the CPU with fixed seeds:

1. The VAE (`AutoencoderKL`, 64x64 RGB -> 16x16x8 latents, vae_scale_factor 4), on freshly drawn training scenes,
   as a deterministic autoencoder with a shape-weighted L1 + image-gradient (edge) L1 loss. Its reconstructions
   are then scored with the judge (squares must stay square), and its latent statistics set `shift_factor` /
   `scaling_factor` as in SD3, so model-space latents `(z - shift) * scale` have zero mean and unit variance.
2. The MMDiT (`SD3Transformer2DModel`) jointly with two small CLIP text encoders that start random, with the
   rectified-flow objective of diffusers' `FlowMatchEulerDiscreteScheduler`: x_t = (1 - s) x0 + s eps, target
   v = eps - x0, timestep = 1000 s, s = sigmoid(n), n ~ N(0, 1) (logit-normal, as SD3), 10% of captions dropped
   to "" for classifier-free guidance, and an EMA of the weights, which is what is saved. The squared error is
   weighted 1 + `--shape-weight` on the latent pixels the caption's shape can reach (`shape_regions`).
   `--init DIR` continues from a checkpoint instead (its VAE kept, its transformer and text encoders trained on);
   the shipped weights were made in three such stages (README.md).

Without T5, `StableDiffusion3Pipeline.encode_prompt` appends `max_sequence_length` (256 in diffusiond) all-zero
tokens to the 16 CLIP tokens. They enter every joint block as identical tokens (the context embedder's bias), so
every query sees 256 identical keys and values; training replaces them by ONE zero token whose attention logit is
raised by log(256) (`ZeroTokenJointAttnProcessor`), which is exactly the same attention, at a quarter of the cost.
`check_zero_token_trick` verifies it against the real pipeline path on the saved checkpoint.

Step counts follow from the time budget (measured speed after a few steps) unless `--vae-steps` / `--steps` fix
them; pass the step counts a run logged to reproduce it exactly on any machine. The checkpoint is written every
`--checkpoint-minutes`, so an interrupted run still leaves usable weights in `--out`; the trained VAE is kept in
`--work`, and a rerun with `--reuse-vae` trains only the transformer.
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import shutil
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from diffusiond.tools.demo import scenes as sc
from diffusiond.tools.demo.text import (
    CLIP_HIDDEN,
    CLIP_PROJECTION,
    FastTokenizer,
    encode_text,
    grow_text_encoder,
    make_text_encoder,
    make_tokenizer,
    tokenize,
    with_zero_token,
)

SEED = 0
# diffusiond's SD3Adapter.max_sequence_length: the all-zero T5 stand-in tokens the pipeline appends.
ZERO_TOKENS = 256
LATENT_CHANNELS = 8
LATENT_SIZE = sc.IMAGE_SIZE // 4
DEFAULT_SHIFT = 2.0
# diffusiond.json (models/declared.py): serving defaults, and what the model serves well. It was trained on 64x64
# images only (larger ones come out speckled and misshapen), so it accepts no other size.
DRAWS = (
    "one small or large circle, square or triangle in red, green, blue, yellow, white or black, at the top left, "
    "top, top right, left, center, right, bottom left, bottom or bottom right, on a plain background of another of "
    "those colours; 64x64"
)


def declaration(captions: str = "variants") -> dict[str, Any]:
    """What a model trained on `captions` ("variants": v2, "grammar": v1) declares in diffusiond.json."""
    variants = captions == "variants"
    return {
        "name": "diffusiond-shapes",
        "width": 64,
        "height": 64,
        "num_inference_steps": 16,
        # Chosen on held-out partial captions (tools/demo/README.md): 3 for v3; v1 was tuned at 2.
        "guidance_scale": 3.0 if variants else 2.0,
        "sizes": [[64, 64]],
        "steps": [4, 100],
        "guidance": [0.0, 10.0],
        "negative_prompt": False,
        "vocabulary": list(sc.VOCABULARY if variants else sc.GRAMMAR_WORDS),
        "draws": DRAWS
        + (
            ". Name any of these, in any order: it picks the rest. It also knows little, tiny, big, ball, dot, "
            "disc, box, centre, middle, upper, lower, corner, side, with, against"
            if variants
            else ""
        ),
    }


DROPOUT = 0.1
VAE_LR = 1e-3
# Extra transformer loss weight on the latent pixels a caption's shape can touch (`shape_regions`).
SHAPE_WEIGHT = 4.0
# One group: GroupNorm normalises each group over space, and on flat-coloured images with 8 groups of few channels
# that erases most of the colour (a VAE with 8 groups was still at L1 0.37 after 100 steps, with 1 group at 0.09).
NORM_GROUPS = 1


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


# --------------------------------------------------------------------------------------------------- components


def make_vae() -> Any:
    from diffusers import AutoencoderKL

    # Three blocks: vae_scale_factor = 2 ** (3 - 1) = 4, so 64x64 images have 16x16 latents.
    return AutoencoderKL(
        in_channels=3,
        out_channels=3,
        down_block_types=("DownEncoderBlock2D",) * 3,
        up_block_types=("UpDecoderBlock2D",) * 3,
        block_out_channels=(16, 32, 64),
        layers_per_block=2,
        act_fn="silu",
        latent_channels=LATENT_CHANNELS,
        norm_num_groups=NORM_GROUPS,
        sample_size=sc.IMAGE_SIZE,
        mid_block_add_attention=False,
        use_quant_conv=False,
        use_post_quant_conv=False,
    )


def make_transformer() -> Any:
    from diffusers import SD3Transformer2DModel

    return SD3Transformer2DModel(
        sample_size=LATENT_SIZE,
        patch_size=2,
        in_channels=LATENT_CHANNELS,
        out_channels=LATENT_CHANNELS,
        num_layers=4,
        attention_head_dim=32,
        num_attention_heads=4,
        joint_attention_dim=2 * CLIP_HIDDEN,  # the two CLIP hidden states, concatenated
        caption_projection_dim=128,  # == inner dim
        pooled_projection_dim=2 * CLIP_PROJECTION,
        pos_embed_max_size=16,  # up to 128x128 images; trained at 64x64 (the centre 8x8 of the grid)
        qk_norm="rms_norm",
    )


def count(module: torch.nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


# --------------------------------------------------------------------------------------------------- attention


class ZeroTokenJointAttnProcessor:
    """diffusers' `JointAttnProcessor2_0`, with the last context token's attention logit raised by log(count): one
    token standing for `count` identical ones (the pipeline's all-zero T5 tokens)."""

    def __init__(self, count: int = ZERO_TOKENS) -> None:
        self.log_count = math.log(count)

    def __call__(
        self,
        attn: Any,
        hidden_states: torch.Tensor,
        encoder_hidden_states: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        *args: Any,
        **kwargs: Any,
    ) -> Any:
        assert encoder_hidden_states is not None, "SD3 joint blocks always attend to the context"
        batch = hidden_states.shape[0]
        n_image = hidden_states.shape[1]

        def heads(x: torch.Tensor) -> torch.Tensor:
            return x.view(batch, -1, attn.heads, x.shape[-1] // attn.heads).transpose(1, 2)

        query, key, value = (
            heads(attn.to_q(hidden_states)),
            heads(attn.to_k(hidden_states)),
            heads(attn.to_v(hidden_states)),
        )
        if attn.norm_q is not None:
            query = attn.norm_q(query)
        if attn.norm_k is not None:
            key = attn.norm_k(key)
        c_query = heads(attn.add_q_proj(encoder_hidden_states))
        c_key = heads(attn.add_k_proj(encoder_hidden_states))
        c_value = heads(attn.add_v_proj(encoder_hidden_states))
        if attn.norm_added_q is not None:
            c_query = attn.norm_added_q(c_query)
        if attn.norm_added_k is not None:
            c_key = attn.norm_added_k(c_key)
        query = torch.cat([query, c_query], dim=2)
        key = torch.cat([key, c_key], dim=2)
        value = torch.cat([value, c_value], dim=2)
        bias = torch.zeros(key.shape[2], dtype=query.dtype, device=query.device)
        bias[-1] = self.log_count
        out = F.scaled_dot_product_attention(query, key, value, attn_mask=bias.view(1, 1, 1, -1))
        out = out.transpose(1, 2).reshape(batch, -1, out.shape[1] * out.shape[-1]).to(query.dtype)
        out, c_out = out[:, :n_image], out[:, n_image:]
        if not attn.context_pre_only:
            c_out = attn.to_add_out(c_out)
        out = attn.to_out[1](attn.to_out[0](out))
        return out, c_out


# --------------------------------------------------------------------------------------------------- schedules


class Budget:
    """Total steps, fixed or derived from a time budget after `calibrate` steps; the LR follows warmup + cosine."""

    def __init__(self, steps: int | None, seconds: float, warmup: int, calibrate: int = 12) -> None:
        self.total = steps
        self.seconds = seconds
        self.warmup = warmup
        self.calibrate = calibrate
        self.start = time.monotonic()
        self._t_calib: float | None = None

    def after_step(self, step: int) -> None:
        if step == 3:
            self._t_calib = time.monotonic()
        if self.total is None and step == 3 + self.calibrate:
            assert self._t_calib is not None
            per_step = (time.monotonic() - self._t_calib) / self.calibrate
            left = self.seconds - (time.monotonic() - self.start)
            self.total = max(step + 1, step + int(0.97 * left / per_step))
            log(f"{per_step:.3f} s/step: planning {self.total} steps")

    def lr_factor(self, step: int, floor: float = 0.05) -> float:
        if step < self.warmup:
            return (step + 1) / self.warmup
        total = self.total or 10**9
        progress = min(1.0, (step - self.warmup) / max(1, total - self.warmup))
        return floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * progress))

    def done(self, step: int) -> bool:
        if self.total is not None and step >= self.total:
            return True
        return time.monotonic() - self.start > 1.1 * self.seconds and self.total is None


# --------------------------------------------------------------------------------------------------- VAE


Jitter = tuple[float, float]  # (position, size) jitter in px
DEFAULT_JITTER: Jitter = (sc.POSITION_JITTER, sc.SIZE_JITTER)


def image_batch(
    rng: np.random.Generator, scenes: list[sc.Scene], n: int, jitter: Jitter = DEFAULT_JITTER
) -> torch.Tensor:
    batch = [sc.random_scene(rng, scenes) for _ in range(n)]
    images = sc.render_batch(batch, rng, position_jitter=jitter[0], size_jitter=jitter[1])
    return torch.from_numpy(sc.to_tensor_range(images))


def shape_weights(x: torch.Tensor, weight: float = 9.0) -> torch.Tensor:
    """Per-pixel loss weights [B, 1, H, W]: 1 on the background, 1 + `weight` on the shape and 2 px around it (the
    shape covers only 2-10% of an image; unweighted, a VAE learns backgrounds first and shapes as blurred blobs)."""
    bg = x[..., :2, :].flatten(2).median(dim=2).values[..., None, None]  # [B, 3, 1, 1], the top rows' colour
    shape = ((x - bg).abs().amax(1, keepdim=True) > 0.05).float()
    return 1 + weight * F.max_pool2d(shape, 5, stride=1, padding=2)


def edge_l1(y: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    dx = lambda t: t[..., :, 1:] - t[..., :, :-1]  # noqa: E731
    dy = lambda t: t[..., 1:, :] - t[..., :-1, :]  # noqa: E731
    return (dx(y) - dx(x)).abs().mean() + (dy(y) - dy(x)).abs().mean()


def train_vae(
    vae: Any,
    train: list[sc.Scene],
    *,
    steps: int | None,
    minutes: float,
    batch: int = 16,
    jitter: Jitter = DEFAULT_JITTER,
) -> dict:
    """A deterministic autoencoder (the posterior mean is decoded; `make_deterministic` then pins the posterior
    variance to ~0), loss = shape-weighted L1 + L1 of the image gradients."""
    rng = np.random.default_rng(SEED + 1)
    opt = torch.optim.AdamW(vae.parameters(), lr=VAE_LR, betas=(0.9, 0.99), weight_decay=0.0)
    budget = Budget(steps, minutes * 60, warmup=30)
    vae.train()
    step, ema_loss = 0, None
    t0 = time.monotonic()
    while not budget.done(step):
        for group in opt.param_groups:
            group["lr"] = VAE_LR * budget.lr_factor(step)
        x = image_batch(rng, train, batch, jitter)
        y = vae.decode(vae.encode(x).latent_dist.mean).sample
        w = shape_weights(x)
        rec = ((y - x).abs() * w).mean() / w.mean()
        edge = edge_l1(y, x)
        loss = rec + edge
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(vae.parameters(), 1.0)
        opt.step()
        budget.after_step(step)
        value = float(loss.detach())
        ema_loss = value if ema_loss is None else 0.95 * ema_loss + 0.05 * value
        if step % 50 == 0:
            log(f"vae step {step}: loss {ema_loss:.4f} (l1 {float(rec.detach()):.4f} edge {float(edge.detach()):.4f})")
        step += 1
    vae.eval()
    make_deterministic(vae)
    return {"steps": step, "seconds": time.monotonic() - t0, "loss": ema_loss, "batch": batch}


@torch.no_grad()
def make_deterministic(vae: Any) -> None:
    """The encoder's log-variance outputs were never trained: pin them to the clamp floor (-30), so
    `latent_dist.sample()` equals `latent_dist.mean` to ~3e-7, as a deterministic autoencoder should."""
    conv = vae.encoder.conv_out
    half = conv.out_channels // 2
    conv.weight[half:] = 0
    conv.bias[half:] = -30.0


@torch.no_grad()
def vae_report(vae: Any, scenes: list[sc.Scene], n: int = 300, seed: int = 7) -> dict[str, Any]:
    """Judge accuracy of VAE reconstructions (posterior mean) of `n` jittered scenes, overall and per shape."""
    from diffusiond.tools.demo.judge import accuracy

    rng = np.random.default_rng(seed)
    batch = [sc.random_scene(rng, scenes) for _ in range(n)]
    images = sc.render_batch(batch, rng)
    x = torch.from_numpy(sc.to_tensor_range(images))
    recon = torch.cat([vae.decode(vae.encode(x[i : i + 50]).latent_dist.mean).sample for i in range(0, n, 50)])
    recon = ((recon.clamp(-1, 1) + 1) / 2).permute(0, 2, 3, 1).numpy()
    report: dict[str, Any] = {"all": accuracy(zip(batch, recon, strict=True))}
    for shape in sc.SHAPES:
        pairs = [(s, r) for s, r in zip(batch, recon, strict=True) if s.shape == shape]
        report[shape] = accuracy(pairs)
    report["mae"] = float(np.abs(recon - images / 255.0).mean())
    return report


# --------------------------------------------------------------------------------------------------- transformer


@torch.no_grad()
def encode_dataset(
    vae: Any, train: list[sc.Scene], per_scene: int, jitter: Jitter = DEFAULT_JITTER
) -> tuple[torch.Tensor, list[int]]:
    """VAE latents [N, 8, 16, 16] of `per_scene` jittered renders of every training scene, and their scene index."""
    rng = np.random.default_rng(SEED + 2)
    index = [i for i in range(len(train)) for _ in range(per_scene)]
    latents = []
    for start in range(0, len(index), 128):
        chunk = [train[i] for i in index[start : start + 128]]
        images = sc.render_batch(chunk, rng, position_jitter=jitter[0], size_jitter=jitter[1])
        x = torch.from_numpy(sc.to_tensor_range(images))
        latents.append(vae.encode(x).latent_dist.mean)
    return torch.cat(latents), index


def shape_regions(scenes: list[sc.Scene], jitter: Jitter = DEFAULT_JITTER) -> torch.Tensor:
    """[S, 1, 16, 16] masks of the latent pixels that a scene's shape can touch: its nominal box grown by the jitter
    and one latent pixel. They depend on the caption only, not on the image drawn, so weighting the loss with them
    keeps its minimiser, E[v | x_t, caption], and only puts more of the gradient on the shape."""
    grid = (torch.arange(LATENT_SIZE, dtype=torch.float32) + 0.5) * 4  # latent pixel centres in image pixels
    masks = []
    for scene in scenes:
        cx, cy, side = sc.geometry(scene)
        reach = (side + jitter[1]) / 2 + jitter[0] + 4
        inside_x = (grid - cx).abs() <= reach
        inside_y = (grid - cy).abs() <= reach
        masks.append((inside_y[:, None] & inside_x[None, :]).float())
    return torch.stack(masks)[:, None]


class CaptionRegions:
    """`shape_regions` for captions that may leave the position or the size out: the union of the regions of every
    scene the caption describes (the whole image when it names no position), still a function of the caption
    only. Masks [1, 16, 16], one per (position or None, size or None)."""

    def __init__(self, jitter: Jitter = DEFAULT_JITTER) -> None:
        probe = sc.Scene("square", "red", "small", "center", "blue")
        self.masks: dict[tuple[str | None, str | None], torch.Tensor] = {}
        for position in (*sc.POSITIONS, None):
            for size in (*sc.SIZES, None):
                scenes = [
                    sc.Scene(probe.shape, probe.colour, z, p, probe.background)
                    for p in ([position] if position else sc.POSITIONS)
                    for z in ([size] if size else sc.SIZES)
                ]
                self.masks[(position, size)] = shape_regions(scenes, jitter).amax(0)

    def __call__(self, scene: sc.Scene, named: tuple[str, ...]) -> torch.Tensor:
        key = (scene.position if "position" in named else None, scene.size if "size" in named else None)
        return self.masks[key]


def ema_update(ema: list[torch.Tensor], params: list[torch.Tensor], decay: float) -> None:
    with torch.no_grad():
        torch._foreach_lerp_(ema, params, 1.0 - decay)


def train_transformer(
    parts: dict[str, Any],
    train: list[sc.Scene],
    data: tuple[torch.Tensor, list[int]],
    *,
    steps: int | None,
    minutes: float,
    batch: int,
    lr: float,
    save: Callable[[dict[str, Any], int], None],
    checkpoint_minutes: float,
    shape_weight: float = 0.0,
    warmup: int = 200,
    jitter: Jitter = DEFAULT_JITTER,
    captions: str = "variants",
    text_lr_scale: float = 1.0,
) -> dict:
    """captions: "variants" (`scenes.describe`: attributes left out, reordered, synonyms; training phrasings only)
    or "grammar" (every caption in full, in the grammar's words: how v1 was trained)."""
    transformer, te1, te2, tok = (
        parts["transformer"],
        parts["text_encoder"],
        parts["text_encoder_2"],
        parts["tokenizer"],
    )
    vae = parts["vae"]
    shift, scale = vae.config.shift_factor, vae.config.scaling_factor
    latents, index = data
    regions = CaptionRegions(jitter)
    no_region = torch.zeros(1, LATENT_SIZE, LATENT_SIZE)
    rng = np.random.default_rng(SEED + 4)
    check = [sc.describe(train[i % len(train)], np.random.default_rng(i), held_out=None).text for i in range(500)]
    fast = FastTokenizer(tok, [*check, "", *(s.caption for s in train[:50])])

    def caption_batch(pick: torch.Tensor, drop: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Token ids [B, 16] and loss weights [B, 1, 16, 16] (1 + shape_weight where the shape can be; 1 for "")."""
        texts, masks = [], []
        for k, dropped in zip(pick.tolist(), drop.tolist(), strict=True):
            scene = train[index[k]]
            if dropped:
                texts.append("")
                masks.append(no_region)
            elif captions == "grammar":
                texts.append(scene.caption)
                masks.append(regions(scene, sc.ATTRIBUTE_ORDER))
            else:
                caption = sc.describe(scene, rng)
                texts.append(caption.text)
                masks.append(regions(scene, caption.named))
        return fast(texts), 1 + shape_weight * torch.stack(masks)

    modules = [transformer, te1, te2]
    ema_modules = [copy.deepcopy(m).eval().requires_grad_(False) for m in modules]
    transformer.set_attn_processor(ZeroTokenJointAttnProcessor())
    params = [p for m in modules for p in m.parameters()]
    ema_params = [p for m in ema_modules for p in m.parameters()]
    # The text encoders may learn faster than the transformer (`text_lr_scale`): v2's captions change what they read.
    groups = [
        {"params": list(transformer.parameters()), "scale": 1.0},
        {"params": [p for m in (te1, te2) for p in m.parameters()], "scale": text_lr_scale},
    ]
    opt = torch.optim.AdamW(groups, lr=lr, betas=(0.9, 0.99), weight_decay=0.01)
    budget = Budget(steps, minutes * 60, warmup=warmup)
    gen = torch.Generator().manual_seed(SEED + 3)
    for m in modules:
        m.train()
    step, ema_loss = 0, None
    t0 = last_save = time.monotonic()
    losses: list[float] = []

    def ema_parts() -> dict[str, Any]:
        return {
            **parts,
            "transformer": ema_modules[0],
            "text_encoder": ema_modules[1],
            "text_encoder_2": ema_modules[2],
        }

    while not budget.done(step):
        factor = budget.lr_factor(step)
        for group in opt.param_groups:
            group["lr"] = lr * factor * group["scale"]
        pick = torch.randint(len(index), (batch,), generator=gen)
        x0 = (latents[pick] - shift) * scale
        drop = torch.rand(batch, generator=gen) < DROPOUT
        ids, w = caption_batch(pick, drop)
        sigma = torch.sigmoid(torch.randn(batch, generator=gen))
        noise = torch.randn(x0.shape, generator=gen)
        s = sigma.view(-1, 1, 1, 1)
        xt = (1 - s) * x0 + s * noise
        embeds, pooled = encode_text(te1, te2, ids)
        out = transformer(
            hidden_states=xt,
            timestep=sigma * 1000,
            encoder_hidden_states=with_zero_token(embeds),
            pooled_projections=pooled,
            return_dict=False,
        )[0]
        loss = (w * (out - (noise - x0)) ** 2).mean() / w.mean()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        ema_update(ema_params, params, min(0.999, (1 + step) / (10 + step)))
        budget.after_step(step)
        value = float(loss.detach())
        losses.append(value)
        ema_loss = value if ema_loss is None else 0.98 * ema_loss + 0.02 * value
        if step % 100 == 0:
            log(f"transformer step {step}: loss {ema_loss:.4f} lr {lr * factor:.2e}")
        step += 1
        if time.monotonic() - last_save > checkpoint_minutes * 60:
            save(ema_parts(), step)
            last_save = time.monotonic()
    save(ema_parts(), step)
    tail = losses[-500:]
    return {
        "steps": step,
        "seconds": time.monotonic() - t0,
        "loss_ema": ema_loss,
        "loss_last_500_mean": float(np.mean(tail)) if tail else None,
        "batch": batch,
        "lr": lr,
    }


# --------------------------------------------------------------------------------------------------- saving


def build_pipeline(parts: dict[str, Any], shift: float = DEFAULT_SHIFT, dtype: torch.dtype = torch.float16) -> Any:
    from diffusers import FlowMatchEulerDiscreteScheduler, StableDiffusion3Pipeline

    def prep(module: Any) -> Any:
        # nn.Module.to: diffusers' ModelMixin.to logs about modules to keep in float32 (there are none here).
        module = torch.nn.Module.to(copy.deepcopy(module), dtype).eval().requires_grad_(False)
        if hasattr(module, "set_default_attn_processor"):
            module.set_default_attn_processor()
        return module

    return StableDiffusion3Pipeline(
        transformer=prep(parts["transformer"]),
        scheduler=FlowMatchEulerDiscreteScheduler(shift=shift),
        vae=prep(parts["vae"]),
        text_encoder=prep(parts["text_encoder"]),
        tokenizer=make_tokenizer(),  # fresh: a tokenizer that has been called keeps its padding settings
        text_encoder_2=prep(parts["text_encoder_2"]),
        tokenizer_2=make_tokenizer(),
        text_encoder_3=None,
        tokenizer_3=None,
    )


def write_defaults(out: Path, defaults: dict[str, Any]) -> None:
    from diffusiond.models.declared import DEFAULTS_FILE

    (out / DEFAULTS_FILE).write_text(json.dumps(defaults, indent=2) + "\n")


def save_checkpoint(
    parts: dict[str, Any], out: Path, *, train: list[sc.Scene], shift: float, defaults: dict[str, Any]
) -> None:
    """Write the complete checkpoint folder to a staging folder, then swap it in (never half-written)."""
    import msgspec

    from diffusiond.models.preview import FACTORS_FILE

    out = out.resolve()
    out.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{out.name}-", dir=out.parent))
    try:
        build_pipeline(parts, shift=shift).save_pretrained(staging)
        write_defaults(staging, defaults)
        from diffusiond.tools.demo.previewfit import fit_preview

        rgb = fit_preview(parts["vae"], train)
        (staging / FACTORS_FILE).write_bytes(msgspec.json.format(msgspec.json.encode(rgb)) + b"\n")
        old = out.with_name(f".{out.name}-old")
        shutil.rmtree(old, ignore_errors=True)
        if out.exists():
            out.rename(old)
        staging.rename(out)
        shutil.rmtree(old, ignore_errors=True)
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def load_pipeline(path: str | Path, dtype: torch.dtype = torch.float32) -> Any:
    """diffusers 0.42 drops the checkpoint's null components (`text_encoder_3`, `tokenizer_3`) and then insists
    on them unless they are passed, as None."""
    from diffusers import StableDiffusion3Pipeline

    pipe = StableDiffusion3Pipeline.from_pretrained(path, dtype=dtype, text_encoder_3=None, tokenizer_3=None)
    pipe.set_progress_bar_config(disable=True)
    return pipe


@torch.no_grad()
def check_zero_token_trick(pipe: Any, prompts: list[str], seed: int = 0) -> float:
    """Max |difference| between the transformer's output on the pipeline's real context (16 CLIP tokens + 256 zero
    tokens, default attention) and on the training context (16 + 1 token, `ZeroTokenJointAttnProcessor`)."""
    transformer = pipe.transformer
    embeds, _, pooled, _ = pipe.encode_prompt(
        prompt=prompts, prompt_2=None, prompt_3=None, do_classifier_free_guidance=False, max_sequence_length=ZERO_TOKENS
    )
    gen = torch.Generator().manual_seed(seed)
    cfg = transformer.config
    x = torch.randn(len(prompts), cfg.in_channels, cfg.sample_size, cfg.sample_size, generator=gen)
    t = torch.rand(len(prompts), generator=gen) * 1000
    kwargs = {"hidden_states": x, "timestep": t, "pooled_projections": pooled, "return_dict": False}
    real = transformer(encoder_hidden_states=embeds, **kwargs)[0]
    ids = tokenize(pipe.tokenizer, prompts)
    clip_embeds, clip_pooled = encode_text(pipe.text_encoder, pipe.text_encoder_2, ids)
    processors = transformer.attn_processors
    transformer.set_attn_processor(ZeroTokenJointAttnProcessor())
    try:
        kwargs["pooled_projections"] = clip_pooled
        trick = transformer(encoder_hidden_states=with_zero_token(clip_embeds), **kwargs)[0]
    finally:
        transformer.set_attn_processor(processors)
    return float((real - trick).abs().max())


# --------------------------------------------------------------------------------------------------- main


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True, type=Path, help="checkpoint folder to write")
    parser.add_argument(
        "--work",
        type=Path,
        default=Path(tempfile.gettempdir()) / "diffusiond-demo-train",
        help="folder for the trained VAE and the run summary",
    )
    parser.add_argument("--reuse-vae", action="store_true", help="reuse the VAE a previous run left in --work")
    parser.add_argument("--minutes", type=float, default=46.0, help="total time budget (both phases)")
    parser.add_argument("--vae-minutes", type=float, default=10.0)
    parser.add_argument("--vae-steps", type=int, default=None, help="fixed VAE steps (overrides the time budget)")
    parser.add_argument("--steps", type=int, default=None, help="fixed transformer steps (overrides the budget)")
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--lr", type=float, default=6e-4)
    parser.add_argument("--renders-per-scene", type=int, default=16)
    parser.add_argument("--shift", type=float, default=DEFAULT_SHIFT, help="sampling shift written to the scheduler")
    parser.add_argument("--checkpoint-minutes", type=float, default=8.0)
    parser.add_argument("--phase", choices=["all", "vae"], default="all")
    parser.add_argument(
        "--init",
        type=Path,
        default=None,
        help="continue from this checkpoint: its VAE is kept, its transformer and text encoders train on",
    )
    parser.add_argument("--shape-weight", type=float, default=SHAPE_WEIGHT, help="extra loss weight near the shape")
    parser.add_argument("--warmup", type=int, default=200, help="transformer learning-rate warmup steps")
    parser.add_argument("--position-jitter", type=float, default=sc.POSITION_JITTER, help="px, training images")
    parser.add_argument("--size-jitter", type=float, default=sc.SIZE_JITTER, help="px, training images")
    parser.add_argument(
        "--captions",
        choices=["variants", "grammar"],
        default="variants",
        help="variants: attributes left out, reordered, synonyms (v2); grammar: full captions only (v1)",
    )
    parser.add_argument("--text-lr-scale", type=float, default=1.0, help="text encoders' learning rate / --lr")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument(
        "--refit-preview", action="store_true", help="only fit --out's preview map again (seconds), print its errors"
    )
    args = parser.parse_args(argv)
    jitter = (args.position_jitter, args.size_jitter)

    torch.set_num_threads(args.threads)
    if args.refit_preview:
        from diffusiond.tools.demo.previewfit import refit_preview

        print(json.dumps(refit_preview(args.out)))
        return
    torch.manual_seed(SEED)
    start = time.monotonic()
    work = args.work
    work.mkdir(parents=True, exist_ok=True)
    train, held_out = sc.split()
    log(f"{len(train)} training scenes, {len(held_out)} held out")
    summary: dict[str, Any] = {}
    summary_path = work / "summary.json"
    if args.reuse_vae and summary_path.exists():
        summary = json.loads(summary_path.read_text())

    from diffusers import AutoencoderKL

    init = load_pipeline(args.init) if args.init else None
    vae_dir = work / "vae"
    if init is not None:
        vae = init.vae
        log(f"continuing from {args.init}")
    elif args.reuse_vae and (vae_dir / "config.json").is_file():
        vae = AutoencoderKL.from_pretrained(vae_dir)
        log(f"reusing the VAE in {vae_dir}")
    else:
        vae = make_vae()
        log(f"VAE: {count(vae):,} parameters")
        summary["vae_train"] = train_vae(vae, train, steps=args.vae_steps, minutes=args.vae_minutes, jitter=jitter)
        vae.save_pretrained(vae_dir)
        summary["vae_report"] = vae_report(vae, held_out)
        summary["vae_params"] = count(vae)
        summary_path.write_text(json.dumps(summary, indent=2))
        log(f"VAE reconstructions judged: {json.dumps(summary['vae_report'])}")
    vae.eval().requires_grad_(False)
    if args.phase == "vae":
        return

    data = encode_dataset(vae, train, args.renders_per_scene, jitter)
    latents = data[0]
    if init is None:
        # As SD3: one shift and one scale for all channels, so that (z - shift) * scale has mean 0 and variance 1.
        vae.register_to_config(
            shift_factor=round(float(latents.mean()), 4), scaling_factor=round(1.0 / float(latents.std()), 4)
        )
    log(f"{len(latents)} latents; shift_factor {vae.config.shift_factor}, scaling_factor {vae.config.scaling_factor}")

    torch.manual_seed(SEED + 5)
    tok = make_tokenizer()
    parts = {
        "vae": vae,
        "tokenizer": tok,
        "tokenizer_2": make_tokenizer(),
        "text_encoder": make_text_encoder(tok) if init is None else init.text_encoder,
        "text_encoder_2": make_text_encoder(tok) if init is None else init.text_encoder_2,
        "transformer": make_transformer() if init is None else init.transformer,
    }
    if init is not None and init.tokenizer.get_vocab() != tok.get_vocab():
        log(f"vocabulary {len(init.tokenizer)} -> {len(tok)} tokens: growing both text encoders")
        for module, old_tok in (("text_encoder", init.tokenizer), ("text_encoder_2", init.tokenizer_2)):
            parts[module] = grow_text_encoder(parts[module], old_tok, tok)
    for module in ("text_encoder", "text_encoder_2", "transformer"):
        parts[module].requires_grad_(True)
    summary["params"] = {k: count(v) for k, v in parts.items() if isinstance(v, torch.nn.Module)}
    log(f"parameters: {summary['params']}")
    left = args.minutes * 60 - (time.monotonic() - start)
    log(f"transformer budget: {left / 60:.1f} min")

    def save(ema_parts: dict[str, Any], step: int) -> None:
        save_checkpoint(ema_parts, args.out, train=train, shift=args.shift, defaults=declaration(args.captions))
        log(f"checkpoint at step {step} -> {args.out}")

    summary["transformer_train"] = train_transformer(
        parts,
        train,
        data,
        steps=args.steps,
        minutes=left / 60,
        batch=args.batch,
        lr=args.lr,
        save=save,
        checkpoint_minutes=args.checkpoint_minutes,
        shape_weight=args.shape_weight,
        warmup=args.warmup,
        jitter=jitter,
        captions=args.captions,
        text_lr_scale=args.text_lr_scale,
    )
    summary["transformer_train"].update(
        init=str(args.init) if args.init else None,
        shape_weight=args.shape_weight,
        jitter=jitter,
        captions=args.captions,
        text_lr_scale=args.text_lr_scale,
    )
    summary_path.write_text(json.dumps(summary, indent=2))

    pipe = load_pipeline(args.out)
    diff = check_zero_token_trick(pipe, [s.caption for s in held_out[:4]] + [""])
    summary["zero_token_trick_max_abs_diff"] = diff
    summary_path.write_text(json.dumps(summary, indent=2))
    log(f"zero-token trick vs the real 256 zero tokens: max |diff| {diff:.2e}")
    log(f"done in {(time.monotonic() - start) / 60:.1f} min: {json.dumps(summary['transformer_train'])}")


if __name__ == "__main__":
    main()
