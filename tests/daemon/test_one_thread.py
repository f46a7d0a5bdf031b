"""One thread owns torch: in a served daemon, loading, warm-up, every step, preview and decode run on the engine's
step thread, and no other thread calls the model. (Measured here: once a second Python thread has run torch ops, each
forward of a small model runs ~2x slower; FACTS.md.)

Every torch-running method of the adapter class is wrapped to record the calling thread before the daemon loads its
model through its own path. Loading through `asyncio.to_thread`, as the daemon once did, fails this test.
"""

from __future__ import annotations

import json
import threading
import urllib.request

from diffusiond.models.families.sd3 import SD3Adapter

# The adapter verbs that run torch. `resolve` and `batch_key` run on the event loop and must stay pure Python.
TORCH_METHODS = ("prepare", "denoise", "step", "predicted_x0", "decode", "preview")


def test_only_the_step_thread_runs_the_model(serve, monkeypatch):
    calls: dict[str, set[str]] = {}

    def record(name: str) -> None:
        calls.setdefault(name, set()).add(threading.current_thread().name)

    real_load = SD3Adapter.from_pretrained.__func__

    def from_pretrained(cls, *args, **kwargs):
        record("from_pretrained")
        return real_load(cls, *args, **kwargs)

    monkeypatch.setattr(SD3Adapter, "from_pretrained", classmethod(from_pretrained))
    for name in TORCH_METHODS:
        real = getattr(SD3Adapter, name)

        def wrapper(self, *args, _real=real, _name=name, **kwargs):
            record(_name)
            return _real(self, *args, **kwargs)

        monkeypatch.setattr(SD3Adapter, name, wrapper)

    server = serve(max_queue=7)  # a server of its own, loaded after the wrappers are in place
    body = {"prompt": "a red circle", "width": 64, "height": 64, "num_inference_steps": 4, "seed": 3}
    body |= {"preview_every": 1, "latents": True}
    request = urllib.request.Request(
        f"{server.base_url}/v1/generations",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(request, timeout=60) as resp:
        events = [line for line in resp.read().decode().splitlines() if line.startswith("event:")]
    assert events[-1] == "event: completed"
    assert set(calls) == {"from_pretrained", *TORCH_METHODS}, calls
    assert all(threads == {"diffusiond-step"} for threads in calls.values()), calls
