"""Run plain torch code on fake tensors and record it into an existing FX graph.

This is how rules get into the backward graph. It does what ``make_fx`` with a
decomposition table does, without building a separate graph, at a fraction of
the cost per op (``make_fx`` spends ~0.7 ms per op; a 1000-layer model has
thousands)::

    recorder = GraphRecorder(bw_gm, fake_mode, decompositions)
    a, b = recorder.bind(grad_a_node), recorder.bind(grad_b_node)
    with recorder.recording():
        recorder.label = "halve"
        out = a * 0.5            # recorded as fxgrad_mul = aten.mul.Tensor(grad_a, 0.5)
    new_node = recorder.node(out)

Every recorded node goes right before the graph's output, is named
``fxgrad_<op>``, and carries ``meta["val"]`` (the fake result),
``meta["fxgrad"] = recorder.label`` and a ``stack_trace`` line with the label.
Ops in the decomposition table are decomposed first, so only ops the compiler
accepts are recorded. Rules repeat the same ops for every gradient, so a
functional op (no mutation, no aliasing, output shape not data-dependent) gets
its fake result from a real fake dispatch once per argument *signature*:
tensors' shapes, strides, dtypes and devices, and the other arguments' values
(only the Python type of a scalar operand of a pointwise op). Later calls with
the same signature get a new fake tensor with the same metadata, without the
dispatch (~4 us instead of 0.1-1 ms; a 1000-layer model records ~10000 ops).
View ops (``view``, ``slice``, ``unsqueeze``, ...) are reused the same way, as
views of their new input's storage at the same offset relative to it.

:meth:`GraphRecorder.replay` goes one step further for a function a rule runs
once per gradient: recorded once per argument signature, then copied node by
node for the other gradients, with no dispatch at all.
"""

from __future__ import annotations

import contextlib
import gc
import operator
from typing import Any, Callable, Iterable, Iterator

import torch
import torch.fx

from fxgrad import _compat
from fxgrad._compat import TorchDispatchMode
from fxgrad.passes import PREFIX, TAG

aten = torch.ops.aten

SYMBOLIC = (
    "fxgrad: {what} has a symbolic shape {shape}, where a parameter's gradient has its parameter's static "
    "shape: the compile left a size symbolic that the parameter's shape fixes "
    "(torch._dynamo.config.prefer_deferred_runtime_asserts_over_guards=True with dynamic=True does: the check "
    "that an input's size equals a weight's becomes a runtime assert). Leave dynamic=None (sizes that vary "
    "become dynamic) or mark the varying dimensions with torch._dynamo.mark_dynamic, or use scope='step', "
    "which reads .grad"
)


class GraphRecorder(TorchDispatchMode):
    """A dispatch mode that appends every op it sees to ``gm``'s graph."""

    def __init__(self, gm: torch.fx.GraphModule, fake_mode: Any, decompositions: dict) -> None:
        super().__init__()
        self.graph = gm.graph
        self.fake_mode = fake_mode
        self.decompositions = decompositions
        self.label = "fxgrad"
        self._nodes: dict[int, torch.fx.Node] = {}  # id of a tensor -> the node whose meta["val"] it is
        # signature -> (None, layout) or (container type, layouts) of a functional op's result,
        # or (layout, offset relative to the input's) of a view's
        self._results_by_signature: dict[tuple, tuple] = {}
        self._keys: dict[int, tuple] = {}  # id of a node's tensor -> its part of a signature
        self._templates: dict[tuple, tuple | None] = {}  # see replay
        self._recorded: list[torch.fx.Node] = []

    def bind(self, node: torch.fx.Node, layer: str | None = None) -> torch.Tensor:
        """The fake tensor standing for ``node`` (a gradient of ``layer``) in recorded code."""
        value = node.meta["val"]
        if any(not isinstance(size, int) for size in value.shape):
            what = f"a gradient of {layer!r}" if layer is not None else node.name
            raise NotImplementedError(SYMBOLIC.format(what=what, shape=tuple(value.shape)))
        self._nodes[id(value)] = node
        return value

    def node(self, tensor: torch.Tensor) -> torch.fx.Node:
        """The graph node holding ``tensor``."""
        try:
            return self._nodes[id(tensor)]
        except KeyError:
            raise ValueError(
                f"rule {self.label!r} used a tensor that is neither a gradient nor computed from "
                "one (a tensor constant?); use Python scalars in rules"
            ) from None

    @contextlib.contextmanager
    def recording(self) -> Iterator[GraphRecorder]:
        """Record every op run inside the block, before the graph's output node."""
        with self.graph.inserting_before(self.graph.output_node()), self.fake_mode, self:
            yield self

    def replay(self, fn: Callable[..., Any], *args: Any) -> Any:
        """``fn(*args)``, recorded once per signature of the arguments, then copied.

        ``fn`` must compute its result from its arguments alone, the same way for
        arguments of the same shapes, strides, dtypes and devices (and equal other
        values): a per-gradient function such as SinkGD's iterations. A copy makes
        each node with a fake result like the recorded one and skips the dispatch
        (~2x fewer microseconds per op). Recordings that read another tensor, or run
        an op other than a functional or view op, are not copied: ``fn`` runs again.
        """
        try:
            key = (fn, tuple(self._tensor_key(a) if isinstance(a, torch.Tensor) else (type(a), a) for a in args))
            hash(key)
        except (_NotPlain, TypeError):
            return fn(*args)
        if key in self._templates:
            template = self._templates[key]
            return fn(*args) if template is None else self._copy(template, args)
        start = len(self._recorded)
        result = fn(*args)
        self._templates[key] = self._template(args, result, self._recorded[start:])
        return result

    def _template(self, args, result, nodes: list[torch.fx.Node]) -> tuple | None:
        """What :meth:`_copy` needs, or None when the recording cannot be copied."""
        inputs = [self._nodes.get(id(a)) for a in args if isinstance(a, torch.Tensor)]
        if None in inputs or len(set(inputs)) < len(inputs):
            return None
        results = list(result) if isinstance(result, (list, tuple)) else [result]
        if not all(isinstance(r, torch.Tensor) and id(r) in self._nodes for r in results):
            return None
        known, steps = set(inputs), []
        for node in nodes:
            view = node.target in _compat.VIEWS
            if not (view or _compat.returns_new_tensors(node.target) and isinstance(node.meta["val"], torch.Tensor)):
                return None
            if not known.issuperset(node.all_input_nodes):
                return None
            known.add(node)
            value = node.meta["val"]
            relative_offset = value.storage_offset() - node.args[0].meta["val"].storage_offset() if view else None
            steps.append((node, _compat.tensor_layout(value), relative_offset))
        outputs = [self.node(r) for r in results]
        if not known.issuperset(outputs):
            return None
        return inputs, steps, outputs, type(result) if isinstance(result, (list, tuple)) else None

    def _copy(self, template: tuple, args) -> Any:
        inputs, steps, outputs, container = template
        new = dict(zip(inputs, (self.node(a) for a in args if isinstance(a, torch.Tensor))))
        with _compat.no_dispatch():
            for node, layout, relative_offset in steps:
                kwargs = torch.fx.node.map_arg(node.kwargs, new.__getitem__) if node.kwargs else {}
                copy = self._new_node(node.target, torch.fx.node.map_arg(node.args, new.__getitem__), kwargs)
                if relative_offset is None:
                    self._tag(copy, _compat.new_fake_like(self.fake_mode, layout))
                else:
                    base = copy.args[0].meta["val"]
                    self._tag(copy, _compat.new_fake_view(base, layout, base.storage_offset() + relative_offset))
                new[node] = copy
        results = [new[node].meta["val"] for node in outputs]
        return results[0] if container is None else container(results)

    def eliminate_dead_code(self, keep: Iterable[torch.fx.Node]) -> None:
        """After recording, erase the recorded nodes whose values nothing uses: not in ``keep``,
        without users and without side effects (a norm order only another transform needed,
        a sort's indices). Nodes that were in the graph before the recording stay."""
        keep, alive = set(keep), []
        for node in reversed(self._recorded):  # users before the nodes they use
            if node in keep or node.users or node.is_impure():
                alive.append(node)
            else:
                self.graph.erase_node(node)
        self._recorded = alive[::-1]

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        decomposition = self.decompositions.get(func)
        if decomposition is not None:
            with self:  # record the ops the decomposition runs
                result = decomposition(*args, **kwargs)
            if result is not NotImplemented:
                return result
        result = self._fake_result(func, args, kwargs)
        if result is None:  # an op run for its side effect, e.g. fxgrad::save_state
            self._record(func, args, kwargs, None)
        elif isinstance(result, torch.Tensor):
            if any(result is arg for arg in args):
                return result  # e.g. .to() to the same dtype
            self._record(func, args, kwargs, result)
        elif isinstance(result, (tuple, list)) and all(isinstance(r, torch.Tensor) for r in result):
            node = self._record(func, args, kwargs, tuple(result))
            for i, item in enumerate(result):
                getitem = self.graph.create_node(
                    "call_function", operator.getitem, (node, i), {}, name=PREFIX + "getitem"
                )
                self._tag(getitem, item)
        return result

    def _fake_result(self, func, args, kwargs) -> Any:
        if func in _compat.VIEWS:
            return self._fake_view(func, args, kwargs)
        signature = self._signature(func, args, kwargs) if _compat.returns_new_tensors(func) else None
        if signature is None:
            return func(*args, **kwargs)
        known = self._results_by_signature.get(signature)
        if known is None:
            result = func(*args, **kwargs)
            if isinstance(result, torch.Tensor):
                self._results_by_signature[signature] = (None, _compat.tensor_layout(result))
            else:
                self._results_by_signature[signature] = (type(result), [_compat.tensor_layout(r) for r in result])
            return result
        container, layout = known
        with _compat.no_dispatch():
            if container is None:
                return _compat.new_fake_like(self.fake_mode, layout)
            return container(_compat.new_fake_like(self.fake_mode, each) for each in layout)

    def _fake_view(self, func, args, kwargs) -> torch.Tensor:
        """A view op's result: dispatched once per signature (which leaves out the input's
        storage offset), then rebuilt on each new input at the same relative offset."""
        signature = self._signature(func, args, kwargs)
        if signature is None:
            return func(*args, **kwargs)
        base = args[0]
        known = self._results_by_signature.get(signature)
        if known is None:
            result = func(*args, **kwargs)
            layout = _compat.tensor_layout(result)
            self._results_by_signature[signature] = (layout, result.storage_offset() - base.storage_offset())
            return result
        layout, relative_offset = known
        with _compat.no_dispatch():
            return _compat.new_fake_view(base, layout, base.storage_offset() + relative_offset)

    def _signature(self, func, args, kwargs) -> tuple | None:
        """What the result's metadata depends on, or None if an argument is not a plain value."""
        by_type = torch.Tag.pointwise in func.tags  # a scalar operand's value cannot change the shape

        def key(value: Any) -> Any:
            if isinstance(value, torch.Tensor):
                return self._tensor_key(value)
            if isinstance(value, (list, tuple)):
                return tuple(key(v) for v in value)
            if isinstance(value, (bool, int, float)):
                return type(value) if by_type else (type(value), value)
            if value is None or isinstance(value, (str, torch.dtype, torch.device, torch.layout, torch.memory_format)):
                return value
            raise _NotPlain

        try:
            return (
                func,
                key(_compat.shape_arguments(func, args)),
                tuple(sorted((name, key(v)) for name, v in kwargs.items())),
            )
        except _NotPlain:
            return None

    def _tensor_key(self, value: torch.Tensor) -> tuple:
        """A tensor's part of a signature; kept for the tensors of graph nodes (alive while
        recording, so their ids stay theirs), which rules mostly read more than once."""
        known = self._keys.get(id(value))
        if known is not None:
            return known
        if (
            not _compat.fake_of(value, self.fake_mode)
            or value.layout != torch.strided  # a sparse gradient (nn.Embedding(sparse=True))
            or not all(isinstance(n, int) for n in value.shape)
        ):
            raise _NotPlain
        key = _compat.tensor_layout(value)
        if id(value) in self._nodes:
            self._keys[id(value)] = key
        return key

    def _record(self, func, args, kwargs, result) -> torch.fx.Node:
        map_arg = lambda a: self.node(a) if isinstance(a, torch.Tensor) else a  # noqa: E731
        kwargs = torch.fx.node.map_aggregate(kwargs, map_arg) if kwargs else {}
        node = self._new_node(func, torch.fx.node.map_aggregate(args, map_arg), kwargs)
        self._tag(node, result)
        return node

    def _new_node(self, func, args: tuple, kwargs: dict) -> torch.fx.Node:
        """A ``call_function`` node of ``func`` on ``args`` and ``kwargs`` (nodes already)."""
        # Arguments assigned after creation: create_node's walk of them for symbolic scalars
        # costs twice as much as the rest of it, and a static-shape recording has none.
        node = self.graph.create_node("call_function", func, name=PREFIX + func.overloadpacket.__name__)
        _compat.set_node_arguments(node, args, kwargs)
        return node

    def _tag(self, node: torch.fx.Node, value: Any) -> None:
        self._recorded.append(node)
        node.meta["val"] = value
        node.meta[TAG] = self.label
        node.meta["stack_trace"] = f"fxgrad: {self.label}\n"
        if isinstance(value, torch.Tensor):
            self._nodes[id(value)] = node


@contextlib.contextmanager
def gc_paused() -> Iterator[None]:
    """Pause Python's cyclic garbage collector, and move what a recording made to the oldest
    generation.

    A recording allocates many small objects (FX nodes, fake tensors); each
    collection they trigger rescans the whole heap. Measured at 1000 layers:
    3.1 s with the collector running, 1.3 s paused. The objects live as long as
    the graph, but back on, the collector would scan them all in its youngest
    generation, then again in the middle one (0.12 s each for sinkhorn's 79,000
    nodes). ``gc.freeze()`` then ``gc.unfreeze()`` moves every tracked object to
    the oldest generation without a scan; it is skipped when the program has
    frozen objects of its own (``unfreeze`` would thaw them).
    """
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if not gc.get_freeze_count():
            gc.freeze()
            gc.unfreeze()
        if enabled:
            gc.enable()


class _NotPlain(Exception):
    """An argument whose effect on the result's metadata is unknown (a SymInt, a subclass, a
    sparse tensor: :func:`~fxgrad._compat.new_fake_like` makes strided tensors only)."""
