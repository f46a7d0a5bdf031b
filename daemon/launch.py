"""`diffusiond serve --nproc N`: N SPMD ranks under torch.distributed's elastic agent (the API behind torchrun).

The agent starts `python -m diffusiond serve` N times with RANK/WORLD_SIZE/MASTER_* set; each worker finds itself in
a launched group (`startup.in_launched_group`) and runs `run_rank`. `torchrun --nproc-per-node N -m diffusiond serve
...` takes exactly the same worker path. When a rank dies, rank 0 fails every request in flight and exits, the agent
stops the group and starts it again (up to `max_restarts` times).

Several nodes: run on each node
    diffusiond serve --nnodes M --nproc N --rdzv-endpoint HOST:PORT ...
(or torchrun with the same rendezvous and TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1, see `_check_agent_store`). Global
rank 0 serves HTTP: it runs on the node whose address sorts first (torch's c10d rendezvous orders nodes by address,
then agent pid). Every rank exits when its own agent dies (`_stop_with_the_agent`); the survivors' collectives then
fail, their agents restart them, and the group waits at the rendezvous (up to `rdzv_timeout`) until the lost node
is back.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import shutil
import signal
import socket
import sys
import threading
import time
import uuid

import msgspec

from diffusiond.daemon.config import ServeConfig
from diffusiond.daemon.listener import LISTENER_ENV, SocketLender, listening_socket

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

    # `cmd_serve` checked the configuration and the model setup (daemon/startup.py `check_serving`).
    if config.model is None:
        from diffusiond.models.default import default_model

        # Build (or find) the default checkpoint once, here, so that every rank loads the same folder.
        config = msgspec.structs.replace(config, model=default_model())
    # Restarted workers otherwise dial the dead attempt's store or hang in gloo's connectFullMesh on CPU
    # (pytorch issue 135712); a fresh store per attempt made every restart come back in our runs.
    os.environ.setdefault("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "1")
    if config.unready_delay + config.drain_timeout > AGENT_KILL_AFTER - 5:
        # The agent SIGKILLs workers 30 s after it forwards SIGTERM; the drain must end before that.
        cap = max(0.0, AGENT_KILL_AFTER - 5 - config.unready_delay)
        log.warning("drain timeout %gs capped at %gs under several ranks (the agent's 30 s)", config.drain_timeout, cap)
        config = msgspec.structs.replace(config, drain_timeout=cap)
    os.environ[RANK_CONFIG_ENV] = msgspec.json.encode(config).decode()
    if config.threads is None and "OMP_NUM_THREADS" not in os.environ:
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
        os.environ["OMP_NUM_THREADS"] = str(max(1, cores // config.nproc))
    several = config.nnodes > 1
    launch_config = LaunchConfig(
        # A fixed node count: the parallel layout is built for exactly nnodes x nproc ranks.
        min_nodes=config.nnodes,
        max_nodes=config.nnodes,
        nproc_per_node=config.nproc,
        # One node: a private rendezvous on a free loopback port. Several: the shared one, by name.
        run_id=config.rdzv_id if several else f"diffusiond-{uuid.uuid4().hex[:8]}",
        rdzv_backend="c10d",
        rdzv_endpoint=config.rdzv_endpoint if several else f"127.0.0.1:{free_port()}",
        rdzv_configs={"join_timeout": config.rdzv_timeout},
        max_restarts=config.max_restarts,
        monitor_interval=0.5,
        local_addr=config.node_addr,
    )
    log.info(
        "launching %d ranks on this node, %d in all (cfg-parallel %d, ulysses %d, ring %d, tp %d, max restarts %d)%s",
        config.nproc,
        config.nnodes * config.nproc,
        config.cfg_parallel,
        config.ulysses,
        config.ring,
        config.tp,
        config.max_restarts,
        f", rendezvous {config.rdzv_endpoint} ({config.rdzv_id})" if several else "",
    )
    # The listening socket outlives every rank 0 (daemon/listener.py): a heal refuses no connection. With several
    # nodes, rank 0's node is known only at the rendezvous: the launcher there binds when its rank 0 first asks.
    if several:
        lender = SocketLender(functools.partial(listening_socket, config.host, config.port))
    else:
        try:
            lender = SocketLender(listening_socket(config.host, config.port))
        except OSError as exc:
            log.error("cannot listen on %s:%d: %s", config.host, config.port, exc)
            return 1
    os.environ[LISTENER_ENV] = lender.path
    from diffusiond.models.loading.kept_weights import FOLDER_ENV as KEPT_ENV
    from diffusiond.models.loading.kept_weights import make_folder

    kept = make_folder(config.keep_weights) if config.keep_weights != "none" else None
    if kept is not None:
        os.environ[KEPT_ENV] = str(kept)
    # SIGHUP reloads the tenants (daemon/tenants.py), not the group: the agent (which would stop every worker on
    # it) leaves it to us, and we pass it on to the workers; rank 0 reads its file again, followers ignore it.
    os.environ["TORCHELASTIC_SIGNALS_TO_HANDLE"] = "SIGTERM,SIGINT,SIGQUIT"
    signal.signal(signal.SIGHUP, lambda *_: _to_workers(signal.SIGHUP))
    try:
        elastic_launch(launch_config, sys.executable)("-m", "diffusiond", "serve")
    except ChildFailedError as exc:
        log.error("ranks failed and restarts are exhausted: %s", exc)
        return 1
    except SignalException as exc:
        # SIGTERM/SIGINT: the agent forwarded it; rank 0 drained and told the followers to leave.
        log.info("stopped by %s", signal.Signals(exc.sigval).name)
        return 0
    finally:
        lender.close()
        os.environ.pop(LISTENER_ENV, None)
        if kept is not None:
            shutil.rmtree(kept, ignore_errors=True)
            os.environ.pop(KEPT_ENV, None)
    return 0


def _to_workers(sig: signal.Signals) -> None:
    """`sig` to every process this launcher started (its children: the agent runs in this process)."""
    me = str(os.getpid())
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            with open(f"/proc/{entry.name}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if fields[1] == me:
            with contextlib.suppress(ProcessLookupError):
                os.kill(int(entry.name), sig)


def worker_config(loaded: ServeConfig) -> ServeConfig:
    """Under our launcher the workers take the launcher's effective configuration; under torchrun, their own."""
    raw = os.environ.get(RANK_CONFIG_ENV)
    return msgspec.json.decode(raw, type=ServeConfig) if raw else loaded


def run_rank(config: ServeConfig) -> int:
    import torch.distributed as dist

    from diffusiond.daemon.ranks import join_group
    from diffusiond.daemon.startup import model_setup
    from diffusiond.engine.follower import run_follower

    setup = model_setup(config)
    rank_id = int(os.environ["RANK"])

    def join():
        rank = join_group(setup)
        log.info("rank %d/%d joined (pid %d)", rank.rank, rank.world_size, os.getpid())
        return rank

    _stop_with_the_agent(rank_id, config.drain_timeout)
    _check_agent_store()
    code = 1
    try:
        if rank_id == 0:
            from diffusiond.daemon.serve import serve

            def join_driver():
                rank = join()
                return rank.adapter, rank.comm

            # The server (and its watchdog pings) is up while the engine's step thread joins the group and loads.
            # A restart of the group: what clients sent to the socket during the heal waits for it.
            healing = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")) > 0
            code = serve(config, load=join_driver, healing=healing)
            return code
        # Followers leave when rank 0 sends the shutdown plan at the end of its drain; a signal must not kill them
        # first, or rank 0's last steps would fail. (A Python handler could not run inside gloo anyway.)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.signal(signal.SIGHUP, signal.SIG_IGN)  # rank 0 reads the tenants again; followers have none
        rank = join()
        try:
            run_follower(rank.adapter, rank.comm, config.paused_bytes)
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


def _stop_with_the_agent(rank_id: int, drain_timeout: float) -> None:
    """The agent starts workers in sessions of their own, so nothing reaps them if it dies without a chance to stop
    them (SIGKILL, OOM, a lost node): every rank watches its parent.

    Rank 0 then drains as on SIGTERM, and its shutdown plan releases the followers. A follower on rank 0's node
    (GROUP_RANK 0: that agent is gone too) waits for that plan, up to the drain timeout and a margin. A follower on
    another node leaves at once: nobody would restart it, and its exit fails rank 0's next collective, so rank 0's
    agent restarts the group, which waits at the rendezvous until this node is back."""
    parent = os.getppid()
    same_node_as_rank0 = os.environ.get("GROUP_RANK", "0") == "0"

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(0.5)
        if rank_id == 0:
            log.error("the elastic agent (pid %d) is gone; draining and stopping", parent)
            os.kill(os.getpid(), signal.SIGTERM)
            return
        if same_node_as_rank0:
            log.error("rank %d: the elastic agent (pid %d) is gone; waiting for rank 0's drain", rank_id, parent)
            time.sleep(drain_timeout + 10.0)
        log.error("rank %d: the elastic agent (pid %d) is gone; exiting", rank_id, parent)
        logging.shutdown()
        # The main thread may sit in a collective that nothing will end: only a hard exit leaves it.
        os._exit(1)

    threading.Thread(target=watch, name="diffusiond-agent-watch", daemon=True).start()


def _check_agent_store() -> None:
    """torchrun shares its rendezvous store with the workers unless TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1. With
    several nodes that breaks healing: an agent that stays up publishes the group's master address only for the
    first rendezvous, so a replaced node waits for it forever (seen with torch 2.13). Our launcher sets the variable."""
    several = int(os.environ.get("GROUP_WORLD_SIZE", "1")) > 1
    if several and os.environ.get("TORCHELASTIC_USE_AGENT_STORE", "").lower() == "true":
        log.warning(
            "several nodes under torchrun's shared store: a node that leaves cannot rejoin. Start torchrun with "
            "TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 in its environment, or use diffusiond serve --nnodes"
        )
