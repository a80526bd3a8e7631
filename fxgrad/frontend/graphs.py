"""Every graph a backend compiled, and the models they belong to.

The coverage check and ``explain`` ask it where a layer is: in this graph,
in another graph of the same forward (a graph break), in some other compiled
graph, or nowhere.

    registry = GraphRegistry()
    registry.add(capture(gm, example_inputs, registry.roots))
"""

from __future__ import annotations

import weakref
from typing import Iterable, Sequence

import torch.nn as nn

from fxgrad.core.layers import Layer, ParamRow, SkipEntry, build_layers, model_rows, parameter_owners
from fxgrad.passes.capture import CapturedGraph, Root, live_root


def merged_order(known: Sequence[str], graph_order: Iterable[str]) -> list[str]:
    """``known`` plus the new layers of a graph, each placed where the graph uses it.

    A recompile that uses a new layer (a branch taken only now) puts it after
    the known layer the graph used just before it, not after every known layer;
    a graph of only new layers (the code after a graph break) comes last.

        >>> merged_order(["stem", "e1", "head"], ["stem", "e2", "e1", "head"])
        ['stem', 'e2', 'e1', 'head']
        >>> merged_order(["a", "b"], ["c", "d"])
        ['a', 'b', 'c', 'd']
    """
    order = list(known)
    position = {name: i for i, name in enumerate(order)}
    pending: list[str] = []
    anchor = None  # index in `order` of the last known layer this graph used
    for name in graph_order:
        if name not in position:
            pending.append(name)
            continue
        if pending:  # new layers used before this known one: insert them just before it
            at = position[name] if anchor is None else anchor + 1
            order[at:at] = pending
            position = {n: i for i, n in enumerate(order)}
            pending = []
        anchor = position[name]
    if pending:
        at = len(order) if anchor is None else anchor + 1
        order[at:at] = pending
    return order


class GraphRegistry:
    """Graphs in compile order; ``roots`` maps ``id(model)`` to the model."""

    def __init__(self) -> None:
        self.graphs: list[CapturedGraph] = []
        self.roots: dict[int, Root] = {}
        self._forward_order: list[str] = []  # layer names, first use first
        self._frames: dict[int | None, int] = {}  # Dynamo frame id -> its number here, first compiled first
        self._held: dict[int, weakref.ref] | None = None  # id() -> the parameter, until a graph changes
        self.generation = 0  # counts changes of what the graphs hold

    def add(self, graph: CapturedGraph) -> None:
        # Dynamo discards the graphs of an analysis it restarted (same compile id), and
        # every graph on torch._dynamo.reset().
        self.graphs = [
            g for g in self.graphs if g.live() and (g.compile_id != graph.compile_id or g.attempt >= graph.attempt)
        ]
        self.graphs.append(graph)
        self._frames.setdefault(graph.compile_id[0], len(self._frames))
        self._forward_order = merged_order(self._forward_order, dict.fromkeys(p.layer for p in graph.params))
        self._changed()

    def discard(self, graph: CapturedGraph) -> None:
        """Forget ``graph``: its compile failed."""
        self.graphs = [g for g in self.graphs if g is not graph]
        self._changed()

    def holds(self, tensor: object) -> bool:
        """Whether a graph holds ``tensor`` (call :meth:`rebound` when one rebinds).

        By identity, not by ``id()`` alone: a freed parameter's id can come back as
        another model's parameter, and Dynamo keeps old graphs alive."""
        if self._held is None:
            graphs = self.training()
            self._held = {id(p.tensor()): p.tensor for graph in graphs for p in graph.params}
            self._held.update((key, ref) for graph in graphs for key, ref, _ in graph.reused_layers())
        ref = self._held.get(id(tensor))
        return ref is not None and ref() is tensor

    def layers_held(self) -> dict[int, str]:
        """``id(parameter) -> layer`` for the parameters the graphs hold or ran with (as
        :meth:`holds` counts them), for messages that name layers."""
        graphs = self.current()
        layers = {key: layer for graph in graphs for key, _, layer in graph.reused_layers()}
        layers.update((id(t), p.layer) for graph in graphs for p in graph.params if (t := p.tensor()) is not None)
        return layers

    def current(self) -> list[CapturedGraph]:
        """The graphs that are not a freed model's (:meth:`CapturedGraph.current`): what the
        questions below are about."""
        return [graph for graph in self.graphs if graph.current()]

    def training(self) -> list[CapturedGraph]:
        """The current graphs that compute gradients of parameters: a graph compiled under
        ``torch.no_grad`` holds parameters without producing their gradients (reversible layers
        run their forward so, and recompute it outside torch.compile for the backward)."""
        return [graph for graph in self.current() if graph.trains]

    def _changed(self) -> None:
        self._held = None
        self.generation += 1

    def rebound(self) -> None:
        """A graph now runs with other parameters (:meth:`CapturedGraph.rebind`)."""
        self._changed()

    def note_reuse(self, graph: CapturedGraph, params: Sequence) -> None:
        """Calls ran ``graph`` with the ``params`` of several modules (one call's after another's,
        in the order of ``graph.params``): remember them and their layers, which the graph's
        rewrite transforms as the layers it was compiled for."""
        owners: dict = {}
        for model, prefix in self._live(self.roots):
            owners.update(parameter_owners(model, prefix))
        graph.reused = {key: (ref, layer) for key, ref, layer in graph.reused_layers()}  # drop freed ones
        for index, param in enumerate(params):  # slot by slot, one call's parameters after another's
            owner = owners.get(id(param))
            if owner is not None:
                graph.reused[id(param)] = weakref.ref(param), owner.layer
                compiled_for = graph.params[index % len(graph.params)].layer
                if compiled_for != owner.layer:  # not the graph's own
                    graph.reused_as[owner.layer] = compiled_for
        self._changed()

    def same_model(self, graph: CapturedGraph, tensors: Sequence) -> bool:
        """Whether a live model ``graph`` was compiled for holds ``tensors`` too (another block of it
        runs the graph, in the same forward), not another model (the next trial's, on a shared backbone)."""
        ids = {id(t) for t in tensors}
        return any(ids <= {id(p) for p in model.parameters()} for model, _ in self._live(p.root for p in graph.params))

    def holds_as_compiled(self, graph: CapturedGraph, inputs: Sequence) -> bool:
        """Whether the models ``graph`` was compiled for hold a call's parameters under the names it was
        compiled with: the model's own, a module of it replaced by a new one, not another module's."""
        for slot in graph.params:
            root = self.roots.get(slot.root) if slot.root is not None else None
            model = root.module() if root is not None else None
            if model is None:
                return False
            name = slot.name.removeprefix(f"{root.prefix}.") if root.prefix else slot.name
            try:
                if model.get_parameter(name) is not inputs[slot.index]:
                    return False
            except AttributeError:
                return False
        return True

    def parameters_of(self, graph: CapturedGraph) -> dict[str, nn.Parameter]:
        """The parameters of the models ``graph`` belongs to, by name."""
        named: dict[str, nn.Parameter] = {}
        for model, prefix in self._live(p.root for p in graph.params):
            named.update((owner.param, owner.tensor) for owner in parameter_owners(model, prefix).values())
        return named

    def _live(self, keys: Iterable[int | None]) -> list[tuple[nn.Module, str]]:
        """The live models of ``roots`` under ``keys`` (each once), with their layer-name prefixes."""
        roots = (self.roots[key] for key in dict.fromkeys(keys) if key is not None)
        return [(model, root.prefix) for root in roots if (model := root.module()) is not None]

    def prefix(self, model: object) -> str:
        """The prefix of ``model``'s layer names (see :class:`Root`)."""
        root = live_root(self.roots, model)
        return root.prefix if root is not None else ""

    def model_name(self, graph: CapturedGraph) -> str:
        """The class name of the model ``graph``'s parameters belong to, for messages."""
        models = (graph.root_refs[key]() for key in graph.roots())
        return next((type(model).__name__ for model in models if model is not None), "the model")

    def forward_order(self) -> list[str]:
        """Layer names in the order the compiled forward first used them."""
        return list(self._forward_order)

    def frame_index(self, graph: CapturedGraph) -> int:
        """0 for the first frame this backend compiled, 1 for the next, ...: recompiles
        of one frame share its number; the code after a graph break is a new frame."""
        return self._frames.get(graph.compile_id[0], 0)

    def frames_of(self, model: nn.Module) -> set[int]:
        """The numbers (:meth:`frame_index`) of the frames whose graphs hold ``model``'s parameters, or
        ran with them (a graph Dynamo reuses for a second model of the same class)."""
        ids = {id(p) for p in model.parameters()}
        return {
            self.frame_index(graph)
            for graph in self.current()
            if id(model) in graph.roots() or not ids.isdisjoint(graph.reused)
        }

    def parts_of_same_forward(self, graph: CapturedGraph) -> list[CapturedGraph]:
        """Other graphs of the same models that run in the same forward as ``graph`` and compute
        gradients (one compiled under ``torch.no_grad``, an evaluation's, splits no gradient).

        A graph break continues the forward in a new frame (a new frame id); a
        recompile of the same frame (same frame id) is an alternative. So are the
        frames Dynamo resumes in after a branch on a tensor (``if x.mean() > 0``),
        one per side: of the other frames, only those that ran in this forward so far
        count, the forward starting at the last call of a graph of its first frame
        (``graph`` asked about while it compiles, before its first call, sees the
        forward before)."""
        frame, _ = graph.compile_id
        if frame is None:
            return []
        roots = graph.roots()
        current = self.current()
        relatives = [other for other in current if other is not graph and other.roots() & roots]
        # the frames that start the forward may hold no parameter (a branch on the input first)
        frames = [graph, *relatives, *(other for other in current if not other.params)]
        first = min(map(self.frame_index, frames))
        start = max(g.last_run for g in frames if self.frame_index(g) == first)
        return [
            other
            for other in relatives
            if other.trains
            and (other.compile_id == graph.compile_id or (other.compile_id[0] != frame and other.last_run >= start))
        ]

    def layers_elsewhere(self, graph: CapturedGraph) -> set[str]:
        """Layers that other compiled graphs hold: the other parts of a forward split by a
        graph break, and recompiles (of a branch, or of a submodule's frame for another
        instance); and layers of other modules that any graph ran for (:meth:`note_reuse`).
        A per-layer transform reaches them in the graph that holds them."""
        graphs = self.training()
        held = {p.layer for other in graphs if other is not graph for p in other.params}
        return held | {layer for other in graphs for _, _, layer in other.reused_layers()}

    def params_elsewhere(self, graph: CapturedGraph) -> tuple[set[str], set[str]]:
        """The names of the parameters that other compiled graphs that compute gradients hold: those
        of the same forward (a graph break), and all (a recompile for other inputs holds some too; a
        parameter in none is unused, or runs eagerly)."""
        same = {p.name for part in self.parts_of_same_forward(graph) for p in part.params}
        return same, same | {p.name for other in self.training() if other is not graph for p in other.params}

    def shared_layers(self, graph: CapturedGraph, has_grad: set[int]) -> set[str]:
        """Layers with a parameter that another graph of the same forward also uses."""
        mine = {p.name: p.layer for p in graph.params if p.index in has_grad}
        others = {name for part in self.parts_of_same_forward(graph) for name in part.param_names()}
        return {layer for name, layer in mine.items() if name in others}

    def locate(self, graph: CapturedGraph, layer: str) -> str:
        """Where a layer missing from ``graph`` is, in words."""
        compiled_for = next((other.reused_as[layer] for other in self.current() if layer in other.reused_as), None)
        if compiled_for is not None:
            return (
                f"in the graph compiled for {compiled_for!r}, which Dynamo runs for it too (a graph break inside a "
                "repeated block's forward)"
            )
        if any(p.layer == layer for part in self.parts_of_same_forward(graph) for p in part.params):
            return "in another compiled graph of the same forward (a graph break)"
        if any(p.layer == layer for other in self.training() for p in other.params):
            return "in another compiled graph (a graph break, or a recompile for a branch taken on other inputs)"
        if any(p.layer == layer for other in self.current() for p in other.params):
            return (
                "only in compiled graphs that compute no gradient (run under torch.no_grad): its gradient comes "
                "from code outside torch.compile (reversible layers recompute their forward in the backward)"
            )
        return (
            "in no compiled graph: it runs outside torch.compile (under torch.compiler.disable, in a module "
            "Dynamo skips, a graph break in a loop, a frame past torch._dynamo.config.recompile_limit, or a "
            "graph whose compile failed, which Dynamo runs eagerly after logging why), or the forward does "
            "not use it (here, or on these inputs: a branch taken on some steps only)"
        )

    def model_layers(
        self, graph: CapturedGraph, has_grad: set[int], skip: tuple[SkipEntry, ...]
    ) -> tuple[list[Layer], list[Layer]]:
        """``(trainable, frozen)`` layers of the models ``graph`` belongs to.

        Parameters present in ``graph`` without a gradient are left out: eager
        PyTorch gives them no gradient either.
        """
        no_grad = {p.name for p in graph.params if p.index not in has_grad}
        trainable: list[ParamRow] = []
        frozen: list[ParamRow] = []
        for model, prefix in self._live(p.root for p in graph.params):
            rows, frozen_rows = model_rows(model, prefix)
            trainable += [row for row in rows if row.param not in no_grad]
            frozen += frozen_rows
        trainable += [
            ParamRow(p.layer, p.name, p.module_type, p.numel)
            for p in graph.params
            if p.root is None and p.index in has_grad
        ]
        frozen_layers = {row.layer for row in frozen} - {row.layer for row in trainable}
        frozen = [row for row in frozen if row.layer in frozen_layers]
        order = self.forward_order()
        return build_layers(trainable, order, skip), build_layers(frozen, order, skip)
