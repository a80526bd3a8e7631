"""What fxgrad learns from a Dynamo graph: which inputs are which parameters.

Dynamo lifts parameters to graph inputs; each placeholder names its source
(``L['self']._modules['fc1']._parameters['weight']``) and the backend receives
the real parameter tensors. fxgrad resolves each source's root object in the
frame being compiled; when it is an ``nn.Module`` (the compiled model, or a
model the compiled function uses), the parameter is mapped to its first owner
in that model's ``named_modules()`` order.

A parameter whose root is not a module (an ``nn.Parameter`` passed as an
argument) becomes a layer of its own, named after its variable. A tensor in a
module's parameter slot that is not an ``nn.Parameter`` (``torch.func.functional_call``
puts it there) is no parameter: it is listed by its slot (``CapturedGraph.stand_ins``),
for the coverage check to report.

Dynamo's DDP optimizer (a compiled model inside ``DistributedDataParallel``,
split into one graph per gradient bucket) hands the backend fake copies of the
parameters; their sources, evaluated in the frame, give the real ones.
"""

from __future__ import annotations

import dataclasses
import operator
import re
import weakref
from typing import Iterator, Sequence

import torch
import torch.fx
import torch.nn as nn

from fxgrad import _compat
from fxgrad.core.layers import Owner, module_type, parameter_owners


@dataclasses.dataclass(frozen=True)
class ParamSlot:
    """A forward-graph input that is a parameter.

    ``index`` is its position among the graph's inputs, which is also the
    position of its gradient among the backward graph's outputs.
    """

    index: int
    layer: str
    name: str
    module_type: type | None
    numel: int
    root: int | None  # id() of the model it belongs to, None for a loose tensor
    tensor: weakref.ref  # the parameter itself, for transforms that read weights
    module: weakref.ref | None = None  # the module that owns it (None for a loose tensor)

    def held_by_owner(self, tensor: torch.Tensor) -> bool:
        """Whether the owning module now holds ``tensor`` under this parameter's name."""
        module = self.module() if self.module is not None else None
        return module is not None and getattr(module, self.name.rpartition(".")[2], None) is tensor


@dataclasses.dataclass
class Root:
    """A model whose parameters appear in compiled graphs.

    ``prefix`` qualifies its layer names. It is empty, so names match
    ``model.named_modules()``, unless the graph that first saw the model used
    several models (a GAN step, say): then it is the variable name; or ``renamed``,
    when another model had its names already: then it is its class and a number.
    """

    module: weakref.ref
    prefix: str
    renamed: bool = False


@dataclasses.dataclass
class CapturedGraph:
    """One Dynamo graph as fxgrad saw it, and what fxgrad did to its backward."""

    compile_id: tuple[int | None, int | None]  # (frame_id, frame_compile_id)
    attempt: int
    num_inputs: int
    params: list[ParamSlot]
    # Filled in when the backward graph is rewritten:
    backward_before: str | None = None
    backward_after: str | None = None
    inserted: str | None = None
    layers: list = dataclasses.field(default_factory=list)
    routes: list = dataclasses.field(default_factory=list)
    gaps: list = dataclasses.field(default_factory=list)
    # Whether this graph may compute a parameter's gradient (not run under no_grad, nor frozen:
    # an EMA copy's graphs do not, and no policy acts on them):
    trains: bool = True
    # Whether it was compiled in grad mode (Dynamo runs it in that mode only): not an evaluation
    # forward's under no_grad
    grad_mode: bool = True
    # The prefixes of the modules it trains that were renamed (see Root):
    renamed_roots: list = dataclasses.field(default_factory=list)
    # Whether the rewritten backward reads parameters (None: not rewritten yet). Such a graph,
    # run for several modules, is bound to each call's parameters before that call's backward.
    reads_weights: bool | None = None
    # Parameters of other modules Dynamo ran this graph with (a graph break inside a repeated
    # block's forward): id -> (the parameter, weakly; its layer). Their gradients are transformed.
    reused: dict = dataclasses.field(default_factory=dict)
    # ... and, by their layer, the layer compiled in their slots, whose routes they get
    reused_as: dict[str, str] = dataclasses.field(default_factory=dict)
    # The compiled callable Dynamo holds; dead after torch._dynamo.reset():
    compiled: weakref.ref | None = None
    # The backend's count of compiled-graph calls at this graph's last call (-1: never called)
    last_run: int = -1
    # Inputs in a module's parameter slots that are plain tensors requiring grad, not the
    # parameters (torch.func.functional_call put them there), by their source's path: no
    # policy reaches their gradients in the backward graph
    stand_ins: list[str] = dataclasses.field(default_factory=list)
    # id() -> the model, weakly, for each model its parameters belong to (ParamSlot.root)
    root_refs: dict = dataclasses.field(default_factory=dict)
    _by_name: dict | None = dataclasses.field(default=None, repr=False)
    # bound_to's getter of the parameters among a call's inputs, and the bound ones, weakly
    _bound: tuple | None = dataclasses.field(default=None, repr=False)

    def live(self) -> bool:
        return self.compiled is None or self.compiled() is not None

    def current(self) -> bool:
        """Live, and not a freed model's: Dynamo keeps a graph whose parameters and their
        modules are all gone (and may run it for a new model, which binds it again), and
        their ``id()``s then name other objects. (A graph whose model is gone but some of
        whose parameters live on, a shared backbone's, stays current; :meth:`roots` leaves
        the model out.)"""
        return self.live() and not (
            self.params and all(p.tensor() is None and (p.module is None or p.module() is None) for p in self.params)
        )

    def reuses(self, param: torch.Tensor) -> bool:
        """Whether ``param`` is one of :attr:`reused` (by identity: a freed one's id is reused)."""
        entry = self.reused.get(id(param))
        return entry is not None and entry[0]() is param

    def reused_layers(self) -> Iterator[tuple[int, weakref.ref, str]]:
        """``(id, parameter weakly, layer)`` of the live parameters in :attr:`reused`."""
        return ((key, ref, layer) for key, (ref, layer) in self.reused.items() if ref() is not None)

    def tensors(self, names: Sequence[str]) -> list[torch.Tensor]:
        """The parameters ``names`` stand for now (weight-reading transforms call this when the
        rewrite records them, and on each step), so the graph reads weights."""
        self.reads_weights = True
        if self._by_name is None:
            self._by_name = {p.name: p.tensor for p in self.params}
        return [self._by_name[name]() for name in names]

    def bound_to(self, inputs: Sequence) -> bool:
        """Whether a call's ``inputs`` are the parameters the graph is bound to, each of them:
        one layer's replaced (``load_state_dict(assign=True)``, a new ``nn.Linear``) must be
        followed, and so must another model sharing the first and last layers (an embedding
        and a tied head). C maps over the slots, as every forward checks."""
        if self._bound is None:
            indices = [p.index for p in self.params]
            take = operator.itemgetter(*indices) if len(indices) > 1 else lambda inputs: (inputs[indices[0]],)
            self._bound = take, [p.tensor for p in self.params]
        take, refs = self._bound
        return all(map(operator.is_, take(inputs), map(weakref.ref.__call__, refs)))

    def rebind(self, inputs: Sequence) -> bool:
        """Follow the parameters a call passes instead of those the graph was compiled
        with; returns whether they replaced those in the same modules
        (``load_state_dict(assign=True)``) rather than belong to another module
        that Dynamo runs this graph for."""
        # told by a slot that changed: one that did not (a weight every block takes) proves nothing
        changed = next((p for p in self.params if p.tensor() is not inputs[p.index]), self.params[0])
        replaced = changed.held_by_owner(inputs[changed.index])
        self.bind([inputs[p.index] for p in self.params])
        return replaced

    def bind(self, tensors: Sequence[torch.Tensor]) -> None:
        """Read ``tensors`` as the parameters, one per slot, from now on."""
        self.params = [dataclasses.replace(p, tensor=weakref.ref(t)) for p, t in zip(self.params, tensors)]
        self._by_name = self._bound = None

    def param_names(self) -> set[str]:
        return {p.name for p in self.params}

    def roots(self) -> set[int]:
        """The ids of the live models its parameters belong to (a freed one's id can be another's)."""
        return {key for key, ref in self.root_refs.items() if ref() is not None}


def live_root(roots: dict[int, Root], module: object) -> Root | None:
    """``module``'s entry in ``roots``, keyed by ``id(module)``; None for an entry a freed
    model left under an id that ``module`` has now."""
    root = roots.get(id(module))
    return root if root is not None and root.module() is module else None


_SIMPLE_SOURCE = re.compile(r"^[LG]\['([^']+)'\]$")
# a source that ends in a module's parameter slot, and each step of it
_PARAMETER_SLOT = re.compile(r"(?:\._modules\['[^']+'\])*\._parameters\['[^']+'\]$")
_MODULE_SLOT = re.compile(r"\._(?:modules|parameters)\['([^']+)'\]")


def capture(gm: torch.fx.GraphModule, example_inputs: Sequence, roots: dict[int, Root]) -> CapturedGraph:
    """Map ``gm``'s parameter inputs to layers; new models are added to ``roots``."""
    held = any(True for _ in gm.parameters()) or any(True for _ in gm.buffers())
    grad_mode = _compat.may_record_grad(gm)
    if held and grad_mode:  # not a compiled optimizer.step(), which holds its parameters
        raise NotImplementedError(
            "fxgrad needs the parameters as graph inputs, in either scope (it learns the layers from them), "
            "and this graph holds them as attributes: leave torch._dynamo.config.install_free_tensors and "
            "inline_inbuilt_nn_modules at their defaults (False and True)"
        )
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    if len(placeholders) != len(example_inputs):
        raise RuntimeError(f"graph has {len(placeholders)} inputs but the backend got {len(example_inputs)} values")
    scope = _compat.current_frame_scope()
    owners = {
        key: parameter_owners(root.module(), root.prefix) for key, root in roots.items() if root.module() is not None
    }
    found, stand_ins = [], []
    for index, (node, value) in enumerate(zip(placeholders, example_inputs)):
        chain = _compat.source_chain(node)
        if isinstance(value, nn.Parameter):
            if _compat.is_fake(value) and chain:
                real = _evaluate(chain[-1], scope)
                value = real if isinstance(real, nn.Parameter) and real.shape == value.shape else value
            # A known model first: in a frame compiled after a graph break inside a
            # submodule's forward, the outermost module in scope is that submodule. Of two
            # known models that hold it, the outer one (a submodule compiled with the same
            # backend as its model holds fewer parameters).
            holders = [key for key, known in owners.items() if id(value) in known]
            home = roots[max(holders, key=lambda key: len(owners[key]))].module() if holders else None
            found.append((index, value, chain, home if home is not None else _find_root(chain, scope)))
        elif isinstance(value, torch.Tensor) and value.requires_grad and chain:
            slot = _PARAMETER_SLOT.search(chain[-1])
            if slot is not None:  # a.weight for ._modules['a']._parameters['weight']
                stand_ins.append(_MODULE_SLOT.sub(r".\1", slot.group(0)).strip("."))
    modules = {id(root): (root, chain[0]) for _, _, chain, root in found if root is not None}
    # the modules some of whose parameters this graph may compute gradients of
    records = grad_mode and _compat.may_have_backward(gm)
    trained = {id(root) for _, value, _, root in found if value.requires_grad} if records else set()
    for key, (module, source) in modules.items():
        if live_root(roots, module) is None:
            prefix = _variable_name(source) if len(modules) > 1 else ""
            named = parameter_owners(module, prefix)
            renamed = _names_taken(named, owners)
            if renamed:
                prefix = f"{type(module).__name__}#{len(roots)}"
                named = parameter_owners(module, prefix)
            roots[key] = Root(weakref.ref(module), prefix, renamed)
            owners[key] = named
    params = []
    for index, value, chain, root in found:
        owner = owners[id(root)].get(id(value)) if root is not None else None
        if owner is None:
            name = _variable_name(chain[-1]) if chain else f"input{index}"
            owner, root = Owner(name, name, None, value), None
        params.append(
            ParamSlot(
                index=index,
                layer=owner.layer,
                name=owner.param,
                module_type=module_type(owner.module) if owner.module is not None else None,
                numel=value.numel(),
                root=id(root) if root is not None else None,
                tensor=weakref.ref(value),
                module=weakref.ref(owner.module) if owner.module is not None else None,
            )
        )
    compile_id, attempt = _compat.compile_id(gm)
    renamed = [roots[key].prefix for key in modules if key in trained and roots[key].renamed]
    root_refs = {key: roots[key].module for key in dict.fromkeys(p.root for p in params if p.root is not None)}
    return CapturedGraph(
        compile_id,
        attempt,
        len(placeholders),
        params,
        trains=bool(trained),
        grad_mode=grad_mode,
        renamed_roots=renamed,
        root_refs=root_refs,
        stand_ins=stand_ins if grad_mode else [],
    )


def graph_model(
    gm: torch.fx.GraphModule, example_inputs: Sequence, known: Sequence[nn.Module] = ()
) -> nn.Module | None:
    """The model a graph's parameters belong to: one of ``known`` that owns the first
    parameter, else the outermost module on its source in the frame being compiled."""
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    for node, value in zip(placeholders, example_inputs):
        if isinstance(value, nn.Parameter):
            owner = next((m for m in known if any(p is value for p in m.parameters())), None)
            return owner if owner is not None else _find_root(_compat.source_chain(node), _compat.current_frame_scope())
    return None


def _names_taken(new: dict[int, Owner], known: dict[int, dict[int, Owner]]) -> bool:
    """Whether other parameters already have some of the layer names in ``new``."""
    taken = {owner.layer for key_owners in known.values() for pid, owner in key_owners.items() if pid not in new}
    return any(owner.layer in taken for owner in new.values())


def _find_root(chain: list[str], scope: tuple[dict, dict] | None) -> nn.Module | None:
    """The outermost module on a source chain, evaluated in the compiled frame."""
    for name in chain[:-1]:
        value = _evaluate(name, scope)
        if isinstance(value, nn.Module):
            return value
    return None


def _evaluate(source_name: str, scope: tuple[dict, dict] | None) -> object:
    """The object a Dynamo source name refers to in the compiled frame, or ``None``."""
    if scope is None:
        return None
    try:
        return eval(source_name, {"L": scope[0], "G": scope[1], "__builtins__": {}})  # noqa: S307 - lookups
    except Exception:
        return None


def _variable_name(source_name: str) -> str:
    """``model`` for ``L['model']`` or ``G['model']``."""
    match = _SIMPLE_SOURCE.match(source_name)
    return match.group(1) if match else source_name
