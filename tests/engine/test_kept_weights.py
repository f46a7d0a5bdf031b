"""Weights kept in shared memory for a group's next attempt (models/loading/kept_weights.py): a heal maps each rank's
share of the denoiser from the file the previous attempt wrote, instead of reading the checkpoint and sharding it again.

Both attempts give one rank's images (tolerance as tests/engine/test_spmd.py). The second attempt's parameters are
checked to be mappings of the kept files (/proc/self/maps), every one of them, and counted as restored: a keeper that
silently read the checkpoint again would leave them private (broken on purpose: `restoring = False` in
models/loading/setup.py, and the second attempt's `restored` was 0: red)."""

import json
import os
from pathlib import Path

import numpy as np
import pytest
import torch
from spmd_requests import FIXTURES, REQUESTS
from spmd_runs import one_rank, two_ranks

from diffusiond.models.loading import kept_weights
from diffusiond.models.loading.kept_weights import KeptWeights, KeptWeightsError

TOLERANCE = 1e-4


@pytest.mark.parametrize(("cfg", "tp", "files"), [(1, 2, 2), (2, 1, 1)])
def test_a_second_attempt_maps_what_the_first_kept(cfg, tp, files, request, tmp_path):
    """--tp 2: each rank keeps its own shard (two files); --cfg-parallel 2: both ranks hold the same weights and
    share one file (the node holds one copy)."""
    model = request.getfixturevalue(FIXTURES["flux"])
    requests = REQUESTS["flux"][:3]
    expected = one_rank(model, requests)
    kept = tmp_path / "kept"
    kept.mkdir()
    for attempt in (1, 2):
        out = tmp_path / f"attempt{attempt}"
        out.mkdir()
        got, _ = two_ranks(model, out, cfg, 1, requests, tp=tp, kept=kept)
        for params, a, b in zip(requests, expected, got, strict=True):
            diff = float(np.abs(a - b).max())
            print(f"attempt {attempt}, cfg {cfg} tp {tp} {params.prompt!r}: max abs diff {diff:.2e}")
            assert diff <= TOLERANCE
        assert len(list(kept.glob("*.json"))) == files
        for r in range(2):
            report = json.loads((out / f"kept{r}.json").read_text())
            print(f"attempt {attempt} rank {r}: {report}")
            # Both attempts run on the kept pages (the first remaps its private copy once written).
            assert report["held"] > 0 and report["mapped"] == report["held"], report
            assert report["restored"] == (report["params"] if attempt == 2 else 0), report


def test_a_kept_file_that_does_not_fit_is_refused_and_removed(tmp_path):
    keeper = KeptWeights(tmp_path, "k")
    module = torch.nn.Linear(4, 3)
    assert keeper.store(module) and keeper.ready()
    other = torch.nn.Linear(4, 5, device="meta")
    with pytest.raises(KeptWeightsError, match=r"weight is kept as float32 \[3, 4\], the model has float32 \[5, 4\]"):
        keeper.restore(other, torch.device("cpu"))
    assert not keeper.ready() and not keeper.data.exists()


def test_the_store_maps_the_module_over_the_file_and_restore_gives_it_back(tmp_path):
    module = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2))
    expected = {k: v.clone() for k, v in module.state_dict().items()}
    weight = module[0].weight
    assert KeptWeights(tmp_path, "k").store(module)
    assert module[0].weight is weight  # the same tensor objects, over the file's pages
    module[0].weight.data.mul_(0)  # copy-on-write: the file keeps the stored values
    empty = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2)).to("meta")
    keeper = KeptWeights(tmp_path, "k")
    assert keeper.restore(empty, torch.device("cpu")) == 4 == keeper.restored
    for key, value in expected.items():
        assert torch.equal(empty.state_dict()[key], value), key


def test_no_room_keeps_nothing(tmp_path, monkeypatch, caplog):
    real = os.statvfs(tmp_path)
    small = os.statvfs_result((*real[:4], 0, *real[5:]))  # f_bavail = 0
    monkeypatch.setattr(kept_weights.os, "statvfs", lambda _: small)
    module = torch.nn.Linear(4, 3)
    assert not KeptWeights(tmp_path, "k").store(module)
    assert "--shm-size" in caplog.text and not list(tmp_path.glob("*.json"))


def test_the_launcher_s_folder_and_those_of_dead_launchers(tmp_path):
    dead = tmp_path / f"{kept_weights.PREFIX}999999999-abcd"
    alive = tmp_path / f"{kept_weights.PREFIX}{os.getppid()}-abcd"
    dead.mkdir()
    alive.mkdir()
    folder = kept_weights.make_folder(str(tmp_path))
    assert folder is not None and folder.is_dir() and folder.name.startswith(f"{kept_weights.PREFIX}{os.getpid()}-")
    assert not dead.exists() and alive.exists()
    assert kept_weights.make_folder(str(tmp_path / "missing")) is None


def test_dropping_a_checkpoint_s_pages_leaves_its_views_readable(tmp_path):
    """What the writer does after keeping weights that diffusers had mapped from the checkpoint: the file's pages
    leave the resident set (RssFile falls by the file's size) and a tensor still viewing them reads the same."""
    from diffusiond.kernels.host import drop_file_pages

    def rss_file() -> int:
        status = dict(line.split(":", 1) for line in Path("/proc/self/status").read_text().splitlines())
        return int(status["RssFile"].split()[0]) * 1024

    path = tmp_path / "weights" / "file.bin"
    path.parent.mkdir()
    values = torch.arange(64 << 20, dtype=torch.uint8)  # 64 MiB
    path.write_bytes(values.numpy().tobytes())
    view = torch.empty(0, dtype=torch.uint8).set_(torch.UntypedStorage.from_file(str(path), False, values.numel()))
    assert torch.equal(view, values)  # every page touched
    before = rss_file()
    assert drop_file_pages(str(tmp_path / "weights")) >= values.numel()
    dropped = before - rss_file()
    print(f"RssFile fell by {dropped / 2**20:.1f} MiB")
    assert dropped >= 0.9 * values.numel()
    assert torch.equal(view, values)


def test_a_writer_that_gives_up_releases_its_claim(tmp_path, monkeypatch):
    """Ranks waiting for a share that its writer could not keep stop waiting at once (not after WAIT_S)."""
    import threading
    import time

    keeper = KeptWeights(tmp_path, "k")
    claim = tmp_path / "k.claim"
    claim.write_text(str(os.getpid()))  # another rank of this node claimed it and is writing
    threading.Timer(0.2, claim.unlink).start()  # ... then found no room and gave up
    started = time.monotonic()
    assert not keeper.store(torch.nn.Linear(4, 3))
    assert time.monotonic() - started < 5
    real = os.statvfs(tmp_path)
    monkeypatch.setattr(kept_weights.os, "statvfs", lambda _: os.statvfs_result((*real[:4], 0, *real[5:])))
    assert not keeper.store(torch.nn.Linear(4, 3))  # no room: its claim is gone again, and no half file
    assert not claim.exists() and not keeper.data.exists()
    monkeypatch.undo()
    assert keeper.store(torch.nn.Linear(4, 3)) and keeper.ready()  # the next attempt keeps it
