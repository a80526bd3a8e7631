"""Step scope as one compiled program over every ``.grad``.

The policy is recorded, as graph scope records it into a backward graph, into a
graph whose inputs are the gradients and which writes each result back into
its input (``aten.copy_``); Inductor compiles it. A program is built once per
*layout* (the names of the parameters with a gradient, their gradients' shapes,
strides, dtypes and devices, and the routes over their layers) and reused: state,
thresholds and the loss scale are device tensors (the state, views of the store's
buffer passed as inputs after the gradients and written like them; the loss scale,
read by a custom op), so nothing recompiles when they change, and nothing syncs. Like Dynamo's
frames, at most ``torch._dynamo.config.recompile_limit`` layouts (8 by default) have
a program; a step with another layout runs the rules eagerly, after one warning, until
that layout has run more than twice as often as the least used program's, which it then
replaces (the layouts of the first steps stop recurring once every parameter keeps a
gradient, under ``zero_grad(set_to_none=False)``)::

    programs = StepPrograms("inductor")
    if not programs.run(routes, owners, store, scaler):
        ...  # a layout or policy it does not run, or a build that failed: run the rules eagerly

FSDP2's gradients are DTensors sharded on dim 0 over a 1-D mesh. The program
takes each rank's local shards; the reductions over the gradients (the layer
norms) are all-reduced over the mesh inside it, all layers' at once
(:func:`~fxgrad.runtime.norm_math.local_shards`). That holds for the rules whose
math needs nothing else of the other shards (:attr:`~fxgrad.core.rule.Leaf.local_shards`).
Other DTensor gradients (tensor parallelism, HSDP's 2-D mesh, replicated
placements) and the other rules (``adaptive_grad_clip``, ``sinkhorn``,
``balance_norms``) run eagerly on the DTensors, after one warning; so do sparse
gradients (``nn.Embedding(sparse=True)``): Inductor compiles strided tensors only.

With ``compiler="aot_eager"`` the recorded graph runs as plain FX code (what
the tests exercise quickly); with ``"inductor"`` it is compiled.
"""

from __future__ import annotations

import contextlib
import dataclasses
import operator
from typing import Any, Callable, Sequence

import torch
import torch.fx
import torch.nn as nn
from torch.distributed.tensor import DTensor, Shard

from fxgrad import _compat
from fxgrad.core.layers import GRAD, Owner, not_none
from fxgrad.core.rule import Route
from fxgrad.core.warn import warn, warn_once
from fxgrad.frontend import update_program
from fxgrad.frontend.rewrite import record_policy
from fxgrad.frontend.update_program import Update
from fxgrad.passes.graphtext import render_inserted
from fxgrad.passes.record import GraphRecorder, gc_paused
from fxgrad.runtime import norm_math
from fxgrad.runtime.context import Fold
from fxgrad.runtime.state import CheckpointMismatch, Group, StateStore, group_label, viewed_group

OWNER_GRAD = operator.attrgetter("tensor.grad")  # a C getter, see fxgrad.core.layers.GRAD


# StepPrograms' last program (variant, layout check, program) and last routes (routes, their int): none yet
_NO_LAST: tuple[Any, Callable[[Sequence[torch.Tensor]], bool], Any] = (None, lambda grads: False, None)
_NO_ROUTING: tuple[Any, int] = (None, -1)


class StepPrograms:
    """The compiled step programs of one backend, by layout."""

    def __init__(self, compiler: str, keep_code: bool = False) -> None:
        self.compiler, self.keep_code = compiler, keep_code
        self.inserted: str | None = None  # with keep_code: the last program built, as render_inserted writes it
        self._programs: dict[tuple, _Built] = {}  # by variant and layout
        self._misses: dict[tuple, int] = {}  # steps run eagerly past the limit, by variant and layout
        # the keys whose program could not be built: they run eagerly; every key does from a second on
        self._failed: set[tuple] = set()
        self._told_eager: set[str] = set()  # the reasons some gradients run eagerly that were given
        # the parameters programs read weights of, by name (kept with the owners they came from)
        self._weights: tuple[Sequence[Owner] | None, dict[str, torch.Tensor]] = (None, {})
        self._last: tuple[Any, Callable[[Sequence[torch.Tensor]], bool], _Built | None] = _NO_LAST
        self._routes: tuple[Sequence, tuple, Any] | None = None  # the last step's parameters, key and routes
        self._routings: dict[tuple, int] = {}  # routes and parameter names -> a small int, for program keys
        self._last_routing: tuple[Any, int] = _NO_ROUTING  # the last routes seen, and their int

    def forget(self) -> None:
        """Drop the last step's parameters and routes (the programs stay)."""
        self._routes, self._weights = None, (None, {})

    def drop(self) -> None:
        """Drop the programs too, each with its compiled code (``inserted`` stays)."""
        self.forget()
        self._programs, self._last, self._last_routing, self._failed = {}, _NO_LAST, _NO_ROUTING, set()

    def routes(
        self,
        models: Sequence[tuple[nn.Module, str]],
        order: Sequence[str],
        compute: Callable[[], Any],
        params: Sequence[nn.Parameter],
    ) -> Any:
        """``compute()`` (the parameters with a gradient and the routes over their layers), or the
        last step's result when the same ``params`` (the models') have a gradient and the forward
        order is the same.

        Routing walks every module and matches every layer against the skip list: too slow to
        repeat on every step of a launch-bound model."""
        with_grad = not_none(map(GRAD, params))
        key = (tuple((id(model), prefix) for model, prefix in models), with_grad, tuple(order))
        if self._routes is None or self._routes[0] is not params or self._routes[1] != key:
            self._routes = params, key, compute()  # holds the parameters, so their ids stay theirs
        return self._routes[2]

    def run(
        self,
        routes: Sequence[tuple[int, Route]],
        owners: Sequence[Owner],
        store: StateStore,
        scaler: Any,
        fold: Fold = None,
        update: Update | None = None,
    ) -> bool:
        """Apply ``routes`` to the ``.grad`` of the parameters of ``owners`` in place, grouped by
        layer as the routes expect (``fold``: all but the global factor, see
        :func:`~fxgrad.runtime.executor.run_policy`), then the optimizer's ``update`` if given
        (:mod:`fxgrad.frontend.update_program`: over plain tensors); ``False`` if it
        cannot (the caller then runs the rules eagerly, and leaves the update to the optimizer)."""
        if len(self._failed) > 1:  # builds fail whatever the layout (Inductor's toolchain, say)
            return False
        grads = list(map(OWNER_GRAD, owners))
        group = None
        if set(map(type, grads)) != {torch.Tensor}:
            group, why = _shard_group(grads, routes)
            if group is None:
                self._eager(
                    f"{why}. The compiled step program takes FSDP2's gradients (sharded on a 1-D mesh) under "
                    "the rules that need nothing else of the other shards (see fxgrad.frontend.step_program)"
                )
                return False
            grads = [g.to_local() for g in grads]
        variant = self._routing(routes, owners), group, scaler is not None, fold, update and update.key
        extra = update.tensors if update is not None else []
        if self._weights[0] is not owners:  # what weight-reading rules read, by name
            self._weights = owners, {o.param: o.tensor for o in owners}

        def build() -> Callable[..., Any] | None:
            sparse = [o.param for o, g in zip(owners, grads) if g.layout != torch.strided]
            if sparse:
                self._eager(
                    f"sparse gradients ({', '.join(sparse)}), which the step program does not take "
                    "(Inductor compiles strided tensors only)"
                )
                return None
            return self._build(routes, owners, grads, group, store, scaler, fold, update)

        program = self._program(variant, [*grads, *extra], build)
        if program is None:
            return False
        with torch.no_grad():
            program(*grads, *extra)
        return True

    def _program(
        self, variant: tuple, tensors: Sequence[torch.Tensor], build: Callable[[], Callable[..., Any] | None]
    ) -> Callable[..., Any] | None:
        """The program for ``variant`` (routing, process group, scaler, fold, update) over the
        layout of ``tensors`` (the gradients, then the update's inputs), built by ``build()``
        the first time (None: it was not; if it raises, that layout runs eagerly from then on,
        after one warning, and if a second layout's raises too, every layout). The last step's is
        checked in C++; the key of the layout, a tuple per tensor, takes 40 us of Python to build
        and hash for the deep MLP's 98 gradients."""
        last_variant, matches, built = self._last
        if last_variant == variant and matches(tensors):
            built.uses += 1
            return built.program
        key = variant, _layout(tensors)
        built = self._programs.get(key)
        if built is None:
            if key in self._failed or not self._room_for(key):
                return None
            try:
                program = build()
            except CheckpointMismatch:  # the eager path would raise it too
                raise
            except Exception as error:  # noqa: BLE001  any failure leaves the eager path, which is exact
                self._failed.add(key)
                which = "on gradients of this layout" if len(self._failed) == 1 else "from now on"
                warn(
                    f"fxgrad: the compiled step program could not be built ({type(error).__name__}: {error}); "
                    f"scope='step' runs the policy eagerly, one op at a time, {which}",
                    RuntimeWarning,
                )
                return None
            if program is None:
                return None
            built = self._programs[key] = _Built(program, self._misses.pop(key, 0))
        built.uses += 1
        self._last = variant, _compat.layout_check(tensors), built
        return built.program

    def _room_for(self, key: tuple) -> bool:
        """Whether a program may be built for the new ``key``: under the limit, or once ``key``
        ran eagerly more than twice as often as the least used program (which is dropped). Twice:
        layouts that recur alike (experts routed at random) must not take turns being built."""
        limit = _compat.dynamo_config().recompile_limit
        if len(self._programs) < limit:
            return True
        misses = self._misses[key] = self._misses.get(key, 0) + 1
        least = min(self._programs, key=lambda k: self._programs[k].uses, default=None)
        if least is not None and misses > 2 * self._programs[least].uses:
            self._misses[least] = self._programs.pop(least).uses
            return True
        if len(self._misses) > 8 * limit:  # many layouts, each rare: keep the most frequent
            self._misses = dict(sorted(self._misses.items(), key=lambda item: item[1])[-4 * limit :])
        self._eager(
            f"{limit} gradient layouts have a program already (torch._dynamo.config.recompile_limit), and "
            "this step's is new: the set of parameters with a gradient changes from step to step "
            "(LayerDrop, a mixture of experts, branches), or one backend serves models of many "
            "shapes (a sweep: give each trial its own backend). A layout that runs eagerly more than twice "
            "as often as the least used program's takes its place. zero_grad(set_to_none=False) keeps "
            "every gradient once it exists, so the layout stops changing; or raise the limit"
        )
        return False

    def _eager(self, why: str) -> None:
        """Say once per reason that these gradients run the rules eagerly, one op at a time, and ``why``."""
        message = f"fxgrad: scope='step' runs the policy eagerly on these gradients, one op at a time: {why}."
        warn_once(self._told_eager, why, message, RuntimeWarning)

    def _routing(self, routes: Sequence[tuple[int, Route]], owners: Sequence[Owner]) -> int:
        """The program key's part for ``routes`` over ``owners``' parameter names (not the
        parameters themselves: weights are read by name at run time, so replaced ones are
        followed). Hashing routes takes longer than a small program runs, so the last step's
        routes object, reused while the same parameters have gradients, keeps its number."""
        if self._last_routing[0] is not routes:
            content = tuple(routes), tuple(o.param for o in owners)
            self._last_routing = routes, self._routings.setdefault(content, len(self._routings))
        return self._last_routing[1]

    def _build(
        self,
        routes: Sequence[tuple[int, Route]],
        owners: Sequence[Owner],
        grads: Sequence[torch.Tensor],
        group: str | None,
        store: StateStore,
        scaler: Any,
        fold: Fold,
        update: Update | None,
    ) -> Callable[..., Any]:
        """The program over ``grads`` (``owners``' gradients, or their local shards over the
        process group named ``group``), and ``update``'s inputs after them."""
        gm, inputs = _gradient_graph(owners, grads)
        lookup = lambda names: [self._weights[1][name] for name in names]  # noqa: E731
        with gc_paused(), norm_math.local_shards(group) if group is not None else contextlib.nullcontext():
            new, folded = record_policy(gm, routes, inputs, store, scaler, lookup, fold=fold, per_step=True)
            if update is not None:
                writes = _record_update(gm, inputs, new, update, folded)
            else:
                writes = [pair for layer, nodes in inputs.items() for pair in zip(nodes, new[layer])]
        if self.keep_code:
            names = {node: o.param for o, node in zip(owners, gm.graph.find_nodes(op="placeholder"))}
            pairs = (pair for layer, nodes in inputs.items() for pair in zip(nodes, new[layer]))
            results = {names[node]: result for node, result in pairs}
            self.inserted = render_inserted(gm, names, results, group_label)
        output = gm.graph.output_node()
        with gm.graph.inserting_before(output):
            for node, result in writes:
                if result is not node:
                    gm.graph.call_function(torch.ops.aten.copy_.default, (node, result))
        groups, saved = _state_as_inputs(gm.graph)
        # Before Inductor too: its FX graph cache key reads the code of the last recompile
        # (GraphModule.__reduce__ copies its state before generating the code again).
        gm.recompile()
        compiled = _compat.inductor_compile_program(gm, update is not None) if self.compiler == "inductor" else gm
        if not groups:
            return compiled

        def program(*tensors: torch.Tensor) -> None:
            compiled(*tensors, *[group.view() for group in groups])
            for group in saved:
                group.saved()

        return program


@dataclasses.dataclass
class _Built:
    """A program, and how many steps ran it."""

    program: Callable[..., Any]
    uses: int = 0


def _shard_group(grads: Sequence[torch.Tensor], routes: Sequence[tuple[int, Route]]) -> tuple[str | None, str]:
    """The name of the process group ``grads`` (some of them DTensors) are sharded over, if the
    program can run ``routes`` on their local shards; else ``None`` and why not."""
    if not all(isinstance(g, DTensor) for g in grads):
        return None, "some gradients are DTensors and some are not"
    meshes = {g.device_mesh for g in grads}
    mesh = meshes.pop()
    if meshes or mesh.ndim != 1:
        return None, "the gradients are not all on one 1-D device mesh (tensor parallelism, HSDP)"
    if not all(isinstance(g.placements[0], Shard) for g in grads):
        return None, "some gradients are not sharded (Replicate or Partial placements)"
    whole = sorted({route.leaf.name for _, route in routes if not route.leaf.local_shards})
    if whole:
        return None, f"the policy's {', '.join(whole)} read(s) more of a gradient than the rank's shard"
    return mesh.get_group().group_name, ""


def _gradient_graph(
    owners: Sequence[Owner], grads: Sequence[torch.Tensor]
) -> tuple[torch.fx.GraphModule, dict[str, list[torch.fx.Node]]]:
    """A graph with one input per gradient of ``grads`` (fake values like them; ``owners``
    give their layers), returning nothing (an empty tuple); its inputs by layer."""
    graph = torch.fx.Graph()
    fake_mode = _compat.new_fake_mode()
    inputs: dict[str, list[torch.fx.Node]] = {}
    for i, (owner, grad) in enumerate(zip(owners, grads)):
        node = graph.placeholder(f"grad_{i}")
        node.meta["val"] = fake_mode.from_tensor(grad)
        inputs.setdefault(owner.layer, []).append(node)
    graph.output(())
    return torch.fx.GraphModule(nn.Module(), graph), inputs


def _record_update(
    gm: torch.fx.GraphModule,
    inputs: dict[str, list[torch.fx.Node]],
    new: dict[str, list[torch.fx.Node]],
    update: Update,
    folded: torch.fx.Node | None,
) -> list[tuple[torch.fx.Node, torch.fx.Node]]:
    """Record ``update`` over the policy's results ``new`` for the gradient nodes ``inputs``,
    taking its tensors as inputs after the gradients, and applying the factor ``folded`` the
    policy left to it, if any; the pairs ``(input, result)`` to write."""
    graph = gm.graph
    grads = list(graph.find_nodes(op="placeholder"))  # in the order of the owners, as update's tensors
    result_of = {node: result for layer, nodes in inputs.items() for node, result in zip(nodes, new[layer])}
    results = [result_of[node] for node in grads]
    fake_mode = grads[0].meta["val"].fake_mode
    with graph.inserting_before(next(node for node in graph.nodes if node.op != "placeholder")):
        extra = [graph.placeholder(f"update_{i}") for i in range(len(update.tensors))]
    for node, tensor in zip(extra, update.tensors):
        node.meta["val"] = fake_mode.from_tensor(tensor.detach())
    recorder = GraphRecorder(gm, fake_mode, _compat.inductor_decompositions())
    with recorder.recording():
        recorder.label = "update"
        fakes = [recorder.bind(node) for node in [*grads, *results, *extra]]
        factor = recorder.bind(folded) if folded is not None else None
        n = len(grads)
        pairs = update_program.record(update.key, recorder.replay, fakes[:n], fakes[n : 2 * n], fakes[2 * n :], factor)
    return [(recorder.node(target), recorder.node(value)) for target, value in pairs]


def _state_as_inputs(graph: torch.fx.Graph) -> tuple[list[Group], list[Group]]:
    """Give the program the state it loads and saves as inputs, views of the store's buffer
    (:meth:`~fxgrad.runtime.state.Group.view`) after the gradients, and write them by
    ``copy_`` at its end as it writes the gradients, instead of calling ``fxgrad::load_state``
    and ``save_state``. Each call cost 30-45 us of the deep MLP's step on the CPU (a Python
    kernel through the dispatcher, a slice, a copy), and Inductor split its kernels around it.
    Groups spread over the buffer, external ones (read from other tensors) and any loaded after
    a save (which must read the saved values) stay calls.

    Returns the groups in the order of the new inputs, and those saved: the caller passes
    their views and then tells the saved ones (:meth:`~fxgrad.runtime.state.Group.saved`)."""
    load, save = torch.ops.fxgrad.load_state.default, torch.ops.fxgrad.save_state.default
    nodes = [node for node in graph.nodes if node.op == "call_function" and node.target in (load, save)]
    written, reread = set(), set()
    for node in nodes:
        if node.target is save:
            written.add(node.args[0])
        elif node.args[0] in written:
            reread.add(node.args[0])
    groups = {
        name: group
        for name in dict.fromkeys(n.args[0] for n in nodes)
        if name not in reread and (group := viewed_group(name))
    }
    if not groups:
        return [], []
    fake_mode = graph.find_nodes(op="placeholder")[0].meta["val"].fake_mode
    first = next(node for node in graph.nodes if node.op != "placeholder")
    placeholders = {}
    with graph.inserting_before(first):
        for name, group in groups.items():
            placeholders[name] = graph.placeholder(f"state_{name}")
            placeholders[name].meta["val"] = fake_mode.from_tensor(group.view())
    saved = []
    for node in nodes:
        name = node.args[0]
        if name not in groups:
            continue
        if node.target is load:
            node.replace_all_uses_with(placeholders[name])
            graph.erase_node(node)
        else:  # the save becomes the write, keeping its name and labels (explain's kernel report)
            node.target, node.args = torch.ops.aten.copy_.default, (placeholders[name], node.args[1])
            graph.output_node().prepend(node)
            saved.append(groups[name])
    return list(groups.values()), saved


def _layout(grads: Sequence[torch.Tensor]) -> tuple:
    """What a program depends on of the gradients themselves."""
    return tuple(map(_compat.tensor_layout, grads))
