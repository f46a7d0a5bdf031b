"""Fault injection for tests/spmd, loaded at start-up by every Python process that has this folder on PYTHONPATH.

In the process whose RANK equals FAULT_INJECT_RANK, a prompt containing `fault:prepare` or `fault:denoise` makes that
stage of the SD3 adapter raise, on that rank only: the rank-local faults of issue 10 (an OOM on one device, a broken
GPU), which no input can cause on every rank at once. Nothing in the daemon knows about this file.
"""

import os

_RANK = os.environ.get("FAULT_INJECT_RANK")

if _RANK is not None and os.environ.get("RANK") == _RANK:
    from diffusiond.models.families.sd3 import SD3Adapter

    def _inject(name: str) -> None:
        real = getattr(SD3Adapter, name)
        marker = f"fault:{name}"

        def stage(self, items):
            # prepare() takes (request id, params) pairs, denoise() RequestStates.
            params = [item[1] if isinstance(item, tuple) else item.params for item in items]
            if any(marker in p.prompt for p in params):
                raise RuntimeError(f"injected {marker} on rank {_RANK}")
            return real(self, items)

        setattr(SD3Adapter, name, stage)

    _inject("prepare")
    _inject("denoise")
