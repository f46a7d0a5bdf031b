"""SPMD over gloo with 2 ranks: CFG-parallel and Ulysses give the images of a world of one, and really split the work.

Tolerance: max abs diff <= 1e-4 on the float image (the same bound as the diffusers parity test; a split attention
and a gathered CFG change only the order of float reductions). Equal images cannot tell a split from two ranks that
each compute everything, so each rank also records what its transformer saw: with CFG-parallel, one row per request
of a CFG batch (not two); with Ulysses, about half of the image tokens in every block, the two halves adding up.
"""

import json

import numpy as np
import pytest
from pictures import picture
from spmd_requests import FIXTURES, REQUESTS
from spmd_runs import one_rank, two_ranks

from diffusiond.models.loading.loader import load_adapter
from diffusiond.models.params import SamplingParams

TOLERANCE = 1e-4
# `--cache dbcache` with `--cache-config` (NAME:JSON, as one_rank and the worker take a cache).
# With TaylorSeer: after a warm-up of 2 computed steps, reused steps add a forecast from each request's own history.
DBCACHE = 'dbcache:{"fn": 2, "bn": 1, "warmup": 2, "taylorseer": true}'
# MagCache with ratios given (the tiny checkpoints have no calibration): it decides from them alone, alike on every
# rank, from its second step (the first round(0.2 x steps) = 1 computes).
MAGCACHE = 'magcache:{"ratios": [1.0, 1.01]}'
# Guidance-distilled families: one row per request, never a CFG batch.
DISTILLED = ("flux2",)


def check_split(
    strategy: str,
    forwards: list[list[dict]],
    *,
    shared_decode: bool = True,
    cfg_rows: bool = True,
    grouped: bool = False,
) -> int:
    """Asserts the split; returns how many images the ranks decoded in all. `strategy`: "cfg" (2 ranks), or
    "sequence" (Ulysses, ring, or both: every rank shards the sequence). `cfg_rows`: the family has CFG batches
    (guidance-distilled families have none: CFG-parallel splits their requests only). `grouped`: a step runs a
    call per text length (GLM-Image): each rank's rows are counted over its calls."""
    world = len(forwards)
    assert forwards[0] and all(len(f) == len(forwards[0]) for f in forwards), "every rank runs the same forwards"
    for steps in zip(*forwards, strict=True):
        f0 = steps[0]
        assert all((f["requests"], f["cfg"]) == (f0["requests"], f0["cfg"]) for f in steps)
        if f0["experts"] > 1:  # a step that runs both experts: one call each on every rank, rows split between them
            assert all(len(f["calls"]) == 2 for f in steps), steps
            rows = [sum(c["rows"] for c in f["calls"]) for f in steps]
            full = f0["requests"] * (2 if f0["cfg"] else 1)
            if strategy == "cfg" and f0["cfg"]:
                assert rows == [full // 2] * 2, steps  # each rank one CFG row of every request, both experts
            elif strategy != "cfg":
                assert rows == [full] * world, steps  # every rank all rows, its shard of the tokens
            continue
        calls = [c for f in steps for c in f["calls"]]
        if grouped:
            assert all(f["calls"] for f in steps), steps
            calls = [{"rows": sum(c["rows"] for c in f["calls"])} for f in steps]
        assert len(calls) == world, "one transformer call per forward on each rank"
        if strategy == "cfg":
            c0, c1 = calls
            n = f0["requests"]
            if f0["cfg"]:
                # Each rank computes one branch: one row per request where one rank alone computes two.
                assert c0["rows"] == c1["rows"] == n, steps
            elif n > 1:
                # No CFG: the ranks split the requests (the first takes the odd one).
                assert (c0["rows"], c1["rows"]) == ((n + 1) // 2, n // 2), steps
        else:
            # Each rank's blocks see its own slice of the sequence (shards may differ by one token): the image
            # tokens, or with them what shares the sharded sequence (Z-Image: the caption).
            full = calls[0]["block_total"]
            assert calls[0]["tokens"] is None or full >= calls[0]["tokens"], calls
            local = [c["block_tokens"] for c in calls]
            assert sum(local) == full and max(local) - min(local) <= 1, calls
            assert all(c["rows"] == f0["requests"] * (2 if f0["cfg"] else 1) for c in calls)
    if strategy == "cfg":
        assert any(f["cfg"] for f in forwards[0]) == cfg_rows, "the requests include CFG batches"
        assert any(not f["cfg"] and f["requests"] > 1 for f in forwards[0]), "and batches without CFG"
    # Requests that finish together are decoded by every rank, each its share; one finishing alone by rank 0 only.
    shared = 0
    for steps in zip(*forwards, strict=True):
        decoded = [f.get("decoded", []) for f in steps]
        if any(decoded[1:]):
            n = sum(d[0] for d in decoded)
            assert decoded == [[len(range(r, n, world))] for r in range(world)], decoded
            shared += 1
        else:  # fewer finished than there are ranks: rank 0 decodes them
            assert decoded[0] == [] or (len(decoded[0]) == 1 and decoded[0][0] < world), steps[0]
    assert shared or not shared_decode, "some requests finished together"
    return sum(n for rank in forwards for f in rank for n in f.get("decoded", []))


@pytest.mark.parametrize(
    ("family", "strategy"),
    [
        ("sd3", "cfg"),
        ("sd3", "ulysses"),
        ("sdxl", "cfg"),
        ("flux", "cfg"),
        ("flux", "ulysses"),
        ("flux-kontext", "cfg"),
        ("flux-kontext", "ulysses"),
        ("flux2-klein", "cfg"),
        ("flux2-klein", "ulysses"),
        ("flux2", "cfg"),
        ("flux2", "ulysses"),
        ("z-image", "cfg"),
        ("z-image", "ulysses"),
        ("ovis-image", "cfg"),
        ("longcat-image", "cfg"),
        ("longcat-image-edit", "cfg"),
        ("glm-image", "cfg"),
        ("qwen-image", "cfg"),
        ("qwen-image", "ulysses"),
        ("wan", "cfg"),
        ("wan", "ulysses"),
        ("wan-i2v", "ulysses"),
        ("wan22", "cfg"),
        ("wan22", "ulysses"),
        ("wan22-ti2v", "cfg"),
        ("wan22-ti2v", "ulysses"),
        # Each Qwen-Image-Edit layout under one strategy (their denoise is one method; each edit step reads a 1 Mpx
        # condition latent, 20-30 s a test here): 2509 CFG-parallel, 2511 (its per-token modulation sharded) and the
        # first Edit Ulysses.
        ("qwen-image-edit-plus", "cfg"),
        ("qwen-image-edit-2511", "ulysses"),
        ("qwen-image-edit", "ulysses"),
        ("qwen-image-layered", "cfg"),
        ("qwen-image-layered", "ulysses"),
        ("qwen-image-21", "cfg"),
        ("hunyuan-video-15", "ulysses"),
        ("stable-audio", "cfg"),
    ],
)
def test_two_ranks_match_one(family, strategy, request, tmp_path):
    model = request.getfixturevalue(FIXTURES[family])
    requests = REQUESTS[family]
    expected = one_rank(model, requests)
    cfg, ulysses = (2, 1) if strategy == "cfg" else (1, 2)
    got, forwards = two_ranks(model, tmp_path, cfg, ulysses, requests)
    grouped = family == "glm-image"  # a call per glyph length
    split = check_split(
        "cfg" if strategy == "cfg" else "sequence", forwards, cfg_rows=family not in DISTILLED, grouped=grouped
    )
    assert split == len(requests)
    # Prompts are encoded once, on rank 0, and broadcast: rank 1 never runs a text encoder.
    encoded = [json.loads((tmp_path / f"encode{r}.json").read_text()) for r in range(2)]
    assert encoded[0]["calls"] > 0 and encoded[0]["sent"] > 0 and encoded[1]["calls"] == 0, encoded
    for params, a, b in zip(requests, expected, got, strict=True):
        assert a.shape == b.shape
        diff = float(np.abs(a - b).max())
        print(f"{family}/{strategy} {params.prompt!r}: max abs diff {diff:.2e}")
        assert diff <= TOLERANCE, f"{family}/{strategy} {params.prompt!r}: max abs diff {diff}"


def test_qwen_image_21_ulysses_shards_the_target_image(tiny_qwenimage21, tmp_path):
    """Qwen-Image 2.1's blocks see one sequence, [text and condition images, target image], attended block-causally:
    under --ulysses 2 each rank keeps the prefix whole and holds half of the target's tokens (both ranks holding all
    of them: red), in every call of a step (one per text layout), and the images equal one rank's, a request
    conditioned on an image (image segments in the prefix) among them."""
    requests = [
        *REQUESTS["qwen-image-21"],
        SamplingParams(
            prompt="make it blue",
            negative_prompt="blurry",
            true_cfg_scale=2.0,
            image=picture(64, 48, seed=3),
            seed=7,
            width=64,
            height=64,
            num_inference_steps=2,
        ),
    ]
    expected = one_rank(tiny_qwenimage21, requests)
    got, forwards = two_ranks(tiny_qwenimage21, tmp_path, 1, 2, requests)
    for params, a, b in zip(requests, expected, got, strict=True):
        diff = float(np.abs(a - b).max())
        print(f"qwen-image-21/ulysses {params.prompt!r}: max abs diff {diff:.2e}")
        assert diff <= TOLERANCE, (params.prompt, diff)
    several = False
    for steps in zip(*forwards, strict=True):
        several |= len(steps[0]["calls"]) > 1
        for calls in zip(*(f["calls"] for f in steps), strict=True):
            assert len({(c["rows"], c["block_replicated"]) for c in calls}) == 1, calls
            target = [c["block_tokens"] - c["block_replicated"] for c in calls]
            assert calls[0]["block_replicated"] > 0 and sum(target) == calls[0]["block_total"], calls
            assert max(target) - min(target) <= 1, calls
    assert several, "steps with rows of several text layouts"


@pytest.mark.parametrize(
    ("family", "ulysses", "ring"),
    [
        ("sd3", 1, 2),
        ("flux", 1, 2),
        ("wan", 1, 2),
        ("flux2-klein", 1, 2),
        ("flux2", 1, 2),
        ("flux", 2, 2),
        ("qwen-image", 1, 2),  # texts of several lengths in a batch: their padding masked on the replicated keys
        ("qwen-image-edit-2511", 1, 2),
        ("qwen-image-layered", 1, 2),  # every layer's frame and the image's in the sharded sequence
    ],
)
def test_ring_attention_matches_one_rank(family, ulysses, ring, request, tmp_path):
    """Ring attention (and Ulysses x ring on 4 ranks): the images of one rank, the sequence sharded over every rank,
    and no rank's attention kernel ever sees the whole sequence's keys: each call gets one ring block (with the text
    on one block) where one rank would attend over all of them."""
    model = request.getfixturevalue(FIXTURES[family])
    requests = REQUESTS[family]
    expected = one_rank(model, requests)
    got, forwards = two_ranks(model, tmp_path, 1, ulysses, requests, ring=ring)
    # (Three requests finish together: shared decoding on 2 ranks, too few for 4.)
    check_split("sequence", forwards, shared_decode=ulysses * ring <= 3)
    for r in range(ulysses * ring):
        calls = json.loads((tmp_path / f"ring{r}.json").read_text())
        assert calls, "no ring attention ran"
        assert all(keys < whole for keys, whole in calls), calls[:8]
    for params, a, b in zip(requests, expected, got, strict=True):
        diff = float(np.abs(a - b).max())
        print(f"{family}/ring {ring} ulysses {ulysses} {params.prompt!r}: max abs diff {diff:.2e}")
        assert diff <= TOLERANCE, f"{family}/ring {params.prompt!r}: max abs diff {diff}"


@pytest.mark.parametrize(
    ("family", "cfg"),
    [
        ("sd3", 1),
        ("sd35", 1),
        ("flux", 1),
        ("flux2-klein", 1),
        ("flux2", 1),
        ("qwen-image", 1),
        ("flux", 2),
        ("z-image", 1),
        ("longcat-image", 1),
        ("longcat-image-edit", 1),
        ("glm-image", 1),
        ("qwen-image-edit-2511", 1),  # the Qwen-Image-Edit family's transformer is Qwen-Image's, with 2511's index
        ("qwen-image-layered", 1),
    ],
)
def test_tensor_parallel_matches_one_rank(family, cfg, request, tmp_path):
    """--tp 2 (and --cfg-parallel 2 x --tp 2 on 4 ranks): one rank's images, while each rank holds its shard of the
    block linears (a TP that kept whole weights on every rank would show the bytes unchanged), and every rank of a
    tensor-parallel group runs the same rows (the split is inside the linears, not across requests)."""
    fixture = {"sd35": "tiny_sd35"}.get(family, FIXTURES.get(family))
    model = request.getfixturevalue(fixture)
    requests = REQUESTS[{"sd35": "sd3"}.get(family, family)][:4]
    expected = one_rank(model, requests)
    got, forwards = two_ranks(model, tmp_path, cfg, 1, requests, tp=2)
    world = 2 * cfg
    for r in range(world):
        local, whole = json.loads((tmp_path / f"weights{r}.json").read_text())
        assert local < 0.9 * whole, (r, local, whole)
    for steps in zip(*forwards, strict=True):
        rows = [[c["rows"] for c in f["calls"]] for f in steps]
        assert rows[0] == rows[1] and rows[-2] == rows[-1], rows  # the two ranks of each TP group: the same rows
        if cfg == 2 and steps[0]["cfg"]:
            assert rows[0] == [steps[0]["requests"]], rows  # and the CFG split on top: one branch per rank
    for params, a, b in zip(requests, expected, got, strict=True):
        diff = float(np.abs(a - b).max())
        print(f"{family}/tp 2 cfg {cfg} {params.prompt!r}: max abs diff {diff:.2e}")
        assert diff <= TOLERANCE, f"{family}/tp {params.prompt!r}: max abs diff {diff}"


@pytest.mark.parametrize(
    ("family", "strategy"),
    [
        ("sd3", "cfg"),
        ("flux", "ulysses"),
        ("sdxl", "cfg"),
        ("z-image", "cfg"),
        ("flux2-klein", "cfg"),
        ("flux2", "cfg"),
        ("qwen-image", "cfg"),  # a causal video VAE's one frame
        ("wan", "ulysses"),  # its clips, a latent frame at a time
        ("wan22-ti2v", "cfg"),  # Wan 2.2's VAE: residual up blocks, a patchified output
    ],
)
def test_vae_parallel_matches_one_rank(family, strategy, request, tmp_path):
    """--vae-parallel 2: an image finishing alone is decoded in two strips, one per rank (each rank's decoded rows
    are about half the image's: a decode done whole on every rank would show the whole height), and the images equal
    one rank's."""
    model = request.getfixturevalue(FIXTURES[family])
    requests = REQUESTS[family]
    expected = one_rank(model, requests)
    cfg, ulysses = (2, 1) if strategy == "cfg" else (1, 2)
    got, forwards = two_ranks(model, tmp_path, cfg, ulysses, requests, vae=2)
    decoded = 0
    for f0, f1 in zip(*forwards, strict=True):
        if "strips" in f0:
            (rows0, width0), (rows1, width1) = f0["strips"][0], f1["strips"][0]
            # Two strips that make one image: rows adding up to its height (whole decodes on both would add to 2x).
            assert width0 == width1 and rows0 > 0 and rows1 > 0 and abs(rows0 - rows1) <= 8, (f0, f1)
            assert rows0 + rows1 in {p.height for p in requests}, (f0, f1)
            decoded += 1
    assert decoded, "no image was decoded in strips"
    for params, a, b in zip(requests, expected, got, strict=True):
        assert a.shape == b.shape
        diff = float(np.abs(a - b).max())
        print(f"{family}/vae-parallel {params.prompt!r}: max abs diff {diff:.2e}")
        assert diff <= TOLERANCE, f"{family}/vae-parallel {params.prompt!r}: max abs diff {diff}"


def test_cfg_parallel_x_ulysses_on_four_ranks(request, tmp_path):
    """--cfg-parallel 2 x --ulysses 2: one rank's images; in CFG batches each rank runs one branch of every request
    (one row each) over its half of the image tokens."""
    model = request.getfixturevalue(FIXTURES["sd3"])
    requests = REQUESTS["sd3"][:4]
    expected = one_rank(model, requests)
    got, forwards = two_ranks(model, tmp_path, 2, 2, requests)
    for steps in zip(*forwards, strict=True):
        calls = [f["calls"][0] for f in steps]
        if steps[0]["cfg"]:
            assert all(c["rows"] == steps[0]["requests"] for c in calls), calls
        for group in (calls[:2], calls[2:]):  # each CFG branch's Ulysses pair shards its sequence
            assert sum(c["block_tokens"] for c in group) == group[0]["block_total"], group
    for params, a, b in zip(requests, expected, got, strict=True):
        diff = float(np.abs(a - b).max())
        assert diff <= TOLERANCE, f"sd3/cfg x ulysses {params.prompt!r}: max abs diff {diff}"


@pytest.mark.parametrize(
    ("family", "strategy"),
    [
        ("sd3", "cfg"),
        ("flux", "ulysses"),
        ("flux-kontext", "cfg"),
        ("flux2-klein", "cfg"),
        ("sdxl", "cfg"),
        ("z-image", "cfg"),
        ("qwen-image", "ulysses"),
        ("wan", "ulysses"),
        ("wan-i2v", "cfg"),
        ("wan22", "cfg"),
        ("flux2", "ulysses"),
    ],
)
def test_sharded_weights_match_one_rank(family, strategy, request, tmp_path):
    """--shard-weights (FSDP2) on top of CFG-parallel or Ulysses: one rank's images, while each rank keeps half of
    the transformer's (or UNet's) weights between forwards (a no-op would show the bytes unchanged)."""
    model = request.getfixturevalue(FIXTURES[family])
    requests = REQUESTS[family][:4]
    expected = one_rank(model, requests)
    cfg, ulysses = (2, 1) if strategy == "cfg" else (1, 2)
    got, _ = two_ranks(model, tmp_path, cfg, ulysses, requests, shard=True)
    for r in range(2):
        local, whole = json.loads((tmp_path / f"weights{r}.json").read_text())
        assert local <= 0.51 * whole, (r, local, whole)
    for params, a, b in zip(requests, expected, got, strict=True):
        diff = float(np.abs(a - b).max())
        print(f"{family}/shard-weights {strategy} {params.prompt!r}: max abs diff {diff:.2e}")
        assert diff <= TOLERANCE, f"{family}/shard {params.prompt!r}: max abs diff {diff}"


@pytest.mark.parametrize("mesh", ["2x1", "1x2"])
def test_hsdp_meshes_match_one_rank(mesh, tiny_sd3, tmp_path):
    """--shard-weights RxS (HSDP: a 2-D mesh, R replicas each sharded over S ranks) on CFG-parallel: one rank's
    images; "1x2" keeps half the weights on each rank (one copy over both), "2x1" shards nothing (two whole
    copies: no rank reports sharded bytes)."""
    requests = REQUESTS["sd3"][:4]
    expected = one_rank(tiny_sd3, requests)
    got, _ = two_ranks(tiny_sd3, tmp_path, 2, 1, requests, shard=mesh)
    for r in range(2):
        if mesh == "2x1":
            assert not (tmp_path / f"weights{r}.json").exists(), r
        else:
            local, whole = json.loads((tmp_path / f"weights{r}.json").read_text())
            assert local <= 0.51 * whole, (r, local, whole)
    for params, a, b in zip(requests, expected, got, strict=True):
        diff = float(np.abs(a - b).max())
        assert diff <= TOLERANCE, f"sd3/hsdp {mesh} {params.prompt!r}: max abs diff {diff}"


@pytest.mark.parametrize("method", ["fbcache", "teacache", DBCACHE, "x0cache", MAGCACHE])
@pytest.mark.parametrize("strategy", ["cfg", "ulysses"])
@pytest.mark.parametrize("family", ["sd3", "flux", "wan22"])
def test_step_cache_decisions_agree_across_ranks(family, strategy, method, request, tmp_path):
    """Step caching on 2 ranks: a request split across ranks (a CFG row, or a token shard, each) decides once from
    sums all-reduced over the ranks. Every rank makes the same decisions, some requests do reuse, and the images are
    the ones one rank gives with the same thresholds. DBCache on the deeper tiny checkpoints (its last blocks
    refine what the reused span's residuals give; under Ulysses each rank holds its shard's)."""
    model = request.getfixturevalue(f"tiny_{family}" + ("_deep" if method == DBCACHE else ""))
    _caches_agree_across_ranks(family, model, strategy, method, tmp_path)


@pytest.mark.parametrize(
    ("family", "fixture", "method"),
    [
        ("z-image", "tiny_zimage", "fbcache"),
        ("z-image", "tiny_zimage_deep", DBCACHE),
        ("flux2-klein", "tiny_flux2klein", "teacache"),
        ("sdxl", "tiny_sdxl", "x0cache"),
    ],
)
def test_step_caches_of_issue_52_agree_across_ranks(family, fixture, method, request, tmp_path):
    """The families whose step-cache menu came with issue 52, on CFG-parallel (their caches refuse Ulysses at
    start): Z-Image's joint sequence (its rows' captions padded to a batch's longest; DBCache with its text-free
    span on 4 layers), FLUX.2 klein's modulations narrowed with the rows, SDXL's UNet left by held rows."""
    _caches_agree_across_ranks(family, request.getfixturevalue(fixture), "cfg", method, tmp_path)


def _caches_agree_across_ranks(family: str, model: str, strategy: str, method: str, tmp_path) -> None:
    import msgspec.structs

    thresholds = [0.0, 10.0, 0.5, 10.0, 0.0, 10.0, 10.0]
    # x0cache reuses once two steps have computed (its rate of change), DBCache here after its warm-up of 2, never at
    # the last: 2 more steps each. Wan 2.2's requests switch experts at their first or second step and start over
    # there (nothing carried across experts): 3 more.
    more = (2 if method in ("x0cache", DBCACHE) else 0) + (3 if family == "wan22" else 0)
    requests = [
        msgspec.structs.replace(p, cache_threshold=t, num_inference_steps=p.num_inference_steps + more)
        for p, t in zip(REQUESTS[family], thresholds, strict=False)
    ]
    expected = one_rank(model, requests, cache=method)
    cfg, ulysses = (2, 1) if strategy == "cfg" else (1, 2)
    got, _ = two_ranks(model, tmp_path, cfg, ulysses, requests, cache=method)
    decisions = [json.loads((tmp_path / f"reuse{r}.json").read_text()) for r in range(2)]
    # The same change, to the last bit, on both ranks (each holds only its row or its token shard of a request):
    # without the all-reduce, each rank would measure its own part.
    assert decisions[0] == decisions[1], "the ranks measured or decided differently"
    assert any(reused for *_, reused in decisions[0]), "nothing was reused: the test would show nothing"
    for params, a, b in zip(requests, expected, got, strict=True):
        diff = float(np.abs(a - b).max())
        assert diff <= TOLERANCE, f"{family}/{strategy} {params.prompt[:20]!r}: max abs diff {diff}"


# One family: each compile costs a minute of CI here. FLUX's two kinds of block are compiled in one process by
# tests/kernels/test_compile.py; what this adds is the compile under a split.
@pytest.mark.parametrize("family", ["sd3"])
def test_cfg_parallel_ranks_run_compiled_blocks(family, request, tmp_path):
    """`--compile` with CFG-parallel: every rank compiles its blocks (no collective runs inside them), the split still
    happens, and the images are one eager rank's."""
    model = request.getfixturevalue(f"tiny_{family}")
    requests = REQUESTS[family]  # with and without CFG: check_split wants both
    expected = one_rank(model, requests)
    got, forwards = two_ranks(model, tmp_path, 2, 1, requests, compile=True)
    check_split("cfg", forwards)
    graphs = [json.loads((tmp_path / f"graphs{r}.json").read_text()) for r in range(2)]
    assert all(g > 0 for g in graphs), graphs
    for params, a, b in zip(requests, expected, got, strict=True):
        diff = float(np.abs(a - b).max())
        assert diff <= TOLERANCE, f"{family} {params.prompt!r}: max abs diff {diff}"


@pytest.mark.parametrize("family", ["sd3", "flux"])
def test_ulysses_attends_with_the_chosen_backend(family, request, tmp_path):
    """`--attention` reaches the Ulysses processors: with `math` (standing in for a GPU kernel here) every rank's
    attention goes through diffusers' dispatch to it, once per layer and forward, and the images match one rank's."""
    model = request.getfixturevalue(f"tiny_{family}")
    requests = REQUESTS[family][:3]
    expected = one_rank(model, requests)
    got, forwards = two_ranks(model, tmp_path, 1, 2, requests, attention="math")
    calls = [json.loads((tmp_path / f"attention{r}.json").read_text()) for r in range(2)]
    transformer_calls = sum(len(f["calls"]) for f in forwards[0])
    layers = sum(1 for m in load_adapter(model).transformer.modules() if hasattr(m, "processor"))
    assert calls[0] == calls[1] == transformer_calls * layers > 0, (calls, transformer_calls, layers)
    for params, a, b in zip(requests, expected, got, strict=True):
        diff = float(np.abs(a - b).max())
        assert diff <= TOLERANCE, f"{family} {params.prompt!r}: max abs diff {diff}"


@pytest.mark.parametrize("strategy", ["cfg", "ulysses"])
def test_stochastic_sampling_agrees_across_ranks(strategy, request, tmp_path):
    """A scheduler that draws fresh noise at every step (the bundled model's): every rank steps every request from
    its own copy of the request's generator, so the ranks stay in step, also when requests without CFG are split
    between CFG ranks, and the images are one rank's."""
    model = request.getfixturevalue("tiny_sd3_stochastic")
    requests = REQUESTS["sd3"]  # with and without CFG
    expected = one_rank(model, requests)
    got, forwards = two_ranks(model, tmp_path, *((2, 1) if strategy == "cfg" else (1, 2)), requests)
    check_split(strategy if strategy == "cfg" else "sequence", forwards)
    for params, a, b in zip(requests, expected, got, strict=True):
        diff = float(np.abs(a - b).max())
        assert diff <= TOLERANCE, f"{strategy} {params.prompt!r}: max abs diff {diff}"


def _row_split_requests(family: str) -> list[SamplingParams]:
    """Requests with CFG and without (LTX-2: with STG and an image too), of one size and frame count, and a
    one-frame clip. Image-to-video checkpoints: every request with an image (HunyuanVideo-1.5's sized by it)."""
    ltx2, i2v = family.startswith("ltx2"), family.endswith("-i2v")
    size = {} if family == "hunyuan-video-15-i2v" else {"width": 64, "height": 64}

    def clip(seed: int, frames: int = 9, **fields) -> SamplingParams:
        image = {"image": picture(64, 64, seed=seed)} if i2v else {}
        return SamplingParams(**{"seed": seed, "num_frames": frames, **size, **image, **fields})

    plain = {"guidance_scale": 1.0, "audio_guidance_scale": 1.0} if ltx2 else {"guidance_scale": 1.0}
    second = {"stg_blocks": (1,), "image": picture(64, 64, seed=2)} if ltx2 else {}
    return [
        clip(1, prompt="a red cat", num_inference_steps=4),
        clip(2, prompt="a blue dog", negative_prompt="blurry", num_inference_steps=3, **second),
        *(clip(10 + i, prompt=f"plain {i}", num_inference_steps=2, **plain) for i in range(3)),
        clip(3, frames=1, prompt="one", num_inference_steps=2),
    ]


@pytest.mark.parametrize(
    ("family", "fixture", "strategy"),
    [
        ("ltx2", "tiny_ltx2", "cfg"),
        ("ltx2", "tiny_ltx2", "ulysses"),
        # Ring attention over both sequences: in the cross-attentions the other sequence's key blocks travel.
        ("ltx2", "tiny_ltx2", "ring"),
        # The image-to-video checkpoints under Ulysses (their rows split as the text-to-video ones' do).
        ("ltx2-i2v", "tiny_ltx2_i2v", "ulysses"),
        ("hunyuan-video-15", "tiny_hunyuan15", "cfg"),
        ("hunyuan-video-15-i2v", "tiny_hunyuan15_i2v", "ulysses"),
    ],
)
def test_a_step_s_rows_split_and_match_one_rank(family, fixture, strategy, request, tmp_path):
    """Families whose steps mix rows freely (LTX-2: up to three passes, CFG rows, STG and modality isolation;
    HunyuanVideo-1.5: a negative row only where a request guides at that step): with --cfg-parallel 2 the step's
    rows are split between the ranks, each computing half of them (a split that computes everything on both ranks:
    red); with --ulysses 2 every rank runs every row over its half of the video tokens (LTX-2: and of the audio
    tokens; with --ring 2 the same halves, and no attention kernel sees a whole sequence's keys of more than one
    token). The frames (and LTX-2's sound) equal one rank's. Text and image-to-video checkpoints alike."""
    model = request.getfixturevalue(fixture)
    requests = _row_split_requests(family)
    sounds: list = []
    expected = one_rank(model, requests, sounds=sounds if family.startswith("ltx2") else None)
    layout = {"cfg": (2, 1), "ulysses": (1, 2), "ring": (1, 1)}[strategy]
    got, forwards = two_ranks(model, tmp_path, *layout, requests, ring=2 if strategy == "ring" else 1)
    if strategy == "ring":
        for r in range(2):
            calls = json.loads((tmp_path / f"ring{r}.json").read_text())
            assert calls and all(keys < whole for keys, whole in calls if whole > 1), calls[:8]
    for i, (params, a, b) in enumerate(zip(requests, expected, got, strict=True)):
        diffs = [float(np.abs(a - b).max())]
        if sounds:
            diffs.append(float(np.abs(sounds[i] - np.load(tmp_path / f"{i}.audio.npy")).max()))
        print(f"{family}/{strategy} {params.prompt!r}: max abs diff {diffs}")
        assert max(diffs) <= TOLERANCE, (params.prompt, diffs)
    for steps in zip(*forwards, strict=True):
        rows = [sum(c["rows"] for c in f["calls"]) for f in steps]
        if strategy == "cfg":
            # Each rank its half (the first the odd row), where one rank alone computes them all.
            assert rows == [(steps[0]["rows"] + 1) // 2, steps[0]["rows"] // 2], steps
            continue
        assert rows == [steps[0]["rows"]] * 2, steps  # every row on both ranks
        for calls in zip(*(f["calls"] for f in steps), strict=True):  # each call: the tokens halved
            for whole, part in (("block_total", "block_tokens"), ("audio", "audio_block_tokens")):
                if whole not in calls[0]:  # no audio (HunyuanVideo-1.5)
                    continue
                local = [c[part] for c in calls]
                assert sum(local) == calls[0][whole] and max(local) - min(local) <= 1, calls
    assert max(f["rows"] for f in forwards[0]) >= 6  # steps with several requests (and passes)
