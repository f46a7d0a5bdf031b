"""LoRA per request over HTTP, on the tiny SD3 checkpoint with tiny random LoRA files: `/v1/loras` (list, load from
--lora-dir, delete), `lora` in native, OpenAI (JSON, multipart edits, the official client's `extra_body`) and video
bodies, every way a file or a name can be refused (each a 400 naming the field, nothing changed), eviction under
--lora-cache-bytes, --lora-fuse, the API key, and the metrics."""

from __future__ import annotations

import base64
import hashlib
import io
import json
import os
import shutil
import struct
import subprocess
import urllib.request
from dataclasses import dataclass
from pathlib import Path

import aiohttp
import numpy as np
import openai
import pytest
import torch
from conftest import API_KEY
from exposition import need, samples
from pictures import picture
from PIL import Image
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from diffusiond.models.lora.files import LoraError, startup_specs
from diffusiond.models.tiny.lora import build_tiny_lora

TIMEOUT = aiohttp.ClientTimeout(total=120)
PROMPT = "a red circle on a white background"
BASE = {"prompt": PROMPT, "size": "64x64", "num_inference_steps": 3, "seed": 5, "response_format": "b64_json"}


@dataclass(frozen=True)
class Files:
    """LoRA files: `a` outside --lora-dir (registered by --lora), `dir` the --lora-dir (its `d.safetensors`
    registered at start; `more/` holds files only POST names), `outside` a folder beside it."""

    a: Path
    dir: Path
    outside: Path


@pytest.fixture(scope="module")
def files(tmp_path_factory, tiny_sd3, tiny_flux) -> Files:
    root = tmp_path_factory.mktemp("loras")
    a = build_tiny_lora(tiny_sd3, root / "outside" / "a.safetensors", seed=1)
    lora_dir = root / "dir"
    build_tiny_lora(tiny_sd3, lora_dir / "d.safetensors", seed=4)
    more = lora_dir / "more"
    for seed, name in enumerate("bc", start=2):
        build_tiny_lora(tiny_sd3, more / f"{name}.safetensors", seed=seed)
    build_tiny_lora(tiny_flux, more / "flux.safetensors", seed=1)  # another family's
    wrong_shapes(a, more / "shapes.safetensors")
    build_tiny_lora(tiny_sd3, root / "outside" / "evil.safetensors", seed=9)
    (more / "garbage.safetensors").write_bytes(bytes(range(256)))
    shutil.copy(a, more / "x.bin")  # a real LoRA, under a name that is not .safetensors
    (more / "link.safetensors").symlink_to(root / "outside" / "evil.safetensors")
    return Files(a=a, dir=lora_dir, outside=root / "outside")


def wrong_shapes(source: Path, out: Path) -> None:
    """`source` with one down projection a column wider than its linear's input: right names, wrong shapes."""
    with safe_open(str(source), "pt") as f:
        metadata = f.metadata()
    tensors = load_file(str(source))
    key = next(k for k in sorted(tensors) if "lora_A" in k)
    tensors[key] = torch.cat([tensors[key], tensors[key][:, :1]], dim=1)
    save_file(tensors, str(out), metadata=metadata)


@pytest.fixture(scope="module")
def lora_server(serve, files):
    return serve(lora_dir=str(files.dir), lora=(f"a={files.a}",))


# ---- helpers ----


def png(b64: str) -> np.ndarray:
    with Image.open(io.BytesIO(base64.b64decode(b64))) as image:
        assert image.format == "PNG"
        return np.asarray(image.convert("RGB")).astype(np.int16)


def assert_error(body: dict, param: str | None) -> dict:
    error = body["error"]
    assert set(error) == {"message", "type", "param", "code"}, error
    assert error["param"] == param, error
    return error


async def listing(session, server) -> dict[str, dict]:
    async with session.get(f"{server.base_url}/v1/loras") as resp:
        assert resp.status == 200, await resp.text()
        body = await resp.json()
    assert body["object"] == "list"
    return {entry["name"]: entry for entry in body["data"]}


async def post_lora(session, server, name: str, path: str) -> tuple[int, dict]:
    async with session.post(f"{server.base_url}/v1/loras", json={"name": name, "path": path}) as resp:
        return resp.status, await resp.json()


async def image(session, server, **fields) -> np.ndarray:
    async with session.post(f"{server.base_url}/v1/images/generations", json={**BASE, **fields}) as resp:
        body = await resp.json()
        assert resp.status == 200, body
    return png(body["data"][0]["b64_json"])


async def refused(session, server, route: str = "/v1/images/generations", base: dict = BASE, **fields) -> dict:
    async with session.post(f"{server.base_url}{route}", json={**base, **fields}) as resp:
        body = await resp.json()
        assert resp.status == 400, body
    return body


def differs(x: np.ndarray, y: np.ndarray) -> bool:
    return float(np.abs(x - y).mean()) > 1.0


# ---- listing, loading, using ----


@pytest.mark.asyncio
async def test_start_up_adapters_are_listed(lora_server, files):
    async with aiohttp.ClientSession(timeout=TIMEOUT) as session:
        loras = await listing(session, lora_server)
    # --lora a=PATH, and every .safetensors file of --lora-dir by its name (not those in its subfolders).
    assert {"a", "d"} <= set(loras), loras
    assert not {"b", "c", "garbage", "link"} & set(loras)
    assert loras["a"]["path"] == str(files.a) and loras["d"]["path"] == str(files.dir / "d.safetensors")
    for entry in (loras["a"], loras["d"]):
        assert entry["object"] == "lora" and entry["bytes"] > 0 and entry["resident"] is True, entry


@pytest.mark.asyncio
async def test_a_posted_adapter_changes_the_image_at_its_scale(lora_server, files):
    async with aiohttp.ClientSession(timeout=TIMEOUT) as session:
        status, entry = await post_lora(session, lora_server, "b", "more/b.safetensors")
        assert status == 201, entry
        assert entry == {
            "object": "lora",
            "name": "b",
            "path": str(files.dir / "more" / "b.safetensors"),
            "bytes": entry["bytes"],
            "sha256": hashlib.sha256((files.dir / "more" / "b.safetensors").read_bytes()).hexdigest(),
            "resident": True,
        }
        assert (await listing(session, lora_server))["b"] == entry
        plain = await image(session, lora_server)
        with_b = await image(session, lora_server, lora=[{"name": "b"}])
        assert differs(with_b, plain)
        np.testing.assert_array_equal(await image(session, lora_server, lora=[{"name": "b", "scale": 1.0}]), with_b)
        # Another adapter, another image; scale 0 adds nothing; half the scale lands in between.
        assert differs(await image(session, lora_server, lora=[{"name": "a"}]), with_b)
        np.testing.assert_array_equal(await image(session, lora_server, lora=[{"name": "b", "scale": 0}]), plain)
        half = await image(session, lora_server, lora=[{"name": "b", "scale": 0.5}])
        assert differs(half, plain) and differs(half, with_b)
        # Two adapters at once; `[]` is no adapter.
        both = await image(session, lora_server, lora=[{"name": "a"}, {"name": "b", "scale": 0.5}])
        assert differs(both, with_b) and differs(both, half)
        np.testing.assert_array_equal(await image(session, lora_server, lora=[]), plain)


@pytest.mark.asyncio
async def test_native_stream_takes_lora(lora_server):
    native = {"prompt": PROMPT, "width": 64, "height": 64, "num_inference_steps": 3, "seed": 5}
    async with aiohttp.ClientSession(timeout=TIMEOUT) as session:
        async with session.post(
            f"{lora_server.base_url}/v1/generations", json={**native, "lora": [{"name": "a", "scale": 0.7}]}
        ) as resp:
            assert resp.status == 200, await resp.text()
            text = await resp.text()
        events = [json.loads(line[5:]) for line in text.splitlines() if line.startswith("data:")]
        completed = [event for event in events if event["type"] == "completed"]
        assert len(completed) == 1, text[-500:]
        native_image = png(completed[0]["images"][0]["b64"])
        # The same request through the Images API gives the same pixels.
        same = await image(session, lora_server, lora=[{"name": "a", "scale": 0.7}])
        np.testing.assert_array_equal(native_image, same)
        assert differs(native_image, await image(session, lora_server))
        body = await refused(session, lora_server, "/v1/generations", native, lora=[{"name": "nope"}])
        assert_error(body, "lora")


@pytest.mark.asyncio
async def test_bad_lora_fields_in_requests_are_400_naming_lora(lora_server):
    async with aiohttp.ClientSession(timeout=TIMEOUT) as session:
        for lora in (
            [{"name": "nope"}],  # not registered
            [{"name": "a"}, {"name": "a"}],  # twice
            [{"name": "a", "scale": 11}],
            [{"name": "a", "weight": 1}],  # unknown field
            [{"name": "../a"}],
            [{"scale": 1}],
            [{"name": "a"}] * 9,
            "a",
            {"name": "a"},
        ):
            error = assert_error(await refused(session, lora_server, lora=lora), "lora")
            assert error["code"] == "invalid_value", error
        error = assert_error(await refused(session, lora_server, lora=[{"name": "nope"}]), "lora")
        assert "unknown LoRA adapter 'nope' (registered: a, " in error["message"], error


# ---- refused files and names ----


@pytest.mark.asyncio
async def test_files_that_are_not_loras_for_this_model_are_refused(lora_server):
    async with aiohttp.ClientSession(timeout=TIMEOUT) as session:
        before = await listing(session, lora_server)
        for path, words in (
            ("more/garbage.safetensors", "not a safetensors file"),
            ("more/x.bin", "must be .safetensors"),
            ("more/flux.safetensors", "flux.safetensors: "),  # another family's LoRA
            ("more/shapes.safetensors", "does not fit this SD3Transformer2DModel"),
            ("more/missing.safetensors", "no such file"),
            ("more", "must be .safetensors"),
        ):
            status, body = await post_lora(session, lora_server, "new", path)
            assert status == 400, (path, body)
            error = assert_error(body, "path")
            assert words in error["message"], (path, error)
        assert await listing(session, lora_server) == before
        await image(session, lora_server, lora=[{"name": "a"}])  # still serving


@pytest.mark.asyncio
async def test_paths_outside_the_lora_dir_are_refused(lora_server, files):
    evil = files.outside / "evil.safetensors"
    async with aiohttp.ClientSession(timeout=TIMEOUT) as session:
        before = await listing(session, lora_server)
        for path in ("../outside/evil.safetensors", str(evil), "more/link.safetensors", str(files.a)):
            status, body = await post_lora(session, lora_server, "evil", path)
            assert status == 400, (path, body)
            assert "outside --lora-dir" in assert_error(body, "path")["message"], body
        assert await listing(session, lora_server) == before


@pytest.mark.asyncio
async def test_names_are_checked_and_taken_names_conflict(lora_server):
    async with aiohttp.ClientSession(timeout=TIMEOUT) as session:
        for name in ("bad name", "-x", "x" * 65, ""):
            status, body = await post_lora(session, lora_server, name, "more/c.safetensors")
            assert status == 400, (name, body)
            assert_error(body, "name")
        status, body = await post_lora(session, lora_server, "a", "more/c.safetensors")
        assert status == 409 and assert_error(body, "name")["code"] == "lora_exists", body
        for bad in ({"name": "c"}, {"path": "more/c.safetensors"}, {"name": "c", "path": "x", "extra": 1}, []):
            async with session.post(f"{lora_server.base_url}/v1/loras", json=bad) as resp:
                assert resp.status == 400, bad
        assert "c" not in await listing(session, lora_server)


# ---- delete ----


@pytest.mark.asyncio
async def test_delete_forgets_the_adapter_and_a_request_using_it_finishes(lora_server):
    base = lora_server.base_url
    async with aiohttp.ClientSession(timeout=TIMEOUT) as session:
        assert (await post_lora(session, lora_server, "c", "more/c.safetensors"))[0] == 201
        long = {"prompt": PROMPT, "width": 64, "height": 64, "num_inference_steps": 60, "seed": 1}
        async with session.post(f"{base}/v1/generations", json={**long, "lora": [{"name": "c"}]}) as stream:
            assert stream.status == 200
            async for line in stream.content:  # running: it holds the adapter
                if line.startswith(b"event: progress"):
                    break
            async with session.delete(f"{base}/v1/loras/c") as resp:
                assert resp.status == 200
                assert await resp.json() == {"name": "c", "object": "lora.deleted", "deleted": True}
            rest = await stream.text()
        assert "event: completed" in rest, rest[-300:]
        assert "c" not in await listing(session, lora_server)
        assert_error(await refused(session, lora_server, lora=[{"name": "c"}]), "lora")
        async with session.delete(f"{base}/v1/loras/c") as resp:
            assert resp.status == 404
            assert assert_error(await resp.json(), "name")["code"] == "not_found"
        # The name is free again.
        assert (await post_lora(session, lora_server, "c", "more/c.safetensors"))[0] == 201
        await image(session, lora_server, lora=[{"name": "c"}])


# ---- the official client, multipart edits ----


def test_openai_client_sends_lora_in_extra_body(lora_server):
    kwargs = dict(prompt=PROMPT, size="64x64", response_format="b64_json")
    extra = {"num_inference_steps": 3, "seed": 5}
    with openai.OpenAI(base_url=f"{lora_server.base_url}/v1", api_key="x", max_retries=0, timeout=60) as client:
        plain = client.images.generate(**kwargs, extra_body=extra)
        styled = client.images.generate(**kwargs, extra_body={**extra, "lora": [{"name": "a", "scale": 0.8}]})
        with pytest.raises(openai.BadRequestError) as info:
            client.images.generate(**kwargs, extra_body={**extra, "lora": [{"name": "nope"}]})
        assert info.value.body["param"] == "lora"
        # Multipart edits carry `lora` as JSON text.
        edit = dict(image=("in.png", picture(64, 64, seed=1), "image/png"), prompt=PROMPT, size="64x64")
        edit_extra = {**extra, "strength": 0.8}
        edited = client.images.edit(**edit, extra_body=edit_extra)
        edited_a = client.images.edit(**edit, extra_body={**edit_extra, "lora": json.dumps([{"name": "a"}])})
        with pytest.raises(openai.BadRequestError) as info:
            client.images.edit(**edit, extra_body={**edit_extra, "lora": json.dumps([{"name": "nope"}])})
        assert info.value.body["param"] == "lora"
        with pytest.raises(openai.BadRequestError) as info:  # flattened into form fields: told to send JSON text
            client.images.edit(**edit, extra_body={**edit_extra, "lora": [{"name": "a"}]})
        assert info.value.body["param"] is not None and "lora" in info.value.body["param"]
    assert differs(png(styled.data[0].b64_json), png(plain.data[0].b64_json))
    assert differs(png(edited_a.data[0].b64_json), png(edited.data[0].b64_json))


@pytest.mark.asyncio
async def test_multipart_lora_that_is_not_json_is_400(lora_server):
    form = aiohttp.FormData()
    form.add_field("image", picture(64, 64), filename="in.png", content_type="image/png")
    form.add_field("prompt", PROMPT)
    form.add_field("lora", "a")
    async with (
        aiohttp.ClientSession(timeout=TIMEOUT) as session,
        session.post(f"{lora_server.base_url}/v1/images/edits", data=form) as resp,
    ):
        assert resp.status == 400
        assert "JSON text" in assert_error(await resp.json(), "lora")["message"]


# ---- eviction and metrics ----


async def scrape(session, server) -> dict[str, float]:
    async with session.get(f"{server.base_url}/metrics") as resp:
        assert resp.status == 200
        return samples(await resp.text())


@pytest.mark.asyncio
async def test_metrics_count_adapters_requests_loads_and_evictions(serve, lora_server, files):
    """A server whose budget holds one adapter: using the other reloads it and evicts the first; the image is the
    one a server that kept it resident makes."""
    async with aiohttp.ClientSession(timeout=TIMEOUT) as session:
        resident = await image(session, lora_server, lora=[{"name": "a"}])
        one = (await listing(session, lora_server))["a"]["bytes"]
        b = files.dir / "more" / "b.safetensors"
        small = serve(lora=(f"a={files.a}", f"b={b}"), lora_cache_bytes=one)
        loras = await listing(session, small)
        assert (loras["a"]["resident"], loras["b"]["resident"]) == (False, True)  # b's registration evicted a
        before = await scrape(session, small)
        reloaded = await image(session, small, lora=[{"name": "a"}])
        np.testing.assert_array_equal(reloaded, resident)
        after = await scrape(session, small)
        loras = await listing(session, small)
        assert (loras["a"]["resident"], loras["b"]["resident"]) == (True, False)
        assert after["diffusiond_lora_adapters"] == 2
        assert after["diffusiond_lora_resident_bytes"] == one
        assert after["diffusiond_lora_loads_total"] - before["diffusiond_lora_loads_total"] == 1
        assert after["diffusiond_lora_evictions_total"] - before["diffusiond_lora_evictions_total"] == 1
        requests_a, requests_b = (f'diffusiond_lora_requests_total{{adapter="{n}"}}' for n in "ab")
        assert after[requests_a] - before.get(requests_a, 0) == 1
        assert after[requests_b] == before[requests_b]
        # A request without adapters changes none of them.
        await image(session, small)
        again = await scrape(session, small)
        assert {k: v for k, v in again.items() if "lora" in k} == {k: v for k, v in after.items() if "lora" in k}
        # The other server: what it lists, its metrics say.
        loras = await listing(session, lora_server)
        async with session.get(f"{lora_server.base_url}/metrics") as resp:
            text = await resp.text()
    metrics = samples(text)
    assert metrics["diffusiond_lora_adapters"] == len(loras)
    assert metrics["diffusiond_lora_resident_bytes"] == sum(e["bytes"] for e in loras.values() if e["resident"])
    assert metrics['diffusiond_lora_requests_total{adapter="a"}'] >= 1


def test_promtool_accepts_the_lora_metrics(lora_server):
    promtool = need("promtool")
    with urllib.request.urlopen(f"{lora_server.base_url}/metrics", timeout=10) as resp:
        text = resp.read().decode()
    assert 'diffusiond_lora_requests_total{adapter="a"}' in text
    check = subprocess.run([promtool, "check", "metrics"], input=text, capture_output=True, text=True)
    assert check.returncode == 0 and not check.stdout.strip() and not check.stderr.strip(), check


@pytest.mark.asyncio
async def test_a_fused_adapter_applies_to_every_request(serve, lora_server, files):
    """--lora-fuse 0.5: requests without `lora` get what the unfused server makes with `a` at 0.5 (up to rounding:
    the fused weights sum in another order); naming it at another scale, or adding another adapter, is refused."""
    fused = serve(lora=(f"a={files.a}",), lora_fuse=0.5)
    async with aiohttp.ClientSession(timeout=TIMEOUT) as session:
        expected = await image(session, lora_server, lora=[{"name": "a", "scale": 0.5}])
        assert differs(expected, await image(session, lora_server))
        got = await image(session, fused)
        assert float(np.abs(got - expected).mean()) < 0.5, np.abs(got - expected).mean()
        np.testing.assert_array_equal(await image(session, fused, lora=[{"name": "a", "scale": 0.5}]), got)
        error = assert_error(await refused(session, fused, lora=[{"name": "a"}]), "lora")
        assert "fused into the weights at scale 0.5" in error["message"], error
        assert (await listing(session, fused))["a"]["resident"] is False  # in the weights, not beside them


# ---- the API key, and servers without LoRA ----


@pytest.mark.asyncio
async def test_the_api_key_guards_the_lora_routes(auth_server):
    base = auth_server.base_url
    async with aiohttp.ClientSession(timeout=TIMEOUT) as session:
        for method, path in (("GET", "/v1/loras"), ("POST", "/v1/loras"), ("DELETE", "/v1/loras/a")):
            async with session.request(method, f"{base}{path}", json={"name": "a", "path": "a.safetensors"}) as resp:
                assert resp.status == 401, (method, path)
        auth = {"Authorization": f"Bearer {API_KEY}"}
        async with session.get(f"{base}/v1/loras", headers=auth) as resp:
            assert await resp.json() == {"object": "list", "data": []}
        # With the key, this server (no --lora-dir) still adds nothing at run time.
        async with session.post(f"{base}/v1/loras", headers=auth, json={"name": "a", "path": "a.safetensors"}) as resp:
            assert resp.status == 400
            assert "needs --lora-dir" in assert_error(await resp.json(), "path")["message"]
        async with session.delete(f"{base}/v1/loras/a", headers=auth) as resp:
            assert resp.status == 404


@pytest.mark.asyncio
async def test_a_family_without_lora_refuses_it(serve, tiny_hunyuan15):
    # HunyuanVideo-1.5: diffusers has no LoRA loader for it (every image family serves LoRA).
    server = serve(model=tiny_hunyuan15, api_key=API_KEY, max_pixels=64 * 64)
    auth = {"Authorization": f"Bearer {API_KEY}"}
    async with aiohttp.ClientSession(timeout=TIMEOUT, headers=auth) as session:
        assert await listing(session, server) == {}
        status, body = await post_lora(session, server, "a", "a.safetensors")
        assert status == 400 and assert_error(body, None)["code"] == "lora_unsupported", body
        assert "does not serve them" in body["error"]["message"]
        video = {"prompt": PROMPT, "size": "64x64", "seconds": "1", "num_inference_steps": 2, "lora": [{"name": "a"}]}
        async with session.post(f"{server.base_url}/v1/videos", json=video) as resp:
            assert resp.status == 400
            assert "does not serve LoRA" in assert_error(await resp.json(), "lora")["message"]


@pytest.mark.asyncio
async def test_video_requests_name_their_adapters(serve, tiny_wan):
    # The video tests' server (tests/daemon/test_videos.py): Wan serves LoRA; none is registered there.
    server = serve(model=tiny_wan, api_key=API_KEY, max_pixels=64 * 64)
    auth = {"Authorization": f"Bearer {API_KEY}"}
    async with aiohttp.ClientSession(timeout=TIMEOUT, headers=auth) as session:
        video = {"prompt": PROMPT, "size": "48x32", "seconds": "1", "num_inference_steps": 2}
        async with session.post(f"{server.base_url}/v1/videos", json={**video, "lora": [{"name": "a"}]}) as resp:
            assert resp.status == 400
            assert "unknown LoRA adapter 'a'" in assert_error(await resp.json(), "lora")["message"]


# ---- bounds (issue 30) ----


@pytest.mark.asyncio
async def test_registrations_are_bounded_before_any_file_is_read(lora_server, files, monkeypatch):
    """A NUL in a path, a 9 MiB header, a file that cannot fit the LoRA budget: each a 400 naming `path` before
    the file is read; past MAX_ADAPTERS registrations a new one is refused."""
    huge_header = files.dir / "more" / "header.safetensors"
    huge_header.write_bytes(struct.pack("<Q", 9 << 20) + b"{" + b" " * (9 << 20))
    sparse = files.dir / "more" / "sparse.safetensors"
    head = b'{"__metadata__": {}}'
    sparse.write_bytes(struct.pack("<Q", len(head)) + head)
    os.truncate(sparse, 3 * lora_server.config.lora_cache_bytes)  # sparse: nothing is written
    async with aiohttp.ClientSession(timeout=TIMEOUT) as session:
        before = await listing(session, lora_server)
        for path, words in (
            ("a\u0000.safetensors", "no NUL"),
            ("more/header.safetensors", "not a safetensors file"),
            ("more/sparse.safetensors", "more than fits in the LoRA budget"),
        ):
            status, body = await post_lora(session, lora_server, "new", path)
            assert status == 400 and words in assert_error(body, "path")["message"], (path, body)
        monkeypatch.setattr("diffusiond.models.lora.registry.MAX_ADAPTERS", len(before) + 1)
        status, body = await post_lora(session, lora_server, "one", "more/b.safetensors")
        assert status == 201, body
        status, body = await post_lora(session, lora_server, "two", "more/c.safetensors")
        assert status == 400 and "the most there may be" in body["error"]["message"], body
        async with session.delete(f"{lora_server.base_url}/v1/loras/one") as resp:
            assert resp.status == 200
        assert await listing(session, lora_server) == before
    huge_header.unlink()
    sparse.unlink()


def test_start_up_follows_no_symlink_out_of_the_lora_dir(tmp_path, files):
    folder = tmp_path / "loras"
    folder.mkdir()
    shutil.copy(files.a, folder / "ok.safetensors")
    (folder / "out.safetensors").symlink_to(files.outside / "evil.safetensors")
    with pytest.raises(LoraError, match="outside --lora-dir"):
        startup_specs((), str(folder))
    (folder / "out.safetensors").unlink()
    assert startup_specs((), str(folder)) == [("ok", str((folder / "ok.safetensors").resolve()))]
