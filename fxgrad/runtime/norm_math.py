"""Gradient norms as plain torch code, accumulated in float32.

Per layer, fxgrad keeps *power sums* ``sum |g|^p`` (the max of ``|g|`` for
``p = inf``) rather than norms: they combine across parameters and layers by
addition, and scaling a layer's gradients by ``f`` scales its power sum by
``f^p``, so a chain of scaling transforms needs the gradients read once.

    >>> import torch
    >>> stats, = layer_stats([[torch.ones(4), torch.ones(5)]], (2.0,))
    >>> stats.norm(2.0)
    tensor(3.)
    >>> group_norm([stats, stats.scaled(torch.tensor(2.0))], 2.0)
    tensor(6.7082)

Every reduction over a whole gradient reaches the other ranks' shards through
:func:`over_shards`: DTensor gradients (FSDP2, tensor parallelism) all-reduce
their partial values one by one, and the step program over FSDP2's local
shards (:func:`local_shards`) all-reduces them all at once.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import math
from typing import Callable, Iterable, Iterator, Literal, Sequence

import torch
from torch.distributed.tensor import DTensor, Replicate

from fxgrad import _compat

Factor = torch.Tensor | float


def accumulation_dtype(tensor: torch.Tensor) -> torch.dtype:
    """float32, or float64 for float64 gradients."""
    return _accumulation_dtype(tensor.dtype)


@functools.cache
def _accumulation_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.promote_types(dtype, torch.float32)


def cast(tensor: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``tensor.to(dtype)``, without dispatching anything when it already has that dtype.

    Rules run once per graph on fake tensors, where every dispatch costs ~0.1 ms.
    """
    return tensor if tensor.dtype == dtype else tensor.to(dtype)


def widen(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` in its :func:`accumulation_dtype`."""
    return cast(tensor, accumulation_dtype(tensor))


def magnitude(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor``, or ``|tensor|`` (real) when it is complex: norms see moduli, as
    ``torch.linalg.vector_norm`` does."""
    return tensor.abs() if tensor.is_complex() else tensor


def power_sum(tensors: Sequence[torch.Tensor], p: float, unscale: torch.Tensor | None = None) -> torch.Tensor:
    """``sum |t|^p`` over all elements (``max |t|`` for ``p = inf``), a 0-dim tensor; of
    ``t * unscale`` when given (a GradScaler's inverse scale: the sum of the scaled values
    overflows float32 at large scales, the unscaled one does not).

    Sparse COO tensors (``nn.Embedding(sparse=True)``) take the finite orders: torch's sparse
    ops coalesce them first (repeated indices add up). They have no max reduction."""
    if math.isinf(p) and any(t.layout != torch.strided for t in tensors):
        raise NotImplementedError(
            "fxgrad: the max-abs norm (norm 'linf', norm_type=inf) of a sparse gradient "
            "(nn.Embedding(sparse=True)?) is not supported; the other norms are"
        )
    wide = [widen(magnitude(t)) for t in tensors]
    if unscale is not None:
        wide = [t * like(t, cast(unscale, t.dtype)) for t in wide]
    if math.isinf(p):
        return _reduce([abs_max(t) for t in wide], torch.maximum)
    if p == 2.0:
        return _reduce([(t * t).sum() for t in wide], torch.add)
    if p == 1.0:
        return _reduce([t.abs().sum() for t in wide], torch.add)
    return _reduce([t.abs().pow(p).sum() for t in wide], torch.add)


def _power_sum_of(p: float, unscale: torch.Tensor | None, *tensors: torch.Tensor) -> torch.Tensor:
    return power_sum(tensors, p, unscale)


def call(fn: Callable[..., torch.Tensor], *args) -> torch.Tensor:
    """``fn(*args)``: the ``replay`` of code that runs on real tensors (step scope) and
    records nothing (see :meth:`~fxgrad.runtime.context.RouteContext.per_tensor`)."""
    return fn(*args)


def abs_max(tensor: torch.Tensor) -> torch.Tensor:
    """``max |tensor|``, 0 for an empty tensor (a rank's shard of a short FSDP2 parameter)."""
    return tensor.abs().amax() if tensor.numel() else tensor.new_zeros((), dtype=tensor.real.dtype)


def l2(tensor: torch.Tensor, dim: int | tuple[int, ...] | None = None, keepdim: bool = False) -> torch.Tensor:
    """The L2 norm of ``tensor`` (over ``dim``): ``sqrt(sum(t * t))``.

    The ops ``torch.linalg.vector_norm`` decomposes into, written out: recording
    them skips its Python decomposition (~0.7 ms per call; sinkhorn makes 11 per
    parameter).
    """
    tensor = magnitude(tensor)
    squares = tensor * tensor
    return (squares.sum() if dim is None else squares.sum(dim, keepdim=keepdim)).sqrt()


def root(value: torch.Tensor, p: float) -> torch.Tensor:
    """The norm from a power sum."""
    if math.isinf(p):
        return value
    if p == 2.0:
        return value.sqrt()
    if p == 1.0:
        return value
    return value.pow(1.0 / p)


def _reduce(values: Iterable[torch.Tensor], op) -> torch.Tensor:
    values = list(values)
    result = values[0]
    for value in values[1:]:
        result = op(result, value)
    return result


class NormStats:
    """Power sums of one layer's gradients, for the norm orders a policy needs.

    A :meth:`scaled` copy computes nothing until it is read: its power sum is the
    original's times ``factor^p``, and its norm, where the original's norm was
    taken, that norm times ``factor`` (one recorded op instead of three for
    ``p = 2``; a chain of scaling rules reads each layer's norm after each one).
    """

    def __init__(self, sums: dict[float, torch.Tensor], scaled_from: tuple[NormStats, Factor] | None = None) -> None:
        self.orders = frozenset(sums) if scaled_from is None else scaled_from[0].orders
        self._sums = dict(sums)
        self._norms: dict[float, torch.Tensor] = {}
        self._scaled_from = scaled_from

    def sum(self, p: float) -> torch.Tensor:
        """``sum |g|^p`` over the layer's gradients (``max |g|`` for ``p = inf``)."""
        if p not in self._sums:
            original, factor = self._scaled_from
            self._sums[p] = original.sum(p) * _power(factor, p)
        return self._sums[p]

    def norm(self, p: float) -> torch.Tensor:
        if p not in self._norms:
            original = self._scaled_from
            if original is not None and p in original[0]._norms:
                self._norms[p] = original[0]._norms[p] * original[1]
            else:
                self._norms[p] = root(self.sum(p), p)
        return self._norms[p]

    def scaled(self, factor: Factor) -> NormStats:
        """The statistics of the gradients multiplied by ``factor >= 0``."""
        return NormStats({}, scaled_from=(self, factor))


def _power(factor: Factor, p: float) -> Factor:
    """``factor ** p`` for how power sums scale (``factor`` itself for 1 and inf)."""
    if math.isinf(p) or p == 1.0:
        return factor
    return factor * factor if p == 2.0 else factor**p


def layer_stats(
    layers: Sequence[Sequence[torch.Tensor]],
    orders: Sequence[float],
    replay: Callable[..., torch.Tensor] = call,
    unscale: torch.Tensor | None = None,
) -> list[NormStats]:
    """The :class:`NormStats` of each layer's gradients (``layers[i]``), over all their shards,
    times ``unscale`` (see :func:`power_sum`). ``replay(fn, *args)`` runs each layer's power
    sums (see :meth:`~fxgrad.runtime.context.RouteContext.per_tensor`)."""
    local = [[replay(_power_sum_of, p, unscale, *grads) for p in orders] for grads in layers]
    sums = [over_shards([row[i] for row in local], "max" if math.isinf(p) else "sum") for i, p in enumerate(orders)]
    return [NormStats({p: sums[i][k] for i, p in enumerate(orders)}) for k in range(len(layers))]


def group_norm(stats: Sequence[NormStats], p: float) -> torch.Tensor:
    """The norm of several layers' gradients taken together."""
    combine = torch.maximum if math.isinf(p) else torch.add
    return root(_reduce((s.sum(p) for s in stats), combine), p)


def clip_coefficient(norm: torch.Tensor, max_norm: float | torch.Tensor) -> torch.Tensor:
    """``min(1, max_norm / (norm + 1e-6))``, as ``clip_grad_norm_`` computes it; ``max_norm``
    may be computed on the device."""
    return torch.clamp_max(max_norm / (norm + 1e-6), 1.0)


def scaled(tensors: Sequence[torch.Tensor], factor: Factor) -> list[torch.Tensor]:
    """``t * factor`` for each tensor, computed in float32 and cast back."""
    return [cast(widen(t) * like(t, factor), t.dtype) for t in tensors]


def replicated(value: torch.Tensor) -> torch.Tensor:
    """A plain tensor: a DTensor's reduction (partial over shards) is all-reduced first."""
    return value.full_tensor() if isinstance(value, DTensor) else value


_SHARDS: contextvars.ContextVar[str | None] = contextvars.ContextVar("fxgrad_local_shards", default=None)


@contextlib.contextmanager
def local_shards(group: str) -> Iterator[None]:
    """Within the block, the gradients are this rank's shards of gradients sharded over the
    process group named ``group`` (FSDP2's, as plain local tensors): :func:`over_shards`
    all-reduces over it."""
    token = _SHARDS.set(group)
    try:
        yield
    finally:
        _SHARDS.reset(token)


def over_shards(values: Sequence[torch.Tensor], op: Literal["sum", "max"] = "sum") -> list[torch.Tensor]:
    """``values``, 0-dim reductions (by ``op``) each over all of a gradient or of several, as
    plain tensors reduced over every rank's shard of those gradients.

    DTensor values are all-reduced one by one (DTensor tracks the partial); values of local
    shards (:func:`local_shards`) by one all-reduce of them stacked; other values are whole."""
    group = _SHARDS.get()
    if group is not None and values:
        return list(_compat.all_reduce(torch.stack(list(values)), op, group).unbind())
    return [replicated(value) for value in values]


def like(tensor: torch.Tensor, factor: Factor) -> Factor:
    """``factor`` in a form that multiplies ``tensor`` (replicated when it is a DTensor)."""
    if isinstance(tensor, DTensor) and isinstance(factor, torch.Tensor) and not isinstance(factor, DTensor):
        mesh = tensor.device_mesh
        return DTensor.from_local(factor, mesh, [Replicate()] * mesh.ndim, run_check=False)
    return factor
