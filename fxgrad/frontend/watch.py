"""Checks that :meth:`fxgrad.Backend.compile` runs around every forward of the model.

Each is O(1) per step and never syncs. They catch what a backward-graph
rewrite cannot see from inside the graph:

* a forward that ran no graph of the backend (Dynamo ran it eagerly);
* a backward that writes the model's gradients without starting from a
  forward of the compiled model (the original model called instead, or a
  method other than ``forward``: both run eagerly);
* a backward that sums gradients into ``.grad`` (:class:`GradWrites`): onto the
  previous backward's (accumulation: not zeroed since), or of two forwards in one
  loss. ``scope="graph"`` then transforms each part, not their sum; the step of an
  optimizer that steps such gradients says so (``summed``).

The gradient checks run when backward reaches the forward's outputs, so
``zero_grad()`` between forward and backward, validation forwards and
forwards whose outputs are dropped raise nothing.

Every autograd hook fxgrad registers (here, in :mod:`~fxgrad.frontend.backend` and
:mod:`~fxgrad.frontend.outside_uses`) is a function made eager once, where it is defined,
with ``torch.compiler.disable``: a train step compiled whole runs ``backward()`` under
Dynamo, which would otherwise trace each hook as a frame of its own with the backend (and
take its bookkeeping for graphs of the model). Once per function, not per hook: making one
costs about 37 us.

    runs = lambda: backend._training_runs               # calls of its compiled forwards that train parameters
    in_graph = lambda: backend.current_scope() == "graph"
    summed = lambda param, message: ...                # reported at the optimizer's step
    ForwardWatch(model, coverage, runs, in_graph, summed).install(torch.compile(model, backend=backend))
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import weakref
from typing import Any, Callable

import torch
import torch.nn as nn
from torch.nn.parameter import is_lazy
from torch.utils.weak import WeakIdKeyDictionary

from fxgrad import _compat
from fxgrad.frontend.coverage import CoverageCheck

ACCUMULATING = (
    "fxgrad: a backward started while .grad still held the previous backward's gradient. If you "
    "accumulate gradients over micro-batches, or backward several losses through one forward "
    "(retain_graph=True), scope='graph' applies the policy to each backward's gradient (its statistics "
    "too), not to their sum: use fxgrad.backend(..., scope='step'), which applies the policy once, at "
    "optimizer.step(). (zero_grad() before each backward silences this.)"
)

TWO_FORWARDS = (
    "fxgrad: one backward() took the outputs of two forwards of {model}. scope='graph' applies the "
    "policy to each forward's gradient on its own (its statistics too), not to their sum (two views, a "
    "contrastive or a GAN discriminator's loss): use fxgrad.backend(..., scope='step'), which applies the "
    "policy once, at optimizer.step()."
)

BYPASSED = (
    "fxgrad: a backward wrote the gradient of {param} without passing through a forward of the compiled "
    "{model}, so the policy {transform!r} did not run on it. Call the module that backend.compile() "
    "returned, not the original model, and compile methods other than forward yourself: "
    "torch.compile(model.method, backend=fxgrad.backend(...)), with a backend of its own (one backend takes "
    "the graphs of two entry points of a model for parts of one forward)."
)


@torch.compiler.disable
def hook_weakly(param: nn.Parameter, method: Callable[[nn.Parameter], None]) -> None:
    """Call ``method(param)`` after each backward writes ``param.grad``, while ``method``'s object
    lives; the hook goes with it (``explain`` makes a watcher per call).

    The collector does not look through a parameter's hooks while C++ holds the parameter
    too (autograd does), so a hook holding its object strongly, which holds the model, would
    keep both alive for good. Eager, like the hook, under compiled autograd (which traces the
    backward's hooks): this is bookkeeping, and ``weakref.finalize`` writes a global registry."""
    ref = weakref.WeakMethod(method)

    @torch.compiler.disable
    def hook(tensor: nn.Parameter) -> None:
        live = ref()
        if live is not None:
            live(tensor)

    weakref.finalize(method.__self__, param.register_post_accumulate_grad_hook(hook).remove)


@dataclasses.dataclass
class _Shared:
    """What the compiled modules of one model share, whatever their backend or scope."""

    # oldest first: backend.compile's, or None for a plain torch.compile with a backend (no watch)
    wrappers: list[weakref.ref | None] = dataclasses.field(default_factory=list)

    def newest(self) -> nn.Module | None:
        """The newest compiled module of the model that still exists (``None``: one that no
        :class:`ForwardWatch` speaks for)."""
        self.wrappers = [ref for ref in self.wrappers if ref is None or ref() is not None]
        newest = self.wrappers[-1] if self.wrappers else None
        return newest() if newest is not None else None


_SHARED: weakref.WeakKeyDictionary[nn.Module, _Shared] = weakref.WeakKeyDictionary()


class _Reached:
    """The latest backward passes that reached the outputs of a compiled forward: of any model
    (an encoder shared by two compiled task models gets its gradient through either), of any
    backend (``explain`` compiles the model with its own). Several: training loops in threads
    run backward passes at once, and one's must not hide another's."""

    def __init__(self) -> None:
        self._ids: collections.deque[int] = collections.deque(maxlen=16)

    def add(self, pass_id: int) -> None:
        if pass_id not in self._ids:
            self._ids.append(pass_id)

    def __contains__(self, pass_id: int) -> bool:
        return pass_id in self._ids


_REACHED = _Reached()


def track_wrapper(model: nn.Module, compiled: nn.Module | None) -> None:
    """Record that ``compiled`` is the newest compiled module of ``model``; ``None``: the model
    was compiled again with plain ``torch.compile`` and a backend of fxgrad's (``fabric.setup``
    of a module ``backend.compile`` returned does), whose checks are the plain path's."""
    _SHARED.setdefault(model, _Shared()).wrappers.append(None if compiled is None else weakref.ref(compiled))


def untrack_wrapper(model: nn.Module, compiled: nn.Module) -> None:
    """Forget ``compiled`` (``explain``'s, done), which may live on until the collector runs: the
    model's own compiled module, or none, is its newest again, and no check of ``compiled``'s
    watch speaks for it (a later eager backward would be reported as bypassing it)."""
    shared = _SHARED.get(model)
    if shared is not None:
        shared.wrappers = [ref for ref in shared.wrappers if ref is None or ref() is not compiled]


class GradWrites:
    """What the backward passes that write a parameter's ``.grad`` sum into it.

    A backward pass that reaches a compiled call holding the parameter is noted, with
    autograd's id for the pass. When that pass writes ``.grad``, it summed more than one
    part if ``.grad`` still held what the previous pass wrote (accumulation: not zeroed
    since; ``zero_grad(set_to_none=False)`` bumps the gradient's version, ``set_to_none``
    drops it) or if it reached two calls holding the parameter (two forwards in one loss:
    autograd adds their gradients before it writes once). Each write calls
    ``summed(param, message)`` with the warning that says which, or ``None`` for a gradient
    of one part. A pass that writes no ``.grad`` (``torch.autograd.grad`` of an input, as
    adversarial training takes) calls nothing::

        writes = GradWrites(summed=lambda param, message: ...)
        writes.reaches(param, model_name)  # from a backward pre-hook of a compiled call's outputs
        loss.backward()
        writes.holds_last_backward(param)  # True until zero_grad()
    """

    def __init__(self, summed: Callable[[nn.Parameter, str | None], None] = lambda param, message: None) -> None:
        self.summed = summed
        self._versions: WeakIdKeyDictionary = WeakIdKeyDictionary()  # nn.Parameter -> int | None
        # nn.Parameter -> (pass id, message, ids of the graphs whose calls reached it in that pass)
        self._reached: WeakIdKeyDictionary = WeakIdKeyDictionary()

    def watch(self, param: nn.Parameter) -> None:
        """Follow the backward writes of ``param.grad`` from now on (again: a no-op)."""
        if param not in self._versions:
            self._versions[param] = None
            hook_weakly(param, self._written)

    def reaches(self, param: nn.Parameter, model: str, graph: object = None) -> None:
        """The running backward pass reached a call of ``model``'s compiled forward holding ``param``
        (``graph``: the compiled graph of that call, when the call is one graph's). Two graphs of
        one forward can both hold a parameter (tied weights across a graph break): a call of each
        is one forward, which the per-graph coverage check reports; a second call of one graph,
        or of the whole forward, is a second forward."""
        self.watch(param)
        current = _compat.backward_pass_id()
        last, message, graphs = self._reached.get(param, (None, None, ()))
        if last != current:
            message, graphs = (ACCUMULATING if self.holds_last_backward(param) else None), ()
        elif graph is None or id(graph) in graphs:
            message = TWO_FORWARDS.format(model=model)
        self._reached[param] = current, message, (*graphs, id(graph))

    def _written(self, param: nn.Parameter) -> None:
        grad = param.grad  # None once an optimizer stepped in a hook of its own and dropped it: written
        self._versions[param] = -1 if grad is None else _compat.tensor_version(grad)
        current, message, _ = self._reached.pop(param, (None, None, ()))
        self.summed(param, message if current == _compat.backward_pass_id() else None)

    def written(self, param: nn.Parameter) -> bool:
        """Whether a backward wrote ``param.grad`` since :meth:`watch`."""
        return self._versions.get(param) is not None

    def holds_last_backward(self, param: nn.Parameter) -> bool:
        grad = param.grad
        return grad is not None and _compat.tensor_version(grad) == self._versions.get(param)


class OncePerPass:
    """``True`` the first time it is called in each backward pass. The outputs of one forward
    call are reached more than once in one pass (a view of an output has an autograd node of
    its own), and by more than one pass (``retain_graph=True``: a second loss through the same
    forward sums into ``.grad``)::

        first = OncePerPass()  # per forward call
        node.register_prehook(lambda grad_outputs: first() and count())
    """

    def __init__(self) -> None:
        self._pass: int | None = None

    def __call__(self) -> bool:
        current = _compat.backward_pass_id()
        first, self._pass = current != self._pass, current
        return first


class WatchedCall:
    """The call ``model.compile()`` installs, with hooks around it as a compiled module's forward
    hooks run, outside Dynamo: what :class:`ForwardWatch` installs on for a model compiled in
    place (``backend.compile(model, in_place=True)``)::

        call = WatchedCall(compiled_call)
        call.register_forward_pre_hook(lambda call, args: ...)
        call.register_forward_hook(lambda call, args, output: ...)
    """

    def __init__(self, call: Callable[..., Any]) -> None:
        self.call = call
        self._pre_hooks: list[Callable[..., None]] = []
        self._hooks: list[Callable[..., None]] = []

    def register_forward_pre_hook(self, hook: Callable[[Any, tuple], None]) -> None:
        self._pre_hooks.append(hook)

    def register_forward_hook(self, hook: Callable[[Any, tuple, Any], None]) -> None:
        self._hooks.append(hook)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        for hook in self._pre_hooks:
            hook(self, args)
        output = self.call(*args, **kwargs)
        for hook in self._hooks:
            hook(self, args, output)
        return output


def probe_names(model: nn.Module, parts: int = 3) -> list[str]:
    """The names of ``model``'s first trainable parameter and of the first of each of its ``parts``
    largest parts (direct children, or its own parameters). A method that bypasses the compiled
    forward through one part (CLIP's ``get_text_features``, whose first parameter, ``logit_scale``,
    it never uses) writes one of them; a few hooks, not one per parameter."""
    first: dict[str, str] = {}
    sizes: dict[str, int] = {}
    for name, param in model.named_parameters():
        if param.requires_grad:
            part = name.split(".", 1)[0]
            first.setdefault(part, name)
            sizes[part] = sizes.get(part, 0) + (0 if is_lazy(param) else param.numel())
    largest = sorted(sizes, key=sizes.__getitem__, reverse=True)[:parts]
    return list(dict.fromkeys([*first.values()][:1] + [first[part] for part in largest]))


class _Probe:
    """A parameter whose gradient writes a :class:`ForwardWatch` follows, looked up by name."""

    def __init__(self, model: nn.Module, name: str) -> None:
        owner, _, self.attr = name.rpartition(".")
        self.name, self.owner = name, model.get_submodule(owner)
        self.param: nn.Parameter = getattr(self.owner, self.attr)
        self.watched: nn.Parameter | None = None  # the one the hooks are on


class ForwardWatch:
    """The per-forward checks of one compiled model.

    ``graph_runs()`` counts calls of the backend's compiled forwards that train parameters: a
    forward whose trained layers all run under ``torch.compiler.disable`` compiles the code
    between them (a ReLU's, or frozen layers'), and the policy does nothing;
    ``in_graph()`` tells whether the policy runs in the graph (``scope``).
    """

    def __init__(
        self,
        model: nn.Module,
        coverage: CoverageCheck,
        graph_runs: Callable[[], int],
        in_graph: Callable[[], bool],
        summed: Callable[[nn.Parameter, str | None], None],
    ) -> None:
        self.model, self.coverage = model, coverage
        self.graph_runs, self.in_graph = graph_runs, in_graph
        self._runs_before = 0
        self._first = True
        self._opaque = False  # a forward returned its tensors in an object tensors_in cannot open
        self._writes = GradWrites(summed)
        self._shared = _SHARED.setdefault(model, _Shared())
        # The first tells accumulation apart from a fresh step, and each tells a bypass: a
        # gradient written in a backward pass that reached no compiled forward's outputs.
        self._probes = [_Probe(model, name) for name in probe_names(model)]
        self._compiled: Callable[[], Any] = lambda: None

    def install(self, compiled: nn.Module | WatchedCall) -> None:
        self._compiled = weakref.ref(compiled)
        compiled.register_forward_pre_hook(self._before)
        compiled.register_forward_hook(self._after)
        self._follow_probes()

    def _follow_probes(self) -> None:
        """Watch the probe parameters, the current ones (``load_state_dict(assign=True)``
        replaces parameters) once they have data (a lazy module's, ``nn.LazyLinear``, has none
        before its first forward)."""
        for i, probe in enumerate(self._probes):
            current = getattr(probe.owner, probe.attr, None)
            if isinstance(current, nn.Parameter):
                probe.param = current
            if probe.param is not probe.watched and not is_lazy(probe.param):
                probe.watched = probe.param
                if i == 0:
                    self._writes.watch(probe.param)
                hook_weakly(probe.param, self._check_bypass)

    def _check_bypass(self, param: nn.Parameter) -> None:
        if self._opaque or _compat.backward_pass_id() in _REACHED:  # every training step's backward: nothing more
            return
        probe = next((probe for probe in self._probes if probe.watched is param), None)
        if probe is None:  # replaced since
            return
        # Only for the newest compiled module of the model: compiling it again (another
        # backend or scope, explain(), a notebook cell run twice) leaves this hook behind.
        compiled = self._compiled()
        if compiled is not None and self._shared.newest() is compiled and self.in_graph():
            self.coverage.warn(
                BYPASSED.format(param=probe.name, model=type(self.model).__name__, transform=self.coverage.transform)
            )

    def _before(self, module: nn.Module, args: Any) -> None:
        self._runs_before = self.graph_runs()

    def _after(self, module: nn.Module, args: Any, output: Any) -> None:
        # Step scope runs the policy on .grad all the same. A first forward that ran no graph is
        # said at once (a model Dynamo never compiles, an LSTM); a later one when a backward
        # reaches its outputs: a forward nobody backpropagates (validation under the
        # set_stance("force_eager") stance, say) leaves the policy nothing to miss.
        # A forward under no_grad (validation, a meta-learning inner pass) is left out: no backward
        # follows, and its graphs train nothing.
        if not torch.is_grad_enabled() or not self.in_graph():
            return
        # parameters frozen around the forward (a GAN's discriminator in the generator's step) get no gradient
        eager = self.graph_runs() == self._runs_before and any(p.requires_grad for p in self.model.parameters())
        stance = _compat.compiler_stance() if eager else None  # the cause, as at this forward
        first, self._first = self._first, False
        if eager and first:
            self.coverage.ran_eagerly(self.model, True, stance=stance)
        self._follow_probes()
        found = _compat.tensors_in(output)
        outputs = [t for t in found if t.grad_fn is not None]
        if not outputs:  # none to wait for (frozen, or an object that is no pytree hides them): said now
            # and when hidden, no backward through them can be told from a bypass
            self._opaque = self._opaque or not found
            if eager and not first:
                self.coverage.ran_eagerly(self.model, False, stance=stance)
            return
        # per forward call; a later forward that ran no graph is reported when a backward reaches it
        reached = functools.partial(self._backward_reached, OncePerPass(), eager and not first, stance)
        for node in {t.grad_fn for t in outputs}:
            node.register_prehook(reached)

    @torch.compiler.disable  # an autograd hook (see the module docstring)
    def _backward_reached(self, first: OncePerPass, ran_eagerly: bool, stance: str | None, grad_outputs: Any) -> None:
        _REACHED.add(_compat.backward_pass_id())
        if not first():
            return
        self.coverage.note_compiled_autograd(self.model.parameters)
        if ran_eagerly:
            self.coverage.ran_eagerly(self.model, False, stance=stance)
        if self._probes:
            self._writes.reaches(self._probes[0].param, type(self.model).__name__)
