"""Run a plan's routes over per-layer gradients, as plain torch code.

:func:`run_policy` is the one driver of both scopes: graph scope calls it
under a recorder, so each op lands in the backward graph; step scope calls it
on the real ``.grad`` tensors.

Consecutive :class:`~fxgrad.core.rule.ScaleLeaf` routes form a *run*: the
gradients are read once for their norms, each route computes its factors
from the (already scaled) norms, and every gradient is multiplied once by the
product of its factors. So ``chain(rescale(), clip_by_norm(1.0),
clip_by_global_norm(1.0))`` costs one read and one write per gradient, and
matches applying the three one after the other up to float rounding.

With a GradScaler the gradients in the graph are scaled; norms are taken of the
gradients times the inverse scale (as ``unscale_`` would leave them, so no sum
overflows at a large scale), every transform sees unscaled values, and the
factors multiply the scaled gradients (``unscale_`` later divides them).

With ``fold="global"`` (:meth:`fxgrad.Backend.fold`; only for policies whose every
factor is one global factor) the gradients are not multiplied: the product of
the factors is the statistic ``folded_factor``, which the optimizer applies in
its own update. With ``fold="layers"`` (graph scope, for policies of factors alone)
each layer's product is the statistic ``folded_factor/<layer>`` (1 for a layer the
policy leaves alone), which the step program's update applies
(:mod:`fxgrad.frontend.update_program`).

A leaf with ``apply_to="update"`` multiplies no gradient either: the product of
its factors per layer is the statistic ``update_factor/<layer>``, which
:mod:`fxgrad.frontend.update_factors` applies to the optimizer's update.
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import torch

from fxgrad.core.rule import Route, ScaleLeaf
from fxgrad.runtime import norm_math
from fxgrad.runtime.context import Fold, GraphContext
from fxgrad.runtime.state import StateStore, flat

Grads = dict[str, list[torch.Tensor]]
FOLDED = "folded_factor"  # the statistic of the factors left to it


def run_policy(
    routes: Sequence[tuple[int, Route]],
    grads: Grads,
    store: StateStore,
    device: torch.device,
    scaler: Any = None,
    params: Callable[[Sequence[str]], list[torch.Tensor]] | None = None,
    frame: int = 0,
    set_label: Callable[[str], None] = lambda label: None,
    fold: Fold = None,
    per_step: bool = False,
    replay: Callable[..., Any] = norm_math.call,
) -> torch.Tensor | None:
    """Apply ``routes`` to ``grads`` (layer name -> its gradients, replaced in place); with
    ``fold="global"``, return the factor left to the optimizer (0-dim, float64 or float32), else ``None``.

    Loads the loss scale and state, runs the routes, and saves the statistics.
    ``params(names)`` returns the parameters with those qualified names (for
    rules that read weights); ``frame`` numbers the compiled frame (see
    :class:`~fxgrad.runtime.context.GraphContext`); ``set_label`` names the
    ops that follow (graph scope tags the recorded nodes with it); ``fold``
    leaves the global factor, or each layer's, to the optimizer (see the module docstring);
    ``per_step``: the gradients are the step's whole ``.grad`` (step scope);
    ``replay(fn, *args)`` runs a rule's per-tensor function (graph scope copies
    its recording for tensors like ones it has seen: see
    :meth:`~fxgrad.passes.record.GraphRecorder.replay`).
    """
    set_label("loss scale")
    graph = GraphContext(store, device, scaler, params, frame, fold, per_step, replay)
    executor = Executor(grads, graph, set_label)
    executor.run(routes)
    set_label("statistics")
    folded = None
    if fold == "global":
        folded = executor.folded if isinstance(executor.folded, torch.Tensor) else torch.ones((), device=device)
        graph.emit([FOLDED], folded, -1)
    elif fold == "layers":  # every layer of the graph: a layer's factor from an earlier backward is stale
        _emit_per_layer(graph, FOLDED, {name: executor.left.get(name, 1.0) for name in grads}, device)
    if executor.on_update:
        _emit_per_layer(graph, "update_factor", executor.on_update, device)
    graph.finish()
    return folded


def _emit_per_layer(
    graph: GraphContext, statistic: str, factors: dict[str, norm_math.Factor], device: torch.device
) -> None:
    """The statistics ``<statistic>/<layer>``, each layer's factor."""
    values = flat(f if isinstance(f, torch.Tensor) else torch.full((), f, device=device) for f in factors.values())
    graph.emit([f"{statistic}/{layer}" for layer in factors], values, -1, [(statistic, n) for n in factors])


class Executor:
    """Applies routes to ``grads`` (layer name -> its gradients) in place."""

    def __init__(self, grads: Grads, graph: GraphContext, set_label: Callable[[str], None]) -> None:
        self.grads, self.graph, self.set_label = grads, graph, set_label
        self.inverse_scale = None if graph.scale is None else 1.0 / graph.scale
        # layer -> (its norm statistics when read, factor applied since), while still valid
        self._norms: dict[str, tuple[norm_math.NormStats, norm_math.Factor]] = {}
        self._at_end: list[Callable[[], None]] = []
        self.folded: norm_math.Factor = 1.0  # with graph.fold "global": the factor left to the optimizer
        self.left: dict[str, norm_math.Factor] = {}  # with graph.fold "layers": layer -> the factor left to it
        self.on_update: dict[str, norm_math.Factor] = {}  # layer -> product of its apply_to="update" factors

    def run(self, routes: Sequence[tuple[int, Route]]) -> None:
        start = 0
        while start < len(routes):
            end = start + 1
            if isinstance(routes[start][1].leaf, ScaleLeaf):
                while end < len(routes) and isinstance(routes[end][1].leaf, ScaleLeaf):
                    end += 1
                self._scale_run(routes[start:end])
            else:
                self._apply(*routes[start])
            start = end
        if self._at_end:
            self.set_label("telemetry after the policy")
        for callback in self._at_end:
            callback()

    def norms_now(self, names: Sequence[str], orders: Sequence[float]) -> list[norm_math.NormStats]:
        """Unscaled norm statistics of the current gradients of ``names``."""
        unknown = [name for name in names if not self._known(name, orders)]
        grads = [self.grads[name] for name in unknown]
        for name, stats in zip(unknown, norm_math.layer_stats(grads, orders, self.graph.replay, self.inverse_scale)):
            self._norms[name] = (stats, 1.0)
        known = [self._norms[name] for name in names]
        return [stats if _is_one(factor) else stats.scaled(factor) for stats, factor in known]

    def _known(self, name: str, orders: Sequence[float]) -> bool:
        known = self._norms.get(name)
        return known is not None and known[0].orders.issuperset(orders)

    def at_end(self, callback: Callable[[], None]) -> None:
        """Run ``callback`` after the last route (e.g. to read the final norms)."""
        self._at_end.append(callback)

    def _apply(self, index: int, route: Route) -> None:
        self.set_label(route.label)
        grads = [self.grads[name] for name in route.names]
        sparse = [name for name, layer in zip(route.names, grads) if any(g.layout != torch.strided for g in layer)]
        if sparse:
            # the skip list keeps layers from per-layer rules only; routing keeps them from any rule
            skip = f", or the backend's skip=({sparse[0]!r},)" if route.leaf.per_layer else ""
            raise NotImplementedError(
                f"fxgrad: {route.leaf!r} works on the elements of each gradient, not only on its norm, "
                f"and the gradients of {', '.join(map(repr, sparse))} are sparse (nn.Embedding(sparse=True)?). "
                "Rules that scale whole gradients by their norms take sparse gradients. Keep these layers "
                f"from this rule (fxgrad.by_name({{...}}, default=...){skip}), or make their gradients dense "
                "(sparse=False)."
            )
        ctx = self.graph.route(index, route.leaf.name, route.layers, self)
        new = route.leaf.apply(grads, route.layers, ctx)
        self.grads.update(zip(route.names, new))
        for name in route.names:
            self._norms.pop(name, None)

    def _scale_run(self, run: Sequence[tuple[int, Route]]) -> None:
        orders = sorted({p for _, route in run for p in route.leaf.norm_orders})
        names = list(dict.fromkeys(name for _, route in run for name in route.names))
        self.set_label("layer norms for " + ", ".join(repr(route.leaf) for _, route in run))
        current = dict(zip(names, self.norms_now(names, orders)))
        last_use = {name: i for i, (_, route) in enumerate(run) for name in route.names}
        factors: dict[str, norm_math.Factor] = {}
        for i, (index, route) in enumerate(run):
            self.set_label(route.label)
            ctx = self.graph.route(index, route.leaf.name, route.layers, self)
            new = route.leaf.factors([current[n] for n in route.names], route.layers, ctx)
            if route.leaf.apply_to == "update":  # the optimizer's update takes it; the gradient stays
                for name, factor in zip(route.names, new):
                    _times(self.on_update, name, factor)
                continue
            for name, factor in zip(route.names, new):
                if _is_one(factor):
                    continue
                _times(factors, name, factor)
                if last_use[name] > i:
                    current[name] = current[name].scaled(factor)
        if self.graph.fold == "global" and factors:  # one global factor: every layer has the same
            factor = next(iter(factors.values()))
            self.folded = factor if _is_one(self.folded) else self.folded * factor
        elif self.graph.fold == "layers":
            for name, factor in factors.items():
                _times(self.left, name, factor)
        else:
            self.set_label("scale gradients")
            for name, factor in factors.items():
                self.grads[name] = norm_math.scaled(self.grads[name], factor)
        for name, factor in factors.items():  # what the gradients are now, or will be in the update
            stats, before = self._norms[name]
            self._norms[name] = (stats, factor if _is_one(before) else before * factor)


def _times(factors: dict[str, norm_math.Factor], name: str, factor: norm_math.Factor) -> None:
    """Multiply ``factors[name]`` (1 when absent) by ``factor``."""
    factors[name] = factor if name not in factors else factors[name] * factor


def _is_one(factor: norm_math.Factor) -> bool:
    return isinstance(factor, float) and factor == 1.0
