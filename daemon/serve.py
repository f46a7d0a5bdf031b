"""Running the app as a service: the listening socket, signals, service manager notifications, drain, exit codes.

The socket is up at once (`/health` answers while the model loads); READY=1 goes to the service manager once the
model is warm. SIGTERM or SIGINT starts the drain: admission stops (`/ready` and new generation requests answer 503,
the socket stays open so load balancers see it), requests in flight get `drain_timeout` seconds to finish, the rest
are cancelled so each client still gets its terminal event, then the app's cleanup stops the engine.

Exit codes: 0 after a drain; 1 when the model fails to load, the engine dies or the address cannot be bound; 2 when
loading finds a setting or file the operator gave wrong (a LoRA file that does not fit the model);
128 + the signal number when a second signal arrives during the drain (exit at once, nothing more is awaited).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import sys
from collections.abc import Awaitable, Callable
from typing import Any

from aiohttp import web

from diffusiond.daemon.app import create_app, reload_tenants
from diffusiond.daemon.config import ServeConfig
from diffusiond.daemon.connections import listen, raise_open_files_limit, runner_options
from diffusiond.daemon.handover import adopt
from diffusiond.daemon.listener import Lent, borrow, listening_socket
from diffusiond.daemon.notify import Notifier
from diffusiond.daemon.state import METRICS, STATE, ServerState

log = logging.getLogger(__name__)

EXIT_OK = 0
EXIT_FAILED = 1
# A setting or file the operator gave that only loading could find wrong (a LoRA file that does not fit the model).
EXIT_CONFIG = 2
# After the engine is idle: time for handlers to write their last event before aiohttp cancels them.
HANDLER_GRACE_S = 5.0
# How often the drain's progress and the engine's liveness are checked.
DRAIN_POLL_S = 0.05
LIVENESS_POLL_S = 0.5
SIGNALS = (
    signal.SIGTERM,  # what service managers and `docker stop` send
    signal.SIGINT,  # Ctrl-C
)


def serve(config: ServeConfig, **app_options: Any) -> int:
    """Serves until a signal (exit code: see above). `app_options` go to `create_app` (how to load the model: rank 0
    of an SPMD group joins its group there)."""
    # Import the model code now: its first import (seconds: diffusers, transformers) would otherwise happen inside
    # the app's loader task and stall the event loop, and with it /health and the watchdog.
    import diffusiond.models.loading.loader  # noqa: F401

    try:
        import uvloop

        loop = uvloop.new_event_loop()
    except ImportError:  # uvloop is optional on platforms without it
        loop = asyncio.new_event_loop()
    asyncio.set_event_loop(loop)
    try:
        return loop.run_until_complete(Service(config, Notifier.from_env(), app_options).run())
    finally:
        try:
            loop.run_until_complete(loop.shutdown_asyncgens())
        finally:
            asyncio.set_event_loop(None)
            loop.close()


class Service:
    def __init__(self, config: ServeConfig, notifier: Notifier, app_options: dict[str, Any] | None = None) -> None:
        self.config = config
        self.notifier = notifier
        self.app_options = app_options or {}
        self.stop = asyncio.Event()
        self.address = f"{config.host}:{config.port}"
        self.site: web.BaseSite | None = None
        # What the launcher lent this rank 0 (daemon/listener.py), held while it accepts.
        self.lent: Lent | None = None

    async def run(self) -> int:
        loop = asyncio.get_running_loop()
        for sig in SIGNALS:
            loop.add_signal_handler(sig, self._on_signal, sig)
        watchdog = asyncio.create_task(self._watchdog())
        try:
            code = await self._serve()
            # Threads of the default executor (image encoding, a model load cut short) finish while the signal
            # handlers are still in place, so a second signal can still cut this short.
            await loop.shutdown_default_executor()
            self.notifier.status(f"stopped (exit code {code})")
            return code
        finally:
            watchdog.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await watchdog
            for sig in (*SIGNALS, signal.SIGHUP):
                loop.remove_signal_handler(sig)
            self.notifier.close()

    async def _serve(self) -> int:
        raise_open_files_limit()  # before the app sizes its connection cap by it
        app = create_app(self.config, **self.app_options)
        state = app[STATE]
        # SIGHUP: the tenants' file read again (daemon/tenants.py); requests already admitted run on.
        loop = asyncio.get_running_loop()
        loop.add_signal_handler(signal.SIGHUP, reload_tenants, app)
        # handler_cancellation: a client that disconnects cancels its handler, which cancels its request.
        runner = web.AppRunner(
            app, handler_cancellation=True, shutdown_timeout=HANDLER_GRACE_S, **runner_options(self.config)
        )
        self.notifier.status(f"loading {self.config.model or 'the default model'}")
        await runner.setup()  # starts the model load (app cleanup_ctx)
        try:
            try:
                # A rank 0 under the launcher: its socket, and requests carried over a heal.
                self.lent = lent = borrow()
                sock = lent.sock if lent is not None else listening_socket(self.config.host, self.config.port)
                self.site = await listen(runner, self.config, sock)
            except OSError as exc:
                log.error("cannot listen on %s: %s", self.address, exc)
                self.notifier.status(f"failed: cannot listen on {self.address}: {exc}")
                return EXIT_FAILED
            host, port = runner.addresses[0][:2]
            self.address = f"{host}:{port}"
            log.info("listening on http://%s", self.address)
            if lent is not None and lent.carried:
                # Requests carried over a heal: this is one, whatever torchelastic's restart count says (a restart
                # for another node's rejoining is not counted: it said 0 once, and the carried requests got 503).
                state.healing = True
                count = await adopt(runner.app, lent.carried)
                runner.app[METRICS].carried.inc(count)
                log.info("serving %d requests the failed group had not started, on their own connections", count)
            return await self._lifecycle(state)
        finally:
            await runner.cleanup()  # closes the socket, waits for handlers, stops the engine

    async def _lifecycle(self, state: ServerState) -> int:
        if await _first(state.loaded.wait(), self.stop.wait()) == 0:
            if not state.ready:
                # _load logged the exception; exit so the service manager restarts us.
                self.notifier.status(f"failed: model did not load: {state.load_error}")
                return EXIT_CONFIG if state.config_error else EXIT_FAILED
            self.notifier.ready(f"ready: serving {state.model_id} on {self.address}")
            if await _first(self.stop.wait(), _until(lambda: not _engine_alive(state), every=LIVENESS_POLL_S)) == 1:
                # Accept nothing more: new connections wait in the socket's backlog for the next rank 0 (the
                # launcher holds the socket, daemon/listener.py) instead of meeting an engine that is gone.
                if self.site is not None:
                    await self.site.stop()
                if self.lent is not None:
                    self.lent.release()  # the launcher answers the probes until the next rank 0 (/ready: 503)
                error = state.engine.error if state.engine is not None else None
                log.error("engine stopped (%r); exiting", error)
                self.notifier.status(f"failed: engine stopped: {error!r}")
                return EXIT_FAILED
        await self._drain(state)
        return EXIT_OK

    async def _drain(self, state: ServerState) -> None:
        if (delay := self.config.unready_delay) > 0 and state.ready:
            state.leaving = True
            log.info("leaving the pool: /ready answers 503, new requests are still taken for %gs", delay)
            self.notifier.stopping(f"leaving the pool: still taking requests for {delay:g}s")
            await asyncio.sleep(delay)
        state.draining = True
        engine = state.engine
        in_flight = engine.num_in_flight if engine is not None else 0
        timeout = self.config.drain_timeout
        log.info("draining: %d requests in flight get up to %gs to finish", in_flight, timeout)
        self.notifier.stopping(f"draining: {in_flight} requests in flight, up to {timeout:g}s")
        if engine is None or await _until(lambda: engine.num_in_flight == 0, timeout):
            return
        cancelled = engine.cancel_all()
        log.warning("drain deadline passed: cancelling %d requests", cancelled)
        self.notifier.status(f"stopping: cancelled {cancelled} requests")
        # Their terminal events come at the next step boundary.
        await _until(lambda: engine.num_in_flight == 0, HANDLER_GRACE_S)

    def _on_signal(self, sig: signal.Signals) -> None:
        name = signal.Signals(sig).name
        if self.stop.is_set():
            log.warning("%s again: exiting now with code %d, without finishing the drain", name, 128 + sig)
            for handler in logging.getLogger().handlers:
                handler.flush()
            sys.stdout.flush()
            os._exit(128 + sig)
        log.info("%s: stopping (send it again to exit at once)", name)
        self.stop.set()

    async def _watchdog(self) -> None:
        """WATCHDOG=1 from the event loop itself: a loop that stops turning stops the pings."""
        interval = self.notifier.watchdog_interval
        if interval is None:
            return
        while True:
            self.notifier.watchdog()
            await asyncio.sleep(interval)


def _engine_alive(state: ServerState) -> bool:
    return state.engine is not None and state.engine.alive


async def _until(predicate: Callable[[], bool], within: float | None = None, every: float = DRAIN_POLL_S) -> bool:
    """Polls `predicate` every `every` seconds until it holds (True) or `within` seconds pass (False)."""
    loop = asyncio.get_running_loop()
    deadline = None if within is None else loop.time() + within
    while not predicate():
        if deadline is not None and loop.time() >= deadline:
            return False
        await asyncio.sleep(every)
    return True


async def _first(*aws: Awaitable) -> int:
    """Waits for the first of `aws` to finish, cancels the others and returns the index of the first."""
    tasks = [asyncio.ensure_future(aw) for aw in aws]
    try:
        done, _ = await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
        return next(i for i, task in enumerate(tasks) if task in done)
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
