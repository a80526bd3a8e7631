"""No silent no-op on the plain ``torch.compile`` path: a check at ``optimizer.step()``.

``torch.compile(model, backend=backend)`` and ``model.compile(backend=backend)``
give fxgrad no hook around the model's forward, and Dynamo may never call the
backend at all (an ``nn.LSTM`` without ``allow_rnn``, ``Module.compile`` or
``torch.compile(DDP(model))`` of an ``nn.Sequential``). Every training loop
passes through ``optimizer.step()``, though: one global step pre-hook serves
every backend (each held weakly) and looks at the parameters the optimizer
steps, with no host sync. For each model the backend was handed (learnt from
the ``torch.compile`` call, see :attr:`fxgrad.Backend.__name__`) or met in a
graph, it reports once:

* layers the policy targets whose parameters have a gradient that no graph of
  the backend produced: they ran eagerly (this includes "no graph reached the
  backend at all");
* gradients that changed since the optimizer's last step while no backward
  of a graph of the backend ran: Dynamo ran the forward eagerly (its
  recompile limit, a ``set_stance``), the original model was called instead of the
  compiled one, or the model was compiled again with another backend.

It warns with :class:`fxgrad.CoverageWarning`, or raises
:class:`fxgrad.CoverageError` when ``strict`` and a transform reduces across
layers. ``backend.compile(model)`` checks the same at each forward
(:mod:`fxgrad.frontend.watch`), so models it compiled are left to that. Only
the backend a model was compiled with last checks it.

    check = StepCheck(backend)
    check.arm()     # once; the hook dies with the check
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import operator
import sys
import weakref
from typing import Any, Callable, Collection, Iterator, Sequence

import torch
import torch.nn as nn
from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

from fxgrad import _compat
from fxgrad.core.layers import GRAD, build_layers, model_rows, not_none, parameter_owners, same_objects
from fxgrad.core.rule import Transform, listed
from fxgrad.core.warn import warn
from fxgrad.frontend.coverage import CoverageCheck, CoverageWarning, rnn_hint
from fxgrad.frontend.graphs import GraphRegistry

_NEWEST: weakref.WeakKeyDictionary[nn.Module, weakref.ref] = weakref.WeakKeyDictionary()

RECOMPILED = (
    "fxgrad: the gradients of {model} changed since the optimizer's last step, but no backward "
    "of a graph compiled by this backend ran: Dynamo ran the forward eagerly (as it does once a frame was "
    "recompiled torch._dynamo.config.recompile_limit times, e.g. once per new input shape; mark "
    'the dimension dynamic or raise the limit; or under torch.compiler.set_stance, "force_eager" '
    'or "eager_then_compile" say; or after a torch.func transform of the compiled model, jvp or jacrev, '
    "which Dynamo cannot trace and from then on runs eagerly), the original model was called instead of the "
    "compiled one, or "
    "the model was compiled again with another backend (set_stance's force_backend too). The policy {transform!r} "
    "did not run on them."
)

TORCH_NN_FORWARD = (
    "\n{model}.forward is torch.nn's own code, which Dynamo compiles only as the forward of the "
    "module torch.compile returns: model.compile() and torch.compile(DDP(model)) leave it eager. "
    "Use model = torch.compile(model, backend=backend), and wrap that in DDP."
)

STEP_SCOPE = (
    " fxgrad.backend(..., scope='step') applies the policy to .grad at optimizer.step(), whatever Dynamo compiled."
)

STAND_IN_HINT = (
    "\nOr the cause a graph of this backend reported: it took plain tensors in place of the parameters "
    "(torch.func.functional_call), and no backward graph transforms their gradients." + STEP_SCOPE
)

OUTSIDE = (
    "fxgrad: optimizer.step() steps {count} parameters with a gradient (shapes {shapes}) that belong to none "
    "of the models this backend compiled, and the policy {transform!r} reduces across layers: its norms "
    "leave them out. If they belong to the model (submodules compiled one by one, as torchtitan compiles "
    "each block alone, or part of the model run outside the compiled module), compile the whole model, or "
    "with scope='step' tell the backend the whole model once: backend.step(model) after the first backward."
)


LOOSE = (
    "fxgrad: the compiled graphs take {count} nn.Parameter(s) with a gradient that belong to no model "
    "({names}: passed as an argument, or a global). Graph scope makes each a layer of its own, but "
    "scope='step' applies the policy to the .grad of the models' parameters only, and leaves them out "
    "of it: not clipped, not counted in its norms. Register them on the model "
    "(model.register_parameter(name, parameter), or a submodule holding them) for step scope to cover "
    "them, or use scope='graph'."
)


TRAINER_CLIPS = (
    "fxgrad: the Hugging Face Trainer stepping this optimizer clips the gradients itself, "
    "max_grad_norm={max_norm} (1.0 is TrainingArguments' default), {when} the policy {transform!r}: two "
    "policies, and its clip wins where it is tighter. Set max_grad_norm=0 (for the same clip, put "
    "fxgrad.clip_by_global_norm({max_norm}) in the policy), or let "
    "fxgrad.integrations.transformers.prepare(model, policy, args) set the Trainer up."
)


def trainer_clip() -> float | None:
    """The ``max_grad_norm`` of a Hugging Face ``Trainer`` on the call stack that clips the
    gradients itself (its default, 1.0, does), or ``None``: a model compiled with
    ``fxgrad.backend`` and handed to a Trainer without
    :func:`fxgrad.integrations.transformers.prepare`, whose callback refuses the setting.

    Walks the stack, for a check once per optimizer, reading the locals of the Trainer's own
    frames only: reading a frame's locals keeps a copy of them on it, and a test's or a
    loop's frame would then keep alive what its code has deleted since."""
    module = sys.modules.get("transformers.trainer")
    if module is None:
        return None
    frame = sys._getframe(1)
    while frame is not None:
        if frame.f_code.co_filename == module.__file__:
            trainer = frame.f_locals.get("self")
            if isinstance(trainer, module.Trainer):
                max_norm = getattr(trainer.args, "max_grad_norm", None)
                return max_norm if max_norm else None
        frame = frame.f_back
    return None


def stepped_ids(optimizer: torch.optim.Optimizer) -> set[int]:
    """The ids of the parameters ``optimizer`` steps (its parameter groups change: read them each time)."""
    return {id(p) for group in optimizer.param_groups for p in group["params"]}


def group_ids(optimizer: torch.optim.Optimizer) -> tuple[tuple[int, ...], ...]:
    """Each parameter group's parameter ids, in order: what ``add_param_group``, a parameter
    moved to another group or put into a group's list in place all change."""
    return tuple(tuple(map(id, group["params"])) for group in optimizer.param_groups)


def report_outside(
    optimizer: torch.optim.Optimizer,
    transform: Transform,
    models: Sequence[nn.Module],
    reported: Collection[int] = (),
) -> None:
    """Warn about the parameters ``optimizer`` steps with a gradient that are in none of ``models``
    nor in any model an fxgrad backend compiled, when ``transform`` reduces across layers: its
    global norm leaves them out. A warning, not an error: a loss module's weights or a task
    weight stepped beside the model may be left out on purpose, as ``clip_grad_norm_(
    model.parameters())`` leaves them. Per-layer rules do not target them: nothing to say then.
    ``reported``: ids of parameters a warning of its own named already."""
    if not transform.reduces_across_layers():
        return
    known = {id(p) for model in [*_NEWEST.keys(), *models] for p in model.parameters()} | set(reported)
    outside = [p for group in optimizer.param_groups for p in group["params"] if p.grad is not None]
    outside = [p for p in outside if id(p) not in known]
    if outside:
        shapes = ", ".join(str(tuple(p.shape)) for p in outside[:4]) + (", ..." if len(outside) > 4 else "")
        warn(OUTSIDE.format(count=len(outside), shapes=shapes, transform=transform), CoverageWarning)


NAMES_MIX = (
    "fxgrad: the models {models} of this backend share the layer names {names}, and the backend keeps the "
    "statistics and state of its policy {transform!r} by layer name: the models' entries under those names "
    "mix. Give each model a backend of its own (fxgrad.backend(...) per model), or compile the module that "
    "holds them all, so that each layer has a name of its own."
)
STATE_MIX = (
    "fxgrad: {optimizer} and {other} step different models of this backend ({models}: a GAN's generator and "
    "discriminator, say), and the state of {rules} spans every layer (a norm history, a step count): each "
    "model's steps update it in turn. Give each model a backend of its own (fxgrad.backend(...) per model)."
)


class ModelsApart:
    """Says once when a backend's statistics or state would mix models it compiled one by one:
    per-layer entries are kept by layer name, which two models can share (a GAN's networks, both
    ``nn.Sequential``); and some rules keep one state over every layer they see (``zclip``'s norm
    history, ``adagc``'s step count), which the steps of two optimizers over different models
    would both update, where that state is one for both (step scope; in graph scope, one per
    compiled frame). A global clip keeps neither, and is exact as it is::

        apart = ModelsApart()
        apart.first_step(optimizer, models, transform, spanning, by_layer, frames)  # each optimizer's first
    """

    def __init__(self) -> None:
        self._stepping: weakref.WeakKeyDictionary[torch.optim.Optimizer, list] = weakref.WeakKeyDictionary()
        self._told = False

    def first_step(
        self,
        optimizer: torch.optim.Optimizer,
        models: Sequence[tuple[nn.Module, str]],
        transform: Transform,
        spanning: Collection[str],
        by_layer: bool,
        frames: Callable[[nn.Module], set[int]] | None,
    ) -> None:
        """``models``: the backend's, with their layer-name prefixes; ``spanning``: the labels of
        the rules that keep a state over all layers; ``by_layer``: whether some state or statistic
        is kept under a layer's name; ``frames(model)``: the compiled frames whose state a model's
        graphs use (graph scope), ``None`` where all share one (step scope)."""
        if self._told:
            return
        inner = {id(m) for model, _ in models for m in model.modules() if m is not model}  # named by their holder
        stepped = stepped_ids(optimizer)
        mine = [
            (model, prefix)
            for model, prefix in models
            if id(model) not in inner and any(id(p) in stepped for p in model.parameters())
        ]
        self._stepping[optimizer] = [(weakref.ref(model), prefix) for model, prefix in mine]
        live = {
            opt: [(model, prefix) for ref, prefix in pairs if (model := ref()) is not None]
            for opt, pairs in list(self._stepping.items())
        }
        if by_layer:
            holders: dict[str, list[nn.Module]] = {}  # by layer name, the models that have it
            for pairs in live.values():
                for model, prefix in pairs:
                    for layer in _layers(model, prefix):
                        found = holders.setdefault(layer, [])
                        if model not in found:
                            found.append(model)
            clash = {layer: found for layer, found in holders.items() if len(found) > 1}
            if clash:
                self._tell(
                    NAMES_MIX,
                    models=", ".join(
                        type(m).__name__ for m in {id(m): m for ms in clash.values() for m in ms}.values()
                    ),
                    names=listed(sorted(clash), 5),
                    transform=transform,
                )
                return
        if not spanning:
            return
        for other, theirs in live.items():
            if other is optimizer or not theirs or not mine or {id(m) for m, _ in theirs} & {id(m) for m, _ in mine}:
                continue
            if frames is not None and not set().union(*(frames(m) for m, _ in mine)) & set().union(
                *(frames(m) for m, _ in theirs)
            ):
                continue  # graph scope: their graphs keep the state apart, one per frame
            self._tell(
                STATE_MIX,
                optimizer=type(optimizer).__name__,
                other=type(other).__name__,
                models=", ".join(type(model).__name__ for model, _ in (*theirs, *mine)),
                rules=", ".join(sorted(spanning)),
            )
            return

    def _tell(self, message: str, **values: Any) -> None:
        self._told = True
        warn(message.format(**values), CoverageWarning)


def _layers(model: nn.Module, prefix: str) -> set[str]:
    """The layer names of ``model``'s parameters."""
    return {owner.layer for owner in parameter_owners(model, prefix).values()}


def hand_over(model: nn.Module, owner: Any) -> None:
    """Record that ``owner`` (a backend) is the newest to compile ``model``."""
    _NEWEST[model] = weakref.ref(owner)


def _newest(module: nn.Module) -> Any | None:
    """The live backend that compiled ``module`` last, if any."""
    ref = _NEWEST.get(module)
    return ref() if ref is not None else None


def superseded(model: nn.Module, owner: Any) -> bool:
    """Whether another live backend compiled ``model`` after ``owner`` (Dynamo's caches can keep
    ``owner`` alive, and its step hook with it: the newest backend's policy is the model's)."""
    newest = _newest(model)
    return newest is not None and newest is not owner


def policed_elsewhere(model: nn.Module, owner: Any) -> tuple[str, Any] | None:
    """The name of a module of ``model`` (``""``: itself) that another live backend with a policy
    compiled last, and that backend; or ``None``: its gradients go through that policy already."""
    for name, module in model.named_modules():
        if superseded(module, owner) and _newest(module).transform is not None:
            return name, _newest(module)
    return None


@contextlib.contextmanager
def handed_back(model: nn.Module) -> Iterator[None]:
    """Give ``model`` back to the backend that compiled it before the block (``explain``
    compiles it with a backend of its own)."""
    before = _NEWEST.get(model)
    try:
        yield
    finally:
        if before is None:
            _NEWEST.pop(model, None)
        else:
            _NEWEST[model] = before


def optimizer_pre_hook(owner: Any, method: Callable[[Any, torch.optim.Optimizer], None]) -> None:
    """Call ``method(owner, optimizer)`` before every ``optimizer.step()`` updates the weights
    (after its closure, if it has one) while ``owner`` lives (it is held weakly)."""
    _BEFORE.add(owner, method)


def optimizer_post_hook(owner: Any, method: Callable[[Any, torch.optim.Optimizer], None]) -> None:
    """Call ``method(owner, optimizer)`` after every ``optimizer.step()`` while ``owner`` lives
    (it is held weakly)."""
    _AFTER.add(owner, method)


def remove_optimizer_hooks(owner: Any) -> None:
    """Stop calling ``owner``'s methods at optimizer steps (before ``owner`` is collected)."""
    for hook in (_BEFORE, _AFTER):
        hook.owners.pop(owner, None)


def after_closure(hook: Callable[[torch.optim.Optimizer], None]) -> Callable[..., tuple[tuple, dict] | None]:
    """An ``optimizer.step()`` pre-hook that calls ``hook(optimizer)`` once the gradients are final.

    ``optimizer.step(closure)`` (Lightning's automatic optimization, LBFGS-style loops) runs the
    forward and backward inside the closure, after the pre-hooks: then ``hook`` runs when the
    closure returns (on each call of it), before the update reads the gradients. It runs
    eagerly when Dynamo compiles ``optimizer.step()`` (a train step compiled whole): fxgrad's
    bookkeeping is not for tracing::

        optimizer.register_step_pre_hook(after_closure(check))
    """
    eager = torch.compiler.disable(hook)

    def pre_hook(optimizer: torch.optim.Optimizer, args: tuple, kwargs: dict) -> tuple[tuple, dict] | None:
        if _STATE_INIT:
            _STATE_INIT.discard(optimizer)  # its state-creating step is over
        if not optimizer.state and _compat.initialising_optimizer_state():
            _STATE_INIT.add(optimizer)  # no training step: no hook of fxgrad's runs, before or after it
            return None
        closure = args[1] if len(args) > 1 else kwargs.get("closure")  # args: (optimizer, *step's args)
        if not callable(closure):  # none, or another argument of an optimizer's own step()
            eager(optimizer)
            return None

        def closure_then_hook() -> Any:
            loss = closure()
            eager(optimizer)
            return loss

        if len(args) > 1:
            return (args[0], closure_then_hook, *args[2:]), kwargs
        return args, {**kwargs, "closure": closure_then_hook}

    return torch.compiler.disable(pre_hook)


def after_step(hook: Callable[[torch.optim.Optimizer, tuple, dict], None]) -> Callable[..., None]:
    """An ``optimizer.step()`` post-hook that calls ``hook(optimizer, args, kwargs)``, eagerly,
    after each step whose pre-hooks :func:`after_closure` ran (not after the step
    ``torch.distributed.checkpoint`` makes to create an optimizer's state)."""

    def post_hook(optimizer: torch.optim.Optimizer, args: tuple, kwargs: dict) -> None:
        if not _STATE_INIT or optimizer not in _STATE_INIT:
            hook(optimizer, args, kwargs)

    return torch.compiler.disable(post_hook)


# optimizers whose step now is the one torch.distributed.checkpoint makes to create their state
_STATE_INIT: weakref.WeakSet[torch.optim.Optimizer] = weakref.WeakSet()


class _GlobalHook:
    """One global optimizer-step hook serving every owner, over a copy of the live ones.

    A hook per owner, removed when the owner is collected, would change torch's hook
    dict while it runs them whenever a collection falls inside ``optimizer.step()``
    ("OrderedDict mutated during iteration"; the fuzzer found it).
    """

    def __init__(self, register: Callable[[Callable[[torch.optim.Optimizer], None]], Any]) -> None:
        self.register = register
        self.owners: weakref.WeakKeyDictionary[Any, Callable] = weakref.WeakKeyDictionary()
        self.registered = False

    def add(self, owner: Any, method: Callable) -> None:
        if not self.registered:
            self.registered = True
            self.register(self.run)
        self.owners[owner] = method

    def run(self, optimizer: torch.optim.Optimizer) -> None:
        for owner, method in list(self.owners.items()):
            method(owner, optimizer)


def hook_step(
    optimizer: torch.optim.Optimizer,
    before: Callable[[torch.optim.Optimizer], None],
    after: Callable[[torch.optim.Optimizer, tuple, dict], None],
) -> None:
    """Call ``before(optimizer)`` before each of ``optimizer``'s updates (:func:`after_closure`)
    and ``after(optimizer, args, kwargs)`` after it, eagerly; :func:`foreign_hooks` leaves them out."""
    optimizer.register_step_pre_hook(after_closure(before))
    optimizer.register_step_post_hook(after_step(after))
    _OWN_HOOKS[optimizer] = _OWN_HOOKS.get(optimizer, 0) + 2


def foreign_hooks(optimizer: torch.optim.Optimizer) -> int:
    """How many step hooks run around ``optimizer``'s update that are not fxgrad's."""
    ours = _OWN_HOOKS.get(optimizer, 0) + _BEFORE.registered + _AFTER.registered
    return _compat.optimizer_step_hooks(optimizer) - ours


_OWN_HOOKS: weakref.WeakKeyDictionary[torch.optim.Optimizer, int] = weakref.WeakKeyDictionary()


_BEFORE = _GlobalHook(lambda run: register_optimizer_step_pre_hook(after_closure(run)))
_AFTER = _GlobalHook(
    lambda run: register_optimizer_step_post_hook(after_step(lambda optimizer, args, kwargs: run(optimizer)))
)


@dataclasses.dataclass
class _Seen:
    """What one optimizer's last step looked like to the check."""

    backwards: int = -1
    grad: Callable[[], Any] = lambda: None  # a stepped parameter's .grad, weakly
    version: int = -1
    unheld: frozenset = frozenset()  # ids of stepped parameters no graph holds, already judged
    # the optimizer's parameters, whether a graph holds each, and the registry's generation then
    params: list = dataclasses.field(default_factory=list)
    held: list[bool] = dataclasses.field(default_factory=list)
    generation: int = -1


class StepCheck:
    """The ``optimizer.step()`` check of one backend (see the module docstring).

    ``models()`` lists the models the backend was handed or met, ``watched``
    those that ``backend.compile`` watches at each forward, ``backwards()``
    counts backward passes through the backend's graphs, ``in_graph()``
    tells whether the policy runs in the backward graphs now, ``idle()`` whether the backend
    serves no live model (the check then unhooks itself until :meth:`arm`), and
    ``before_update(optimizer)`` runs before the step of an
    optimizer that steps parameters of the backend's graphs.
    """

    def __init__(
        self,
        owner: Any,
        registry: GraphRegistry,
        coverage: CoverageCheck,
        models: Callable[[], list[nn.Module]],
        watched: weakref.WeakSet,
        backwards: Callable[[], int],
        in_graph: Callable[[], bool],
        idle: Callable[[], bool],
        before_update: Callable[[torch.optim.Optimizer], None],
    ) -> None:
        self.owner = weakref.ref(owner)
        self.registry, self.coverage, self.models, self.watched = registry, coverage, models, watched
        self.backwards, self.in_graph, self.idle, self.before_update = backwards, in_graph, idle, before_update
        self._seen: weakref.WeakKeyDictionary[torch.optim.Optimizer, _Seen] = weakref.WeakKeyDictionary()
        self._armed = False
        self._counting = False  # are backwards counted for some graph? (see unwatched)

    def arm(self) -> None:
        if not self._armed:
            self._armed = True
            optimizer_pre_hook(self, StepCheck.before_optimizer_step)

    def unwatched(self, graph: Any) -> bool:
        """Whether ``graph`` (a :class:`~fxgrad.passes.capture.CapturedGraph`) holds parameters of a
        model that ``backend.compile`` does not watch per forward: its backwards need counting."""
        found = any(graph.root_refs[key]() not in self.watched for key in graph.roots())
        self._counting = self._counting or found
        return found

    def before_optimizer_step(self, optimizer: torch.optim.Optimizer) -> None:
        if self.idle():
            remove_optimizer_hooks(self)
            self._armed = False
            return
        if not self.in_graph():
            return
        if self.coverage.unplaced:
            self.coverage.unplaced_used(self.registry.holds)
        seen = self._seen.setdefault(optimizer, _Seen())
        params = list(itertools.chain.from_iterable(group["params"] for group in optimizer.param_groups))
        if seen.generation != self.registry.generation or not same_objects(params, seen.params):
            seen.params, seen.held = params, list(map(self.registry.holds, params))
            seen.generation = self.registry.generation
        with_grad = not_none(map(GRAD, params))
        # the first held parameter with a gradient; the ids of those with one no graph holds
        probe = next(itertools.compress(params, map(operator.and_, seen.held, with_grad)), None)
        unheld = list(map(id, itertools.compress(params, map(operator.gt, with_grad, seen.held))))
        if probe is not None:
            self.before_update(optimizer)
        if unheld and frozenset(unheld) != seen.unheld:
            seen.unheld = frozenset(unheld)
            self._unheld(seen.unheld)
            if probe is not None:  # this optimizer steps this backend's models
                report_outside(optimizer, self.coverage.transform, self.models())
        backwards = self.backwards()
        if probe is not None and self._counting:
            version = _compat.tensor_version(probe.grad)
            if (seen.grad() is not probe.grad or seen.version != version) and backwards == seen.backwards:
                self._bypassed(probe)
            seen.grad, seen.version = weakref.ref(probe.grad), version
        seen.backwards = backwards

    def _checked_models(self) -> list[nn.Module]:
        owner = self.owner()
        return [m for m in self.models() if m not in self.watched and not superseded(m, owner)]

    def _unheld(self, unheld: frozenset) -> None:
        """Parameters with a gradient that no graph of the backend holds."""
        reported = {layer.name for graph in self.registry.current() for gap in graph.gaps for layer, _ in gap.layers}
        for model in self._checked_models():
            prefix = self.registry.prefix(model)
            layers = build_layers(model_rows(model, prefix)[0], self.registry.forward_order(), self.coverage.skip)
            owners = parameter_owners(model, prefix)
            missing = {owners[pid].param for pid in unheld if pid in owners}
            left_out = [
                layer
                for route in self.coverage.transform.routes(layers)
                for layer in route.layers
                if layer.name not in reported and missing & set(layer.params)
            ]
            if not left_out:
                continue
            if not any(self.registry.holds(owner.tensor) for owner in owners.values()):
                stand_ins = any(graph.stand_ins for graph in self.registry.current())
                stance = _compat.compiler_stance()
                hint = STAND_IN_HINT if stand_ins else self._hint(model, stance)
                self.coverage.ran_eagerly(model, True, hint, stance)
                continue
            names = ", ".join(dict.fromkeys(layer.name for layer in left_out))
            self.coverage.report(
                f"fxgrad: layers of {type(model).__name__} that the policy {self.coverage.transform!r} targets "
                f"got gradients from no graph of this backend (their forward ran eagerly): {names}."
                f"{rnn_hint(left_out)}{self._hint(model, _compat.compiler_stance())}",
                fatal=any(route.leaf.reach == "group" for route in self.coverage.transform.routes(left_out)),
            )

    def _bypassed(self, probe: nn.Parameter) -> None:
        """``probe``'s gradient is new, yet no backward through the backend's graphs ran since the last step."""
        for model in self._checked_models():
            if any(p is probe for p in model.parameters()):
                rows = model_rows(model, "")[0]
                layers = build_layers(rows, (), self.coverage.skip)
                self.coverage.report(
                    RECOMPILED.format(model=type(model).__name__, transform=self.coverage.transform),
                    fatal=any(route.leaf.reach == "group" for route in self.coverage.transform.routes(layers)),
                )

    def _hint(self, model: nn.Module, stance: str | None) -> str:
        if self.coverage.chosen_cause(model, stance) is not None:  # named in the report
            return STEP_SCOPE
        torch_nn = (type(model).forward.__module__ or "").startswith("torch.nn.")  # None: a GraphModule's
        if torch_nn and self.coverage.compiled_as.get(model) != "module":
            return TORCH_NN_FORWARD.format(model=type(model).__name__) + STEP_SCOPE
        return "\ntorch._dynamo.explain(model)(*args) lists what Dynamo could not compile, and why." + STEP_SCOPE
