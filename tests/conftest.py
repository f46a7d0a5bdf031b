"""Shared fixtures: tiny checkpoints built offline once per session, and live servers on loopback sockets.

A live server is a real diffusiond app in a background thread with its own (uv)loop. `serve(**config)` starts one
server per distinct config and keeps it for the session, so the tiny model loads once per variant; `server`,
`auth_server` and `small_server` are the variants the tests use.
"""

from __future__ import annotations

import asyncio
import http.client
import json
import logging
import os
import shutil
import threading
import time
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass
from typing import Any, TypeVar

import msgspec
import pytest
import torch
from aiohttp import web

from diffusiond.daemon.app import create_app
from diffusiond.daemon.config import ServeConfig
from diffusiond.daemon.connections import listen, runner_options
from diffusiond.daemon.state import STATE, ServerState
from diffusiond.models.tiny import build_tiny

# More threads than cores slows torch down by an order of magnitude: under pytest-xdist (`make test` runs two workers)
# each worker takes its share of the cores, and the processes a test starts inherit that share through OMP_NUM_THREADS.
_CORES = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
THREADS = max(1, _CORES // int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1")))
torch.set_num_threads(THREADS)
if "PYTEST_XDIST_WORKER" in os.environ:
    os.environ.setdefault("OMP_NUM_THREADS", str(THREADS))

# Under pytest-xdist each file runs whole on one worker (`--dist loadfile`: module fixtures built once), handed out in
# collection order (`--no-loadscope-reorder` in the Makefile: xdist's default reorder sorts files by their number of
# tests, which put a file of 10 slow tests last): the longest files first, so that the run does not end with one
# worker on a long file while the other waits (measured: the last 4% of a run took 7 of its 27 minutes, the image
# build among them). Ordered by their seconds in a CI run (2026-12-07: 581, 271, 260, 251, 168, 140, ... s).
SLOW_FIRST = (
    "tests/engine/test_spmd.py",
    "tests/spmd/test_serve_ranks.py",
    "tests/test_readme.py",
    "tests/models/test_edits.py",
    "tests/service/test_image.py",
    "tests/models/test_demo.py",
    "tests/models/test_hunyuan15.py",
    "tests/service/test_serve.py",
    "tests/bench/test_priorities.py",
    "tests/daemon/test_edits.py",
    "tests/models/test_edit_caches.py",
    "tests/models/test_lora.py",
    "tests/daemon/test_connections.py",
    "tests/models/test_lazy_weights.py",
    "tests/daemon/test_job_db.py",
    "tests/deploy/test_shared_jobs.py",
    "tests/kernels/test_compile.py",
    "tests/bench/test_compare.py",
    "tests/models/test_hunyuan15_cache.py",
    "tests/deploy/test_haproxy.py",
    "tests/models/test_stepcache.py",
    "tests/bench/",
    "tests/models/test_wan.py",
    "tests/spmd/",
)


def pytest_collection_modifyitems(config, items) -> None:
    if "PYTEST_XDIST_WORKER" not in os.environ:
        return

    def rank(item) -> int:
        return next((i for i, prefix in enumerate(SLOW_FIRST) if item.nodeid.startswith(prefix)), len(SLOW_FIRST))

    items.sort(key=rank)  # stable: within a rank, collection order


@pytest.fixture(autouse=True)
def _restore_logging():
    """The CLI's `main` installs its own root handler on the current (captured) stderr; a later log record from a
    server thread would then write to a closed capture stream."""
    root = logging.getLogger()
    before, level = set(root.handlers), root.level
    yield
    for handler in root.handlers[:]:
        if type(handler) is logging.StreamHandler and handler not in before:
            root.removeHandler(handler)
    root.setLevel(level)


@pytest.fixture(scope="session", autouse=True)
def _no_listener_folders_left():
    """A launcher killed with SIGKILL (tests of healing, of replicas dying, teardowns of process trees) cannot remove
    the folder of its listening socket (daemon/listener.py): those this session made and nobody listens on go at its
    end (a CI run left ten in /tmp before)."""
    import socket
    import tempfile
    from pathlib import Path

    pattern = "diffusiond-listener-*"
    before = set(Path(tempfile.gettempdir()).glob(pattern))
    yield
    for folder in set(Path(tempfile.gettempdir()).glob(pattern)) - before:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as probe:
            try:
                probe.connect(str(folder / "socket"))
            except OSError:  # refused or gone: its launcher is dead
                shutil.rmtree(folder, ignore_errors=True)


@pytest.fixture(scope="session", autouse=True)
def _no_video_folders_left():
    """Daemons killed with SIGKILL leave their temporary video folders; a next start removes them
    (daemon/video_store.py `remove_dead_folders`), and so does the end of the session."""
    import tempfile
    from pathlib import Path

    from diffusiond.daemon.video_store import remove_dead_folders

    yield
    remove_dead_folders(Path(tempfile.gettempdir()))


@pytest.fixture(scope="session")
def postgres():
    """A PostgreSQL server of the session's own (tests/pg.py); `postgres.database()` makes a database per test."""
    from needs import missing
    from pg import Postgres, binaries

    if binaries() is None:
        missing("needs Debian's postgresql (.ci/run installs it)")
    server = Postgres()
    yield server
    server.stop()


@pytest.fixture(scope="session")
def tiny_sd3(tmp_path_factory) -> str:
    return str(build_tiny("sd3", tmp_path_factory.mktemp("tiny") / "sd3"))


def _deep(builder: Callable[[], Any], out: Any) -> str:
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        builder().save_pretrained(out)
    return str(out)


@pytest.fixture(scope="session")
def tiny_sd3_deep(tmp_path_factory) -> str:
    """Tiny SD3 with 5 blocks (DBCache's first, middle and last ones; the last takes the text tokens only)."""
    from diffusiond.models.tiny import images as tiny_images

    return _deep(lambda: tiny_images.build_sd3(num_layers=5), tmp_path_factory.mktemp("tiny") / "sd3-deep")


@pytest.fixture(scope="session")
def tiny_flux_deep(tmp_path_factory) -> str:
    """Tiny FLUX.1 with 2 double-stream and 3 single-stream blocks (a DBCache span crosses from one to the other)."""
    from diffusiond.models.tiny import images as tiny_images

    return _deep(
        lambda: tiny_images.build_flux(num_layers=2, num_single_layers=3), tmp_path_factory.mktemp("tiny") / "flux-deep"
    )


@pytest.fixture(scope="session")
def tiny_qwenimage_deep(tmp_path_factory) -> str:
    """Tiny Qwen-Image with 3 blocks (DBCache's first, middle and last: the text tokens' residual is kept)."""
    from diffusiond.models.tiny import qwen

    return _deep(lambda: qwen.build_qwenimage(num_layers=3), tmp_path_factory.mktemp("tiny") / "qwen-image-deep")


@pytest.fixture(scope="session")
def tiny_qwenimage_other_layout(tmp_path_factory) -> str:
    """A `QwenImagePipeline` checkpoint laid out otherwise than the suite's (as Qwen-Image-2512 is a checkpoint of the
    same class): 3 blocks, other rotary axes, another scheduler shift."""
    from diffusiond.models.tiny import qwen

    def build():
        pipe = qwen.build_qwenimage(num_layers=3, axes_dims_rope=(2, 8, 6))
        pipe.scheduler.register_to_config(base_shift=0.7, max_shift=1.1)
        return pipe

    return _deep(build, tmp_path_factory.mktemp("tiny") / "qwen-image-other")


@pytest.fixture(scope="session")
def tiny_zimage_deep(tmp_path_factory) -> str:
    """Tiny Z-Image with 4 main layers (DBCache's first, middle and last over the joint sequence)."""
    from diffusiond.models.tiny import qwen

    return _deep(lambda: qwen.build_zimage(n_layers=4), tmp_path_factory.mktemp("tiny") / "z-image-deep")


@pytest.fixture(scope="session")
def tiny_sd3_stochastic(tiny_sd3, tmp_path_factory) -> str:
    """Tiny SD3 whose scheduler samples with fresh noise at every step (`stochastic_sampling`, as the bundled
    model)."""
    path = tmp_path_factory.mktemp("tiny") / "sd3-stochastic"
    shutil.copytree(tiny_sd3, path)
    config = path / "scheduler" / "scheduler_config.json"
    config.write_text(json.dumps({**json.loads(config.read_text()), "stochastic_sampling": True}))
    return str(path)


@pytest.fixture(scope="session")
def tiny_flux(tmp_path_factory) -> str:
    return str(build_tiny("flux", tmp_path_factory.mktemp("tiny") / "flux"))


@pytest.fixture(scope="session")
def tiny_sd15(tmp_path_factory) -> str:
    """Stable Diffusion 1.5's layout: no dedicated family (the generic path serves it)."""
    return str(build_tiny("sd15", tmp_path_factory.mktemp("tiny") / "sd15"))


@pytest.fixture(scope="session")
def tiny_stable_audio(tmp_path_factory) -> str:
    """Stable Audio Open's layout: sound alone, on the generic path."""
    return str(build_tiny("stable-audio", tmp_path_factory.mktemp("tiny") / "stable-audio"))


@pytest.fixture(scope="session")
def tiny_flux_modular(tmp_path_factory) -> str:
    """FLUX.1's tiny components as a Modular pipeline (modular_model_index.json)."""
    return str(build_tiny("flux-modular", tmp_path_factory.mktemp("tiny") / "flux-modular"))


@pytest.fixture(scope="session")
def tiny_flux3_klein(tmp_path_factory) -> str:
    """FLUX.3 [klein] as its Modular pipeline (Flux3ModularPipeline): a prompt upsampler before the text encoder."""
    return str(build_tiny("flux3-klein", tmp_path_factory.mktemp("tiny") / "flux3-klein"))


@pytest.fixture(scope="session")
def tiny_kandinsky6(tmp_path_factory) -> str:
    """Kandinsky 6's layout: video with sound, on the generic path."""
    return str(build_tiny("kandinsky6", tmp_path_factory.mktemp("tiny") / "kandinsky6"))


@pytest.fixture(scope="session")
def tiny_sdxl(tmp_path_factory) -> str:
    return str(build_tiny("sdxl", tmp_path_factory.mktemp("tiny") / "sdxl"))


@pytest.fixture(scope="session")
def tiny_flux2klein(tmp_path_factory) -> str:
    return str(build_tiny("flux2-klein", tmp_path_factory.mktemp("tiny") / "flux2-klein"))


@pytest.fixture(scope="session")
def tiny_flux2(tmp_path_factory) -> str:
    return str(build_tiny("flux2", tmp_path_factory.mktemp("tiny") / "flux2"))


@pytest.fixture(scope="session")
def tiny_qwenimage21(tmp_path_factory) -> str:
    return str(build_tiny("qwen-image-21", tmp_path_factory.mktemp("tiny") / "qwen-image-21"))


@pytest.fixture(scope="session")
def tiny_glm_image(tmp_path_factory) -> str:
    return str(build_tiny("glm-image", tmp_path_factory.mktemp("tiny") / "glm-image"))


@pytest.fixture(scope="session")
def tiny_wan(tmp_path_factory) -> str:
    return str(build_tiny("wan", tmp_path_factory.mktemp("tiny") / "wan"))


@pytest.fixture(scope="session")
def tiny_wan_i2v(tmp_path_factory) -> str:
    return str(build_tiny("wan-i2v", tmp_path_factory.mktemp("tiny") / "wan-i2v"))


@pytest.fixture(scope="session")
def tiny_qwenimage_edit(tmp_path_factory) -> str:
    return str(build_tiny("qwen-image-edit", tmp_path_factory.mktemp("tiny") / "qwen-image-edit"))


@pytest.fixture(scope="session")
def tiny_qwenimage_edit_plus(tmp_path_factory) -> str:
    return str(build_tiny("qwen-image-edit-plus", tmp_path_factory.mktemp("tiny") / "qwen-image-edit-plus"))


@pytest.fixture(scope="session")
def tiny_qwenimage_edit_2511(tmp_path_factory) -> str:
    """Qwen-Image-Edit-2511's layout: the image tokens modulated at timestep 0 (`zero_cond_t`)."""
    import torch

    from diffusiond.models.tiny.qwen import build_qwenimage_edit_plus

    out = tmp_path_factory.mktemp("tiny") / "qwen-image-edit-2511"
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        build_qwenimage_edit_plus(zero_cond_t=True).save_pretrained(out)
    return str(out)


@pytest.fixture(scope="session")
def tiny_wan22(tmp_path_factory) -> str:
    return str(build_tiny("wan22", tmp_path_factory.mktemp("tiny") / "wan22"))


@pytest.fixture(scope="session")
def tiny_wan22_deep(tmp_path_factory) -> str:
    """Tiny Wan 2.2 A14B with 4 blocks per expert (DBCache's first, middle and last ones)."""
    from diffusiond.models.tiny.wan import build_wan

    return _deep(lambda: build_wan(two_experts=True, layers=4), tmp_path_factory.mktemp("tiny") / "wan22-deep")


@pytest.fixture(scope="session")
def tiny_wan22_i2v(tmp_path_factory) -> str:
    return str(build_tiny("wan22-i2v", tmp_path_factory.mktemp("tiny") / "wan22-i2v"))


@pytest.fixture(scope="session")
def tiny_wan22_ti2v(tmp_path_factory) -> str:
    return str(build_tiny("wan22-ti2v", tmp_path_factory.mktemp("tiny") / "wan22-ti2v"))


@pytest.fixture(scope="session")
def tiny_ltx2(tmp_path_factory) -> str:
    return str(build_tiny("ltx2", tmp_path_factory.mktemp("tiny") / "ltx2"))


@pytest.fixture(scope="session")
def tiny_ltx2_i2v(tmp_path_factory) -> str:
    return str(build_tiny("ltx2-i2v", tmp_path_factory.mktemp("tiny") / "ltx2-i2v"))


@pytest.fixture(scope="session")
def tiny_hunyuan15(tmp_path_factory) -> str:
    return str(build_tiny("hunyuan-video-15", tmp_path_factory.mktemp("tiny") / "hunyuan-video-15"))


@pytest.fixture(scope="session")
def tiny_hunyuan15_i2v(tmp_path_factory) -> str:
    return str(build_tiny("hunyuan-video-15-i2v", tmp_path_factory.mktemp("tiny") / "hunyuan-video-15-i2v"))


@pytest.fixture(scope="session")
def tiny_wan_i2v_no_image_attention(tmp_path_factory) -> str:
    """Wan 2.2 I2V's layout (one expert here): no image cross-attention, no image encoder."""
    import torch

    from diffusiond.models.tiny.wan import build_wan_i2v

    out = tmp_path_factory.mktemp("tiny") / "wan-i2v-latents-only"
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        build_wan_i2v(image_context=False).save_pretrained(out)
    return str(out)


@pytest.fixture(scope="session")
def tiny_wan_i2v_no_image_projections(tmp_path_factory) -> str:
    """Wan 2.1 I2V's layout with an image embedding (`image_dim`) but no image key/value projections
    (`added_kv_proj_dim` null): diffusers' WanImageToVideoPipeline runs it; the wan-i2v family does not read it."""
    from diffusiond.models.tiny.wan import build_wan_i2v

    return _deep(lambda: build_wan_i2v(image_projections=False), tmp_path_factory.mktemp("tiny") / "wan-i2v-no-kv")


@pytest.fixture(scope="session")
def tiny_kontext(tmp_path_factory) -> str:
    return str(build_tiny("flux-kontext", tmp_path_factory.mktemp("tiny") / "flux-kontext"))


@pytest.fixture(scope="session")
def tiny_sd35(tmp_path_factory) -> str:
    return str(build_tiny("sd35", tmp_path_factory.mktemp("tiny") / "sd35"))


@pytest.fixture(scope="session")
def tiny_zimage(tmp_path_factory) -> str:
    return str(build_tiny("z-image", tmp_path_factory.mktemp("tiny") / "z-image"))


@pytest.fixture(scope="session")
def tiny_ovis(tmp_path_factory) -> str:
    return str(build_tiny("ovis-image", tmp_path_factory.mktemp("tiny") / "ovis-image"))


@pytest.fixture(scope="session")
def tiny_longcat(tmp_path_factory) -> str:
    return str(build_tiny("longcat-image", tmp_path_factory.mktemp("tiny") / "longcat-image"))


@pytest.fixture(scope="session")
def tiny_longcat_edit(tmp_path_factory) -> str:
    return str(build_tiny("longcat-image-edit", tmp_path_factory.mktemp("tiny") / "longcat-image-edit"))


@pytest.fixture(scope="session")
def tiny_qwenimage_layered(tmp_path_factory) -> str:
    return str(build_tiny("qwen-image-layered", tmp_path_factory.mktemp("tiny") / "qwen-image-layered"))


@pytest.fixture(scope="session")
def tiny_qwenimage(tmp_path_factory) -> str:
    return str(build_tiny("qwen-image", tmp_path_factory.mktemp("tiny") / "qwen-image"))


try:
    import uvloop
except ImportError:  # pragma: no cover - uvloop is optional off Linux/macOS
    uvloop = None

T = TypeVar("T")

READY_TIMEOUT_S = 60.0
STOP_TIMEOUT_S = 30.0
API_KEY = "secret"


@dataclass
class LiveServer:
    base_url: str
    port: int
    app: web.Application
    loop: asyncio.AbstractEventLoop
    config: ServeConfig

    @property
    def state(self) -> ServerState:
        return self.app[STATE]

    def call(self, fn: Callable[[], T], timeout: float = 10.0) -> T:
        """Run `fn` on the server's event loop (where request state is mutated) and return its result."""

        async def run() -> T:
            return fn()

        return asyncio.run_coroutine_threadsafe(run(), self.loop).result(timeout)

    def run(self, coro_fn: Callable[[], Awaitable[T]], timeout: float = 30.0) -> T:
        """Run a coroutine on the server's event loop (e.g. a request straight to `state.engine`)."""

        async def run() -> T:
            return await coro_fn()

        return asyncio.run_coroutine_threadsafe(run(), self.loop).result(timeout)

    def record(self, request_id: str) -> dict | None:
        """A copy of the status record of a request, read on the server loop."""

        def read() -> dict | None:
            rec = self.state.records.get(request_id)
            return None if rec is None else dict(vars(rec))

        return self.call(read)

    def num_in_flight(self) -> int:
        return self.call(lambda: self.state.engine.num_in_flight)

    def wait_until(self, predicate: Callable[[], bool], timeout: float = 15.0, what: str = "condition") -> None:
        deadline = time.monotonic() + timeout
        while not predicate():
            if time.monotonic() > deadline:
                raise AssertionError(f"timed out after {timeout}s waiting for {what}")
            time.sleep(0.02)

    def wait_idle(self, timeout: float = 15.0) -> None:
        """No request in flight and no per-request state left in the executor."""

        def idle() -> bool:
            engine = self.state.engine
            return self.num_in_flight() == 0 and not engine.executor.states and not engine.scheduler.has_work()

        self.wait_until(idle, timeout, "the engine to become idle")


class ServerThread:
    def __init__(self, config: ServeConfig, model: str) -> None:
        self.config = config
        self.model = model
        self.loop: asyncio.AbstractEventLoop | None = None
        self.runner: web.AppRunner | None = None
        self.app: web.Application | None = None
        self.port: int | None = None
        self.error: BaseException | None = None
        self._started = threading.Event()
        self._thread = threading.Thread(target=self._main, name=f"diffusiond-test-server-{id(self)}", daemon=True)

    def start(self) -> LiveServer:
        self._thread.start()
        if not self._started.wait(READY_TIMEOUT_S):
            raise RuntimeError("server thread did not start")
        if self.error is not None:
            raise RuntimeError("server failed to start") from self.error
        assert self.app is not None and self.loop is not None and self.port is not None
        server = LiveServer(f"http://127.0.0.1:{self.port}", self.port, self.app, self.loop, self.config)
        self._wait_ready()
        return server

    def _wait_ready(self) -> None:
        deadline = time.monotonic() + READY_TIMEOUT_S
        last = None
        while time.monotonic() < deadline:
            conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=5)
            try:
                conn.request("GET", "/ready")
                resp = conn.getresponse()
                body = resp.read()
                last = (resp.status, body)
                if resp.status == 200:
                    return
                if resp.status == 503 and json.loads(body).get("status") == "failed":
                    raise RuntimeError(f"model failed to load: {body!r}")
            finally:
                conn.close()
            time.sleep(0.05)
        raise RuntimeError(f"server not ready after {READY_TIMEOUT_S}s; last /ready answer {last!r}")

    def _main(self) -> None:
        loop = uvloop.new_event_loop() if uvloop is not None else asyncio.new_event_loop()
        self.loop = loop
        try:
            try:
                loop.run_until_complete(self._setup())
            except BaseException as exc:
                self.error = exc
                return
            finally:
                self._started.set()
            loop.run_forever()
            loop.run_until_complete(self._teardown())
        finally:
            loop.close()

    async def _setup(self) -> None:
        self.app = create_app(self.config)  # its own loader: config.model, as `diffusiond serve` loads
        self.runner = web.AppRunner(
            self.app, handler_cancellation=True, shutdown_timeout=5.0, **runner_options(self.config)
        )
        await self.runner.setup()
        await listen(self.runner, msgspec.structs.replace(self.config, host="127.0.0.1", port=0))
        self.port = self.runner.addresses[0][1]

    async def _teardown(self) -> None:
        assert self.runner is not None
        await self.runner.cleanup()
        loop = asyncio.get_running_loop()
        await loop.shutdown_asyncgens()
        await loop.shutdown_default_executor()

    def stop(self) -> None:
        if self.loop is not None and self._thread.is_alive() and not self.loop.is_closed():
            self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(STOP_TIMEOUT_S)
        if self._thread.is_alive():
            raise RuntimeError("server thread did not stop")


@pytest.fixture(scope="session")
def serve(tiny_sd3) -> Iterator[Callable[..., LiveServer]]:
    """serve(**ServeConfig fields) -> a live server for that config (the tiny SD3 checkpoint unless `model` says
    otherwise), started once per session."""
    threads: dict[tuple, ServerThread] = {}
    servers: dict[tuple, LiveServer] = {}

    def get(**overrides: Any) -> LiveServer:
        key = tuple(sorted(overrides.items()))
        if key not in servers:
            # Tests run long requests (1000 steps) to act on them mid-flight.
            config = {"model": tiny_sd3, "max_steps": 1000, **overrides}
            thread = ServerThread(ServeConfig(port=0, **config), config["model"])
            threads[key] = thread
            try:
                servers[key] = thread.start()
            except BaseException:
                thread.stop()
                del threads[key]
                raise
        return servers[key]

    yield get
    errors = []
    for thread in threads.values():
        try:
            thread.stop()
        except Exception as exc:
            errors.append(exc)
    if errors:
        raise errors[0]


@pytest.fixture(scope="session")
def server(serve) -> LiveServer:
    return serve()


@pytest.fixture(scope="session")
def auth_server(serve) -> LiveServer:
    return serve(api_key=API_KEY)


@pytest.fixture(scope="session")
def small_server(serve) -> LiveServer:
    return serve(max_batch=1, max_queue=1)


@pytest.fixture(scope="session")
def model_id(server) -> str:
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=10)
    try:
        conn.request("GET", "/v1/models")
        resp = conn.getresponse()
        body = json.loads(resp.read())
    finally:
        conn.close()
    assert resp.status == 200, body
    assert body["object"] == "list" and len(body["data"]) == 1, body
    return body["data"][0]["id"]
