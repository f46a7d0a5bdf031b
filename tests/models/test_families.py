"""What each family declares (models/base.py): the loaded checkpoint's capabilities, `serve`'s start-up refusals, and
README's table, which must equal the one the declarations generate. Model differences live in `models/` only."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import aiohttp
import pytest
from procs import refused

from diffusiond.models.families.specs import FAMILIES, families_table
from diffusiond.models.loading.loader import load_adapter
from diffusiond.models.params import ParamError, SamplingParams

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize(
    ("fixture", "guidance", "ulysses", "cache"),
    [
        ("tiny_sd3", ("cfg", "skip-layer"), (2, 4), ("fbcache", "dbcache", "teacache", "x0cache", "magcache")),
        ("tiny_flux", ("distilled", "true-cfg"), (2,), ("fbcache", "dbcache", "teacache", "x0cache", "magcache")),
        ("tiny_kontext", ("distilled", "true-cfg"), (2,), ("fbcache", "dbcache", "teacache", "x0cache", "magcache")),
        ("tiny_sdxl", ("cfg",), (), ("x0cache",)),
        ("tiny_flux2klein", ("cfg",), (2,), ("fbcache", "dbcache", "teacache", "x0cache", "magcache")),
        ("tiny_zimage", ("cfg",), (2,), ("fbcache", "dbcache", "teacache", "x0cache", "magcache")),
        ("tiny_ovis", ("cfg",), (), ("fbcache", "dbcache", "x0cache")),
        ("tiny_longcat", ("cfg",), (), ("fbcache", "dbcache", "x0cache")),
        ("tiny_longcat_edit", ("cfg",), (), ("fbcache", "dbcache", "x0cache")),
        ("tiny_glm_image", ("cfg",), (), ("fbcache", "dbcache", "x0cache")),
        # The tiny Qwen-Image has no guidance embedding, so it drops "distilled" from its family's styles.
        ("tiny_qwenimage", ("true-cfg",), (2,), ("fbcache", "dbcache", "teacache", "x0cache", "magcache")),
        ("tiny_qwenimage_layered", ("true-cfg",), (2,), ("fbcache", "dbcache", "teacache", "x0cache", "magcache")),
        ("tiny_wan", ("cfg",), (2,), ("fbcache", "dbcache", "teacache", "x0cache", "magcache")),
        ("tiny_wan_i2v", ("cfg",), (2,), ("fbcache", "dbcache", "teacache", "x0cache", "magcache")),
    ],
)
def test_loaded_checkpoints_declare_what_they_support(fixture, guidance, ulysses, cache, request):
    caps = load_adapter(request.getfixturevalue(fixture)).capabilities
    assert caps.guidance_styles == guidance
    assert caps.ulysses_degrees == ulysses  # divisors of the heads (SD3 tiny: 4, FLUX tiny: 2)
    assert caps.cache_methods == cache
    assert "cfg-parallel" in caps.parallel
    public = caps.public()
    assert public["guidance_styles"] == list(guidance) and public["ulysses_degrees"] == list(ulysses)


@pytest.mark.parametrize(
    ("fixture", "flags", "message"),
    [
        (
            "tiny_sdxl",
            ["--nproc", "2", "--ulysses", "2"],
            "the sdxl family (StableDiffusionXLPipeline) does not support Ulysses",
        ),
        (
            "tiny_zimage",
            ["--nproc", "3", "--ulysses", "3"],
            "--ulysses 3 must divide the number of attention heads (2)",
        ),
        ("tiny_sd3", ["--nproc", "3", "--ulysses", "3"], "--ulysses 3 must divide the number of attention heads (4)"),
        ("tiny_sdxl", ["--cache", "teacache"], "--cache teacache: the sdxl family implements x0cache"),
        (
            "tiny_zimage",
            ["--nproc", "2", "--ulysses", "2", "--cache", "fbcache"],
            "--cache fbcache with --ulysses 2: the z-image family cannot combine them yet",
        ),
        ("tiny_zimage", ["--nproc", "2", "--ring", "2"], "--ring 2: the z-image family (ZImagePipeline) does not"),
        ("tiny_sdxl", ["--nproc", "2", "--tp", "2"], "--tp 2: the sdxl family (StableDiffusionXLPipeline) does not"),
        ("tiny_sd3", ["--nproc", "3", "--ulysses", "3", "--tp", "1"], "must divide the number of attention heads"),
        ("tiny_sd3", ["--nproc", "2", "--cfg-parallel", "2", "--tp", "2"], "x --tp (2) = 4 must equal"),
        ("tiny_sd3", ["--shard-weights"], "--shard-weights splits the weights over the ranks: it needs --nproc 2"),
        ("tiny_ltx2", ["--nproc", "2", "--cfg-parallel", "2", "--vae-parallel", "2"], "does not decode in strips"),
        (
            "tiny_ltx2",
            ["--nproc", "2", "--cfg-parallel", "2", "--cache", "dbcache"],
            "--cache dbcache with --cfg-parallel: the ltx2 family cannot combine them yet",
        ),
        (
            "tiny_glm_image",
            ["--nproc", "2", "--cfg-parallel", "2", "--cache", "fbcache"],
            "--cache fbcache with --cfg-parallel: the glm-image family cannot combine them yet",
        ),
        (
            "tiny_ltx2",
            ["--cache", "teacache"],
            "--cache teacache: the ltx2 family implements fbcache, dbcache, x0cache",
        ),
        (
            "tiny_hunyuan15",
            ["--nproc", "2", "--ulysses", "2", "--cache", "fbcache"],
            "--cache fbcache with --ulysses 2: the hunyuan-video-15 family cannot combine them yet",
        ),
        ("tiny_sd3", ["--vae-parallel", "2"], "--vae-parallel 2 decodes on that many ranks"),
        (
            "tiny_qwenimage",
            ["--nproc", "2", "--ulysses", "2", "--cache", "fbcache"],
            "--cache fbcache with --ulysses 2: the qwen-image family cannot combine them yet",
        ),
    ],
)
def test_serve_refuses_what_the_family_cannot_do_at_start(fixture, flags, message, request):
    stderr = refused("serve", "--model", request.getfixturevalue(fixture), *flags)
    assert message in stderr, stderr


def test_the_reference_table_is_generated_from_the_declarations():
    """docs/families.md's table against the reference design's, from our declarations (issue 52)."""
    from diffusiond.models.families.reference import reference_table

    page = (ROOT / "docs" / "families.md").read_text()
    table = re.search(r"<!-- reference:start -->\n(.*?)<!-- reference:end -->", page, re.S)
    assert table is not None, "docs/families.md has no reference table"
    assert table.group(1) == reference_table(), "docs/families.md's reference table drifted: paste reference_table()"
    cells, _, notes = table.group(1).partition("\n\n")
    for number in set(re.findall(r"no \((\d+)\)", cells)):
        assert f"\n({number}) " in f"\n{notes}", f"no ({number}) has no reason"


def test_readme_table_is_generated_from_the_declarations():
    readme = (ROOT / "README.md").read_text()
    table = re.search(r"<!-- families:start -->\n(.*?)<!-- families:end -->", readme, re.S)
    assert table is not None, "README has no families table"
    assert table.group(1) == families_table(), "README's table drifted: paste families_table()'s output"
    for name in FAMILIES:
        assert f"`{name}`" in table.group(1)


# What names a family in code: its pipeline classes and family names, as identifiers or inside string literals.
FAMILY_NAMES = re.compile(r"sd3|flux|z[-_]?image|qwen|sdxl|ltx|stablediffusion|(?-i:\bwan\b|Wan[A-Z]|wan[-_])", re.I)


def code_names(path: Path):
    """(line, text) of the identifiers and string constants of `path`, docstrings left out (comments are not in
    the tree)."""
    tree = ast.parse(path.read_text())
    docstrings = {
        id(node.body[0].value)
        for node in ast.walk(tree)
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
        and node.body
        and isinstance(node.body[0], ast.Expr)
        and isinstance(node.body[0].value, ast.Constant)
    }
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docstrings:
            yield node.lineno, node.value
        elif isinstance(node, ast.Name):
            yield node.lineno, node.id
        elif isinstance(node, ast.Attribute):
            yield node.lineno, node.attr
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef, ast.alias)):
            yield node.lineno, node.name


@pytest.mark.parametrize("package", ["daemon", "engine", "kernels", "metrics"])
def test_no_family_is_named_outside_models(package):
    """Core code asks the adapter; it never tests which family it has, and kernels/ holds only generic math."""
    found = [
        f"{path.relative_to(ROOT)}:{line}: {text}"
        for path in sorted((ROOT / package).rglob("*.py"))
        for line, text in code_names(path)
        if FAMILY_NAMES.search(text)
    ]
    assert not found, found


def test_skip_layer_guidance_is_refused_by_families_without_it(tiny_flux):
    adapter = load_adapter(tiny_flux)
    with pytest.raises(ParamError, match="the flux family has no skip-layer guidance") as info:
        adapter.resolve(SamplingParams(prompt="a cat", skip_guidance_layers=(0,)))
    assert info.value.param == "skip_guidance_layers"


@pytest.mark.asyncio
async def test_skip_layer_guidance_over_http_names_the_field(serve):
    """The native API takes it; a block the transformer does not have is a 400 naming the field (tiny SD3: 2)."""
    server = serve()
    async with aiohttp.ClientSession() as session:
        body = {"prompt": "a red circle", "width": 64, "height": 64, "skip_guidance_layers": [5]}
        async with session.post(f"{server.base_url}/v1/generations", json=body) as resp:
            error = await resp.json()
        assert resp.status == 400 and error["error"]["param"] == "skip_guidance_layers", error
        assert "blocks 0 to 1" in error["error"]["message"]
        body = {**body, "skip_guidance_layers": [1], "num_inference_steps": 3, "guidance_scale": 4.0}
        async with session.post(f"{server.base_url}/v1/generations", json=body) as resp:
            events = [line async for line in resp.content if line.startswith(b"event: ")]
        assert resp.status == 200 and events[-1].strip() == b"event: completed", events
