"""Evaluate, configure and illustrate the demo model, generating through diffusiond's own engine.

    python -m diffusiond.tools.demo.evaluate sweep      # shift x guidance grid on held-out captions
    python -m diffusiond.tools.demo.evaluate configure --shift S --steps N --guidance G
    python -m diffusiond.tools.demo.evaluate eval       # judge accuracy at 8, 16 and 30 steps
    python -m diffusiond.tools.demo.evaluate gallery --out docs/gallery
    python -m diffusiond.tools.demo.evaluate timing

`--model` defaults to the shipped checkpoint (models/demo/weights). Every prompt of an evaluation is a held-out
caption (a scene combination never seen in training), with seed 1000 + its index, so results are reproducible.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

from diffusiond.tools.demo import scenes as sc
from diffusiond.tools.demo.judge import accuracy, format_table

WEIGHTS = Path(__file__).parent / "weights"
SEED_BASE = 1000
EVAL_ORDER_SEED = 0


def load(model: str | Path) -> Any:
    from diffusiond.models.loading.loader import load_adapter

    return load_adapter(str(model))


def generate(
    adapter: Any, requests: list[Any], *, max_batch: int = 32
) -> list[tuple[np.ndarray, list[tuple[int, np.ndarray]]]]:
    """Run `requests` (SamplingParams) through an Engine; per request (final float image, [(step, preview)])."""
    from diffusiond.engine.engine import Engine
    from diffusiond.engine.outputs import Cancelled, Completed, Failed, Preview

    async def collect(handle: Any) -> tuple[np.ndarray, list[tuple[int, np.ndarray]]]:
        previews = []
        async for event in handle.events():
            if isinstance(event, Preview):
                previews.append((event.step, event.image))
            elif isinstance(event, Completed):
                return event.image, previews
            elif isinstance(event, Cancelled | Failed):
                raise RuntimeError(f"request did not complete: {event}")
        raise RuntimeError("no terminal event")

    async def run() -> list[tuple[np.ndarray, list[tuple[int, np.ndarray]]]]:
        engine = Engine(adapter, max_batch=max_batch, max_waiting=len(requests) + 8)
        await engine.start()
        try:
            handles = [engine.add_request(p) for p in requests]
            return list(await asyncio.gather(*(collect(h) for h in handles)))
        finally:
            await engine.stop()

    return asyncio.run(run())


def eval_scenes(n: int | None = None) -> list[sc.Scene]:
    """The held-out scenes in a fixed shuffled order (all_scenes() is sorted by shape), the first `n` of them."""
    held_out = sc.split()[1]
    order = np.random.default_rng(EVAL_ORDER_SEED).permutation(len(held_out))
    shuffled = [held_out[i] for i in order]
    return shuffled if n is None else shuffled[:n]


def score(
    adapter: Any, scenes: list[sc.Scene], *, steps: int | None = None, guidance: float | None = None
) -> dict[str, float]:
    from diffusiond.models.params import SamplingParams

    requests = [
        SamplingParams(prompt=s.caption, seed=SEED_BASE + i, num_inference_steps=steps, guidance_scale=guidance)
        for i, s in enumerate(scenes)
    ]
    images = [image for image, _ in generate(adapter, requests)]
    acc = accuracy(zip(scenes, images, strict=True))
    for shape in sc.SHAPES:  # the shape attribute by the shape asked for
        pairs = [(s, img) for s, img in zip(scenes, images, strict=True) if s.shape == shape]
        if pairs:
            acc[f"shape|{shape}"] = accuracy(pairs)["shape"]
    return acc


def set_shift(adapter: Any, shift: float) -> None:
    set_scheduler(adapter, shift=shift)


def set_scheduler(adapter: Any, **config: Any) -> None:
    """The adapter's scheduler with `config` changed (as `configure` would write it)."""
    from diffusiond.models.loading.loader import change_scheduler

    adapter.pipe.scheduler = change_scheduler(adapter.pipe.scheduler, config)


def cmd_sweep(args: argparse.Namespace) -> None:
    adapter = load(args.model)
    scenes = eval_scenes(args.n)
    rows = {}
    for shift in args.shifts:
        set_shift(adapter, shift)
        for guidance in args.guidance:
            t0 = time.monotonic()
            rows[f"shift {shift:g}, guidance {guidance:g}, {args.steps} steps"] = acc = score(
                adapter, scenes, steps=args.steps, guidance=guidance
            )
            print(
                f"shift {shift:g} guidance {guidance:g}: {json.dumps(acc)} ({time.monotonic() - t0:.0f} s)", flush=True
            )
    print(format_table(rows))


def cmd_configure(args: argparse.Namespace) -> None:
    from diffusiond.tools.demo.train import write_defaults

    model = Path(args.model)
    path = model / "scheduler" / "scheduler_config.json"
    config = json.loads(path.read_text())
    config["shift"] = args.shift
    if args.stochastic is not None:
        config["stochastic_sampling"] = args.stochastic
    path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    from diffusiond.models.declared import DEFAULTS_FILE

    declared = json.loads((model / DEFAULTS_FILE).read_text())  # keep what else it declares
    write_defaults(model, {**declared, "num_inference_steps": args.steps, "guidance_scale": args.guidance})
    sampler = "stochastic" if config.get("stochastic_sampling") else "deterministic"
    print(f"{model}: shift {args.shift}, {sampler} sampling, {args.steps} steps, guidance {args.guidance}")


def cmd_eval(args: argparse.Namespace) -> None:
    adapter = load(args.model)
    caps = adapter.capabilities
    scenes = eval_scenes(args.n)
    rows = {}
    for steps in args.steps:
        t0 = time.monotonic()
        rows[f"{steps} steps"] = acc = score(adapter, scenes, steps=steps)
        print(f"{steps} steps: {json.dumps(acc)} ({time.monotonic() - t0:.0f} s)", flush=True)
    print(
        f"guidance {caps.default_guidance}, {caps.default_width}x{caps.default_height}, {len(scenes)} held-out prompts"
    )
    print(format_table(rows))
    by_shape = {label: {a: acc.get(f"shape|{a}", float("nan")) for a in sc.SHAPES} for label, acc in rows.items()}
    print("shape attribute by the shape asked for:")
    for label, acc in by_shape.items():
        print(f"  {label}: " + ", ".join(f"{a} {100 * v:.1f}%" for a, v in acc.items()))
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=2) + "\n")


def _upscale(image: np.ndarray, factor: int) -> Any:
    from PIL import Image

    if image.dtype != np.uint8:
        image = (np.clip(image, 0, 1) * 255).round().astype(np.uint8)
    pil = Image.fromarray(image)
    return pil.resize((pil.width * factor, pil.height * factor), Image.Resampling.NEAREST)


def gallery_scenes(k: int = 10) -> list[sc.Scene]:
    """A varied pick of held-out scenes: shapes in turn, sizes alternating, and greedily as many new colours,
    backgrounds and positions as possible."""
    chosen: list[sc.Scene] = []
    seen: set[tuple[str, str]] = set()
    pool = eval_scenes()
    sizes = list(sc.SIZES)

    def features(s: sc.Scene) -> set[tuple[str, str]]:
        return {("colour", s.colour), ("bg", s.background), ("pos", s.position)}

    for i in range(k):
        shape, size = sc.SHAPES[i % len(sc.SHAPES)], sizes[i % len(sizes)]
        candidates = [s for s in pool if s.shape == shape and s.size == size and s not in chosen]
        best = max(candidates, key=lambda s: len(features(s) - seen))
        chosen.append(best)
        seen |= features(best)
    return chosen


# What a new user types first: short prompts that leave things out, reordered ones and synonyms, with what each one
# names (the judge checks those; the model picks the rest, differently per seed).
PLAIN_PROMPTS: tuple[tuple[str, dict[str, str]], ...] = (
    ("a red circle", {"colour": "red", "shape": "circle"}),
    ("a blue square on a yellow background", {"colour": "blue", "shape": "square", "background": "yellow"}),
    ("on a yellow background, a blue square", {"colour": "blue", "shape": "square", "background": "yellow"}),
    ("a green triangle", {"colour": "green", "shape": "triangle"}),
    ("a big white ball in the middle", {"size": "large", "colour": "white", "shape": "circle", "position": "center"}),
    (
        "a tiny black box in the upper left corner",
        {"size": "small", "colour": "black", "shape": "square", "position": "top left"},
    ),
    ("a yellow shape at the bottom", {"colour": "yellow", "position": "bottom"}),
    (
        "a triangle on the right against a blue background",
        {"shape": "triangle", "position": "right", "background": "blue"},
    ),
)
PLAIN_SEEDS = 4


def judge_partial(named: dict[str, str], image: np.ndarray) -> list[str]:
    """The named attributes the image gets wrong."""
    from diffusiond.tools.demo.judge import analyse

    seen = analyse(image)
    return [a for a, value in named.items() if getattr(seen, a) != value]


GALLERY_README = """\
# Gallery: the shipped demo model

Images from `models/demo/weights`, the default model of `diffusiond`: a 64x64 text-to-image model in the standard
SD3 diffusers format, trained from nothing on procedural shape scenes (see
[tools/demo/README.md](../../tools/demo/README.md)). Every prompt below is a **held-out** caption: that
combination of shape, colour, size, position and background was never in the training set. Generated through
diffusiond's engine at the checkpoint's defaults ({steps} steps, guidance {guidance}, 64x64), shown upscaled 4x
(nearest neighbour); the last column is what `tools/demo/judge.py` found wrong.

![gallery](gallery.png)

| image | prompt | seed | judge: wrong attributes |
|---|---|---|---|
{rows}

## Previews of one request

[previews.png](previews.png): the engine's previews of one request after steps {preview_steps} (the predicted clean
latent mapped to RGB by the least-squares preview map fitted for this model, `diffusiond_preview.json`, at the
latent resolution 16x16), then the final decoded image on the right. Prompt: "{preview_prompt}", seed
{preview_seed}.

![previews](previews.png)

## Plain prompts

Prompts as a new user types them: attributes left out, parts reordered, synonyms. The model draws what a prompt
names and picks the rest, differently per seed (seeds {plain_seeds}, one column each):

![plain prompts](plain.png)

| prompt | judge: wrong attributes, per seed |
|---|---|
{plain_rows}

Regenerate this folder with `python -m diffusiond.tools.demo.evaluate gallery --out docs/gallery`.
"""


def cmd_gallery(args: argparse.Namespace) -> None:
    from PIL import Image

    from diffusiond.models.params import SamplingParams
    from diffusiond.tools.demo.judge import judge

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    adapter = load(args.model)
    scenes = gallery_scenes(args.k)
    requests = [SamplingParams(prompt=s.caption, seed=SEED_BASE + i) for i, s in enumerate(scenes)]
    results = generate(adapter, requests)
    lines = []
    tiles = []
    for i, (scene, (image, _)) in enumerate(zip(scenes, results, strict=True)):
        name = f"{i + 1:02d}-{scene.size}-{scene.colour}-{scene.shape}.png"
        tile = _upscale(image, 4)
        tile.save(out / name)
        tiles.append(tile)
        verdict = judge(scene, image)
        wrong = [a for a, ok in verdict.as_dict().items() if not ok]
        lines.append((name, scene.caption, SEED_BASE + i, ", ".join(wrong) or "-"))
    # All tiles in one row-major grid (5 per row) with a 4 px gutter.
    per_row, gap = 5, 4
    rows = (len(tiles) + per_row - 1) // per_row
    side = tiles[0].width
    grid = Image.new("RGB", (per_row * side + (per_row - 1) * gap, rows * side + (rows - 1) * gap), (255, 255, 255))
    for i, tile in enumerate(tiles):
        grid.paste(tile, ((i % per_row) * (side + gap), (i // per_row) * (side + gap)))
    grid.save(out / "gallery.png")

    # One request's previews (every --preview-every steps) beside its final image.
    caps = adapter.capabilities
    scene = scenes[args.preview_index]
    params = SamplingParams(prompt=scene.caption, seed=SEED_BASE + args.preview_index, preview_every=args.preview_every)
    ((image, previews),) = generate(adapter, [params])
    frames = [_upscale(p, 4 * adapter.vae_scale_factor) for _, p in previews] + [_upscale(image, 4)]
    strip = Image.new("RGB", (len(frames) * side + (len(frames) - 1) * gap, side), (255, 255, 255))
    for i, frame in enumerate(frames):
        strip.paste(frame, (i * (side + gap), 0))
    strip.save(out / "previews.png")
    meta = {
        "defaults": {"steps": caps.default_steps, "guidance": caps.default_guidance, "size": caps.default_width},
        "images": [{"file": f, "prompt": p, "seed": s, "judge_wrong": w} for f, p, s, w in lines],
        "previews": {"prompt": scene.caption, "seed": params.seed, "steps": [s for s, _ in previews]},
    }
    # Plain prompts: one row per prompt, one column per seed.
    plain_seeds = [SEED_BASE + i for i in range(PLAIN_SEEDS)]
    requests = [SamplingParams(prompt=p, seed=seed) for p, _ in PLAIN_PROMPTS for seed in plain_seeds]
    images = [image for image, _ in generate(adapter, requests)]
    sheet = Image.new(
        "RGB", (PLAIN_SEEDS * side + (PLAIN_SEEDS - 1) * gap, len(PLAIN_PROMPTS) * (side + gap) - gap), (255, 255, 255)
    )
    plain_rows = []
    for i, (prompt, named) in enumerate(PLAIN_PROMPTS):
        wrong = []
        for j in range(PLAIN_SEEDS):
            image = images[i * PLAIN_SEEDS + j]
            sheet.paste(_upscale(image, 4), (j * (side + gap), i * (side + gap)))
            wrong.append(", ".join(judge_partial(named, image)) or "-")
        plain_rows.append((prompt, wrong))
    sheet.save(out / "plain.png")
    meta["plain"] = [{"prompt": p, "seeds": plain_seeds, "judge_wrong": w} for p, w in plain_rows]
    (out / "gallery.json").write_text(json.dumps(meta, indent=2) + "\n")
    rows = "\n".join(f"| ![]({f}) | {p} | {s} | {w} |" for f, p, s, w in lines)
    readme = GALLERY_README.format(
        steps=caps.default_steps,
        guidance=f"{caps.default_guidance:g}",
        rows=rows,
        preview_steps=", ".join(str(step) for step, _ in previews),
        preview_prompt=scene.caption,
        preview_seed=params.seed,
        plain_seeds=", ".join(str(x) for x in plain_seeds),
        plain_rows="\n".join(f"| {p} | {' / '.join(w)} |" for p, w in plain_rows),
    )
    (out / "README.md").write_text(readme)
    print(readme)


def cmd_timing(args: argparse.Namespace) -> None:
    from diffusiond.models.params import SamplingParams

    adapter = load(args.model)
    for threads in args.threads:
        torch.set_num_threads(threads)
        requests = [SamplingParams(prompt=s.caption, seed=i) for i, s in enumerate(eval_scenes(args.n + 1))]
        generate(adapter, requests[:1], max_batch=1)  # warm-up
        t0 = time.perf_counter()
        for r in requests[1:]:
            generate(adapter, [r], max_batch=1)
        per = (time.perf_counter() - t0) / args.n
        caps = adapter.capabilities
        print(
            f"{threads} thread(s): {per * 1000:.0f} ms per image, one request at a time "
            f"({caps.default_steps} steps, guidance {caps.default_guidance}, {caps.default_width} px)",
            flush=True,
        )


def partial_named(rng: np.random.Generator) -> tuple[str, ...]:
    """A random proper, non-empty subset of the attributes (each named with probability 1/2)."""
    while True:
        named = tuple(a for a in sc.ATTRIBUTE_ORDER if rng.random() < 0.5)
        if 0 < len(named) < len(sc.ATTRIBUTE_ORDER):
            return named


def caption_cases(
    kind: str, n: int, per_scene: int = 1, seed_base: int = SEED_BASE
) -> list[tuple[sc.Scene, sc.Caption]]:
    """(held-out scene, caption) pairs, fixed by `kind`: "grammar" (full captions in the grammar's words, as v1 was
    trained on), "full" (every attribute named, in a held-out phrasing) or "partial" (a random proper subset named,
    in a held-out phrasing); `per_scene` captions for each of the first `n` evaluation scenes. `seed_base` draws
    the phrasings (another value: another set of captions for the same scenes)."""
    cases: list[tuple[sc.Scene, sc.Caption]] = []
    for i, scene in enumerate(eval_scenes(n)):
        texts: set[str] = set()
        for j in range(per_scene):
            rng = np.random.default_rng([seed_base, i, j, len(kind)])
            if kind == "grammar":
                caption = sc.Caption(scene.caption, sc.ATTRIBUTE_ORDER, (), held_out=False)
            elif kind == "full":
                caption = sc.describe(scene, rng, named=sc.ATTRIBUTE_ORDER, held_out=True)
            else:
                caption = None
                while caption is None or caption.text in texts:  # some small subsets have no held-out phrasing
                    with contextlib.suppress(RuntimeError):
                        caption = sc.describe(scene, rng, named=partial_named(rng), held_out=True, tries=500)
            texts.add(caption.text)
            cases.append((scene, caption))
    return cases


def judge_named(cases: list[tuple[sc.Scene, sc.Caption]], images: list[np.ndarray]) -> dict[str, Any]:
    """Accuracy per attribute where the caption names it, and for attributes left out, how varied the model's own
    choices are: the share of the most common value and the number of distinct values seen."""
    from diffusiond.tools.demo.judge import ATTRIBUTES, analyse

    right: dict[str, list[bool]] = {a: [] for a in ATTRIBUTES}
    picked: dict[str, list[str | None]] = {a: [] for a in ATTRIBUTES}
    for (scene, caption), image in zip(cases, images, strict=True):
        seen = analyse(image)
        for attribute in ATTRIBUTES:
            if attribute in caption.named:
                right[attribute].append(getattr(seen, attribute) == getattr(scene, attribute))
            else:
                picked[attribute].append(getattr(seen, attribute))
    result: dict[str, Any] = {a: round(float(np.mean(v)), 3) for a, v in right.items() if v}
    result["n"] = len(cases)
    result["left out"] = {
        a: {
            "n": len(v),
            "distinct": len(set(v)),
            "most common": round(max(v.count(x) for x in set(v)) / len(v), 3),
        }
        for a, v in picked.items()
        if v
    }
    return result


def cmd_partial(args: argparse.Namespace) -> None:
    """Accuracy on held-out scenes in held-out phrasings, full and partial: each attribute counted where a caption
    names it (the model picks the others: how varied its picks are is reported too)."""
    from diffusiond.models.params import SamplingParams

    adapter = load(args.model)
    if args.stochastic is not None:
        set_scheduler(adapter, stochastic_sampling=args.stochastic)
    table: dict[str, Any] = {}
    for kind in args.kinds:
        cases = caption_cases(kind, args.n, args.per_scene if kind == "partial" else 1, args.seed_base)
        for steps in args.steps:
            for guidance in args.guidance or [None]:
                requests = [
                    SamplingParams(
                        prompt=c.text, seed=args.seed_base + i, num_inference_steps=steps, guidance_scale=guidance
                    )
                    for i, (_, c) in enumerate(cases)
                ]
                images = [image for image, _ in generate(adapter, requests)]
                label = f"{kind}, {steps} steps" + ("" if guidance is None else f", guidance {guidance:g}")
                table[label] = row = judge_named(cases, images)
                print(f"{label}: {json.dumps(row)}", flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(table, indent=2) + "\n")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=str(WEIGHTS))
    parser.add_argument("--threads-torch", type=int, default=1, help="torch threads (default 1)")
    sub = parser.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("sweep")
    p.add_argument("--n", type=int, default=60)
    p.add_argument("--steps", type=int, default=16)
    p.add_argument("--shifts", type=float, nargs="+", default=[1.0, 2.0, 3.0])
    p.add_argument("--guidance", type=float, nargs="+", default=[2.0, 4.0, 6.0])
    p.set_defaults(fn=cmd_sweep)
    p = sub.add_parser("configure")
    p.add_argument("--shift", type=float, required=True)
    p.add_argument("--steps", type=int, required=True)
    p.add_argument("--guidance", type=float, required=True)
    p.add_argument(
        "--stochastic",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="the scheduler's stochastic_sampling (fresh noise at every step; default: keep the checkpoint's)",
    )
    p.set_defaults(fn=cmd_configure)
    p = sub.add_parser("eval")
    p.add_argument("--n", type=int, default=None, help="number of held-out prompts (default: all)")
    p.add_argument("--steps", type=int, nargs="+", default=[8, 16, 30])
    p.add_argument("--json", default=None)
    p.set_defaults(fn=cmd_eval)
    p = sub.add_parser("partial", help="accuracy on held-out phrasings, full and partial")
    p.add_argument("--n", type=int, default=60, help="held-out scenes")
    p.add_argument("--per-scene", type=int, default=4, help="partial captions per scene")
    p.add_argument("--kinds", nargs="+", default=["grammar", "full", "partial"], choices=["grammar", "full", "partial"])
    p.add_argument("--steps", type=int, nargs="+", default=[8, 16])
    p.add_argument("--guidance", type=float, nargs="+", default=None, help="guidance scales (default: the model's)")
    p.add_argument(
        "--stochastic",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="sample with or without stochastic_sampling (default: the checkpoint's scheduler)",
    )
    p.add_argument("--seed-base", type=int, default=SEED_BASE, help="seeds of the phrasings and of the images")
    p.add_argument("--json", default=None)
    p.set_defaults(fn=cmd_partial)
    p = sub.add_parser("gallery")
    p.add_argument("--out", default="docs/gallery")
    p.add_argument("--k", type=int, default=10)
    p.add_argument("--preview-index", type=int, default=0)
    p.add_argument("--preview-every", type=int, default=2)
    p.set_defaults(fn=cmd_gallery)
    p = sub.add_parser("timing")
    p.add_argument("--n", type=int, default=10)
    p.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    p.set_defaults(fn=cmd_timing)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads_torch)
    args.fn(args)


if __name__ == "__main__":
    main()
