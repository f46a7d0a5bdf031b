"""Every parallel layout we ship or tell users to type passes the start-up validation `serve` runs (issue 31: the
multi-node manifest and docs line said `--ulysses 16`, which divides the heads of no served model, so every rank of
such a group failed at start, a hundred restarts over). The pod templates of deploy/kubernetes with their
environment, and each `diffusiond serve` or `torchrun ... -m diffusiond serve` line of README.md and docs/ that sets
a layout, become a configuration as `serve` reads it and go through `check_serving`; a hub id's family and heads
come from `KNOWN_CHECKPOINTS`, as they do at start. Broken on purpose once: with `--ulysses=16` back in group.yaml,
both of its templates failed here."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest
from deploy.test_kubernetes import pod_templates

from diffusiond.daemon.cli import build_parser
from diffusiond.daemon.config import load_config
from diffusiond.daemon.startup import check_serving
from diffusiond.models.families.specs import KNOWN_CHECKPOINTS

ROOT = Path(__file__).parents[2]
LAYOUT_FLAGS = ("--nproc", "--nnodes", "--cfg-parallel", "--ulysses", "--ring", "--tp", "--shard-weights")
# What the pods' placeholders stand for.
PLACEHOLDERS = {"LWS_GROUP_SIZE": "2", "LWS_LEADER_ADDRESS": "10.0.0.1", "POD_IP": "10.0.0.2"}


@pytest.fixture(autouse=True)
def clean_env(monkeypatch):
    import os

    for var in list(os.environ):
        if var.startswith("DIFFUSIOND_"):
            monkeypatch.delenv(var)


def check(args: list[str], env: dict[str, str]) -> None:
    config, _ = load_config(vars(build_parser().parse_args(["serve", *args])), env)
    check_serving(config)


def shell_lines() -> list[tuple[str, list[str]]]:
    """(where, serve's arguments) of every documented command line that sets a layout."""
    out = []
    for path in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        blocks = re.findall(r"```[a-z]*\n(.*?)```", path.read_text(), re.S)  # code blocks only, not prose
        text = re.sub(r"\\\n\s*", " ", "\n".join(blocks))  # continuation lines joined
        for line in text.splitlines():
            command = line.split("#", 1)[0].strip()
            if "diffusiond serve" not in command or not any(flag in command for flag in LAYOUT_FLAGS):
                continue
            if "[" in command or re.search(r"\s[A-Z]\s", f" {command} "):  # a synopsis (`--nproc N [...]`)
                continue
            words = shlex.split(command)
            if words[0] == "torchrun" or "torchrun" in words:
                words = words[words.index("torchrun") :]
                per_node = words[words.index("--nproc-per-node") + 1]
                nodes = words[words.index("--nnodes") + 1] if "--nnodes" in words else "1"
                serve = words[words.index("serve") + 1 :]
                args = [*serve, "--nproc", per_node, "--nnodes", nodes]
                if nodes != "1":
                    args += ["--rdzv-endpoint", "HOST:29400"]
            else:
                args = words[words.index("serve") + 1 :]
            out.append((f"{path.name}: {command[:80]}", args))
    return out


def manifest_pods() -> list[tuple[str, list[str], dict[str, str]]]:
    """(where, args, DIFFUSIOND_* environment) of every pod template, placeholders filled in."""
    out = []
    for where, template in pod_templates():
        container = template["spec"]["containers"][0]
        fill = lambda text: re.sub(r"\$\((\w+)\)", lambda m: PLACEHOLDERS[m.group(1)], text)  # noqa: E731
        env = {}
        for item in container.get("env", []):
            if item["name"].startswith("DIFFUSIOND_"):
                env[item["name"]] = fill(item["value"]) if "value" in item else "from-a-secret"
        args = [fill(arg) for arg in container.get("args", [])]
        if any(arg.split("=")[0] in LAYOUT_FLAGS for arg in args) or "DIFFUSIOND_NPROC" in env:
            out.append((where, args, env))
    return out


def test_the_lines_and_pods_are_found():
    """So that the parametrized tests below cannot pass by finding nothing."""
    lines = [where for where, _ in shell_lines()]
    assert sum("ranks.md" in w for w in lines) >= 10, lines
    assert any("torchrun" in w for w in lines), lines
    assert [where for where, _, _ in manifest_pods()] == ["group.yaml leader", "group.yaml worker"]


@pytest.mark.parametrize(("where", "args"), shell_lines(), ids=lambda v: v if isinstance(v, str) else None)
def test_documented_layouts_start(where, args):
    check(args, {})


@pytest.mark.parametrize(("where", "args", "env"), manifest_pods(), ids=lambda v: v if isinstance(v, str) else None)
def test_shipped_manifests_start(where, args, env):
    assert env.get("DIFFUSIOND_MODEL") in KNOWN_CHECKPOINTS, "a manifest's model must be checkable before download"
    check(args, env)


def test_a_hub_model_is_checked_before_any_download():
    from diffusiond.models.loading.setup import SetupError

    with pytest.raises(SetupError, match=r"--ulysses 16 must divide the number of attention heads \(24\)"):
        check(["--model", "stabilityai/stable-diffusion-3.5-medium", "--nproc", "16", "--ulysses", "16"], {})
