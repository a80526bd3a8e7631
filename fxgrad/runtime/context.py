"""What a transform may use while fxgrad records it into a backward graph.

Leaves receive a :class:`RouteContext`. Its state, loss scale and statistics
are device tensors read and written by custom ops inside the compiled graph,
so they change every step without a host sync or a recompile::

    def factors(self, stats, layers, ctx):
        state = ctx.state(shared={"tau": ((), 0.0)}, per_layer={"ema": 0.0})
        ...
        ctx.save(state, tau=new_tau, ema=new_ema)       # all entries, same shapes
        ctx.emit("clip_coef", coef)                      # -> backend.stats()["clip_coef"]
        ctx.emit_per_layer("grad_norm", norms_vector)    # -> "grad_norm/<layer>"
"""

from __future__ import annotations

import functools
import math
from typing import Any, Callable, Literal, Sequence

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Replicate

from fxgrad import _compat
from fxgrad.core.layers import Layer
from fxgrad.runtime.norm_math import call, replicated, widen
from fxgrad.runtime.state import StateStore, flat

Shape = tuple[int, ...]
# What a run of the policy leaves to the optimizer's update: the global factor, each layer's
# (see fxgrad.runtime.executor), or nothing
Fold = Literal["global", "layers"] | None


class GraphContext:
    """Shared by the routes of one backward graph: store, device, loss scale, stats.

    State entries are per transform and, for per-layer values, per layer, so
    every recompile of the same code updates the same EMAs and histories. A
    transform's shared entries (a threshold, a history) are also per compiled
    ``frame``: ``0`` for the first frame, ``k`` for the k-th other one (the
    code after a graph break), whose keys end in ``@frame<k>``.
    """

    def __init__(
        self,
        store: StateStore,
        device: torch.device,
        scaler: Any = None,
        params: Callable[[Sequence[str]], list[torch.Tensor]] | None = None,
        frame: int = 0,
        fold: Fold = None,
        per_step: bool = False,
        replay: Callable[..., Any] = call,
    ) -> None:
        self.store, self.device = store, device
        self.replay = replay
        self.params = params
        self.frame = frame
        self.fold = fold  # leave the global factor, or each layer's, to the optimizer: see Executor
        self.per_step = per_step  # step scope: the gradients are every .grad, after any data-parallel reduction
        self._stats: dict[str, tuple[str, str] | None] = {}  # key -> (statistic, layer) if per layer
        self._stat_order: list[tuple[list[str], torch.Tensor]] = []
        self.scale: torch.Tensor | None = None
        self.threshold_scale: torch.Tensor | None = None  # set by skip_nonfinite(backoff=...)
        self.skipped: torch.Tensor | None = None  # set by skip_nonfinite: this step's gradients were zeroed
        if scaler is not None:
            read = lambda: _read_scale(scaler)  # noqa: E731
            group = store.external_group("loss scale", ("loss scale",), read, 1, device)
            self.scale = torch.ops.fxgrad.load_state(group.name)[0]

    def route(self, index: int, name: str, layers: Sequence[Layer], executor: Any) -> RouteContext:
        return RouteContext(self, f"{index}.{name}", index, layers, executor)

    def emit(
        self, keys: list[str], value: torch.Tensor, index: int, layer_of: Sequence[tuple[str, str]] | None = None
    ) -> None:
        """Statistics ``keys`` with values ``value``; ``layer_of`` gives each key's
        ``(statistic, layer)`` when they are per-layer values."""
        named = []
        for i, key in enumerate(keys):
            if key in self._stats:  # a second transform reporting it: named apart, not in the totals
                key, found = f"{key}@{index}", None
            else:
                found = layer_of[i] if layer_of is not None else None
            self._stats[key] = found
            named.append(key)
        self._stat_order.append((named, value))

    def finish(self) -> None:
        """Record the save of this graph's statistics."""
        if not self._stat_order:
            return
        keys = [key for keys, _ in self._stat_order for key in keys]
        per_layer = {key: found for key, found in self._stats.items() if found is not None}
        group = self.store.stats_group(keys, self.device, per_layer)
        torch.ops.fxgrad.save_state(group.name, flat(value for _, value in self._stat_order))


@torch.library.custom_op("fxgrad::rank_extremes", mutates_args=())
def rank_extremes(value: torch.Tensor) -> torch.Tensor:
    """``[max, -min]`` of the 0-dim ``value`` over the ranks of the default process group:
    one all-reduce (MAX) of 2 values, on the device."""
    both = torch.stack([value, -value])
    dist.all_reduce(both, op=dist.ReduceOp.MAX)
    return both


@rank_extremes.register_fake
def _rank_extremes_fake(value: torch.Tensor) -> torch.Tensor:
    return value.new_empty(2)


def _read_scale(scaler: Any) -> torch.Tensor:
    scale = _compat.grad_scaler_scale(scaler)
    if scale is None:
        raise RuntimeError("GradScaler has no scale yet: call scaler.scale(loss).backward()")
    return scale


class RouteContext:
    """One route's view of the graph context: its own state namespace and layers."""

    def __init__(self, graph: GraphContext, key: str, index: int, layers: Sequence[Layer], executor: Any) -> None:
        self.graph, self.key, self.index, self.layers = graph, key, index, list(layers)
        self._executor = executor
        self._groups: dict[int, Any] = {}

    @property
    def scale(self) -> torch.Tensor | None:
        """The loss scale (float64, 0-dim) when the backend has a GradScaler."""
        return self.graph.scale

    def per_tensor(self, fn: Callable[..., torch.Tensor], *args: Any) -> torch.Tensor:
        """``fn(*args)``, for a function of its arguments alone that a rule runs once per
        gradient or layer: graph scope records it once per kind of argument (shapes, strides, dtypes,
        devices, other values) and copies that recording for the rest, ~2x cheaper per op.

            out = [[ctx.per_tensor(self._one, g, ctx.scale) for g in group] for group in grads]
        """
        return self.graph.replay(fn, *args)

    def threshold(self, value: float) -> float | torch.Tensor:
        """A clipping threshold as configured, times the factor that
        ``skip_nonfinite(backoff=...)`` earlier in the policy keeps (float64, on the device)."""
        scale = self.graph.threshold_scale
        return value if scale is None else scale * value

    def lower_thresholds(self, scale: torch.Tensor) -> None:
        """Make :meth:`threshold` multiply by ``scale`` for the routes recorded after this one."""
        self.graph.threshold_scale = scale

    def skip_state_updates(self, skipped: torch.Tensor) -> None:
        """Make :meth:`save` of the routes recorded after this one keep the old state when
        ``skipped`` (0-dim, bool) holds: a step whose gradients ``skip_nonfinite`` zeroed is no
        step to the rules after it (a zero norm in autoclip's history would lower its threshold;
        in AdaGC's EMA, clip every later step to zero)."""
        self.graph.skipped = skipped

    def state(
        self,
        shared: dict[str, tuple[Shape, float]] | None = None,
        per_layer: dict[str, float] | None = None,
        per_param: dict[str, float] | None = None,
    ) -> dict[str, torch.Tensor]:
        """Load this route's state: ``shared`` entries with their shapes, one
        value per layer for each ``per_layer`` entry (a vector over ``layers``),
        and one value per parameter for each ``per_param`` entry (a vector over
        the layers' ``params``, layer by layer).

        Returned tensors are float64. Initial values apply the first time.
        """
        shared, per_layer, per_param = shared or {}, per_layer or {}, per_param or {}
        if shared:
            self.graph.store.spanning.add(self.key)
        if per_layer or per_param:
            self.graph.store.by_layer.add(self.key)
        names = [layer.name for layer in self.layers]
        params = [param for layer in self.layers for param in layer.params]
        frame = f"@frame{self.graph.frame}" if self.graph.frame else ""
        entries = [(f"{self.key}/{n}{frame}", shape, init) for n, (shape, init) in shared.items()]
        entries += [(f"{self.key}/{n}/{layer}", (), init) for n, init in per_layer.items() for layer in names]
        entries += [(f"{self.key}/{n}/{param}", (), init) for n, init in per_param.items() for param in params]
        group = self.graph.store.group(self.key, entries, self.graph.device)
        buffer = torch.ops.fxgrad.load_state(group.name)
        values, offset = {}, 0
        for n, (shape, _) in shared.items():
            size = math.prod(shape)
            values[n] = buffer[offset : offset + size].view(shape)
            offset += size
        for n in per_layer:
            values[n] = buffer[offset : offset + len(names)]
            offset += len(names)
        for n in per_param:
            values[n] = buffer[offset : offset + len(params)]
            offset += len(params)
        self._groups[id(values)] = (group, list(shared) + list(per_layer) + list(per_param))
        return values

    def save(
        self, state: dict[str, torch.Tensor], *, finite: torch.Tensor | None = None, **new: torch.Tensor
    ) -> dict[str, torch.Tensor]:
        """Write back every entry of ``state`` (new values, same shapes), and return what was written.

        With ``finite=norms``, every entry keeps its old value unless all of
        ``norms`` are finite: one overflow step (routine with a GradScaler, which
        then skips the whole step) must not leave a NaN EMA or target behind for
        good, nor advance the layers whose norms happened to stay finite. So does
        every entry on a step ``skip_nonfinite`` earlier in the policy skipped
        (:meth:`skip_state_updates`).
        """
        group, order = self._groups[id(state)]
        missing = set(order) - set(new)
        if missing:
            raise ValueError(f"save() of {self.key} needs values for {sorted(missing)}")
        ok = None
        if finite is not None:
            ok = torch.isfinite(finite)
            ok = ok.all() if ok.dim() else ok
        if self.graph.skipped is not None:
            ok = ~self.graph.skipped if ok is None else ok & ~self.graph.skipped
        if ok is not None:
            new = {n: torch.where(ok, value, state[n]) for n, value in new.items()}
        torch.ops.fxgrad.save_state(group.name, flat(new[n] for n in order))
        return new

    def emit(self, name: str, value: torch.Tensor) -> None:
        """A statistic for ``backend.stats()[name]`` (a 0-dim tensor)."""
        self.graph.emit([name], value, self.index)

    def emit_per_layer(self, name: str, values: torch.Tensor) -> None:
        """One statistic per layer, ``backend.stats()[f"{name}/{layer}"]``."""
        layers = [layer.name for layer in self.layers]
        keys = [f"{name}/{layer}" for layer in layers]
        self.graph.emit(keys, values, self.index, [(name, layer) for layer in layers])

    def ranks_differ(self, checksum: torch.Tensor) -> torch.Tensor:
        """1.0 (float64, 0-dim) when the 0-dim ``checksum`` is not the same on every rank, beyond a
        relative 1e-6 (a non-finite value counts as one value); 0.0 in a single process.

        In a multi-process job it costs one all-reduce of 2 values (:func:`rank_extremes`), on
        the device, and needs step scope: in graph scope each rank sees its own gradient, so
        the ranks differ by design (``ValueError``).
        """
        if _compat.data_parallel_world_size() == 1:
            return torch.zeros((), dtype=torch.float64, device=checksum.device)
        if not self.graph.per_step:
            raise ValueError(
                "check_ranks compares the gradients every rank applies, after the data-parallel "
                "reduction; scope='graph' transforms each rank's own gradient: use scope='step' or 'auto'"
            )
        value = checksum.to(torch.float64)
        both = torch.ops.fxgrad.rank_extremes(torch.where(torch.isfinite(value), value, -1.0))
        high, low = both[0], -both[1]
        return ((high - low) > 1e-6 * torch.maximum(high.abs(), low.abs())).to(torch.float64)

    def after_policy(self, callback: Callable[[list], None]) -> None:
        """Call ``callback(stats)`` with the L2 :class:`~fxgrad.runtime.norm_math.NormStats` of this
        route's layers once the whole policy has run (for "after" telemetry)."""
        names = [layer.name for layer in self.layers]
        self._executor.at_end(lambda: callback(self._executor.norms_now(names, (2.0,))))

    def weight_norms(self) -> torch.Tensor:
        """The L2 norm of each layer's parameters (float64 vector over ``layers``), computed in
        float32 or wider: a bfloat16 layer's norm in bfloat16 is 0.3% off (nearby layers' tie),
        a float16 one's is inf above 65504.

        Parameters are not inputs of the backward graph; a custom op reads them
        on the device (the optimizer has not stepped yet, so they are current).
        """
        params = self._params()

        def read() -> torch.Tensor:  # FSDP2: whole-layer norms, reduced over the shards
            return torch.stack(
                [
                    replicated(torch.linalg.vector_norm(torch.stack(_compat.foreach_norm(ps, _norm_dtype(ps)))))
                    for ps in params()
                ]
            )

        return self._external("weight norms", read, len(self.layers))

    def weight_row_norms(self) -> list[list[torch.Tensor]]:
        """Per layer, per parameter: the L2 norm of each output row (dims 1..), kept
        broadcastable (``(rows, 1, ...)``); one norm for 0-D and 1-D parameters."""
        params = self._params()
        shapes = [[_row_shape(p) for p in layer_params] for layer_params in params()]

        def read() -> torch.Tensor:  # DTensor weights: every row's whole norm, on every rank
            return torch.cat([replicated(_row_norms(p)).reshape(-1) for layer_params in params() for p in layer_params])

        return _split(self._external("weight row norms", read, _numel(shapes)), shapes)

    def weights(self) -> list[list[torch.Tensor]]:
        """Per layer, per parameter: a copy of the parameter's values, in float32 or the widest
        dtype among the parameters (float64, complex).

        Costs one read of those parameters per step.
        """
        params = self._params()
        shapes = [[tuple(p.shape) for p in layer_params] for layer_params in params()]
        if len({isinstance(p, DTensor) for layer_params in params() for p in layer_params}) > 1:
            raise ValueError(
                f"fxgrad: {self.key} reads the weights themselves, and these mix DTensors and plain tensors "
                "(tensor parallelism, with modules outside the plan): not supported. Route it to the "
                "parallelized layers only (by_name, by_type), or leave it out under tensor parallelism"
            )
        dtype = _widest([p for ps in params() for p in ps])

        def read() -> torch.Tensor:  # DTensor weights whole on every rank: uneven shards do not flatten
            return torch.cat([_whole(p).reshape(-1) for layer_params in params() for p in layer_params])

        return _split(self._external("weights", read, _numel(shapes), dtype=dtype), shapes)

    def _params(self) -> Callable[[], list[list[torch.Tensor]]]:
        if self.graph.params is None:
            raise RuntimeError("parameter values are not available in this graph")
        lookup = self.graph.params
        names = [layer.params for layer in self.layers]
        for layer_params in names:  # now: a name that resolves to no parameter fails here, not in the backward
            lookup(layer_params)
        return lambda: [lookup(layer_params) for layer_params in names]

    def _external(
        self, what: str, read: Callable[[], torch.Tensor], numel: int, dtype: torch.dtype = torch.float64
    ) -> torch.Tensor:
        # One group per parameter lookup: a frame recompiled (a new input shape) has a graph of its
        # own, each bound to the parameters of its own calls (a graph run for repeated blocks).
        key = (what, self.key, tuple(layer.name for layer in self.layers), self.graph.params)
        group = self.graph.store.external_group(f"{what} of {self.key}", key, read, numel, self.graph.device, dtype)
        return torch.ops.fxgrad.load_state(group.name)


def _numel(shapes: list[list[Shape]]) -> int:
    return sum(math.prod(shape) for layer_shapes in shapes for shape in layer_shapes)


def _split(values: torch.Tensor, shapes: list[list[Shape]]) -> list[list[torch.Tensor]]:
    """Views of a flat tensor, per layer and parameter, with ``shapes`` (one ``split``, not a
    slice per parameter: each op costs a fake dispatch when it is recorded)."""
    pieces = iter(values.split_with_sizes([math.prod(shape) for layer in shapes for shape in layer]))
    return [[next(pieces).view(shape) for shape in layer] for layer in shapes]


def _whole(param: torch.Tensor) -> torch.Tensor:
    """``param``, replicated on every rank if it is a DTensor (still a DTensor, so that it meets
    the DTensor gradients of its layer in the rule's ops)."""
    if isinstance(param, DTensor) and not all(p.is_replicate() for p in param.placements):
        return param.redistribute(param.device_mesh, [Replicate()] * param.device_mesh.ndim)
    return param


def _row_shape(param: torch.Tensor) -> tuple[int, ...]:
    return (param.shape[0],) + (1,) * (param.dim() - 1) if param.dim() > 1 else ()


def _widest(tensors: Sequence[torch.Tensor]) -> torch.dtype:
    """float32, or the widest dtype among ``tensors`` if wider (float64, complex)."""
    return functools.reduce(torch.promote_types, [t.dtype for t in tensors], torch.float32)


def _norm_dtype(params: Sequence[torch.Tensor]) -> torch.dtype | None:
    """The dtype the norms of ``params`` are computed in (:func:`_widest`); none for complex
    ones (their norms are real)."""
    return None if any(p.is_complex() for p in params) else _widest(params)


def _row_norms(param: torch.Tensor) -> torch.Tensor:
    """Unit-wise norms as AGC defines them: per output row for 2+ dims, whole tensor else."""
    values = param if param.is_complex() else widen(param)  # float64 weights keep float64 norms
    if param.dim() <= 1:
        return torch.linalg.vector_norm(values)
    return torch.linalg.vector_norm(values, dim=tuple(range(1, param.dim())), keepdim=True)
