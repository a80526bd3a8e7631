"""No silent no-ops: compare what the policy targets with what a graph holds.

fxgrad rewrites one backward graph at a time. A layer the policy targets can be
missing from it: its module ran outside ``torch.compile`` (a graph break into
eager code, an ``nn.LSTM`` Dynamo did not capture), it lives in another
compiled graph (a graph break), or it is frozen. Per-layer transforms then
skip it: fxgrad warns with the layers named. A transform that reduces across
layers (``clip_by_global_norm``, ``rescale(target="mean")``) would compute a
different number than eager PyTorch: fxgrad raises :class:`CoverageError`
unless the backend has ``strict=False``.
"""

from __future__ import annotations

import dataclasses
import weakref
from typing import Callable, Collection, Iterable, Sequence

import torch
import torch.distributed
import torch.nn as nn

from fxgrad import _compat
from fxgrad.core import match
from fxgrad.core.layers import (
    DEFAULT_SKIP,
    WHAT_IS_A_LAYER,
    Layer,
    SkipEntry,
    build_layers,
    model_rows,
)
from fxgrad.core.rule import Route, Transform, listed
from fxgrad.core.warn import CoverageWarning, warn
from fxgrad.frontend.graphs import GraphRegistry
from fxgrad.frontend.plan import GraphPlan
from fxgrad.passes.capture import CapturedGraph


class CoverageError(RuntimeError):
    """A cross-layer transform would see only part of the model's gradients."""


@dataclasses.dataclass(frozen=True)
class Gap:
    """Layers one route should reach but cannot, each with the reason."""

    route: str
    problem: str
    layers: tuple[tuple[Layer, str], ...]
    fatal: bool
    unplaced: tuple[str, ...] = ()  # parameters in no graph, of layers with others in this one

    def describe(self) -> str:
        rows = [f"    {layer.name} ({layer.type_name}): {why}" for layer, why in self.layers[:20]]
        if len(self.layers) > 20:
            rows.append(f"    ... and {len(self.layers) - 20} more")
        return f"{self.route} {self.problem}:\n" + "\n".join(rows)


NO_GRAPH_PART = (
    "in no compiled graph, the rest of it in this one: the forward does not use them (on these inputs, at "
    "least), or they run outside torch.compile (a function under torch.compiler.disable)"
)


def find_gaps(
    intended: Sequence[Route],
    actual: Sequence[Route],
    shared_layers: set[str],
    elsewhere: set[str],
    locate: Callable[[str], str],
    params_elsewhere: tuple[set[str], set[str]],
) -> list[Gap]:
    """Compare the routes over the whole model with the routes over one graph.

    ``intended`` and ``actual`` come from the same policy, so they line up
    index by index. ``shared_layers`` are layers with a parameter that another
    graph of the same forward also uses; ``elsewhere`` are layers that another
    compiled graph holds (per-layer transforms reach them there), and
    ``params_elsewhere`` the parameters, by name: those other graphs of the same
    forward hold, and those any other graph holds; ``locate(layer_name)`` says
    where a missing layer is.
    """
    same_forward, held = params_elsewhere
    gaps = []
    for want, have in zip(intended, actual):
        have_params = {layer.name: set(layer.params) for layer in have.layers}
        missing = [(layer, locate(layer.name)) for layer in want.layers if layer.name not in have_params]
        present = [layer for layer in want.layers if layer.name in have_params]
        absent = {layer.name: set(layer.params) - have_params[layer.name] for layer in present}
        split = [  # the rest of the layer in another graph of this forward (not one for other inputs)
            (layer, f"only {len(have_params[layer.name])} of its {len(layer.params)} parameters are in this graph")
            for layer in present
            if absent[layer.name] & same_forward
        ]
        partial = [  # ... or in none: unused by the forward (XLNet's segment bias), or run eagerly
            (layer, f"{', '.join(sorted(absent[layer.name]))} {NO_GRAPH_PART}")
            for layer in present
            if absent[layer.name] and not absent[layer.name] & held
        ]
        shared = [
            (layer, "a parameter of it is also used by another graph of the same forward")
            for layer in present
            if layer.name in shared_layers
        ]
        route, reach = repr(want.leaf), want.leaf.reach
        if reach == "group" and not have.layers and all(layer.name in elsewhere for layer, _ in missing):
            continue  # applied to none of this graph's layers (frozen ones): the graphs holding the rest check theirs
        if reach == "group" and (missing or split or partial or shared):
            gaps.append(
                Gap(route, "would see only part of its layers", _unique(missing + split + partial + shared), True)
            )
            continue
        broken = (split if reach == "layer" else []) + shared
        if broken:
            gaps.append(Gap(route, "would see only part of a layer's gradient", _unique(broken), True))
        unreached = tuple((layer, why) for layer, why in missing if layer.name not in elsewhere)
        if unreached:
            gaps.append(Gap(route, "is not applied to", unreached, False))
        if partial:
            unplaced = {name for layer, _ in partial for name in set(layer.params) - have_params[layer.name]}
            gaps.append(Gap(route, "is applied to only part of", tuple(partial), False, tuple(sorted(unplaced))))
    return gaps


def refuse_flat_parameters(model: nn.Module) -> None:
    """Raise ``TypeError`` if ``model`` holds an FSDP1 ``FullyShardedDataParallel``: it flattens
    the parameters of each module it wraps into one, so no layer is left for the policy, and
    each rank's ``.grad`` is a shard whose norms nothing all-reduces. FSDP2's ``fully_shard``
    keeps the parameters (docs/distributed.md)."""
    if not torch.distributed.is_available():
        return
    from torch.distributed.fsdp import FullyShardedDataParallel

    wrapped = _where_held(model, FullyShardedDataParallel)
    if wrapped is not None:
        raise TypeError(
            f"model: {type(model).__name__} holds FSDP1's FullyShardedDataParallel ({wrapped}), "
            "which flattens each wrapped module's parameters into one; fxgrad sees no layers there. Shard with "
            "FSDP2 instead: torch.distributed.fsdp.fully_shard"
        )


def refuse_fsdp2_in_graph_scope(model: nn.Module) -> None:
    """Raise ``ValueError`` if ``model`` holds FSDP2 modules (``fully_shard``): their forward
    gathers the parameters outside any compiled graph, so no backward graph holds a parameter
    and graph scope would do nothing. Step scope runs on the sharded ``.grad``. Checked when
    the backend meets the model, and again before graph scope reports a gap (a model sharded
    after it was compiled)."""
    sharded = fsdp2_sharded(model)
    if sharded is not None:
        raise ValueError(
            f"scope: {type(model).__name__} is sharded with FSDP2's fully_shard ({sharded}), "
            "whose forward gathers the parameters outside the compiled graphs: in graph scope no backward graph "
            "holds them and the policy would do nothing. Use scope='step' (the default, 'auto', is step scope "
            "when torch.distributed has more than one process)"
        )


def fsdp2_sharded(model: nn.Module) -> str | None:
    """Where in ``model`` its first FSDP2 module (``fully_shard``) is, for a message; ``None``
    if it has none."""
    if not torch.distributed.is_available():
        return None
    from torch.distributed.fsdp import FSDPModule

    return _where_held(model, FSDPModule)


def _where_held(model: nn.Module, kind: type) -> str | None:
    """Where in ``model`` the first module of type ``kind`` is, for a message (``None``: nowhere)."""
    name = next((name for name, module in model.named_modules() if isinstance(module, kind)), None)
    return None if name is None else f"at {name!r}" if name else "at its root"


def policy_misses(transform: Transform | None, skip: Sequence[SkipEntry], model: nn.Module) -> list[str]:
    """Warnings for the routing keys and added skip entries that match no layer of
    ``model``: they do nothing (a typo, or a tied weight that belongs to another layer);
    and for the rules routed to layers they cannot change (:meth:`Leaf.idle`)."""
    trainable, frozen = model_rows(model, "")
    layers = build_layers(trainable + frozen, (), skip)
    misses = transform.unmatched(layers) if transform is not None else []
    if transform is not None:
        misses += _idle_routes(transform, layers, {row.layer for row in trainable})
    misses += [
        f"skip entry {entry!r} matches no layer ({WHAT_IS_A_LAYER})"
        for entry in skip
        if entry not in DEFAULT_SKIP and not any(match.matches(entry, layer) for layer in layers)
    ]
    return [f"fxgrad: in {type(model).__name__}, {miss}. It does nothing." for miss in misses]


def _idle_routes(transform: Transform, layers: Sequence[Layer], trainable: set[str]) -> list[str]:
    """Why rules change no gradient of the layers they reach, frozen ones too: they may thaw
    (gradual unfreezing), so a rule idle on the trainable ones alone is not (the message marks
    the frozen ones)."""
    return [
        f"{route.leaf!r} reaches only {listed([_marked(layer, trainable) for layer in route.layers], 5)}: {why}"
        for route in transform.routes(layers)
        if route.layers and (why := route.leaf.idle(route.layers))
    ]


def _marked(layer: Layer, trainable: set[str]) -> str:
    return layer.name if layer.name in trainable else f"{layer.name} (frozen)"


def frozen_named(transform: Transform, trainable: Sequence[Layer], frozen: Sequence[Layer]) -> str | None:
    """The warning for the ``frozen`` layers named by keys of ``transform`` that choose no
    trainable layer (they get no gradient, so such a key does nothing), or ``None``. Not those
    a rule over every layer reaches, nor those of a key that acts on trainable layers too: a
    LoRA model's frozen base trains silently, as under ``clip_grad_norm_``, whether the policy
    names the base's ``nn.Linear``s (and so its adapters') or not."""
    idle = {layer.name for layer in frozen}
    named = set().union(*(chosen for chosen in transform.named([*trainable, *frozen]) if chosen <= idle))
    targeted = [layer.name for layer in frozen if layer.name in named]
    if not targeted:
        return None
    count = (
        "1 layer the policy names is frozen (requires_grad=False) and gets"
        if len(targeted) == 1
        else f"{len(targeted)} layers the policy names are frozen (requires_grad=False) and get"
    )
    return f"fxgrad: {count} no gradient: {listed(targeted, 20)}"


def model_layers(model: nn.Module, skip: Sequence[SkipEntry]) -> tuple[list[Layer], list[Layer]]:
    """The layers of ``model`` with a trainable parameter, and those with none."""
    trainable, frozen = model_rows(model, "")
    held = {row.layer for row in trainable}
    return build_layers(trainable, (), skip), build_layers([row for row in frozen if row.layer not in held], (), skip)


def _grad_state(param: nn.Parameter) -> tuple:
    """What tells a write to ``param.grad`` (a new tensor, or one changed in place): no sync."""
    grad = param.grad
    return (None, 0) if grad is None else (id(grad), _compat.tensor_version(grad))


def _unique(rows: list[tuple[Layer, str]]) -> tuple[tuple[Layer, str], ...]:
    """One row per layer, the first reason kept."""
    return tuple({layer: (layer, why) for layer, why in reversed(rows)}.values())[::-1]


def rnn_hint(layers: Sequence[Layer]) -> str:
    """Advice when uncaptured layers are RNNs that Dynamo skips by default."""
    if _compat.rnn_capture_enabled():
        return ""
    if not any(layer.module_type is not None and issubclass(layer.module_type, nn.RNNBase) for layer in layers):
        return ""
    return (
        "\nDynamo does not capture nn.RNN/nn.LSTM/nn.GRU unless "
        "torch._dynamo.config.allow_rnn = True; set it before the model's first call."
    )


def ddp_hint() -> str:
    """Advice when the graphs may be DDP's buckets rather than graph breaks."""
    if _compat.data_parallel_world_size() == 1:
        return ""
    return (
        "\nUnder DDP, Dynamo's DDP optimizer also compiles one graph per gradient bucket "
        "(torch._dynamo.config.optimize_ddp): scope='step', the default of scope='auto' in a "
        "data-parallel job, is the one that sees the model's whole gradient."
    )


FATAL_ADVICE = (
    "Each compiled graph has its own backward, so a norm taken in one graph is not "
    "the norm over the model. Use fxgrad.backend(..., scope='step') to transform every "
    "gradient at once at optimizer.step() (or backend.step()), remove the graph break "
    "(torch._dynamo.explain(model)(*args) lists them), freeze parameters the forward does not "
    "use (requires_grad_(False)), or pass strict=False to apply the transform per graph anyway."
)


HOOKED = (
    "fxgrad: the parameters {names} have gradient hooks (Tensor.register_hook). Autograd runs them on the "
    "gradient the backward graph returns, so in graph scope the policy acts on the gradient "
    "before the hook, not on what the hook returns (which clip_grad_norm_ after backward() "
    "would see). Use fxgrad.backend(..., scope='step'), which applies the policy to .grad after "
    "every hook has run."
)


STAND_INS = (
    "fxgrad: a compiled graph takes plain tensors, not nn.Parameters, in the parameter slots {names} "
    "(torch.func.functional_call, or another reparametrization, put them there). Graph scope transforms the "
    "gradients of nn.Parameter inputs, so the policy {t!r} sees neither these tensors' gradients nor those "
    "of the parameters they were computed from. If they are computed from the parameters (a perturbation), "
    "use fxgrad.backend(..., scope='step'): it applies the policy to the parameters' .grad at "
    "optimizer.step(). Tensors trained themselves (functional training) are no module's parameters, and no "
    "scope reaches them: make them nn.Parameters of a module."
)


SPLIT_MODELS = (
    "fxgrad: {optimizer} steps the parameters of {count} models this backend compiled one by one ({models}), "
    "and in scope='graph' each one's backward applies {t!r} to its own gradients: its cross-layer norms are "
    "each model's, not those of every parameter the optimizer steps (which clip_grad_norm_ over them would "
    "take). Use fxgrad.backend(..., scope='step'), which runs the policy once over every gradient (if the "
    "models name their layers alike, two nn.Sequential, tell it one module that holds them all once, "
    "backend.step(whole) after the first backward); or compile one module that holds them all (torchtitan "
    "compiles each block alone: see docs/distributed.md); or, if each model's own norm is what you mean, give "
    "each model a backend of its own"
)


COMPILED_AUTOGRAD = (
    "fxgrad: compiled autograd is on. It retraces AOTAutograd's original backward graphs, so "
    "fxgrad's rewrite of them would not run and the policy {transform!r} would do nothing. Use "
    "fxgrad.backend(..., scope='step'), which applies the policy to .grad at optimizer.step(), "
    "or turn compiled autograd off."
)


UNPOLICED = (
    "fxgrad: {optimizer} steps gradients that a backward under compiled autograd wrote (turned on around "
    "backward()). Compiled autograd retraces AOTAutograd's original backward graphs, not fxgrad's rewrite of "
    "them, so the policy {transform!r} did not act on them. Use fxgrad.backend(..., scope='step'), which "
    "applies the policy to .grad at optimizer.step(), or turn compiled autograd off."
)


class CoverageCheck:
    """Checks each backward graph of one backend and reports each finding once."""

    def __init__(self, transform: Transform, skip: tuple[SkipEntry, ...], strict: bool) -> None:
        self.transform, self.skip, self.strict = transform, skip, strict
        self._reported: set[str] = set()
        self.fatal: list[str] = []  # what was reported that strict=True raises (explain's copy is not strict)
        # parameters in no graph while the rest of their layer is in one: unused, or run eagerly (see unplaced_used)
        self.unplaced: dict[int, tuple[weakref.ref, str]] = {}
        self._unpoliced: dict[int, tuple[weakref.ref, tuple]] = {}  # by id: see note_compiled_autograd
        # how each model was compiled: "module" (torch.compile(model)), "other" (Module.compile, a DDP
        # wrapper) or "disabled" (torch.compile(..., disable=True)); and the last error a compile of this
        # backend raised, which torch._dynamo.config.suppress_errors turns into an eager frame
        self.compiled_as: weakref.WeakKeyDictionary[nn.Module, str] = weakref.WeakKeyDictionary()
        self.compile_error: str | None = None

    def graph(self, registry: GraphRegistry, graph: CapturedGraph, plan: GraphPlan, has_grad: set[int]) -> None:
        """Compare ``plan`` with what the policy targets across the model; warn or raise."""
        for key in graph.roots():  # sharded after it was compiled: the gaps are FSDP2's, said as compile() says it
            refuse_fsdp2_in_graph_scope(graph.root_refs[key]())
        trainable, frozen = registry.model_layers(graph, has_grad, self.skip)
        intended = self.transform.routes(trainable)
        gaps = find_gaps(
            intended,
            plan.routes,
            registry.shared_layers(graph, has_grad),
            registry.layers_elsewhere(graph),
            lambda layer: registry.locate(graph, layer),
            registry.params_elsewhere(graph),
        )
        graph.gaps = gaps
        named = registry.parameters_of(graph) if any(gap.unplaced for gap in gaps) else {}
        for gap in gaps:
            for name in gap.unplaced:
                if name in named:
                    self.unplaced[id(named[name])] = weakref.ref(named[name]), f"{gap.route}: {name}"
        if graph.stand_ins:  # the cause of the gaps of the layers they stand in: said first, alone
            self.report(
                STAND_INS.format(names=listed(graph.stand_ins, 20), t=self.transform),
                fatal=self.transform.reduces_across_layers(),
            )
            explained = {name.rpartition(".")[0] for name in graph.stand_ins}
            gaps = [
                dataclasses.replace(gap, layers=tuple(r for r in gap.layers if r[0].name not in explained))
                for gap in gaps
            ]
            gaps = [gap for gap in gaps if gap.layers]
        fatal = [gap for gap in gaps if gap.fatal]
        if fatal:
            text = "\n".join(gap.describe() for gap in fatal)
            layers = [layer for gap in fatal for layer, _ in gap.layers]
            self.report(f"fxgrad: {text}\n{FATAL_ADVICE}{rnn_hint(layers)}{ddp_hint()}", fatal=True)
        for gap in gaps:
            if not gap.fatal:
                self.warn(f"fxgrad: {gap.describe()}{rnn_hint([layer for layer, _ in gap.layers])}")
        self._hooked(graph, plan)
        message = frozen_named(self.transform, trainable, frozen)
        if message is not None:
            self.warn(message)

    def stepped_together(self, registry: GraphRegistry, stepped: set[int], optimizer: str) -> None:
        """At an optimizer's first step: a rule that reduces across layers meets each model's
        gradients apart when one optimizer (``stepped``: the ids of its parameters) steps the
        parameters of several models this backend compiled, no graph holding them all (an
        encoder and a head compiled one by one; torchtitan's blocks)."""
        if not self.transform.reduces_across_layers():
            return
        graphs = [graph for graph in registry.current() if graph.trains]
        models = {key: model for key, root in registry.roots.items() if (model := root.module()) is not None}
        params = {key: {id(p) for p in model.parameters()} for key, model in models.items()}

        def owner(param: int, root: int | None = None) -> int | None:
            """The model ``param`` belongs to: ``root`` (the one its slot was captured for) if it
            still holds it, else the first that does (Dynamo binds a graph to each call's parameters)."""
            if root in params and param in params[root]:
                return root
            return next((key for key, ids in params.items() if param in ids), None)

        # the models whose stepped parameters some graph holds or ran with (an ensemble of one class runs one)
        found = {
            owner(id(slot.tensor()), slot.root)
            for graph in graphs
            for slot in graph.params
            if id(slot.tensor()) in stepped
        }
        found |= {owner(key) for graph in graphs for key, _, _ in graph.reused_layers() if key in stepped}
        roots = {key: models[key] for key in found if key is not None}
        # a model inside another counted one (a submodule compiled with the same backend) is not one more
        inside = {id(m) for model in roots.values() for m in model.modules() if m is not model}
        roots = {key: model for key, model in roots.items() if key not in inside}
        if len(roots) < 2 or any(graph.roots() >= roots.keys() for graph in graphs):
            return
        names = ", ".join(sorted(type(model).__name__ for model in roots.values()))
        self.report(
            SPLIT_MODELS.format(optimizer=optimizer, count=len(roots), models=names, t=self.transform),
            fatal=True,
        )

    def _hooked(self, graph: CapturedGraph, plan: GraphPlan) -> None:
        """Gradient hooks on parameters the policy acts on run after it in graph scope."""
        acted_on = {layer.name for route in plan.routes for layer in route.layers}
        hooked = [
            slot.name
            for slot in graph.params
            if slot.layer in acted_on and (tensor := slot.tensor()) is not None and _compat.has_grad_hooks(tensor)
        ]
        if hooked:
            self.warn(HOOKED.format(names=", ".join(hooked)))

    def ran_eagerly(self, model: nn.Module, first: bool, hint: str = "", stance: str | None = None) -> None:
        """A forward of ``model`` ran no graph of this backend: the policy did nothing.
        ``stance``: the ``torch.compiler.set_stance`` in effect at that forward, if any
        (:func:`fxgrad._compat.compiler_stance`), the cause then named, as are
        ``torch.compile(..., disable=True)`` and a compile of this backend that failed under
        ``suppress_errors``."""
        if not any(p.requires_grad for p in model.parameters()):
            return
        refuse_fsdp2_in_graph_scope(model)  # sharded after it was compiled (its forward gathers outside the graphs)
        layers = build_layers(model_rows(model, "")[0], (), self.skip)
        name = type(model).__name__
        what = f"no graph of {name} reached the backend" if first else f"a forward of {name} ran no compiled graph"
        rnn = rnn_hint(layers)
        chosen = self.chosen_cause(model, stance)
        if chosen is not None:  # the user's own choice
            rnn, why = "", f"{what}: torch.compile ran it eagerly ({chosen})"
        elif first and self.compile_error is not None and _compat.dynamo_config().suppress_errors:
            rnn = ""  # which frame's compile failed is not known: a likely cause, and the usual ones
            why = (
                f"no graph of {name} was compiled: torch.compile ran it eagerly (a compile of this backend "
                f"failed, {self.compile_error}, and torch._dynamo.config.suppress_errors=True runs that frame "
                "eagerly; or Dynamo could not trace it, or it is under torch.compiler.disable)"
            )
        else:
            if rnn:  # the likeliest cause, which the hint gives alone
                cause = ""
            elif first:
                cause = (
                    " (Dynamo runs a frame eagerly when it cannot trace it or it is under torch.compiler.disable, "
                    "which the trained layers may be while the code between them, or frozen layers, compile to "
                    "graphs that train no parameter, and when the frame's code was "
                    "compiled torch._dynamo.config.recompile_limit times already, which code that many models "
                    "share reaches, e.g. a decorator's wrapper around forward as in transformers, or that "
                    "every compile of the same model class with another backend shares; Dynamo then logs 'hit "
                    "config.recompile_limit'. backend.compile(model) gives the compiled model its own cache, "
                    "as torch.compile(..., isolate_recompiles=True) does)"
                )
            else:
                cause = (
                    ", as Dynamo does once a frame was recompiled torch._dynamo.config.recompile_limit times "
                    "(e.g. once per new input shape; mark the dimension dynamic or raise the limit), and with "
                    "code under torch.compiler.disable"
                )
            why = (
                f"{what}: torch.compile ran it eagerly{cause}, or traced it into the graph of an outer model "
                "compiled with another backend, which compiles it with that backend (compile the outer model "
                "with this one)"
            )
        self.report(
            f"fxgrad: {why}, and the policy {self.transform!r} does nothing.{rnn}{hint}",
            fatal=any(route.leaf.reach == "group" for route in self.transform.routes(layers)),
        )

    def chosen_cause(self, model: nn.Module, stance: str | None) -> str | None:
        """The user's setting that runs ``model`` eagerly, if any: ``stance`` (the
        ``torch.compiler.set_stance`` in effect at its forward) or ``disable=True``."""
        if stance is not None:
            return f"torch.compiler.set_stance({stance}) is in effect"
        if self.compiled_as.get(model) == "disabled":
            return "torch.compile(..., disable=True) compiles nothing"
        return None

    def report(self, message: str, fatal: bool) -> None:
        """Raise :class:`CoverageError` when ``fatal`` (a transform reduces across layers) and
        ``strict``; warn once otherwise."""
        if fatal and self.strict:
            raise CoverageError(message)
        if fatal:
            self.fatal.append(message)
        self.warn(message)

    def unplaced_used(self, held: Callable[[object], bool]) -> None:
        """At an optimizer's step: a parameter in no compiled graph, the rest of its layer in one, has a
        gradient, so it ran eagerly rather than unused: the layer's rule saw part of its gradient.
        ``held(param)``: whether a graph holds it now (one compiled since, for other inputs)."""
        for key, (ref, _) in list(self.unplaced.items()):
            param = ref()
            if param is None or held(param):
                del self.unplaced[key]
        used = [key for key, (ref, _) in self.unplaced.items() if ref().grad is not None]
        if not used:
            return
        named = "\n".join(f"    {self.unplaced.pop(key)[1]}" for key in used)
        self.report(
            "fxgrad: these parameters got a gradient from no compiled graph (they run outside torch.compile: a "
            "function under torch.compiler.disable, or a graph break in a loop), while the rest of their layer is "
            f"in one, so the layer's rule saw only part of its gradient:\n{named}\nUse fxgrad.backend(..., "
            "scope='step'), which transforms the whole .grad at optimizer.step(), or compile that part too.",
            fatal=True,
        )

    def compiled_autograd(self) -> None:
        """At a forward: refuse to rewrite backward graphs that compiled autograd would bypass."""
        if _compat.compiled_autograd_requested():
            raise CoverageError(COMPILED_AUTOGRAD.format(transform=self.transform))

    def note_compiled_autograd(self, params: Callable[[], Iterable[nn.Parameter]]) -> None:
        """In a backward that reached a compiled forward's outputs: if compiled autograd runs it
        (turned on around ``backward()`` alone, which no forward sees), note the forward's
        trainable ``params()``. It runs the unrewritten graphs: the step that takes a gradient of
        theirs raises (:meth:`refuse_unpoliced`). Not at once: the backward may write none of
        theirs (a frozen discriminator in a GAN's generator step, ``backward(inputs=...)``): each
        is noted with its ``.grad`` as it is now, which a gradient the backward writes replaces or
        changes in place. A later backward through the rewritten graphs, once ``zero_grad()``
        dropped them, starts over (zeroed in place, ``set_to_none=False``, they stay noted:
        telling zeros from a gradient would take a host sync)."""
        if _compat.compiled_autograd_running():
            for p in params():
                if p is not None and p.requires_grad and id(p) not in self._unpoliced:
                    self._unpoliced[id(p)] = weakref.ref(p), _grad_state(p)
        elif self._unpoliced:
            for p in params():
                if p is not None and p.grad is None:
                    self._unpoliced.pop(id(p), None)

    @property
    def unpoliced(self) -> bool:
        """Whether :meth:`note_compiled_autograd` noted gradients a step may take (else no step asks)."""
        return bool(self._unpoliced)

    def refuse_unpoliced(self, ids: Collection[int], optimizer: str) -> None:
        """At an optimizer's step (``ids``: those of the parameters it steps): raise if it steps a
        gradient that a backward under compiled autograd wrote (:meth:`note_compiled_autograd`)."""
        written = {}  # those whose gradient the backward under compiled autograd wrote, and is still there
        for key, (ref, before) in self._unpoliced.items():
            p = ref()
            if p is not None and p.grad is not None and _grad_state(p) != before:
                written[key] = ref, before
        if any(key in ids for key in written):  # kept: a retry of the step is refused too
            self._unpoliced = written
            raise CoverageError(UNPOLICED.format(optimizer=optimizer, transform=self.transform))
        self._unpoliced = {key: entry for key, entry in written.items() if key not in ids}  # another optimizer's

    def warn(self, message: str) -> None:
        """Warn once per message with :class:`CoverageWarning`."""
        if message not in self._reported:
            self._reported.add(message)
            warn(message, CoverageWarning)
