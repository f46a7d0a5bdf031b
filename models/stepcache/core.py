"""What every step-cache method shares: the server's method (`Method`, `method_of`), a request's cache and its
decision (`RequestCache`, `restart`, `reuse`), the change signals (`changes`, `relative_l1`), the batch a cached
forward runs over (`Batch`, `fit`) and the blocks run over a sub-batch of it (`run_blocks`). The methods themselves,
and what they do with these, are in models/stepcache/methods.py."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch

from diffusiond.kernels.host import to_device
from diffusiond.models.stepcache.settings import IDENTITY, check_cache_config


@dataclass
class Method:
    """The server's cache method; for TeaCache, the polynomial (highest degree first) that maps the modulated
    input's relative change to an estimate of the output's. `record`, when a list, receives (input change, change of
    the residual the blocks add) for every request-step computed after a computed step: the pairs
    tools/calibrate.py fits."""

    name: str
    coefficients: tuple[float, ...] = IDENTITY
    record: list[tuple[float, float]] | None = field(default=None, repr=False)
    # DBCache's blocks always computed first and last, and the steps before any reuse (fbcache: 1, 0, 0).
    fn: int = 1
    bn: int = 0
    warmup: int = 0
    # DBCache: forecast the reused span's residuals by TaylorSeer (its order: the finite differences kept).
    taylorseer: bool = False
    taylorseer_order: int = 1
    # x0cache: the most steps a request reuses in a row.
    max_run: int = 1
    # MagCache: the checkpoint's magnitude ratio per step (the norm of the blocks' residual over the previous
    # step's, on a calibration's steps), the most steps reused in a row, the share of first steps always computed.
    ratios: tuple[float, ...] = ()
    max_skip: int = 3
    retention: float = 0.2

    def rescale(self, x: float) -> float:
        value = 0.0
        for c in self.coefficients:  # Horner
            value = value * x + c
        return max(value, 0.0)  # a fitted polynomial may dip below 0 outside its data; a change cannot


def method_of(
    name: str, config: dict[str, Any], blocks: int, coefficients: tuple[float, ...] = IDENTITY, ratios: Any = None
) -> Method:
    """The server's method from `--cache NAME` and `--cache-config` (`config`, parsed JSON) for a transformer of
    `blocks` blocks; `ratios`: MagCache's measured for the checkpoint, when `config` gives none. ValueError naming
    what is wrong (an unknown key, a bad value, no block left to reuse, MagCache without ratios)."""
    settings = check_cache_config(name, config)
    settings.pop("scm", None)  # the requests' default mask: the adapter's (models/flowmatch/requests.py)
    settings.setdefault("ratios", tuple(ratios or ()))
    method = Method(name, coefficients, **settings)
    if name == "magcache" and not method.ratios:
        raise ValueError(
            "--cache magcache needs the checkpoint's magnitude ratios: measure them with `python -m "
            "diffusiond.tools.calibrate --method magcache --model MODEL` (or give them: --cache-config "
            "'{\"ratios\": [...]}')"
        )
    if name == "dbcache" and method.fn + method.bn >= blocks:
        raise ValueError(
            f"--cache-config: fn + bn = {method.fn + method.bn} leaves none of the transformer's {blocks} blocks "
            "to reuse"
        )
    return method


@dataclass
class RequestCache:
    """One request's cache, per row: the signal at its previous step (fbcache: the first block's residual at its
    last computed step; teacache: the modulated input at its previous step, computed or not), the residual to reuse,
    and TeaCache's accumulated estimate since the last computed step."""

    signal: torch.Tensor
    rest: torch.Tensor
    # dbcache with blocks after the reused ones: the text tokens' residual of the reused blocks.
    rest_text: torch.Tensor | None = None
    # TaylorSeer: the step of the last computed residuals, and their finite differences per step (first order first)
    # between the computed steps before, for `rest` and `rest_text`.
    at: int = 0
    rest_diffs: list[torch.Tensor] = field(default_factory=list)
    text_diffs: list[torch.Tensor] = field(default_factory=list)
    # x0cache (`signal`: the predicted clean image of the last computed step; `rest` unused): its relative change per
    # step between the last two computed steps, the steps since the last computed one, and whether this step reuses.
    rate: float | None = None
    since: int = 0
    holding: bool = False
    computed: int = 0
    reused: int = 0
    accumulated: float = 0.0
    # MagCache, since the last computed step: the product of the steps' magnitude ratios and the steps counted.
    magnitude: float = 1.0
    counted: int = 0
    # The denoiser that computed its history (Wan 2.2 A14B's experts: `restart` at the switch).
    denoiser: int = 0


def restart(state: Any) -> None:
    """The request moves to another denoiser (Wan 2.2 A14B's low-noise expert): no residual, signal or forecast
    of the other one's applies, so its next step computes and starts a new history. Its reuses so far stay counted
    (`RequestState.reused_before`)."""
    if state.cache is not None:
        state.reused_before += state.cache.reused
        state.cache = None


def reuse(state: Any, change: float | None) -> bool:
    """Whether this request may skip blocks at this step. `change`: its change signal since its last computed step
    (fbcache: relative L1 change of the first-block residual; teacache: the accumulated rescaled change), measured
    over all its rows and tokens on every rank (None: no cache yet). Steps its mask lists (`cache_steps`) compute."""
    threshold = state.params.cache_threshold or 0.0
    last = state.step_index + 1 >= state.total_steps
    if threshold <= 0 or change is None or state.step_index == 0 or last:
        return False
    mask = state.params.cache_steps
    if mask is not None and state.step_index in mask:
        return False
    return change < threshold


def changes(current: torch.Tensor, rows: int, previous: Sequence[torch.Tensor | None]) -> list[float | None]:
    """Each request's relative L1 change of `current` (its `rows` rows) against `previous`, agreed by every rank of a
    group: the sums |x - x_prev| and |x_prev| over the rows and tokens each rank holds are all-reduced, so a request
    split across ranks (CFG-parallel: a row each; Ulysses: a token shard each) decides once, the same everywhere.
    (Ranks that hold the same rows add copies of the same sums; the ratio is unchanged.)"""
    import torch.distributed as dist

    sums = torch.zeros(len(previous), 2, dtype=torch.float64, device=current.device)
    for i, prev in enumerate(previous):
        if prev is not None:
            mine = current[i * rows : (i + 1) * rows].double()
            sums[i, 0] = (mine - fit(prev, mine.shape[1]).double()).abs().sum()
            sums[i, 1] = prev.double().abs().sum()
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(sums)  # every rank runs every step's forward (SPMD): the world is the right group
    values = (sums[:, 0] / sums[:, 1].clamp_min(1e-12)).tolist()
    return [None if prev is None else value for prev, value in zip(previous, values, strict=True)]


def relative_l1(current: torch.Tensor, previous: torch.Tensor) -> float:
    """mean|x - x_prev| / mean|x_prev|, on this rank's elements."""
    previous = previous.double()
    return float((current.double() - previous).abs().sum() / previous.abs().sum().clamp_min(1e-12))


def signals(states: Sequence[Any]) -> list[torch.Tensor | None]:
    return [None if s.cache is None else s.cache.signal for s in states]


@dataclass
class Batch:
    """One cached forward's inputs: B requests x `rows` rows of image tokens `h` [B * rows, S, D], text tokens
    `enc` [B * rows, L, D] and `temb` [B * rows, ...]. `row_kwargs`: block arguments with a row per batch row (a
    text mask, or None), sub-batched with the rows; `narrows`: what holds a plan per row and narrows it to a
    sub-batch (`narrow(rows or None)`, a context: the transformer's LoRA layers, Wan's projection plan);
    `block_kwargs`: the other block arguments. `context`: `enc` is a context the blocks read and return unchanged
    (Wan's text), so no residual of it is kept. `valid`: [B * rows, S], the tokens of `h` that are each row's own,
    where rows of one batch are padded to its longest (Z-Image's joint sequence; None: every token): the change
    signals read those only, so that a request decides as it would alone.

    A request's sequence may be padded to another length at every step (the batch's longest, as requests come and
    go): what it keeps (signals, residuals, their differences) is fitted to the step's length (`fit`), the padding's
    share zeros."""

    h: torch.Tensor
    enc: torch.Tensor
    temb: torch.Tensor
    rows: int
    states: Sequence[Any]
    row_kwargs: dict[str, torch.Tensor | None] = field(default_factory=dict)
    narrows: Sequence[Any] = ()
    block_kwargs: dict[str, Any] = field(default_factory=dict)
    context: bool = False
    valid: torch.Tensor | None = None

    def signal(self, x: torch.Tensor) -> torch.Tensor:
        """`x` [B * rows, S, ...] with the padding's tokens zeroed (a change signal reads the rows' own tokens)."""
        if self.valid is None:
            return x
        return x * self.valid.view(*self.valid.shape, *([1] * (x.dim() - 2))).to(x.dtype)


def fit(x: torch.Tensor, tokens: int) -> torch.Tensor:
    """`x` [rows, S, ...] cut or zero-padded to `tokens` tokens (dim 1): a request's kept tensors at this step's
    padded length."""
    if x.dim() < 2 or x.shape[1] == tokens:
        return x
    if x.shape[1] > tokens:
        return x[:, :tokens]
    return torch.nn.functional.pad(x, (0, 0) * (x.dim() - 2) + (0, tokens - x.shape[1]))


@dataclass
class Ran:
    """What `run_blocks` gives: the image tokens of every row after the blocks (rows that did not run: as they came,
    in a new tensor), and the running rows' image and text tokens after them (in `computing` order; None when no row
    ran). `text`: the text tokens of every row, when asked for (`text=True`)."""

    h: torch.Tensor
    hc: torch.Tensor | None
    ec: torch.Tensor | None
    text: torch.Tensor | None = None


@contextmanager
def narrowed(narrows: Sequence[Any], picked: list[int] | None) -> Iterator[None]:
    """The row plans (a transformer's LoRA layers, Wan's projections) narrowed to a sub-batch's rows (`picked`; None:
    every row)."""
    with ExitStack() as stack:
        for plan in narrows:
            stack.enter_context(plan.narrow(picked))
        yield


def run_blocks(
    blocks: Sequence[Any], h: torch.Tensor, enc: torch.Tensor, batch: Batch, computing: list[int], text: bool = False
) -> Ran:
    """`blocks` over `h` and `enc`'s rows of the `computing` requests (a sub-batch; all of them when every request
    computes, exactly as the pipeline's forward)."""
    rows, temb, row_kwargs = batch.rows, batch.temb, batch.row_kwargs
    n = h.shape[0] // rows
    if len(computing) == n:
        hc, ec, tc, index = h, enc, temb, None
    else:
        if not computing:
            return Ran(h.clone(), None, None, enc.clone() if text else None)
        picked = [i * rows + r for i in computing for r in range(rows)]
        index = to_device(picked, h.device)
        hc, ec, tc = h[index], enc[index], temb[index]
        row_kwargs = {name: None if t is None else t[index] for name, t in row_kwargs.items()}
    with narrowed(batch.narrows, picked if index is not None else None):
        for block in blocks:
            ec, hc = block(hidden_states=hc, encoder_hidden_states=ec, temb=tc, **row_kwargs, **batch.block_kwargs)
    if index is None:
        return Ran(hc, hc, ec, ec if text else None)
    out = h.clone()
    out[index] = hc
    if not text:
        return Ran(out, hc, ec)
    out_text = enc.clone()
    out_text[index] = ec
    return Ran(out, hc, ec, out_text)
