"""What a model declares it serves (models/declared.py), against the bundled model: shown at /v1/models, enforced
before any work starts (HTTP and `generate`), unknown words reported, its proper name, a warm-up that is not a
user request."""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path

import aiohttp
import pytest
from pictures import mask, picture

from diffusiond.bench.serve import sse_events
from diffusiond.daemon import cli
from diffusiond.daemon.app import METRICS
from diffusiond.models.default import default_model

TIMEOUT = aiohttp.ClientTimeout(total=60)


@pytest.fixture(scope="module")
def demo(serve):
    return serve(model=default_model(), max_steps=None)


async def post(url: str, body: dict) -> tuple[int, dict, dict]:
    async with aiohttp.ClientSession(timeout=TIMEOUT) as session, session.post(url, json=body) as resp:
        if resp.content_type == "text/event-stream":
            events = {name: data async for name, data in sse_events(resp)}
            return resp.status, dict(resp.headers), events
        return resp.status, dict(resp.headers), await resp.json()


def requests_total(server) -> float:
    """Every request the engine has seen end, whatever its outcome, from the metrics registry."""
    return sum(
        sample.value
        for metric in server.app[METRICS].registry.collect()
        if metric.name == "diffusiond_requests"
        for sample in metric.samples
        if sample.name == "diffusiond_requests_total"
    )


@pytest.mark.asyncio
async def test_models_lists_what_the_model_serves(demo):
    async with aiohttp.ClientSession(timeout=TIMEOUT) as session, session.get(f"{demo.base_url}/v1/models") as resp:
        (entry,) = (await resp.json())["data"]
    assert entry["id"] == "diffusiond-shapes", entry["id"]  # its declared name, not the folder's ("weights")
    caps = entry["diffusiond"]
    assert caps["sizes"] == ["64x64"] and caps["default_size"] == "64x64"
    assert caps["steps"] == [4, 100] and caps["guidance_scale"] == [0.0, 10.0]
    assert caps["negative_prompt"] is False
    assert {"circle", "square", "triangle", "red", "background"} <= set(caps["vocabulary"])
    assert "circle" in caps["draws"]
    # What its family declares (models/base.py), narrowed to the checkpoint: 4 heads, so Ulysses over 2 or 4 ranks.
    assert caps["guidance_styles"] == ["cfg", "skip-layer"]
    assert caps["parallel"] == ["cfg-parallel", "ulysses", "ring", "tp", "shard-weights", "vae-parallel"]
    assert caps["cache_methods"] == ["fbcache", "dbcache", "teacache", "x0cache", "magcache"]
    assert caps["image_inputs"] == ["img2img", "mask"]
    assert caps["ulysses_degrees"] and all(d > 1 for d in caps["ulysses_degrees"])


@pytest.mark.asyncio
@pytest.mark.parametrize(
    "route,body,param",
    [
        ("/v1/images/generations", {"prompt": "a red circle", "size": "256x256"}, "size"),
        ("/v1/generations", {"prompt": "a red circle", "width": 128, "height": 128}, "width"),
        ("/v1/generations", {"prompt": "a red circle", "num_inference_steps": 2}, "num_inference_steps"),
        ("/v1/generations", {"prompt": "a red circle", "guidance_scale": 20}, "guidance_scale"),
        ("/v1/images/generations", {"prompt": "a red circle", "negative_prompt": "blue"}, "negative_prompt"),
    ],
)
async def test_what_the_model_does_not_serve_is_refused_before_any_work(demo, route, body, param):
    before = requests_total(demo)
    status, _, error = await post(demo.base_url + route, body)
    assert status == 400, error
    assert error["error"]["param"] == param and "this model" in error["error"]["message"], error
    assert requests_total(demo) == before, "nothing may reach the engine"


@pytest.mark.asyncio
async def test_unknown_words_are_reported_not_refused(demo):
    status, headers, events = await post(
        f"{demo.base_url}/v1/generations", {"prompt": "a red cat on a blue background", "seed": 1}
    )
    assert status == 200 and headers["X-Unknown-Words"] == "cat", headers
    assert events["queued"]["unknown_words"] == ["cat"] and events["completed"]["unknown_words"] == ["cat"]
    status, headers, _ = await post(
        f"{demo.base_url}/v1/images/generations", {"prompt": "A Large GREEN Square, top left; Dogs!", "seed": 1}
    )
    assert status == 200 and headers["X-Unknown-Words"] == "dogs", headers
    status, headers, events = await post(
        f"{demo.base_url}/v1/generations", {"prompt": "a small red circle in the center on a blue background"}
    )
    assert status == 200 and "X-Unknown-Words" not in headers and "unknown_words" not in events["queued"]


def test_warm_up_is_not_a_user_request(serve, caplog):
    with caplog.at_level(logging.INFO, logger="diffusiond.requests"):
        server = serve(model=default_model(), max_steps=None, max_batch=2)  # a fresh server: its own warm-up
    assert requests_total(server) == 0
    assert not [r for r in caplog.records if r.name == "diffusiond.requests"], caplog.records


def test_warm_up_runs_the_shape_requests_will_have(demo, server):
    """The default size with the default guidance (CFG on where it is by default), for the fewest steps served."""
    from diffusiond.daemon.app import warm_up_params

    for live in (demo, server):
        caps = live.state.engine.adapter.capabilities
        warm = warm_up_params(caps)
        assert (warm.width, warm.height) == (caps.default_width, caps.default_height)
        assert warm.guidance_scale == caps.default_guidance
        assert warm.num_inference_steps == max(2, caps.steps[0] if caps.steps else 2)
    assert warm_up_params(demo.state.engine.adapter.capabilities).num_inference_steps == 4  # its declared least


def test_served_model_names_are_aliases(serve):
    """`--served-model-name shapes gpt-image-1 dall-e-3`: an application written for OpenAI (the official SDK, its
    model "gpt-image-1") gets images; each name is listed and retrievable, answers echo the name asked; another name
    is a 404 model_not_found naming `model`."""
    import base64

    import openai

    server = serve(model=default_model(), max_steps=None, served_model_name=("shapes", "gpt-image-1", "dall-e-3"))
    assert server.state.model_id == "shapes"
    with openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="x", max_retries=0, timeout=60) as client:
        assert [m.id for m in client.models.list()] == ["shapes", "gpt-image-1", "dall-e-3"]
        assert client.models.retrieve("dall-e-3").id == "dall-e-3"
        pictures = {}
        for name in ("gpt-image-1", "dall-e-3", "shapes"):
            result = client.images.generate(model=name, prompt="a red circle", n=1, extra_body={"seed": 3})
            pictures[name] = base64.b64decode(result.data[0].b64_json)
            assert pictures[name].startswith(b"\x89PNG")
        assert len(set(pictures.values())) == 1  # one model under three names
        for call in (
            lambda: client.images.generate(model="gpt-image-2", prompt="a red circle"),
            lambda: client.models.retrieve("gpt-image-2"),
        ):
            with pytest.raises(openai.NotFoundError) as err:
                call()
            assert err.value.body["code"] == "model_not_found" and err.value.body["param"] == "model"
            assert "'gpt-image-1'" in err.value.body["message"]


def test_generate_refuses_before_loading(monkeypatch, capsys, tmp_path):
    def no_load(*args, **kwargs):
        raise AssertionError("the model must not load for a request it does not serve")

    monkeypatch.setattr("diffusiond.models.loading.loader.load_adapter", no_load)
    t0 = time.monotonic()
    code = cli.main(["generate", "a red circle", "--size", "256x256", "--out", str(tmp_path / "x.png")])
    err = capsys.readouterr().err
    assert code == 2 and "--size" in err and "64x64" in err and "Traceback" not in err, err
    assert time.monotonic() - t0 < 5
    code = cli.main(["generate", "a red circle", "--steps", "1", "--out", str(tmp_path / "x.png")])
    assert code == 2 and "--steps" in capsys.readouterr().err


def test_generate_reports_unknown_words(capsys, tmp_path):
    out = tmp_path / "cat.png"
    code = cli.main(["generate", "a red cat", "--seed", "1", "--out", str(out)])
    captured = capsys.readouterr()
    assert code == 0 and out.stat().st_size > 0, captured.err
    assert "does not know: cat" in captured.err


def test_generate_edits_an_image(capsys, tmp_path):
    (tmp_path / "in.png").write_bytes(picture(96, 64))
    (tmp_path / "bad.png").write_bytes(b"not a picture")
    out = tmp_path / "edit.png"
    args = ["generate", "a red circle", "--seed", "1", "--strength", "0.5", "--out", str(out)]
    code = cli.main([*args, "--image", str(tmp_path / "in.png")])
    captured = capsys.readouterr()
    assert code == 0 and out.stat().st_size > 0, captured.err
    code = cli.main([*args, "--image", str(tmp_path / "bad.png")])
    err = capsys.readouterr().err
    assert code == 2 and "--image" in err and "Traceback" not in err, err
    code = cli.main(["generate", "a red circle", "--strength", "0.5", "--out", str(out)])
    assert code == 2 and "--strength" in capsys.readouterr().err
    # Inpainting: repaint the left half only.
    (tmp_path / "mask.png").write_bytes(mask(96, 64, (0, 0, 48, 64))[0])
    code = cli.main([*args, "--image", str(tmp_path / "in.png"), "--mask", str(tmp_path / "mask.png")])
    assert code == 0, capsys.readouterr().err
    code = cli.main(["generate", "a red circle", "--mask", str(tmp_path / "mask.png"), "--out", str(out)])
    err = capsys.readouterr().err
    assert code == 2 and "--mask" in err and "needs the image" in err, err


def test_help_describes_every_flag():
    parser = cli.build_parser()
    for name in ("serve", "generate"):
        sub = parser._subparsers._group_actions[0].choices[name]
        missing = [a.option_strings for a in sub._actions if a.option_strings and not a.help]
        assert not missing, (name, missing)
    serve = parser._subparsers._group_actions[0].choices["serve"]
    groups = {group.title: [a.dest for a in group._group_actions] for group in serve._action_groups}
    ranks = next(dests for title, dests in groups.items() if title.startswith("several ranks"))
    assert {"nproc", "cfg_parallel", "ulysses", "ring", "tp", "shard_weights", "nnodes", "max_restarts"} <= set(ranks)


def test_the_shipped_declaration_is_what_training_writes():
    from diffusiond.models.declared import DEFAULTS_FILE, read_declared
    from diffusiond.tools.demo.train import declaration

    path = Path(default_model())
    shipped = json.loads((path / DEFAULTS_FILE).read_text())
    assert shipped in (declaration("variants"), declaration("grammar"))
    assert read_declared(str(path)).sizes == [(64, 64)]


@pytest.mark.asyncio
async def test_preview_modes(demo):
    """ "fast" previews are the latent -> RGB map at latent resolution; "vae" previews are decoded, full size, and the
    last one is (nearly) the final image."""
    import base64
    import io

    from PIL import Image

    def size(b64: str) -> tuple[int, int]:
        return Image.open(io.BytesIO(base64.b64decode(b64))).size

    for mode, side in (("fast", 16), ("vae", 64)):
        async with aiohttp.ClientSession(timeout=TIMEOUT) as session:
            body = {"prompt": "a large blue square in the center on a yellow background", "seed": 2}
            body |= {"preview_every": 5, "preview": mode}
            async with session.post(f"{demo.base_url}/v1/generations", json=body) as resp:
                events = [(name, data) async for name, data in sse_events(resp)]
        previews = [data for name, data in events if name == "preview"]
        assert previews and all((p["width"], p["height"]) == (side, side) for p in previews), (mode, previews[:1])
        assert all(size(p["b64"]) == (side, side) for p in previews)
    status, _, error = await post(f"{demo.base_url}/v1/generations", {"prompt": "a red circle", "preview": "slow"})
    assert status == 400 and error["error"]["param"] == "preview", error
