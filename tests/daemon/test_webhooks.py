"""Webhooks for jobs (daemon/webhooks.py), on the tiny Wan 2.1 checkpoint: each tenant's endpoint gets OpenAI's
`video.completed` / `video.failed`, signed the Standard Webhooks way (checked by OpenAI's own SDK), at least once
with one event id through a receiver that fails twice, and nothing for a cancelled job or another tenant's."""

from __future__ import annotations

import base64
import hashlib
import http.server
import json
import threading
import time
import urllib.request

import openai
import pytest
from conftest import ServerThread

from diffusiond.daemon.config import ConfigError, ServeConfig, load_config
from diffusiond.daemon.startup import check_serving
from diffusiond.daemon.tenants import Tenants, TenantsError
from diffusiond.daemon.webhooks import WEBHOOKS, event_body, sign

pytestmark = pytest.mark.filterwarnings("ignore:The Sora API:DeprecationWarning")

KEYS = {"alice": "alice-key", "bob": "bob-key"}
SECRETS = {name: "whsec_" + base64.b64encode(hashlib.sha256(name.encode()).digest()).decode() for name in KEYS}
PROMPT = "a red ball rolling on grass"


def sample(text: str, name: str) -> float:
    (line,) = [line for line in text.splitlines() if line.startswith(name + " ")]
    return float(line.split()[-1])


class Receiver:
    """A webhook endpoint per tenant (`/alice`, `/bob`): every try recorded; the first `fail[path]` answered 500."""

    def __init__(self) -> None:
        self.tries: list[tuple[str, dict[str, str], bytes]] = []
        self.fail: dict[str, int] = {}
        self.lock = threading.Lock()
        receiver = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers["Content-Length"]))
                with receiver.lock:
                    receiver.tries.append((self.path, {k.lower(): v for k, v in self.headers.items()}, body))
                    failing = receiver.fail.get(self.path, 0) > 0
                    if failing:
                        receiver.fail[self.path] -= 1
                self.send_response(500 if failing else 204)
                self.send_header("Content-Length", "0")
                self.end_headers()

            def log_message(self, *args) -> None:
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def for_object(self, object_id: str) -> list[tuple[str, dict[str, str], bytes]]:
        with self.lock:
            return [t for t in self.tries if json.loads(t[2])["data"]["id"] == object_id]

    def wait(self, object_id: str, count: int, within: float = 30.0) -> list[tuple[str, dict[str, str], bytes]]:
        deadline = time.monotonic() + within
        while len(tries := self.for_object(object_id)) < count:
            assert time.monotonic() < deadline, f"{object_id}: {len(tries)} tries of {count} within {within}s"
            time.sleep(0.02)
        return tries


@pytest.fixture(scope="module")
def receiver():
    r = Receiver()
    yield r
    r.server.shutdown()
    r.server.server_close()


@pytest.fixture(scope="module")
def hooked(serve, tiny_wan, receiver, tmp_path_factory):
    """A video server whose tenants each have their endpoint; bob may store 1 byte of video (his jobs fail)."""
    path = tmp_path_factory.mktemp("webhooks") / "tenants.toml"
    lines = []
    for name, key in KEYS.items():
        lines += [f"[tenants.{name}]", f'key_sha256 = "{hashlib.sha256(key.encode()).hexdigest()}"']
        lines += [f'webhook_url = "{receiver.url}/{name}"', f'webhook_secret = "{SECRETS[name]}"']
        lines.append("admin = true" if name == "alice" else "max_stored_bytes = 1")  # bob's jobs fail
    path.write_text("\n".join(lines) + "\n")
    server = serve(model=tiny_wan, api_keys_file=str(path), max_pixels=64 * 64)
    server.app[WEBHOOKS].first_delay = 0.05  # the tries' backoff, shortened (1 s, 2 s, ... as shipped)
    return server


def client(server, name: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key=KEYS[name], max_retries=0, timeout=60)


def test_a_receiver_that_fails_twice_gets_the_signed_event_once_per_id(hooked, receiver):
    with client(hooked, "alice") as alice:
        cancelled = alice.videos.create(
            prompt=PROMPT, size="48x32", seconds="1", extra_body={"num_inference_steps": 1000}
        )
        alice.videos.delete(cancelled.id)
        receiver.fail["/alice"] = 2
        job = alice.videos.create_and_poll(
            prompt=PROMPT, size="48x32", extra_body={"num_inference_steps": 2, "num_frames": 5}, poll_interval_ms=20
        )
        assert job.status == "completed", job
    tries = receiver.wait(job.id, 3)
    time.sleep(0.3)  # (a fourth try would come 0.4 s after the third)
    assert len(receiver.for_object(job.id)) == 3
    assert {path for path, _, _ in tries} == {"/alice"}
    assert len({headers["webhook-id"] for _, headers, _ in tries}) == 1  # one event, tried three times
    assert len({body for _, _, body in tries}) == 1
    for _, headers, body in tries:
        openai.OpenAI(api_key="unused").webhooks.verify_signature(body, headers, secret=SECRETS["alice"])
        with pytest.raises(openai.InvalidWebhookSignatureError):  # bob's secret does not sign alice's events
            openai.OpenAI(api_key="unused").webhooks.verify_signature(body, headers, secret=SECRETS["bob"])
    event = json.loads(tries[0][2])
    assert event == {
        "id": tries[0][1]["webhook-id"], "object": "event", "type": "video.completed",
        "created_at": event["created_at"], "data": {"id": job.id},
    }  # fmt: skip
    assert abs(event["created_at"] - time.time()) < 60
    assert receiver.for_object(cancelled.id) == []  # a cancelled job tells nobody
    asked = urllib.request.Request(f"{hooked.base_url}/metrics", headers={"Authorization": f"Bearer {KEYS['alice']}"})
    with urllib.request.urlopen(asked, timeout=10) as answer:
        metrics = answer.read().decode()
    counts = {r: sample(metrics, f'diffusiond_webhooks_total{{result="{r}"}}') for r in ("retried", "delivered")}
    assert counts["retried"] >= 2 and counts["delivered"] >= 1, counts


def test_a_failed_job_tells_its_own_tenant_only(hooked, receiver):
    with client(hooked, "bob") as bob:
        job = bob.videos.create_and_poll(
            prompt=PROMPT, size="48x32", extra_body={"num_inference_steps": 2, "num_frames": 5}, poll_interval_ms=20
        )
    assert job.status == "failed" and job.error.code == "max_stored_bytes", job
    ((path, headers, body),) = receiver.wait(job.id, 1)
    assert path == "/bob"
    assert json.loads(body)["type"] == "video.failed"
    openai.OpenAI(api_key="unused").webhooks.verify_signature(body, headers, secret=SECRETS["bob"])


def test_the_signature_is_standard_webhooks_v1():
    """The spec's own example (standard-webhooks, its test vectors): secret, id, timestamp and payload."""
    secret = "whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw"
    payload = b'{"test": 2432232314}'
    expected = "v1,g0hM9SsE+OTPJTGt/tmIKtSyZlE3uFJELVlNIOLJ1OE="
    assert sign(secret, "msg_p5jXN8AQM9LWM0D4loKWxJek", 1614265330, payload) == expected
    body = event_body("video.completed", "video_1", "evt_1", 7)
    assert json.loads(body) == {"id": "evt_1", "object": "event", "type": "video.completed", "created_at": 7,
                                "data": {"id": "video_1"}}  # fmt: skip


def test_webhook_settings_are_checked_at_start(tmp_path):
    with pytest.raises(ConfigError, match="--webhook-url and --webhook-secret go together"):
        check_serving(ServeConfig(webhook_url="http://127.0.0.1:9/hooks"))
    with pytest.raises(ConfigError, match="webhook_secret"):
        load_config({"webhook_secret": "not-a-secret"}, {})
    with pytest.raises(ConfigError, match="webhook_url"):
        load_config({"webhook_url": "ftp://example.com/x"}, {})
    path = tmp_path / "tenants.toml"
    path.write_text(f'[tenants.a]\nkey_sha256 = "{hashlib.sha256(b"k").hexdigest()}"\nwebhook_url = "http://h/x"\n')
    with pytest.raises(TenantsError, match="webhook_url and webhook_secret go together"):
        Tenants.read(path)


def test_an_event_not_delivered_before_a_restart_is_sent_after_it(tiny_wan, receiver, tmp_path):
    """Under --state-dir the job's record keeps its undelivered event: a restart sends it again with the same id
    (receivers drop repeats by it), and once delivered the record says so: the next restart sends nothing. Red
    without the resend at start (the receiver never got the event)."""
    secret = SECRETS["alice"]
    config = {"model": tiny_wan, "state_dir": str(tmp_path / "state"), "max_pixels": 64 * 64,
              "webhook_url": f"{receiver.url}/restart", "webhook_secret": secret}  # fmt: skip

    def start() -> tuple[ServerThread, str]:
        thread = ServerThread(ServeConfig(port=0, **config), tiny_wan)
        return thread, thread.start().base_url

    receiver.fail["/restart"] = 1000  # down: every try fails
    first, base = start()
    try:
        with openai.OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0, timeout=60) as c:
            job = c.videos.create_and_poll(
                prompt=PROMPT, size="48x32", extra_body={"num_inference_steps": 2, "num_frames": 5}, poll_interval_ms=20
            )
        failed = receiver.wait(job.id, 1)  # tried, refused (the next try is 1 s later)
    finally:
        first.stop()
    receiver.fail["/restart"] = 0  # back up
    second, _ = start()
    try:
        tries = receiver.wait(job.id, len(failed) + 1)
    finally:
        second.stop()
    event_ids = {headers["webhook-id"] for _, headers, _ in tries}
    assert len(event_ids) == 1, event_ids  # the same event, before and after the restart
    _, headers, body = tries[-1]
    openai.OpenAI(api_key="unused").webhooks.verify_signature(body, headers, secret=secret)
    assert json.loads(body)["type"] == "video.completed"
    third, _ = start()
    time.sleep(1.0)
    third.stop()
    assert len(receiver.for_object(job.id)) == len(tries)  # delivered: not sent again
