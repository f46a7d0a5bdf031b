"""Configuration: CLI flags > DIFFUSIOND_* environment > TOML file > defaults, unknown keys and bad values named,
and `diffusiond config` printing the effective configuration."""

from __future__ import annotations

import json
import subprocess
import sys
import tomllib

import msgspec
import pytest
import torch

from diffusiond.daemon.cli import build_parser, main
from diffusiond.daemon.config import FIELDS, ConfigError, ServeConfig, load_config


@pytest.fixture(autouse=True)
def clean_env(monkeypatch):
    """No DIFFUSIOND_* variables from the machine running the tests."""
    import os

    for var in list(os.environ):
        if var.startswith("DIFFUSIOND_"):
            monkeypatch.delenv(var)


def write(path, text: str) -> str:
    path.write_text(text)
    return str(path)


def cli(*argv: str) -> dict:
    """The flags as `serve` parses them."""
    return vars(build_parser().parse_args(["serve", *argv]))


def run_config(capsys, *argv: str) -> tuple[int, str, str]:
    code = main(["config", *argv])
    out, err = capsys.readouterr()
    return code, out, err


# ---- precedence ----


def test_each_layer_overrides_the_ones_below(tmp_path):
    path = write(tmp_path / "d.toml", 'max_batch = 2\nmax_queue = 2\nport = 2\nhost = "10.0.0.2"\n')
    env = {"DIFFUSIOND_MAX_BATCH": "3", "DIFFUSIOND_MAX_QUEUE": "3", "DIFFUSIOND_PORT": "3"}
    config, sources = load_config(cli("--max-batch", "4", "--max-queue", "4"), env, path)
    # max_batch and max_queue: CLI over env over file; port: env over file; host: file over default.
    assert (config.max_batch, config.max_queue, config.port, config.host) == (4, 4, 3, "10.0.0.2")
    assert config.device == ServeConfig().device
    assert sources["max_batch"] == "--max-batch"
    assert sources["port"] == "DIFFUSIOND_PORT"
    assert sources["host"] == path
    assert sources["device"] == "default"


def test_flags_not_given_do_not_override(tmp_path):
    """argparse must not inject defaults: a bare `serve` leaves every field to the layers below."""
    assert not set(cli()) & set(FIELDS)
    assert not set(vars(build_parser().parse_args(["config"]))) & set(FIELDS)
    path = write(tmp_path / "d.toml", 'host = "0.0.0.0"\nlog_level = "debug"\nlog_format = "json"\n')
    config, _ = load_config(cli(), {"DIFFUSIOND_DRAIN_TIMEOUT": "5"}, path)
    assert (config.host, config.log_level, config.log_format, config.drain_timeout) == ("0.0.0.0", "DEBUG", "json", 5)


def test_every_serve_flag_maps_to_its_field():
    argv = [
        "--model", "m", "--host", "0.0.0.0", "--port", "9", "--api-key", "k", "--api-keys-file", "t.toml",
        "--state-dir", "/var/lib/d", "--url-secret", "s" * 32, "--public-base-url", "https://d.example",
        "--state-url", "postgresql://db/d", "--replica-id", "r1", "--job-lease", "9",
        "--max-batch", "2", "--max-queue", "3", "--default-priority", "4", "--priority-aging-steps", "7",
        "--result-cache-bytes", "1024",
        "--device", "cuda:1", "--dtype", "bfloat16", "--threads", "2", "--drain-timeout", "1.5", "--nproc", "4",
        "--cfg-parallel", "2", "--ulysses", "2", "--ring", "2", "--tp", "2", "--shard-weights", "--vae-parallel", "2",
        "--max-restarts", "0", "--keep-weights", "none",
        "--max-body-bytes", "100", "--max-frames", "33",
        "--max-image-bytes", "2048",
        "--log-level", "debug", "--log-format", "json", "--allow-unauthenticated", "--max-pixels", "4096",
        "--max-steps", "20", "--max-n", "2", "--sse-keepalive", "0.5", "--batch-wait-ms", "0",
        "--unready-delay", "2", "--nnodes", "2", "--rdzv-endpoint", "head:29400", "--rdzv-id", "g1",
        "--rdzv-timeout", "60", "--node-addr", "10.0.0.2", "--served-model-name", "shapes",
        "--cache", "dbcache", "--cache-config", '{"fn": 2}', "--cache-threshold", "0.3", "--attention", "math",
        "--compile",
        "--compile-cache", "/var/cache/inductor", "--quantize", "int8", "--quantize-skip", "proj_out",
        "--offload", "group", "--video-dir", "/var/lib/videos", "--video-store-bytes", "5000", "--video-ttl", "60",
        "--video-max-jobs", "7", "--lora", "style=/loras/style.safetensors", "--lora", "ink=ink.safetensors",
        "--lora-dir", "/var/lib/loras", "--lora-cache-bytes", "1000", "--lora-fuse",
        "--scheduler-config", '{"shift": 3.0}', "--adapter", "generic", "--keepalive-timeout", "5",
        "--max-connections", "100",
        "--max-reading-bytes", "4096", "--min-body-rate", "1024",
        "--write-timeout", "7", "--allowed-hosts", "a.example", "--allowed-hosts",
        ".b.example", "--cors-origins", "https://ui.example", "--send-buffer-bytes", "65536", "--no-preemption",
        "--class-window-ms", "500", "--paused-bytes", "4096", "--class-deadline", "9=5000",
        "--class-deadline", "5=60000", "--webhook-url", "https://hooks.example/d",
        "--webhook-secret", "whsec_" + "A" * 32, "--reconnect-window", "2.5",
    ]  # fmt: skip
    config, sources = load_config(cli(*argv), {})
    assert config == ServeConfig(
        model="m", host="0.0.0.0", port=9, api_key="k", api_keys_file="t.toml",
        state_dir="/var/lib/d", url_secret="s" * 32, public_base_url="https://d.example",
        state_url="postgresql://db/d", replica_id="r1", job_lease=9.0, max_batch=2, max_queue=3, device="cuda:1",
        default_priority=4, priority_aging_steps=7, result_cache_bytes=1024, preemption=False, paused_bytes=4096,
        class_window_ms=500, class_deadlines=("9=5000", "5=60000"),
        dtype="bfloat16",
        threads=2, drain_timeout=1.5, nproc=4, cfg_parallel=2, ulysses=2, ring=2, tp=2, shard_weights=True,
        vae_parallel=2, max_restarts=0, keep_weights="none", max_body_bytes=100, max_frames=33,
        max_image_bytes=2048, log_level="DEBUG", log_format="json", allow_unauthenticated=True, max_pixels=4096,
        max_steps=20, max_n=2,
        sse_keepalive=0.5, batch_wait_ms=0.0, unready_delay=2.0, nnodes=2, rdzv_endpoint="head:29400", rdzv_id="g1",
        rdzv_timeout=60.0, node_addr="10.0.0.2", served_model_name=("shapes",),
        cache="dbcache", cache_config='{"fn": 2}', cache_threshold=0.3,
        attention="math", compile=True, compile_cache="/var/cache/inductor",
        quantize="int8", quantize_skip="proj_out", offload="group", video_dir="/var/lib/videos",
        video_store_bytes=5000, video_ttl=60.0, video_max_jobs=7,
        lora=("style=/loras/style.safetensors", "ink=ink.safetensors"), lora_dir="/var/lib/loras",
        lora_cache_bytes=1000, lora_fuse=1.0, scheduler_config='{"shift": 3.0}', adapter="generic",
        keepalive_timeout=5.0,
        max_connections=100, max_reading_bytes=4096, min_body_rate=1024,
        write_timeout=7.0, allowed_hosts=("a.example", ".b.example"),
        cors_origins=("https://ui.example",), send_buffer_bytes=65536,
        webhook_url="https://hooks.example/d", webhook_secret="whsec_" + "A" * 32, reconnect_window=2.5,
    )  # fmt: skip
    assert all(source.startswith("--") for source in sources.values()), sources
    # The global logging flags, before the subcommand, still work.
    args = vars(build_parser().parse_args(["--log-level", "warning", "--log-format", "json", "serve"]))
    config, _ = load_config(args, {})
    assert (config.log_level, config.log_format) == ("WARNING", "json")


def test_environment_values_are_converted():
    env = {
        "DIFFUSIOND_MAX_BATCH": "4",
        "DIFFUSIOND_DRAIN_TIMEOUT": "2.5",
        "DIFFUSIOND_THREADS": "3",
        "DIFFUSIOND_API_KEY": "secret",
        "DIFFUSIOND_LOG_LEVEL": "debug",
        # Empty counts as unset (an env file may list every variable); DIFFUSIOND_CACHE is the model cache's.
        "DIFFUSIOND_MODEL": "",
        "DIFFUSIOND_CACHE": "/tmp/somewhere",
        # A list: comma-separated.
        "DIFFUSIOND_LORA": "style=/a.safetensors, ink=b.safetensors",
    }
    config, _ = load_config({}, env)
    assert (config.max_batch, config.drain_timeout, config.threads) == (4, 2.5, 3)
    assert config.lora == ("style=/a.safetensors", "ink=b.safetensors")
    assert (config.api_key, config.log_level, config.model) == ("secret", "DEBUG", None)
    # --shard-weights: true (FSDP over every rank) or RxS (HSDP).
    for value, expected in [("true", True), ("2x1", "2x1"), ("false", False)]:
        config, _ = load_config({}, {"DIFFUSIOND_SHARD_WEIGHTS": value})
        assert config.shard_weights == expected, value


def test_served_model_names_from_each_layer(tmp_path):
    """A name or several: the flag takes them after it (and again), the file a string or a list, the environment
    comma-separated names."""
    names = ("shapes", "gpt-image-1", "dall-e-3")
    assert load_config(cli("--served-model-name", *names), {})[0].served_model_name == names
    argv = cli("--served-model-name", "shapes", "--served-model-name", "gpt-image-1", "dall-e-3")
    assert load_config(argv, {})[0].served_model_name == names
    one = write(tmp_path / "one.toml", 'served_model_name = "shapes"\n')
    many = write(tmp_path / "many.toml", 'served_model_name = ["shapes", "gpt-image-1", "dall-e-3"]\n')
    assert load_config({}, {}, one)[0].served_model_name == ("shapes",)
    assert load_config({}, {}, many)[0].served_model_name == names
    env = {"DIFFUSIOND_SERVED_MODEL_NAME": "shapes, gpt-image-1,dall-e-3"}
    assert load_config({}, env)[0].served_model_name == names
    assert load_config({}, {})[0].served_model_name == ()


def test_config_file_from_the_environment_and_the_flag(tmp_path):
    from_env = write(tmp_path / "env.toml", "max_batch = 5\n")
    from_flag = write(tmp_path / "flag.toml", "max_batch = 6\n")
    assert load_config({}, {"DIFFUSIOND_CONFIG": from_env})[0].max_batch == 5
    assert load_config(cli("--config", from_flag), {"DIFFUSIOND_CONFIG": from_env}, from_flag)[0].max_batch == 6


# ---- errors ----


@pytest.mark.parametrize(
    ("toml", "message"),
    [
        ("max_bach = 4\n", "unknown key 'max_bach' in {path} (did you mean 'max_batch'?)"),
        ("max-batch = 4\n", "unknown key 'max-batch' in {path} (did you mean 'max_batch'?)"),
        ("[serve]\nport = 1\n", "unknown key 'serve' in {path}"),
        ('max_batch = "4"\n', "bad value for max_batch in {path}: expected `int`, got `str`"),
        ("max_batch = 0\n", "bad value for max_batch in {path}: expected `int` >= 1"),
        ("port = 70000\n", "bad value for port in {path}: expected `int` <= 65535"),
        ('dtype = "float8"\n', "bad value for dtype in {path}: invalid enum value 'float8'"),
        ("max_batch = \n", "{path} is not valid TOML"),
        ('url_secret = "guessable"\n', "bad value for url_secret in {path}: expected `str` of length >= 32"),
        ('served_model_name = ["a b"]\n', "bad value for served_model_name in {path}: expected `str` matching"),
        ('served_model_name = ""\n', "bad value for served_model_name in {path}: expected `str` of length >= 1"),
    ],
)
def test_file_errors_name_the_key_and_file(tmp_path, capsys, toml, message):
    path = write(tmp_path / "diffusiond.toml", toml)
    code, out, err = run_config(capsys, "--config", path)
    assert code == 2 and out == ""
    assert message.format(path=path) in err


@pytest.mark.parametrize(
    ("var", "value", "message"),
    [
        ("DIFFUSIOND_MAX_BACH", "4", "unknown environment variable DIFFUSIOND_MAX_BACH"),
        ("DIFFUSIOND_NPROCS", "2", "unknown environment variable DIFFUSIOND_NPROCS (did you mean 'DIFFUSIOND_NPROC'?)"),
        ("DIFFUSIOND_MAX_BATCH", "four", "bad value for max_batch from DIFFUSIOND_MAX_BATCH='four'"),
        ("DIFFUSIOND_LOG_FORMAT", "xml", "bad value for log_format from DIFFUSIOND_LOG_FORMAT='xml'"),
        ("DIFFUSIOND_DRAIN_TIMEOUT", "-1", "bad value for drain_timeout from DIFFUSIOND_DRAIN_TIMEOUT='-1'"),
    ],
)
def test_environment_errors_name_the_variable(monkeypatch, capsys, var, value, message):
    monkeypatch.setenv(var, value)
    code, out, err = run_config(capsys)
    assert code == 2 and out == ""
    assert message in err


def test_flag_errors_and_missing_file(tmp_path, capsys):
    code, _, err = run_config(capsys, "--max-batch", "0")
    assert code == 2 and "bad value for max_batch from --max-batch 0: expected `int` >= 1" in err
    code, _, err = run_config(capsys, "--config", str(tmp_path / "missing.toml"))
    assert code == 2 and f"cannot read config file {tmp_path / 'missing.toml'}" in err


def test_serve_exits_2_on_a_bad_configuration(monkeypatch, capsys):
    """Before binding a socket or loading anything."""
    monkeypatch.setenv("DIFFUSIOND_MAX_BATCH", "many")
    assert main(["serve"]) == 2
    assert (
        "diffusiond serve: error: bad value for max_batch from DIFFUSIOND_MAX_BATCH='many'" in capsys.readouterr().err
    )


def test_serve_exits_2_on_a_video_dir_it_cannot_write(tmp_path, capsys):
    blocked = tmp_path / "file"
    blocked.write_text("not a folder")
    assert main(["serve", "--video-dir", str(blocked / "videos")]) == 2
    assert f"diffusiond serve: error: --video-dir {blocked / 'videos'}: cannot create it" in capsys.readouterr().err


def safetensors_file(path) -> str:
    from safetensors.torch import save_file

    save_file({"x": torch.zeros(1)}, str(path))
    return str(path)


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--lora", "style"], "--lora 'style': expected NAME=PATH"),
        (["--lora", "a b={good}"], "LoRA name 'a b': use 1-64 letters"),
        (["--lora", "a={good}", "--lora", "a={good}"], "two LoRA adapters are named 'a'"),
        (["--lora", "a={dir}/missing.safetensors"], "{dir}/missing.safetensors: no such file"),
        (["--lora", "a={dir}/a.bin"], "{dir}/a.bin: LoRA files must be .safetensors"),
        (["--lora", "a={dir}/junk.safetensors"], "{dir}/junk.safetensors: not a safetensors file"),
        (["--lora-dir", "{dir}/nowhere"], "--lora-dir {dir}/nowhere: not a directory"),
        (["--lora-fuse"], "--lora-fuse adds an adapter into the weights: give it one with --lora NAME=PATH"),
        (
            ["--lora-fuse", "0.5", "--lora-dir", "{loras}"],
            "--lora-fuse adds one adapter into the weights; --lora and --lora-dir give 2: give exactly one",
        ),
        (["--lora", "a={good}", "--compile"], "LoRA adapters (--lora, --lora-dir): not with --compile yet"),
        (["--lora-dir", "{loras}", "--tp", "2"], "LoRA adapters (--lora, --lora-dir): not with --tp yet"),
    ],
)
def test_serve_exits_2_on_lora_settings_it_cannot_serve(tmp_path, capsys, argv, message):
    """Before any rank starts or the model loads: the pairs, the folder, each file's header, and the features LoRA
    does not compose with."""
    loras = tmp_path / "loras"
    loras.mkdir()
    good = safetensors_file(loras / "one.safetensors")
    safetensors_file(loras / "two.safetensors")
    (tmp_path / "a.bin").write_bytes(b"pickle")
    (tmp_path / "junk.safetensors").write_bytes(b"\xff" * 64)
    values = {"good": good, "dir": tmp_path, "loras": loras}
    assert main(["serve", *(arg.format(**values) for arg in argv)]) == 2
    assert f"diffusiond serve: error: {message.format(**values)}" in capsys.readouterr().err


def test_load_config_raises_config_error():
    with pytest.raises(ConfigError, match="DIFFUSIOND_PORTT"):
        load_config({}, {"DIFFUSIOND_PORTT": "1"})


# ---- diffusiond config ----


def test_config_prints_toml_that_loads_back(tmp_path, monkeypatch, capsys):
    path = write(tmp_path / "d.toml", 'model = "some/model"\nport = 2\ndrain_timeout = 7.5\nlora = ["a=/x"]\n')
    monkeypatch.setenv("DIFFUSIOND_MAX_BATCH", "3")
    monkeypatch.setenv("DIFFUSIOND_API_KEY", "hunter2")
    code, out, _ = run_config(capsys, "--config", path, "--max-queue", "5")
    assert code == 0
    assert "hunter2" not in out
    assert "max_batch = 3  # DIFFUSIOND_MAX_BATCH" in out
    assert f"port = 2  # {path}" in out
    assert "max_queue = 5  # --max-queue" in out
    assert "# api_key: set, hidden (DIFFUSIOND_API_KEY)" in out
    # The output is a config file: loaded back (without the environment) it gives the same settings, the hidden key
    # aside.
    printed = write(tmp_path / "printed.toml", out)
    expected, _ = load_config(cli("--max-queue", "5"), {"DIFFUSIOND_MAX_BATCH": "3"}, path)
    assert expected.api_key is None
    assert load_config({}, {}, printed)[0] == expected
    assert tomllib.loads(out)["drain_timeout"] == 7.5
    assert tomllib.loads(out)["lora"] == ["a=/x"]


def test_config_prints_json_with_the_key_hidden(monkeypatch, capsys):
    monkeypatch.setenv("DIFFUSIOND_API_KEY", "hunter2")
    code, out, _ = run_config(capsys, "--format", "json", "--port", "1234")
    assert code == 0 and "hunter2" not in out
    data = json.loads(out)
    assert set(data) == set(FIELDS)
    assert data["api_key"] == "<hidden>" and data["port"] == 1234 and data["model"] is None
    assert data == {**msgspec.json.decode(msgspec.json.encode(ServeConfig(port=1234))), "api_key": "<hidden>"}


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (("serve", "--scheduler-config", "shift=3"), "--scheduler-config: not JSON"),
        (("serve", "--scheduler-config", "[3]"), "--scheduler-config: give a JSON object"),
        (("generate", "a red circle", "--scheduler-config", "3"), "--scheduler-config: give a JSON object"),
    ],
)
def test_scheduler_config_must_be_a_json_object(args, message):
    from procs import refused

    assert message in refused(*args)


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["generate", "a red circle", "--size", "4096x4096"], "--size: this model draws 64x64 only, not 4096x4096"),
        (
            ["serve", "--model", "{tiny_sd3}", "--nproc", "3", "--ulysses", "3"],
            "must divide the number of attention heads",
        ),
        (
            ["serve", "--nproc", "2", "--cfg-parallel", "2", "--tp", "2"],
            "x --tp (2) = 4 must equal the number of ranks",
        ),
        (["serve", "--class-deadline", "12=500"], "--class-deadline '12=500': expected P=MS"),
        (
            ["serve", "--nproc", "2", "--cfg-parallel", "2", "--shard-weights", "2x2"],
            "--shard-weights 2x2: 2 replicas x 2 ranks each = 4 must equal the number of ranks (2",
        ),
        (["serve", "--shard-weights", "2"], "shard_weights"),
    ],
)
def test_what_needs_no_torch_is_refused_before_torch_is_imported(argv, message, tiny_sd3):
    """The checkpoint's declarations, the family's and every flag rule (models/loading/setup.py `check_setup`) are read
    without torch: a refusal costs a tenth of a second, not the imports (6-9 s)."""
    code = (
        "import sys; from diffusiond.__main__ import main; "
        f"code = main({[arg.format(tiny_sd3=tiny_sd3) for arg in argv]!r}); "
        "sys.exit(10 + code if 'torch' in sys.modules else code)"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2, (proc.returncode, proc.stderr)  # 12: refused, but after importing torch
    assert message in proc.stderr, proc.stderr
