"""Images by URL (`response_format: "url"`, daemon/files.py): the official client gets a URL that serves the PNG
without the API key (the same bytes `b64_json` gives for the same seed); a URL with another id, another expiry or a
signature of another key serves nothing, nor one that expired."""

from __future__ import annotations

import base64
import json
import logging
import time
import urllib.error
import urllib.request

import openai
import pytest

from diffusiond.daemon.files import FileStore, write_file

API_KEY = "secret"


def fetch(url: str) -> tuple[int, bytes, str]:
    try:
        with urllib.request.urlopen(url, timeout=30) as resp:
            return resp.status, resp.read(), resp.headers["Content-Type"]
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read(), exc.headers["Content-Type"]


def test_the_openai_client_gets_a_url_that_serves_the_png(auth_server, caplog):
    caplog.set_level(logging.INFO, logger="aiohttp.access")
    with openai.OpenAI(base_url=f"{auth_server.base_url}/v1", api_key=API_KEY, max_retries=0, timeout=60) as client:
        model = client.models.list().data[0].id
        args = {"model": model, "prompt": "a red circle", "size": "64x64", "extra_body": {"num_inference_steps": 2,
                "seed": 5}}  # fmt: skip
        by_url = client.images.generate(**args, response_format="url")
        by_b64 = client.images.generate(**args, response_format="b64_json")
    url = by_url.data[0].url
    assert url.startswith(f"{auth_server.base_url}/v1/files/file_") and by_url.data[0].b64_json is None
    status, data, media = fetch(url)  # no Authorization header
    assert (status, media) == (200, "image/png") and data == base64.b64decode(by_b64.data[0].b64_json)

    path, _, query = url.partition("?")
    fields = dict(pair.split("=") for pair in query.split("&"))
    signature, expires = fields["signature"], fields["expires"]
    forged = [
        f"{path}?expires={expires}&signature={signature[:-1]}{'0' if signature[-1] != '0' else '1'}",
        f"{path}?expires={int(expires) + 3600}&signature={signature}",  # a later expiry, the same signature
        f"{path.replace('file_', 'file_0', 1)[:-1]}?expires={expires}&signature={signature}",
        f"{path}?expires={expires}",
        path,
    ]
    for bad in forged:
        status, body, _ = fetch(bad)
        assert status == 404, (bad, status, body[:200])
    # The access log never holds a signature (whoever reads the log could fetch the file until it expires).
    time.sleep(0.05)  # the server thread's last records
    lines = [r.getMessage() for r in caplog.records if r.name == "aiohttp.access"]
    assert any("/v1/files/file_" in line and "signature=REDACTED" in line for line in lines), lines[-3:]
    assert not any(signature in line or signature[:-1] in line for line in lines), lines


def sse(body: bytes) -> list[tuple[str, dict]]:
    events = []
    for block in body.decode().split("\n\n"):
        lines = dict(line.split(": ", 1) for line in block.splitlines() if ": " in line and not line.startswith(":"))
        if "event" in lines:
            events.append((lines["event"], json.loads(lines["data"])))
    return events


def test_a_native_stream_completes_with_a_url_when_asked(auth_server):
    """`response_format: "url"` on `POST /v1/generations`: the completed event names the image by its signed URL,
    and carries no base64; the URL serves the same PNG a base64 answer carries."""

    def generate(**extra) -> dict:
        body = {"prompt": "a red circle", "width": 64, "height": 64, "num_inference_steps": 2, "seed": 5, **extra}
        request = urllib.request.Request(
            f"{auth_server.base_url}/v1/generations",
            data=json.dumps(body).encode(),
            headers={"Content-Type": "application/json", "Authorization": f"Bearer {API_KEY}"},
        )
        with urllib.request.urlopen(request, timeout=60) as resp:
            events = sse(resp.read())
        assert events[-1][0] == "completed", events[-1]
        return events[-1][1]

    by_url, by_b64 = generate(response_format="url"), generate()
    (image,) = by_url["images"]
    assert set(image) == {"format", "url"} and image["url"].startswith(f"{auth_server.base_url}/v1/files/file_")
    status, data, media = fetch(image["url"])
    assert (status, media) == (200, "image/png") and data == base64.b64decode(by_b64["images"][0]["b64"])


def test_a_url_expires_with_its_file(tmp_path):
    now = [1000.0]
    store = FileStore(tmp_path, max_bytes=100, ttl=60, secret=b"k", clock=lambda: now[0])
    entry = store.reserve("alice", "png", 10)
    write_file(tmp_path, entry, b"x" * 10)
    query = store.url("http://h", entry).split("?")[1]
    fields = dict(pair.split("=") for pair in query.split("&"))
    assert store.lookup(entry.id, fields["expires"], fields["signature"]) is entry
    other = FileStore(tmp_path / "other", max_bytes=100, ttl=60, secret=b"another key", clock=lambda: now[0])
    assert other.signature(entry.id, entry.expires_at) != fields["signature"]
    now[0] += 60
    assert store.lookup(entry.id, fields["expires"], fields["signature"]) is None
    assert not (tmp_path / entry.name).exists() and store.used == 0


def test_room_is_made_by_forgetting_the_oldest(tmp_path):
    store = FileStore(tmp_path, max_bytes=25, ttl=60, secret=b"k")
    first, second = store.reserve("a", "png", 10), store.reserve("a", "png", 10)
    store.reserve("a", "png", 10)
    assert first.id not in store.files and second.id in store.files and store.used == 20
    with pytest.raises(ValueError, match="the image is 30 bytes"):
        store.reserve("a", "png", 30)


def test_one_tenant_s_images_push_out_its_own_first(tmp_path):
    """The store's room is shared: past it, the tenant holding the most forgets its own oldest, so bob's stream of
    images leaves alice's URL working (the globally oldest went first: alice's, red)."""
    store = FileStore(tmp_path, max_bytes=40, ttl=60, secret=b"k")
    alice = store.reserve("alice", "png", 10)
    bobs = [store.reserve("bob", "png", 10) for _ in range(6)]
    assert alice.id in store.files and store.used == 40
    assert [b.id in store.files for b in bobs] == [False, False, False, True, True, True]
    # Her next one: bob still holds more (30 against her 20 with it), his oldest goes.
    store.reserve("alice", "png", 10)
    assert alice.id in store.files and sum(f.owner == "bob" for f in store.files.values()) == 2
    # And the next: now she would hold the most (30 against 20), her own oldest goes, none of bob's.
    store.reserve("alice", "png", 10)
    assert alice.id not in store.files and sum(f.owner == "bob" for f in store.files.values()) == 2


@pytest.mark.filterwarnings("ignore:The Sora API:DeprecationWarning")  # as tests/daemon/test_videos.py
def test_a_completed_video_has_a_url_too(serve, tiny_wan):
    server = serve(model=tiny_wan, api_key=API_KEY, max_pixels=64 * 64)  # test_videos.py's server
    with openai.OpenAI(base_url=f"{server.base_url}/v1", api_key=API_KEY, max_retries=0, timeout=60) as client:
        job = client.videos.create_and_poll(
            prompt="a clip by url", size="64x64", extra_body={"num_frames": 5, "num_inference_steps": 1, "seed": 2}
        )
        assert job.status == "completed"
        content = client.videos.download_content(job.id).read()
        listed = client.videos.retrieve(job.id).model_extra["url"]
    status, data, media = fetch(listed)  # no Authorization header
    assert (status, media, data) == (200, "video/mp4", content)
    path, _, query = listed.partition("?")
    assert fetch(f"{path}?{query.replace('signature=', 'signature=0')}")[0] == 404
    assert fetch(path.replace("/v1/files/", "/v1/files/x") + "?" + query)[0] == 404

    # The native stream of a video model, asked for a URL: its completed event names the clip, with no base64.
    body = {"prompt": "a clip by url", "width": 64, "height": 64, "num_frames": 5, "num_inference_steps": 1,
            "seed": 2, "response_format": "url"}  # fmt: skip
    request = urllib.request.Request(
        f"{server.base_url}/v1/generations",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json", "Authorization": f"Bearer {API_KEY}"},
    )
    with urllib.request.urlopen(request, timeout=60) as resp:
        name, completed = sse(resp.read())[-1]
    video = completed["video"]
    assert name == "completed" and "b64" not in video and video["format"] == "mp4", completed
    status, data, media = fetch(video["url"])
    assert (status, media) == (200, "video/mp4") and data[4:8] == b"ftyp"


def test_replicas_sharing_a_folder_serve_each_others_images(tmp_path):
    """`--state-url` replicas keep their images in sibling folders; one signed URL is valid on each (one secret),
    and a replica that did not make the image finds it by its id. A URL of another secret, or changed, is not."""
    one = FileStore(tmp_path / "files" / "replica1", max_bytes=100, ttl=60, secret=b"shared")
    two = FileStore(tmp_path / "files" / "replica2", max_bytes=100, ttl=60, secret=b"shared")
    entry = one.reserve("alice", "png", 3)
    write_file(one.directory, entry, b"png")
    expires, signature = str(entry.expires_at), one.signature(entry.id, entry.expires_at)
    assert two.lookup(entry.id, expires, signature) is None  # not its own
    assert two.elsewhere(entry.id, expires, signature) == (one.directory / entry.name, "png")
    assert two.elsewhere(entry.id, expires, "0" * 64) is None
    assert two.elsewhere(entry.id, str(entry.expires_at + 1), signature) is None
    stranger = FileStore(tmp_path / "files" / "replica3", max_bytes=100, ttl=60, secret=b"its own")
    assert stranger.elsewhere(entry.id, expires, signature) is None
    # A replica that restarts removes its own stale images only.
    FileStore(tmp_path / "files" / "replica2", max_bytes=100, ttl=60, secret=b"shared")
    assert (one.directory / entry.name).is_file()


def test_a_url_with_non_ascii_parts_is_refused_not_an_error(tmp_path):
    """Found by schemathesis: a non-ASCII signature made hmac.compare_digest raise (a 500), and "²" passes
    str.isdigit but not int()."""
    store = FileStore(tmp_path, max_bytes=100, ttl=60, secret=b"k")
    entry = store.reserve("alice", "png", 3)
    good = store.signature(entry.id, entry.expires_at)
    assert store.valid(entry.id, str(entry.expires_at), good)
    assert not store.valid(entry.id, str(entry.expires_at), good[:-1] + "ñ")
    assert not store.valid(entry.id, "²", good)
    assert store.elsewhere("file_ñ", str(entry.expires_at), good) is None
