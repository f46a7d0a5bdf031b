"""Collectives inside the model (CFG-parallel gathers, Ulysses all-to-alls) fail as a group, never per request; and
work done once on rank 0 for every rank (`SharedEncoding`)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator


class CommError(RuntimeError):
    """A collective failed: a rank died or the group broke. Never a single request's fault."""


@contextlib.contextmanager
def collective(what: str) -> Iterator[None]:
    """A failed collective breaks the group (a rank died, or ranks disagree), whichever request it ran for: it
    surfaces as CommError, which stops the engine instead of failing one request."""
    try:
        yield
    except CommError:
        raise
    except Exception as exc:
        raise CommError(f"{what} failed: {exc}") from exc


def gather_digests(digest: bytes, device) -> list[bytes]:
    """Every rank's `digest` (bytes of one length on every rank), in rank order: what each rank read, compared."""
    import torch
    import torch.distributed as dist

    mine = torch.frombuffer(bytearray(digest), dtype=torch.uint8).to(device)
    every = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(every, mine)
    return [t.cpu().numpy().tobytes() for t in every]


class SharedWorkFailed(RuntimeError):
    """The work failed on rank 0; every rank of the group raises this, at the same point."""


class SharedEncoding:
    """Work whose result every rank needs, done once: rank 0 of `group` runs it and broadcasts the tensors it made
    (prompt encodings), the others receive them instead of running it. The ranks must ask for the same work in the
    same order (SPMD: the same plans); a digest of what each asked for is checked, so ranks that diverged fail loudly.
    A failure on rank 0 reaches every rank as the same exception, so their retries stay in step."""

    def __init__(self, group, rank: int, device) -> None:
        self.group, self.rank, self.device = group, rank, device
        self.sent = 0  # bytes broadcast, for tests and metrics

    def run(self, key: str, work) -> list[tuple]:
        """`work()` -> one tuple of tensors per item, on rank 0; every rank gets that list. `key`: what is asked (the
        texts), identical on every rank."""
        import hashlib

        import msgspec
        import torch
        import torch.distributed as dist

        digest = hashlib.blake2b(key.encode(), digest_size=8).hexdigest()
        items: list[tuple] = []
        header: dict = {"digest": digest, "error": None, "items": []}
        if self.rank == 0:
            try:
                items = work()
                header["items"] = [
                    [(str(t.dtype).removeprefix("torch."), list(t.shape)) for t in item] for item in items
                ]
            except Exception as exc:
                header["error"] = f"{type(exc).__name__}: {exc}"
        with collective("encode-once broadcast"):
            data = msgspec.json.encode(header) if self.rank == 0 else b""
            size = torch.tensor([len(data)], dtype=torch.int64, device=self.device)
            dist.broadcast(size, 0, group=self.group)
            raw = torch.empty(int(size.item()), dtype=torch.uint8, device=self.device)
            if self.rank == 0:
                raw.copy_(torch.frombuffer(bytearray(data), dtype=torch.uint8))
            dist.broadcast(raw, 0, group=self.group)
            header = msgspec.json.decode(raw.cpu().numpy().tobytes())
            if header["error"] is not None:
                raise SharedWorkFailed(f"prompt encoding failed on rank 0: {header['error']}")
            if header["digest"] != digest:
                raise CommError("ranks asked to encode different prompts: they have diverged")
            if self.rank != 0:
                items = [
                    tuple(torch.empty(shape, dtype=getattr(torch, dtype), device=self.device) for dtype, shape in item)
                    for item in header["items"]
                ]
            for item in items:
                for t in item:
                    t = t.contiguous()
                    dist.broadcast(t, 0, group=self.group)
                    self.sent += t.numel() * t.element_size()
        return items
