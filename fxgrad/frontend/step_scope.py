"""The policy applied to ``.grad`` after backward: ``fxgrad.backend(..., scope="step")``.

A backward graph only holds the gradients of one graph, of one micro-batch,
before the data-parallel all-reduce. When the policy must see more (a global
clip across graph breaks, the gradient accumulated over micro-batches, the
all-reduced gradient of DDP, FSDP2's sharded gradients), apply it once per
optimizer step instead::

    backend = fxgrad.backend(fxgrad.clip_by_global_norm(1.0), scope="step")
    model = backend.compile(model)            # the backward graphs are left alone
    for micro_batch in micro_batches:
        loss_fn(model(micro_batch)).backward()
    backend.step()                            # once, on the accumulated gradient
    optimizer.step()

The same plain-torch rules run as one compiled program over the gradients
(:mod:`fxgrad.frontend.step_program`), state and statistics included; nothing
syncs with the host. Under FSDP2 the program takes each rank's local shards and
all-reduces the layer norms inside it; other DTensor gradients (tensor parallelism)
run the rules eagerly, where DTensor all-reduces the partial sums.

``backend.step()`` is optional when a ``torch.optim`` optimizer steps the
model: :class:`StepScope` hooks ``optimizer.step()`` and runs the policy there
on the models that optimizer steps, if their gradients changed since the last
``backend.step()`` (it never runs twice on the same gradients). Call it
yourself when something must see the transformed gradients before the
optimizer does.
"""

from __future__ import annotations

import itertools
import operator
import weakref
from typing import Any, Callable, Sequence

import torch
import torch.distributed
import torch.nn as nn
from torch.distributed.tensor import DTensor, Replicate
from torch.utils.weak import WeakIdKeyDictionary

from fxgrad import _compat
from fxgrad.core.layers import (
    GRAD,
    Layer,
    ModelParameters,
    Owner,
    ParamRow,
    SkipEntry,
    build_layers,
    module_type,
    not_none,
    parameter_owners,
)
from fxgrad.core.rule import Route, Transform
from fxgrad.core.warn import warn
from fxgrad.frontend.coverage import CoverageError, CoverageWarning
from fxgrad.frontend.step_check import optimizer_pre_hook, remove_optimizer_hooks, stepped_ids
from fxgrad.frontend.step_program import StepPrograms
from fxgrad.frontend.update_program import Update
from fxgrad.runtime.context import Fold
from fxgrad.runtime.executor import run_policy
from fxgrad.runtime.state import StateStore


def step_routes(
    transform: Transform, models: Sequence[tuple[nn.Module, str]], skip: Sequence[SkipEntry], order: Sequence[str] = ()
) -> tuple[list[Owner], list[tuple[int, Route]]]:
    """The parameters that have a gradient, and the transform's non-empty routes over them.

    Raises :class:`~fxgrad.CoverageError` when two models name different modules alike: their
    layers would merge into one."""
    owners = models_owners(models)
    named: dict[str, nn.Module] = {}
    for owner in owners.values():
        if named.setdefault(owner.layer, owner.module) is not owner.module:
            raise CoverageError(SAME_NAMES.format(layer=owner.layer, kind=type(owner.module).__name__))
    with_grad = [o for o in owners.values() if o.tensor.grad is not None]
    layers = owners_layers(with_grad, skip, order or list(dict.fromkeys(o.layer for o in owners.values())))
    routes = [(i, route) for i, route in enumerate(transform.routes(layers)) if route.layers]
    # Without their modules: callers keep them from step to step, and must not keep a model
    # alive (a backend outlives its models: torch._dynamo holds every backend it compiled with).
    return [o._replace(module=None) for o in with_grad], routes


def models_owners(models: Sequence[tuple[nn.Module, str]]) -> dict[int, Owner]:
    """``id(parameter) -> Owner`` over ``(model, layer prefix)`` pairs; a parameter reachable
    from two models counts once, as the first one names it."""
    owners: dict[int, Owner] = {}
    for model, prefix in models:
        for key, owner in parameter_owners(model, prefix).items():
            owners.setdefault(key, owner)
    return owners


def owners_layers(owners: Sequence[Owner], skip: Sequence[SkipEntry], order: Sequence[str] = ()) -> list[Layer]:
    """The layers ``owners``' parameters make up (``order``: the forward order of the layers)."""
    rows = [ParamRow(o.layer, o.param, module_type(o.module), o.tensor.numel()) for o in owners]
    return build_layers(rows, order, skip)


def apply_to_grads(
    transform: Transform,
    models: Sequence[tuple[nn.Module, str]],
    skip: Sequence[SkipEntry],
    store: StateStore,
    scaler: Any = None,
    order: Sequence[str] = (),
    programs: StepPrograms | None = None,
    params: Sequence[nn.Parameter] | None = None,
    fold: Fold = None,
    update: Callable[[Sequence[Owner]], Update | None] = lambda owners: None,
) -> Update | None:
    """Apply ``transform`` to the ``.grad`` of ``models``' parameters, in place.

    ``models`` pairs each model with its layer-name prefix; ``order`` is the
    forward order of layers (for depth), named-module order when empty. With
    ``programs`` the rules run as a compiled program where they can, else eagerly;
    ``params``, the models' parameters if the caller has them, saves walking the models again.
    ``fold="global"`` leaves the policy's global factor to the optimizer (:meth:`fxgrad.Backend.fold`);
    ``update(owners)`` gives the optimizer's update for the program to run after the policy
    (:mod:`fxgrad.frontend.update_program`), which is returned if it ran.
    """
    if programs is None:
        with_grad, routes = step_routes(transform, models, skip, order)
    else:
        compute = lambda: step_routes(transform, models, skip, order)  # noqa: E731
        params = [p for model, _ in models for p in model.parameters()] if params is None else params
        with_grad, routes = programs.routes(models, order, compute, params)
    if not with_grad:
        return None
    if programs is not None:
        folded = update(with_grad)
        if programs.run(routes, with_grad, store, scaler, fold, folded):
            return folded
        if folded is not None:
            folded.unused()
    params: dict[str, list[nn.Parameter]] = {}
    for owner in with_grad:
        params.setdefault(owner.layer, []).append(owner.tensor)
    grads = {layer: [p.grad for p in ps] for layer, ps in params.items()}
    by_name = {o.param: o.tensor for o in with_grad}
    with torch.no_grad():
        device = with_grad[0].tensor.grad.device
        lookup = lambda names: [by_name[n] for n in names]  # noqa: E731
        run_policy(routes, grads, store, device, scaler, lookup, fold=fold, per_step=True)
        for layer, ps in params.items():
            for param, grad in zip(ps, grads[layer]):
                if grad is not param.grad:
                    param.grad.copy_(_placed_like(grad, param.grad))
    return None


def _placed_like(value: torch.Tensor, grad: torch.Tensor) -> torch.Tensor:
    """``value`` with ``grad``'s placements, which ``grad.copy_`` needs.

    A DTensor rule's result can come back replicated: on a rank's empty shard (a 2-row head on
    4 ranks), and from an element-wise rule (``zero_nonfinite``) on a gradient partial over the
    ranks (tensor parallelism's ``SequenceParallel`` norms), where DTensor all-reduces first. It
    will not make a replicated value partial; a partial sum is then each rank's equal share."""
    if not (isinstance(grad, DTensor) and isinstance(value, DTensor)) or value.placements == grad.placements:
        return value
    mesh, placements = grad.device_mesh, grad.placements
    if not any(p.is_partial() for p in placements):
        return value.redistribute(mesh, placements)
    local = value.redistribute(mesh, [Replicate() if p.is_partial() else p for p in placements]).to_local()
    for dim, placement in enumerate(placements):
        if placement.is_partial() and placement.reduce_op == "sum":
            local = local / mesh.size(dim)
    return DTensor.from_local(local, mesh, placements, run_check=False, shape=grad.shape, stride=grad.stride())


SAME_NAMES = (
    "fxgrad: step scope met two modules both named {layer!r} ({kind}), each in a model of its own that "
    "the backend compiled: their layers would merge into one. Separate models (a GAN's generator and "
    "discriminator): apply the policy to each on its own, backend.step(model), or let each one's optimizer "
    "step run it. Parts of one model compiled one by one (torchtitan compiles each block alone; an encoder "
    "and a head one optimizer steps): tell the backend the whole model once, backend.step(model) after the "
    "first backward, and it names every layer from there (parts no module holds: keep one that does alive, "
    "whole = nn.ModuleDict({{'encoder': encoder, 'head': head}}), and pass it); or compile the whole model"
)

Models = Callable[[], list[tuple[nn.Module, str]]]


class PolicyRuns:
    """Warns when gradients are dropped before step scope's policy ever ran on them.

    Step scope runs at ``optimizer.step()`` of a ``torch.optim`` optimizer, or at
    ``backend.step()``. A loop that updates the weights itself calls neither, and the
    policy silently does nothing. Until the policy first runs (:attr:`watching`), a
    backward through a compiled graph that starts on zeroed gradients (not accumulating)
    after an earlier one shows it; two in a row warn (one could be a batch skipped on
    purpose). Once the policy ran, the loop calls one of them, and backwards go
    unwatched::

        runs = PolicyRuns()
        if runs.watching:
            runs.backward_started(probe, accumulating=False)  # per compiled graph, per backward
        runs.ran()  # per run of the policy

    Left out while a process group is initialized: DDP and FSDP2 replace or free the
    ``.grad`` a probe reads, which would look like zeroing.
    """

    def __init__(self) -> None:
        self._ran = False
        self._told = False
        # per probe (one parameter per compiled graph): backwards in a row that found its gradient dropped
        self._dropped: WeakIdKeyDictionary = WeakIdKeyDictionary()
        self._versions: WeakIdKeyDictionary = WeakIdKeyDictionary()  # per probe, at its last counted backward

    def ran(self) -> None:
        self._ran = True

    @property
    def watching(self) -> bool:
        """Whether backwards need :meth:`backward_started`: the policy never ran, and nothing was said."""
        return not self._ran and not self._told

    def backward_started(
        self, probe: nn.Parameter, accumulating: bool, written: bool = True, ours: Callable[[], bool] = lambda: True
    ) -> None:
        """A backward reaches a compiled graph of which ``probe`` is a parameter; ``accumulating``:
        whether ``probe.grad`` still holds the previous backward's gradient; ``written``: whether
        any backward wrote ``probe.grad`` (``torch.autograd.grad`` returns gradients instead);
        ``ours()``: whether ``probe`` is a parameter of the models (``functional_call`` swaps in
        others). Passes that write no ``.grad`` count only once the weights moved since the last one
        counted: an adversarial attack's passes (``torch.autograd.grad`` of the input) before
        the first step leave them as they are, a loop that updates them itself does not."""
        if not self.watching:
            return
        if not written:
            version = _compat.tensor_version(probe)
            if self._versions.get(probe) == version:
                return
            self._versions[probe] = version
        dropped = self._dropped.get(probe)
        self._dropped[probe] = 0 if dropped is None or accumulating else dropped + 1
        if self._dropped[probe] >= 2 and not torch.distributed.is_initialized():
            self._told = True
            message = NOT_WRITTEN if not written else DROPPED if ours() else NOT_THE_MODELS
            warn(message, CoverageWarning)  # at the backward


DROPPED = (
    "fxgrad: scope='step' applies the policy at optimizer.step() of a torch.optim optimizer that steps the "
    "model's parameters, or at backend.step(), and neither ran between backward passes whose gradients were "
    "then zeroed (an optimizer over copies of the parameters, fp32 master weights, is not one): the policy "
    "did nothing to them. Call backend.step() after the last backward() of each step, before the gradients "
    "are copied or the weights updated."
)

NOT_THE_MODELS = (
    "fxgrad: scope='step' applies the policy to the .grad of the model's own parameters (model.parameters()), "
    "and the compiled model runs with parameters that are not (torch.func.functional_call with tensors of your "
    "own?): no backward writes the model's gradients, and neither optimizer.step() nor backend.step() finds any "
    "to transform: the policy did nothing. scope='graph' transforms the gradients of the parameters the "
    "forward used, inside the backward graph."
)

NOT_WRITTEN = (
    "fxgrad: scope='step' applies the policy to .grad, and the backward passes through the compiled model "
    "wrote no .grad (torch.autograd.grad returns the gradients instead): the policy did nothing to them. "
    "scope='graph' transforms the gradients inside the backward graph, torch.autograd.grad's included."
)


UNCHANGED = (
    "fxgrad: {optimizer}.step() steps the gradients the policy ran on at its last step, unchanged (each "
    "the tensor it was, at the version it was), though the compiled model ran forward in grad mode since. "
    "If no backward wrote new gradients since, nothing is wrong (the step repeats the last one's "
    "gradients, which already had the policy). If new ones were written through .data "
    "(p.grad.data.copy_(g), p.grad.data = g), which moves no version counter, the policy did not run on "
    "them: write p.grad.copy_(g), or assign p.grad = g."
)


class StepScope:
    """Runs a backend's policy on ``.grad``, once per set of gradients.

    ``models()`` lists ``(model, layer prefix)`` pairs; ``run(models, scaler, params, optimizer)``
    applies the policy (``params``: the models' parameters, walked once per step; ``optimizer``:
    the one about to step, ``None`` from ``backend.step()``).
    After :meth:`arm`, a global ``optimizer.step()`` pre-hook runs it for
    optimizers that step these models' parameters while ``active()`` (``scope="auto"``
    is step scope only in a data-parallel job), unless :meth:`apply` already ran on the
    current gradients, then calls ``after(optimizer)`` (the optimizer
    fold hands its factor over there). At a step that finds none of its models alive it
    unhooks itself and calls ``gone()``: what the backend keeps for them can go then.
    """

    def __init__(
        self,
        models: Models,
        run: Callable[[list, Any, list, Any], None],
        scaler: Any,
        after: Callable[[torch.optim.Optimizer], None],
        active: Callable[[], bool],
        gone: Callable[[], None],
        forwards: Callable[[], int] = lambda: 0,
    ) -> None:
        self.models, self.run, self.scaler, self.after, self.active = models, run, scaler, after, active
        self.gone = gone
        self.forwards = forwards  # counts the calls of the backend's compiled forwards in grad mode
        self._seen = SeenGrads()
        # the optimizer whose step last ran the policy (None: backend.step()), and the forwards then
        self._last_run: tuple[weakref.ref | None, int] = (None, 0)
        self._told_unchanged = False  # see _stepped_again
        # after backend.step(): the forwards then, the parameters, their gradients then (weakly) and versions
        self._by_hand: tuple[int, Sequence[nn.Parameter], list[weakref.ref | None], list[int | None]] | None = None
        self._armed = False
        self._walks: dict[tuple[int, ...], ModelParameters] = {}  # by the ids of the models walked
        self._ids: tuple[tuple, frozenset] = ((), frozenset())  # the last walk, and its parameters' ids

    def arm(self) -> None:
        """Hook ``optimizer.step()`` (once; removed when this object dies, or when a step finds
        none of its models alive)."""
        if not self._armed:
            self._armed = True
            optimizer_pre_hook(self, StepScope.before_optimizer_step)

    def apply(
        self,
        models: list[tuple[nn.Module, str]],
        scaler: Any,
        params: list[nn.Parameter] | None = None,
        by_hand: bool = False,
        optimizer: torch.optim.Optimizer | None = None,
    ) -> None:
        """Run the policy on ``models``' gradients (``params``: their parameters, if known),
        unless it already ran on them. ``by_hand``: called by ``backend.step()``, after which the
        code before the optimizer's step may change the gradients in place (a clip of its own):
        that step then takes them as they are (see :meth:`_edited_since_by_hand`)."""
        params = self.parameters(models) if params is None else params
        grads = list(map(GRAD, params))
        if self._seen.changed(params, grads):
            self.run(models, scaler, params, optimizer)  # in place: each .grad stays the tensor it was
            self._seen.record(params, grads)
            self._last_run = None if optimizer is None else weakref.ref(optimizer), self.forwards()
        elif not self._told_unchanged and self._stepped_again(optimizer) and any(g is not None for g in grads):
            self._told_unchanged = True
            warn(UNCHANGED.format(optimizer=type(optimizer).__name__), CoverageWarning)
        if by_hand:
            refs = [None if g is None else weakref.ref(g) for g in grads]
            self._by_hand = (
                self.forwards(),
                params,
                refs,
                [None if g is None else _compat.gradient_version(g) for g in grads],
            )

    def before_optimizer_step(self, optimizer: torch.optim.Optimizer) -> None:
        if not self.active():
            return
        models = self.models()
        if not models:  # its models are gone (torch._dynamo keeps the backend): unhook until arm()
            remove_optimizer_hooks(self)
            self._armed = False
            self.gone()
            return
        if len(models) > 1:  # the models this optimizer steps: a GAN's generator, or its discriminator
            stepped = stepped_ids(optimizer)
            models = [pair for pair in models if any(id(p) in stepped for p in self.parameters([pair]))]
        params = self.parameters(models)
        ours = self.ids(params)
        steps_ours = any(id(p) in ours for group in optimizer.param_groups for p in group["params"])
        if not steps_ours:
            return
        if not self._edited_since_by_hand():
            unscaled = self.scaler is not None and id(optimizer) in _compat.grad_scaler_unscaled(self.scaler)
            self.apply(models, None if unscaled else self.scaler, params, optimizer=optimizer)
        self.after(optimizer)

    def _stepped_again(self, optimizer: torch.optim.Optimizer | None) -> bool:
        """Whether the optimizer whose step last ran the policy steps again on gradients that look
        like those it ran on (each the tensor it was, at the version it was), after a compiled
        forward in grad mode: a step with no backward since (the same gradients, which need
        nothing), or gradients written without moving their version (``p.grad.data.copy_(g)``),
        which fxgrad cannot tell apart. Another optimizer over the same gradients (weights and
        biases apart) and a step after :meth:`apply` by hand take them as they are."""
        last, forwards = self._last_run
        return optimizer is not None and last is not None and last() is optimizer and forwards != self.forwards()

    def _edited_since_by_hand(self) -> bool:
        """Whether the gradients are those ``backend.step()`` last ran the policy on, changed in place
        once at most since (a clip of the user's own, which the version check would take for new
        gradients): no compiled forward in grad mode ran since (one under ``no_grad``, for logging,
        does not count), each gradient is the tensor it was, and its version moved by one or less
        (a new backward onto zeroed gradients moves it by two: the zeroing, then the sum; an eager
        forward leaves the count of compiled ones as it was). If
        so, they count as seen as they are now, for this optimizer and any other that steps next
        (a GAN's two). The first optimizer step after ``backend.step()`` takes the mark."""
        if self._by_hand is None:
            return False
        (forwards, params, refs, versions), self._by_hand = self._by_hand, None
        grads = list(map(GRAD, params))
        if forwards != self.forwards():
            return False
        for ref, version, grad in zip(refs, versions, grads):
            if (None if ref is None else ref()) is not grad:
                return False
            if grad is not None and _compat.gradient_version(grad) - version > 1:
                return False
        self._seen.record(params, grads)
        return True

    def forget(self) -> None:
        """Drop the kept walks, a model having died (what ran on which gradients stays known;
        ``params`` a caller walked stay valid)."""
        self._walks, self._ids, self._by_hand = {}, ((), frozenset()), None
        self._seen.forget()

    def parameters(self, models: list[tuple[nn.Module, str]]) -> tuple[nn.Parameter, ...]:
        """``models``' parameters, each once (walked again only when a model changed)."""
        key = tuple(id(model) for model, _ in models)
        if key not in self._walks:  # a new walk: forget those of models gone, which hold their parameters
            self._walks = {key: walk for key, walk in self._walks.items() if walk.alive()}
            self._walks[key] = ModelParameters()
        return self._walks[key]([model for model, _ in models])

    def ids(self, params: tuple[nn.Parameter, ...]) -> frozenset[int]:
        """The ids of ``params`` (a walk :meth:`parameters` returned), kept with the last walk."""
        if self._ids[0] is not params:
            self._ids = params, frozenset(map(id, params))
        return self._ids[1]


class SeenGrads:
    """The gradients the policy ran on, so that it runs once per set of gradients.

    Each parameter's gradient, weakly, and the gradient's version (bumped by an in-place
    change: accumulation into it, the policy's own writes; a DTensor's counts its local
    tensor's, which FSDP2 accumulates into, see :func:`fxgrad._compat.gradient_versions`).
    The last run's record is kept
    as lists in the order of its parameters (the kept walk of :meth:`StepScope.parameters`),
    which the next step compares with C maps over the gradients; other parameters (a GAN's
    generator, after the policy ran on both models) are looked up one by one::

        seen = SeenGrads()
        if seen.changed(params, grads):  # grads: each parameter's .grad, or None
            ...  # run the policy
            seen.record(params, [p.grad for p in params])
    """

    def __init__(self) -> None:
        self._by_id: dict[int, tuple[weakref.ref, int]] = {}  # by parameter id, up to the last record
        # the last record: its parameters, which of them had a gradient, those gradients weakly, their versions
        self._last: tuple[Sequence[nn.Parameter], list[bool], list[weakref.ref], list[int]] = ((), [], [], [])

    def changed(self, params: Sequence[nn.Parameter], grads: Sequence[torch.Tensor | None]) -> bool:
        """Whether a gradient of ``params`` is not the one recorded for its parameter, or changed since."""
        last, held, refs, versions = self._last
        if last is params and not_none(grads) == held:
            grads = list(itertools.compress(grads, held))
            return any(map(operator.is_not, map(weakref.ref.__call__, refs), grads)) or versions != (
                _compat.gradient_versions(grads)
            )
        self._merge_last()
        for p, grad in zip(params, grads):
            if grad is not None:
                ref, version = self._by_id.get(id(p), (None, None))
                if ref is None or ref() is not grad or version != _compat.gradient_version(grad):
                    return True
        return False

    def record(self, params: Sequence[nn.Parameter], grads: Sequence[torch.Tensor | None]) -> None:
        """The policy ran on ``grads``, the gradients of ``params`` (``None`` where none)."""
        if self._last[0] is not params:
            self._merge_last()
        held = not_none(grads)
        grads = list(itertools.compress(grads, held))
        self._last = params, held, list(map(weakref.ref, grads)), _compat.gradient_versions(grads)

    def forget(self) -> None:
        """Keep the last record by parameter id, not with the parameters, and drop the records
        of freed gradients."""
        self._merge_last()
        self._by_id = {key: entry for key, entry in self._by_id.items() if entry[0]() is not None}

    def _merge_last(self) -> None:
        params, held, refs, versions = self._last
        self._by_id.update(zip(map(id, itertools.compress(params, held)), zip(refs, versions)))
        self._last = (), [], [], []
