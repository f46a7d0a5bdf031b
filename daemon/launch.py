"""`diffusiond serve --nproc N`: N SPMD ranks under torch.distributed's elastic agent (the API behind torchrun).

The agent starts `python -m diffusiond serve` N times with RANK/WORLD_SIZE/MASTER_* set; each worker finds itself in
a launched group (`ranks.in_launched_group`) and runs `run_rank`. `torchrun --nproc-per-node N -m diffusiond serve
...` takes exactly the same worker path. When a rank dies, rank 0 fails every request in flight and exits, the agent
stops the group and starts it again (up to `max_restarts` times).

Several nodes: run on each node
    torchrun --nnodes M --nproc-per-node N --rdzv-backend c10d --rdzv-endpoint HOST:PORT -m diffusiond serve ...
(global rank 0, on the node that wins the rendezvous, serves HTTP).
"""

from __future__ import annotations

import logging
import os
import signal
import socket
import sys
import threading
import time
import uuid

import msgspec

from diffusiond.daemon.config import ServeConfig

log = logging.getLogger(__name__)

# The effective configuration, handed from the launcher to its workers (not a DIFFUSIOND_* setting).
RANK_CONFIG_ENV = "_DIFFUSIOND_RANK_CONFIG"
# torch.distributed.elastic's agent: SIGTERM to the workers, SIGKILL this many seconds later.
AGENT_KILL_AFTER = 30.0


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def launch(config: ServeConfig) -> int:
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    from diffusiond.kernels.parallel import ParallelLayout

    ParallelLayout(config.nproc, config.cfg_parallel, config.ulysses).validate()
    if config.model is None:
        from diffusiond.models.default import default_model

        # Build (or find) the default checkpoint once, here, so that every rank loads the same folder.
        config = msgspec.structs.replace(config, model=default_model())
    # Restarted workers otherwise dial the dead attempt's store or hang in gloo's connectFullMesh on CPU
    # (pytorch issue 135712); a fresh store per attempt made every restart come back in our runs.
    os.environ.setdefault("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "1")
    if config.drain_timeout > AGENT_KILL_AFTER - 5:
        # The agent SIGKILLs workers 30 s after it forwards SIGTERM; the drain must end before that.
        log.warning("drain timeout %gs capped at %gs under --nproc > 1", config.drain_timeout, AGENT_KILL_AFTER - 5)
        config = msgspec.structs.replace(config, drain_timeout=AGENT_KILL_AFTER - 5)
    os.environ[RANK_CONFIG_ENV] = msgspec.json.encode(config).decode()
    if config.threads is None and "OMP_NUM_THREADS" not in os.environ:
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
        os.environ["OMP_NUM_THREADS"] = str(max(1, cores // config.nproc))
    launch_config = LaunchConfig(
        min_nodes=1,
        max_nodes=1,
        nproc_per_node=config.nproc,
        run_id=f"diffusiond-{uuid.uuid4().hex[:8]}",
        rdzv_backend="c10d",
        rdzv_endpoint=f"127.0.0.1:{free_port()}",
        max_restarts=config.max_restarts,
        monitor_interval=0.5,
    )
    log.info(
        "launching %d ranks (cfg-parallel %d, ulysses %d, max restarts %d)",
        config.nproc,
        config.cfg_parallel,
        config.ulysses,
        config.max_restarts,
    )
    try:
        elastic_launch(launch_config, sys.executable)("-m", "diffusiond", "serve")
    except ChildFailedError as exc:
        log.error("ranks failed and restarts are exhausted: %s", exc)
        return 1
    except SignalException as exc:
        # SIGTERM/SIGINT: the agent forwarded it; rank 0 drained and told the followers to leave.
        log.info("stopped by %s", signal.Signals(exc.sigval).name)
        return 0
    return 0


def worker_config(loaded: ServeConfig) -> ServeConfig:
    """Under our launcher the workers take the launcher's effective configuration; under torchrun, their own."""
    raw = os.environ.get(RANK_CONFIG_ENV)
    return msgspec.json.decode(raw, type=ServeConfig) if raw else loaded


def run_rank(config: ServeConfig) -> int:
    import torch.distributed as dist

    from diffusiond.daemon.ranks import join_group
    from diffusiond.engine.follower import run_follower

    if config.model is None:
        from diffusiond.models.default import default_model

        config = msgspec.structs.replace(config, model=default_model())
    model = config.model
    assert model is not None
    rank_id = int(os.environ["RANK"])

    def join():
        rank = join_group(
            model, device=config.device, dtype=config.dtype, cfg_parallel=config.cfg_parallel, ulysses=config.ulysses
        )
        log.info("rank %d/%d joined (pid %d)", rank.rank, rank.world_size, os.getpid())
        return rank

    _stop_with_the_agent(rank_id)
    code = 1
    try:
        if rank_id == 0:
            from diffusiond.daemon.serve import serve

            def join_driver():
                rank = join()
                return rank.adapter, rank.comm

            # The server (and its watchdog pings) is up while the engine's step thread joins the group and loads.
            code = serve(config, load=join_driver)
            return code
        # Followers leave when rank 0 sends the shutdown plan at the end of its drain; a signal must not kill them
        # first, or rank 0's last steps would fail. (A Python handler could not run inside gloo anyway.)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        rank = join()
        try:
            run_follower(rank.adapter, rank.comm)
        except Exception as exc:
            log.error("rank %d: %s; exiting so the agent restarts the group", rank.rank, exc)
            return 1
        code = 0
        return code
    finally:
        # A failed group may have a collective in flight that never ends (NCCL): tearing it down could hang, and
        # the process is about to exit anyway.
        if code == 0 and dist.is_initialized():
            dist.destroy_process_group()


def _stop_with_the_agent(rank_id: int) -> None:
    """The agent starts workers in sessions of their own, so nothing reaps them if it dies without a chance to stop
    them (SIGKILL, OOM). Rank 0 then drains as on SIGTERM, and its shutdown plan releases the followers."""
    if rank_id != 0:
        return
    parent = os.getppid()

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(1.0)
        log.error("the elastic agent (pid %d) is gone; stopping", parent)
        os.kill(os.getpid(), signal.SIGTERM)

    threading.Thread(target=watch, name="diffusiond-agent-watch", daemon=True).start()
