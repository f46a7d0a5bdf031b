"""The exact result cache (`--result-cache-bytes`, engine/result_cache.py; issue 34): a request identical to a
finished one, its seed chosen by its client, is answered with the first's image without a step (the engine's step
counter does not move), marked as cached; another seed, or no seed, runs. Broken on purpose once: with the seed
left out of the key, the request with another seed was answered from the cache (red)."""

from __future__ import annotations

import base64
import json
import re
import urllib.request

import pytest

BODY = {"prompt": "a red circle", "width": 64, "height": 64, "num_inference_steps": 3, "seed": 11}


@pytest.fixture(scope="module")
def cached(serve):
    return serve(result_cache_bytes=16 << 20)


def post(base: str, path: str, body: dict) -> tuple[bytes, dict]:
    request = urllib.request.Request(
        f"{base}{path}", data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(request, timeout=60) as resp:
        return resp.read(), dict(resp.headers)


def completed(base: str, body: dict) -> dict:
    raw, _ = post(base, "/v1/generations", body)
    events = [block for block in raw.decode().split("\n\n") if block.startswith("event: completed")]
    assert len(events) == 1, raw[-500:]
    (data,) = [line for line in events[0].splitlines() if line.startswith("data: ")]
    return json.loads(data.removeprefix("data: "))


def metric(base: str, name: str) -> float:
    with urllib.request.urlopen(f"{base}/metrics", timeout=10) as resp:
        text = resp.read().decode()
    match = re.search(rf"^{re.escape(name)} (\S+)$", text, re.M)
    return float(match.group(1)) if match else 0.0


def test_an_identical_request_is_answered_from_the_cache(cached):
    base = cached.base_url
    first = completed(base, BODY)
    steps = metric(base, "diffusiond_steps_total")
    again = completed(base, BODY)
    assert again.get("cached") is True and "cached" not in first
    assert again["images"][0]["b64"] == first["images"][0]["b64"] and again["seed"] == first["seed"]
    assert metric(base, "diffusiond_steps_total") == steps  # no step ran for it
    assert metric(base, 'diffusiond_result_cache_lookups_total{result="hit"}') >= 1

    # Another seed, or none: it runs.
    other = completed(base, {**BODY, "seed": 12})
    assert "cached" not in other and other["images"][0]["b64"] != first["images"][0]["b64"]
    unseeded = {k: v for k, v in BODY.items() if k != "seed"}
    for _ in range(2):
        assert "cached" not in completed(base, unseeded)
    assert metric(base, "diffusiond_steps_total") == steps + 3 * 3

    # The Images API: the same cache; the answer says so in a header.
    image = {"prompt": "a blue square", "size": "64x64", "num_inference_steps": 2, "seed": 5}
    one, _ = post(base, "/v1/images/generations", image)
    two, headers = post(base, "/v1/images/generations", image)
    assert headers.get("X-Diffusiond-Cache") == "hit"
    decoded = [base64.b64decode(json.loads(r)["data"][0]["b64_json"]) for r in (one, two)]
    assert decoded[0] == decoded[1]


def test_every_form_of_a_cached_result_says_so(cached, serve, tiny_wan):
    """A cached answer by URL, and a cached clip of a video model, are marked as the base64 image is (before, a
    video's completed event never said `cached`: bench.priorities on a tiny Wan caught it)."""
    body = {**BODY, "prompt": "a green square", "response_format": "url"}
    first, again = completed(cached.base_url, body), completed(cached.base_url, body)
    assert again.get("cached") is True and "cached" not in first and set(again["images"][0]) == {"format", "url"}
    video = serve(model=tiny_wan, max_pixels=64 * 64, result_cache_bytes=16 << 20)
    clip = {"prompt": "a red circle", "width": 48, "height": 32, "num_frames": 5, "num_inference_steps": 2, "seed": 3}
    first, again = completed(video.base_url, clip), completed(video.base_url, clip)
    assert again.get("cached") is True and "cached" not in first
    assert again["video"]["num_frames"] == first["video"]["num_frames"] == 5


def test_one_tenant_s_results_never_answer_another(serve, tmp_path_factory):
    """A hit takes milliseconds and a miss a whole generation: with one cache for all, bob could time a request
    to learn whether alice had asked for it. Each tenant's results answer its own requests only (red with the
    tenant left out of the key: bob's first request was a hit)."""
    import hashlib

    keys = tmp_path_factory.mktemp("cache-tenants") / "keys.toml"
    keys.write_text(
        "".join(f'[tenants.{n}]\nkey_sha256 = "{hashlib.sha256(n.encode()).hexdigest()}"\n' for n in ("alice", "bob"))
    )
    base = serve(result_cache_bytes=16 << 20, api_keys_file=str(keys)).base_url
    image = {"prompt": "a green triangle", "size": "64x64", "num_inference_steps": 2, "seed": 7}

    def ask(name: str) -> tuple[bytes, str | None]:
        request = urllib.request.Request(
            f"{base}/v1/images/generations", data=json.dumps(image).encode(),
            headers={"Content-Type": "application/json", "Authorization": f"Bearer {name}"},
        )  # fmt: skip
        with urllib.request.urlopen(request, timeout=60) as resp:
            return base64.b64decode(json.loads(resp.read())["data"][0]["b64_json"]), resp.headers.get(
                "X-Diffusiond-Cache"
            )

    alice, hit = ask("alice")
    assert hit is None
    assert ask("alice") == (alice, "hit")
    bob, hit = ask("bob")
    assert hit is None and bob == alice  # computed again for bob: the same image, not alice's kept one
    assert ask("bob") == (bob, "hit")
