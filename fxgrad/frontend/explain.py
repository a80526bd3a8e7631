"""``fxgrad.explain``: what a policy does to a model, layer by layer.

>>> import torch, fxgrad
>>> model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.LayerNorm(4))
>>> report = fxgrad.explain(model, torch.randn(2, 4),
...     backend=fxgrad.backend(fxgrad.clip_by_norm(1.0), compiler="aot_eager"))
>>> print(report.table())
policy: clip_by_norm(max_norm=1.0)
layer  type       params  action
0      Linear         20  clip_by_norm(max_norm=1.0)
1      LayerNorm       8  skipped: is a LayerNorm
"""

from __future__ import annotations

import contextlib
import dataclasses
import warnings
from typing import Any, Iterator, Mapping

import torch
import torch.nn as nn

from fxgrad import _compat
from fxgrad.core import validate
from fxgrad.core.layers import module_type, parameter_owners, skip_reason
from fxgrad.frontend.backend import Backend
from fxgrad.frontend.coverage import CoverageWarning
from fxgrad.frontend.fold import per_layer
from fxgrad.frontend.kernels import KernelCollector, ProgramKernels
from fxgrad.frontend.step_check import handed_back, stepped_ids
from fxgrad.frontend.step_scope import step_routes
from fxgrad.frontend.watch import untrack_wrapper
from fxgrad.passes.capture import CapturedGraph


@dataclasses.dataclass(frozen=True)
class LayerDecision:
    """One row of the report: ``action`` lists the rules that reach the layer, each with the
    values that apply to this layer (``rescale(..., multiplier=1.3)``), or why none does."""

    name: str
    type_name: str
    numel: int
    action: str


@dataclasses.dataclass
class Report:
    """The outcome of :func:`explain`.

    ``layers``: one :class:`LayerDecision` per layer of the model.
    ``graphs``: the compiled graphs, each with ``backward_before``,
    ``backward_after`` (normalized code) and ``inserted`` (fxgrad's nodes only;
    inserted nodes are named ``fxgrad_*`` and tagged ``node.meta["fxgrad"]``).
    ``warnings``: the coverage warnings training would show; ``raises``: those of them that
    training with this backend raises as :class:`~fxgrad.CoverageError` (``strict=True``).
    ``kernels``: with ``explain(..., kernels=True)``, the Inductor kernel launches of each
    backward graph (and of the step program in step scope), each with the fxgrad nodes
    and the model nodes it computes (:class:`~fxgrad.frontend.kernels.ProgramKernels`);
    ``None`` otherwise. :meth:`kernels_table` prints them.
    """

    backend: Backend  # the backend explained (the run used a non-strict copy)
    layers: list[LayerDecision]
    graphs: list[CapturedGraph]
    loss: torch.Tensor
    warnings: list[str]
    kernels: list[ProgramKernels] | None = None
    compiler: str = ""  # what compiled the graphs shown: Inductor with kernels=True, else the backend's
    raises: list[str] = dataclasses.field(default_factory=list)
    program: str | None = None  # step scope: the step program's nodes, as inserted shows a backward's

    @property
    def backward_before(self) -> str:
        return self._joined("backward_before")

    @property
    def backward_after(self) -> str:
        return self._joined("backward_after")

    @property
    def inserted(self) -> str:
        """fxgrad's nodes: those inserted into each backward graph, or in step scope the step
        program's (which leaves the backward alone), in the same form."""
        return self.program if self.program is not None else self._joined("inserted")

    def _joined(self, field: str) -> str:
        texts = [getattr(g, field) for g in self.graphs if getattr(g, field) is not None]
        if len(texts) == 1:
            return texts[0]
        return "".join(f"# ---- backward graph {i}\n{text}" for i, text in enumerate(texts))

    def table(self) -> str:
        """The policy, then the per-layer decisions as an aligned text table."""
        rows = [("layer", "type", "params", "action")]
        rows += [(r.name, r.type_name, str(r.numel), r.action) for r in self.layers]
        widths = [max(len(row[i]) for row in rows) for i in range(3)]
        lines = [f"policy: {self.backend.transform!r}"]
        lines += sorted({self._folded_line(type(o).__name__, o) for o in self.backend.folded_into()})
        lines += [
            f"{name:<{widths[0]}}  {kind:<{widths[1]}}  {numel:>{widths[2]}}  {action}"
            for name, kind, numel, action in rows
        ]
        return "\n".join(line.rstrip() for line in lines)

    def _folded_line(self, name: str, optimizer: torch.optim.Optimizer) -> str:
        """What the fold into ``optimizer`` (of class ``name``) does now."""
        layers = per_layer(self.backend.transform)
        left = (
            "each layer's factor (stats: folded_factor/<layer>)"
            if layers
            else "the global factor (stats: folded_factor)"
        )
        before = ".grad holds the gradient before it until the step (backend.scaled_grads gives it after)"
        if not self.backend.runs_update_of(optimizer):
            how = "a pass before its own step applies them" if layers else "its own step applies it (grad_scale)"
            why = "amsgrad, maximize, step hooks of others, ..."
            return f"folded into {name}, whose update no program can run now ({why}): {how}; {before}"
        if self.backend.current_scope() == "graph":
            return (
                f"folded into {name}: the backward leaves {left}, and a program runs {name}'s update with it; {before}"
            )
        return (
            f"folded into {name}: the step program runs {name}'s update on the gradients the policy transforms "
            "(.grad holds them after the step, as torch's fused update leaves them)"
        )

    def kernels_table(self) -> str:
        """Per compiled program, its kernel launches in order: the number of model nodes and
        the names of the fxgrad nodes each computes; a generated kernel that computes only
        fxgrad nodes is marked as a separate pass."""
        if self.kernels is None:
            raise ValueError("this report has no kernels: call fxgrad.explain(..., kernels=True)")
        if not self.kernels:
            return "no Inductor kernels: no backward graph was compiled"
        return "\n\n".join(program.table() for program in self.kernels)

    def __str__(self) -> str:
        # .item() syncs with the device: fine, explain is a one-off diagnostic, not a training step.
        backend = self.backend
        parts = [
            self.table(),
            "",
            f"{len(self.graphs)} compiled graph(s) (compiler={self.compiler!r}, scope={backend.scope!r}), "
            f"loss {self.loss.item():.6g}",
        ]
        if self.raises:
            parts += ["", "training with this backend raises CoverageError (strict=True) at the first of these:"]
            parts += [f"  {w}" for w in self.raises]
        if any(w not in self.raises for w in self.warnings):
            parts += ["", "warnings:"] + [f"  {w}" for w in self.warnings if w not in self.raises]
        for i, graph in enumerate(self.graphs):
            if graph.inserted is not None:
                parts += ["", f"inserted into backward graph {i}:", graph.inserted.rstrip()]
        if self.program is not None:
            parts += ["", "the step program (scope='step': run on .grad at optimizer.step()):", self.program.rstrip()]
        if self.kernels is not None:
            parts += ["", "Inductor kernels (explain compiled with Inductor), in launch order:", self.kernels_table()]
        return "\n".join(parts)


def explain(model: nn.Module, *args: Any, backend: Backend, kernels: bool = False, **kwargs: Any) -> Report:
    """Run one forward and backward of ``model`` with ``backend`` and report.

    The loss is ``output.loss`` when the output has one (Hugging Face models) or
    ``output["loss"]`` of a dict, else a tuple's first element when it is a scalar
    with a gradient (``(loss, logits)``, as with ``return_dict=False``), otherwise the
    sum of the floating-point outputs. ``model`` is left as it was: its gradients,
    buffers (BatchNorm statistics), the gradients of inputs that require grad and the
    RNG state are restored afterwards. Coverage problems are reported, not raised. The
    backward is of the unscaled loss, so a backend's ``GradScaler`` is left
    out: the graphs shown do not divide the norms by the loss scale. Each call compiles
    the model with a backend of its own, whose compiled code Dynamo keeps until
    ``torch._dynamo.reset()``, as it keeps any backend's: 0.6-1.2 MB a call on a small
    MLP (2026-12-06), not the model nor its weights. Call it once, not every few steps.

    ``kernels=True`` also reports which Inductor kernels compute fxgrad's nodes
    (``report.kernels``, ``report.kernels_table()``): per backward graph, and in step
    scope per compiled step program (run once on the gradients of this backward; with
    an optimizer :meth:`~fxgrad.Backend.fold` folds its update into, the program with that
    update, run on a fresh copy of the optimizer, the weights copied and put back), each
    kernel launch in order with its fxgrad nodes and its number of model nodes.
    The run compiles with Inductor even when ``backend`` has ``compiler="aot_eager"``
    (the policy's nodes are the same; only Inductor makes kernels), without
    Inductor's FX graph cache, so that every graph is lowered and its kernels traced::

        report = fxgrad.explain(model, x, backend=backend, kernels=True)
        print(report.kernels_table())
        # backward graph 0: 9 launches, 5 of them generated kernels
        # kernel                                   model nodes  fxgrad nodes
        # cpp_fused_sum_view_0                               2  fxgrad_mul_3, fxgrad_sum_3
        # extern_kernels.mm                                  1  -
        # cpp_fused_2                                        0  fxgrad_mul_2, fxgrad_sum_2  <- a separate pass
        # ...
    """
    if not isinstance(backend, Backend):
        raise TypeError(f"backend must be an fxgrad.backend(...), got {type(backend).__name__}")
    if not isinstance(kernels, bool):
        raise TypeError(f"kernels must be a bool, got {kernels!r}")
    validate.module("model", model)
    model = _compat.unwrap_model(model)  # explain compiles the model inside a compiled or wrapped module itself
    if type(model).forward is nn.Module.forward:  # ModuleList, ModuleDict: nothing to run
        raise TypeError(f"model must be a module with a forward(), and {type(model).__name__} has none")
    if not any(p.requires_grad for p in model.parameters()):
        raise ValueError("model has no parameter that requires grad: no gradient for a policy to act on")
    # A GradScaler has no scale before its first scaled backward, and this one is unscaled.
    probe = Backend(
        backend.transform,
        skip=backend.skip,
        compiler="inductor" if kernels else backend.compiler,
        strict=False,
        keep_code=True,
        scope=backend.scope,
    )
    collector = KernelCollector(lambda: probe.graphs) if kernels else None
    capture = collector.capture() if collector is not None else contextlib.nullcontext()
    set_aside = _compat.compiled_call_set_aside(model)  # compiled in place (backend.compile(..., in_place=True))
    restored = _restored(model, (args, kwargs))
    with restored, handed_back(model), set_aside, warnings.catch_warnings(record=True) as caught, capture:
        warnings.simplefilter("always", CoverageWarning)
        folded = _optimizer_copy(backend, model, in_graph=True) if probe.current_scope() == "graph" else None
        if folded is not None:  # the backward graphs leave the factor to the update, as training's do
            probe.fold(folded)
        compiled = probe.compile(model)
        try:
            loss = _loss_of(compiled(*args, **kwargs))
            loss.backward()
            step_scope = None
            if probe.transform is not None and probe.current_scope() == "step":
                step_scope = step_routes(probe.transform, [(model, "")], probe.skip, probe.registry.forward_order())[1]
                update = _optimizer_copy(backend, model, in_graph=False)
                with (
                    collector.step_program() if collector is not None else contextlib.nullcontext(),
                    _weights_restored(model) if update is not None else contextlib.nullcontext(),
                ):
                    if update is not None:  # the program the folded step runs, with the optimizer's update
                        probe.fold(update)
                    # on this backward's gradients; _restored puts .grad back
                    probe.transform_grads(model, optimizer=update)
        finally:
            probe.retire()
            untrack_wrapper(model, compiled)
    messages = list(dict.fromkeys(str(w.message) for w in caught if issubclass(w.category, CoverageWarning)))
    decisions = _decisions(model, probe, step_scope)
    fatal = probe._coverage.fatal if backend.strict and probe._coverage is not None else []
    report = Report(
        backend,
        decisions,
        probe.graphs,
        loss.detach(),
        messages,
        compiler=probe.compiler,
        raises=list(fatal),
        program=probe.step_program_code() if step_scope is not None else None,
    )
    if collector is not None:
        report.kernels = collector.result(probe.graphs, stepped=step_scope is not None)
    return report


@dataclasses.dataclass
class _LayerInfo:
    type_name: str
    numel: int = 0
    trainable: bool = False
    module_type: type | None = None


def _decisions(model: nn.Module, probe: Backend, step_scope: list | None) -> list[LayerDecision]:
    """Per layer, what happens; ``step_scope`` holds the routes ``.grad`` gets in step scope."""
    layers: dict[str, _LayerInfo] = {}
    for owner in parameter_owners(model).values():
        kind = module_type(owner.module)
        info = layers.setdefault(owner.layer, _LayerInfo(kind.__name__, module_type=kind))
        info.numel += owner.tensor.numel()
        info.trainable |= owner.tensor.requires_grad
    actions: dict[str, list[str]] = {}
    seen: set[str] = set(layers) if step_scope is not None else set()  # step scope sees every .grad
    # the routes of step scope's program, or of each graph (a layer in several: a recompile's)
    groups = [[route for _, route in step_scope]] if step_scope is not None else [g.routes for g in probe.graphs]
    routes = [route for group in groups for route in group]
    reused_as: dict[str, str] = {}  # layers run in a graph compiled for another block's: that layer
    for graph in probe.graphs:
        seen |= {layer.name for layer in graph.layers}
        reused_as.update(graph.reused_as)
    on_grad = {layer.name for route in routes if route.leaf.apply_to == "grad" for layer in route.layers}
    for group in groups:  # every rule in order (one chained twice, twice); a layer's first graph says it
        done: dict[str, list[str]] = {}
        for route in group:
            for layer in route.layers:
                done.setdefault(layer.name, []).append(route.leaf.on_layer(layer))
        for name, rules in done.items():
            actions.setdefault(name, rules)
    rows = []
    for name, info in layers.items():
        reason = skip_reason(name, info.module_type, probe.skip)
        if not info.trainable:
            action = "frozen (requires_grad=False): no gradient"
        elif name not in seen and name in reused_as:
            compiled_for = reused_as[name]
            done = " -> ".join(actions.get(compiled_for, ["untouched"]))
            action = f"{done}  (in the graph compiled for {compiled_for}, which Dynamo runs for it too)"
        elif name not in seen and any(p.layer == name for graph in probe.graphs if graph.trains for p in graph.params):
            action = "no gradient: a graph holds it, and its output does not reach the loss (detached or unused)"
        elif name not in seen:
            action = "not captured: " + _where(probe, name)
        elif name in actions:
            where = "  (on .grad, at optimizer.step)" if name in on_grad else "  (at optimizer.step)"
            action = " -> ".join(actions[name]) + (where if step_scope is not None else "")
            if reason:
                action += f"  (per-layer transforms skip it: {reason})"
        elif reason:
            action = f"skipped: {reason}"
        else:
            action = "untouched"
        rows.append(LayerDecision(name, info.type_name, info.numel, action))
    return rows


def _where(probe: Backend, layer: str) -> str:
    if not probe.graphs:
        return "no graph was compiled (Dynamo ran the model eagerly)"
    return probe.registry.locate(probe.graphs[-1], layer)


def _loss_of(output: Any) -> torch.Tensor:
    """``output.loss`` (a mapping's ``output["loss"]``); else a tuple's first element when it is a
    scalar with a gradient (a Hugging Face model's ``(loss, logits, ...)`` with
    ``return_dict=False``); else the sum of the floating-point outputs."""
    loss = output.get("loss") if isinstance(output, Mapping) else getattr(output, "loss", None)
    if isinstance(loss, torch.Tensor):
        if loss.numel() != 1 or not loss.requires_grad:
            raise ValueError(
                f"explain runs one backward from the model's output.loss, and it is "
                f"{'a tensor of shape ' + str(tuple(loss.shape)) if loss.numel() != 1 else 'without a gradient'}: "
                "give explain a model whose loss is one number computed from its parameters"
            )
        return loss
    first = output[0] if isinstance(output, (tuple, list)) and output else None
    if isinstance(first, torch.Tensor) and first.dim() == 0 and first.is_floating_point() and first.requires_grad:
        return first
    floats = [t for t in _tensors(output) if t.is_floating_point()]
    if not floats:
        raise ValueError("explain needs a model output with a .loss or floating-point tensors")
    if not any(t.requires_grad for t in floats):
        raise ValueError(
            "explain runs one backward, and the model's output has no gradient (computed under torch.no_grad(), "
            "or from no trainable parameter): nothing would reach the policy"
        )
    return sum(t.float().sum() for t in floats)


def _tensors(value: Any) -> Iterator[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, Mapping):
        for item in value.values():
            yield from _tensors(item)
    elif isinstance(value, (list, tuple)):
        for item in value:
            yield from _tensors(item)


def _optimizer_copy(backend: Backend, model: nn.Module, in_graph: bool) -> torch.optim.Optimizer | None:
    """A fresh copy (no state) of an optimizer over ``model``'s parameters that ``backend``
    folds into (``backend.fold``), if there is one: in graph scope (``in_graph``) any, which the
    backward graphs leave the factor to; in step scope one whose update the step program runs."""
    ours = {id(p) for p in model.parameters()}
    for optimizer in backend.folded_into():
        if (in_graph or backend.runs_update_of(optimizer)) and not stepped_ids(optimizer).isdisjoint(ours):
            return type(optimizer)([{**group, "params": list(group["params"])} for group in optimizer.param_groups])
    return None


@contextlib.contextmanager
def _weights_restored(model: nn.Module) -> Iterator[None]:
    """Put ``model``'s weights back on exit (a copy of them meanwhile)."""
    saved = [(p, p.detach().clone()) for p in model.parameters()]
    try:
        yield
    finally:
        with torch.no_grad():
            for p, value in saved:
                p.copy_(value)


class _restored:
    """Restore a model's gradients, buffers and attributes, the gradients of ``inputs`` (leaf
    tensors that require grad: the backward writes theirs too), and the RNG state, on exit.

    The attributes: Lightning's wrapper of ``torch.compile`` sets ``_compile_kwargs`` on the
    model, through the compiled module, and ``fabric.setup`` compiles the model again with
    them: after ``explain``, with its probe backend, not the user's."""

    def __init__(self, model: nn.Module, inputs: Any = ()) -> None:
        self.model, self.inputs = model, inputs

    def __enter__(self) -> None:
        self.attributes = dict(vars(self.model))
        self.grads = {p: p.grad for p in self.model.parameters()}
        leaves = (t for t in _compat.tensors_in(self.inputs) if t.is_leaf and t.requires_grad)
        self.grads.update((t, t.grad) for t in leaves if t not in self.grads)
        # each buffer's module and name too: a forward may assign a new tensor (self.ema = ...)
        self.buffers = [
            (module, name, b, b.detach().clone())
            for module in self.model.modules()
            for name, b in module.named_buffers(recurse=False)
        ]
        for p in self.grads:
            p.grad = None
        self.rng = torch.random.fork_rng()
        self.rng.__enter__()

    def __exit__(self, *exc: Any) -> None:
        self.rng.__exit__(*exc)
        with torch.no_grad():
            for module, name, buffer, saved in self.buffers:
                if getattr(module, name, None) is not buffer:
                    setattr(module, name, buffer)
                buffer.copy_(saved)
        for p, grad in self.grads.items():
            p.grad = grad
        attributes = vars(self.model)
        for name in attributes.keys() - self.attributes.keys():
            del attributes[name]
        attributes.update(self.attributes)
