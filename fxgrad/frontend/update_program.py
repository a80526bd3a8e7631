"""The optimizer's update inside the step program: per-layer factors folded.

A fused optimizer takes one ``grad_scale`` per call, so only a single global factor
folds there (:mod:`fxgrad.frontend.fold`). In step scope any policy folds another way,
per-layer factors (``rescale``, ``clip_by_norm``, AGC, ...) and per-gradient transforms
included: the step program that runs the policy also runs the update of torch's fused
``Adam``, ``AdamW`` or ``SGD``, on the gradient it has just transformed, in the same
loops. The norms are read once; the scaled gradient is never a pass of its own. In graph
scope the backward leaves each layer's factor (``folded_factor/<layer>``), and a program of
the same kind, with no policy, runs the update with them. A global factor folds the same
way, in either scope (measured cheaper than torch's own fused step with ``grad_scale``:
docs/performance.md). A factor multiplies its gradient in the update's dtype (float64 for
float64 weights, which a float32 ``grad_scale`` would round), before the inverse loss scale.
The program writes the weights, the optimizer's state (``exp_avg``, ``exp_avg_sq`` and
``step``; ``momentum_buffer``) and the transformed gradient to ``.grad``, where torch's
fused update would; the optimizer's own ``step()`` then finds no parameter group to
update (they are put back after it). Hyperparameters are read from the parameter
groups at each step into device tensors (a scheduler recompiles nothing, OneCycleLR's
cycled momentum included). A ``GradScaler``'s ``grad_scale`` and ``found_inf`` are
honoured as torch's fused kernels honour them: a step with an overflow changes no
weight, state or step count.

    backend = fxgrad.backend(fxgrad.rescale(alpha=0.5), scope="step")
    model = torch.compile(model, backend=backend)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
    backend.fold(optimizer)   # the step program now runs AdamW's update too

An optimizer with step hooks of anyone but fxgrad keeps its own step: its pre-hooks run
after fxgrad's, and their edits of the gradients or the learning rate would come after an
update run in fxgrad's.

The math is that of torch's fused kernels (``aten/src/ATen/native/cpu/FusedAdamKernel.cpp``,
``FusedSGDKernel.cpp``), in float64 for float64 weights and float32 for the others, with
the step size in float64; the weights after each step equal the policy then torch's
fused step to rounding (``tests/test_update_program.py``). What does not fold this way, and runs the policy
then torch's own step, is in docs/performance.md ("The optimizer fold").
"""

from __future__ import annotations

import dataclasses
import operator
import weakref
from typing import Any, Callable, Sequence

import torch
from torch.distributed.tensor import DTensor

from fxgrad.core.layers import Owner
from fxgrad.core.warn import warn_once
from fxgrad.frontend.step_check import foreign_hooks, group_ids, hook_step

ADAM = (torch.optim.Adam, torch.optim.AdamW)


def why_not(optimizer: torch.optim.Optimizer) -> str | None:
    """Why the step program cannot run ``optimizer``'s update, or ``None`` when it can."""
    if type(optimizer) not in (*ADAM, torch.optim.SGD):
        return f"the step program runs the update of Adam, AdamW and SGD only, not {type(optimizer).__name__}"
    for group in optimizer.param_groups:
        if not group.get("fused"):
            return f"{type(optimizer).__name__} without fused=True (pass fused=True: its math is the one folded)"
        flags = [flag for flag in ("amsgrad", "maximize", "differentiable") if group.get(flag)]
        if flags:
            return f"{type(optimizer).__name__} with {', '.join(f'{flag}=True' for flag in flags)}"
        if isinstance(group.get("momentum"), torch.Tensor):  # whether it keeps buffers depends on its value
            return "SGD with a momentum given as a tensor (torch's step reads its value on the host)"
    return None


@dataclasses.dataclass(frozen=True)
class Update:
    """One step's update of one optimizer, as the step program takes it: ``key`` (the
    optimizer's class and hyperparameters, each gradient's parameter group, and where the
    factors the backward left to the update sit, if it did) goes into the program's key, and
    ``tensors`` are its inputs after the gradients (weights, state, then each group's learning
    rate, the scaler's inverse scale and ``found_inf``, then the buffer of those factors): see
    :func:`record`."""

    key: tuple
    tensors: list[torch.Tensor]
    made: list[tuple[dict, tuple[str, ...]]]  # optimizer state it started: (a parameter's state, keys)

    def unused(self) -> None:
        """The program did not run it (it was not built, or ran eagerly): drop the state it
        started, which the optimizer's own step starts as it does (SGD's first momentum buffer
        is the gradient, not zeros)."""
        for state, keys in self.made:
            for key in keys:
                del state[key]


class UpdateFolds:
    """The optimizers whose update the step program runs, for one backend.

    ``add(optimizer)`` once :func:`why_not` allows it; at each step, ``update(optimizer,
    owners)`` gives the step program its :class:`Update` (``None``: this step cannot fold,
    and the optimizer steps as usual, told once unless ``add(optimizer, quiet=True)``: its
    ``grad_scale`` then carries the global factor); ``ran(optimizer)`` after the program ran it. The
    optimizer's own ``step()`` then finds no parameter group (they are set aside from the
    end of its pre-hooks to its post-hooks), so it updates nothing: the program updated every
    parameter it steps that has a gradient."""

    def __init__(self) -> None:
        self._folded: weakref.WeakSet[torch.optim.Optimizer] = weakref.WeakSet()
        self._ran: weakref.WeakSet[torch.optim.Optimizer] = weakref.WeakSet()  # for its step now beginning
        # its parameter groups, set aside during its step
        self._aside: weakref.WeakKeyDictionary[torch.optim.Optimizer, list] = weakref.WeakKeyDictionary()
        self._scalars: dict[tuple, torch.Tensor] = {}  # kept 0-dim inputs: learning rates, 1 and 0
        self._values: dict[tuple, float | None] = {}  # ... the number each holds (None: a tensor's)
        self._layouts: weakref.WeakKeyDictionary[torch.optim.Optimizer, _Layout] = weakref.WeakKeyDictionary()
        self._told: weakref.WeakSet[torch.optim.Optimizer] = weakref.WeakSet()  # see _tell (quiet: added)
        self._preceded: tuple[str, set[int]] | None = None  # see _ran_first

    def __contains__(self, optimizer: torch.optim.Optimizer) -> bool:
        return optimizer in self._folded

    def optimizers(self) -> list[torch.optim.Optimizer]:
        """The optimizers whose update the step program runs (while they live)."""
        return list(self._folded)

    def runs(self, optimizer: torch.optim.Optimizer) -> bool:
        """Whether the program would run ``optimizer``'s update at a step now (as far as the
        optimizer says: its groups' flags and hooks)."""
        return optimizer in self._folded and why_not(optimizer) is None and not foreign_hooks(optimizer)

    def add(self, optimizer: torch.optim.Optimizer, quiet: bool = False) -> None:
        """Run ``optimizer``'s update in the step program from its next step on (again: a no-op);
        ``quiet``: a step that cannot is not told (another fold takes it)."""
        if optimizer not in self._folded:
            self._folded.add(optimizer)
            if quiet:
                self._told.add(optimizer)
            hook_step(optimizer, self._set_aside, self._put_back)

    def update(
        self,
        optimizer: torch.optim.Optimizer | None,
        owners: Sequence[Owner],
        left: tuple[torch.Tensor, tuple[int | None, ...]] | None = None,
    ) -> Update | None:
        """The update of ``optimizer`` over ``owners``' parameters, if it steps exactly those
        with a gradient and can run in the program now; else ``None``. ``left``: the factors
        graph scope's backward left to the update, a buffer and each gradient's offset in it
        (``None``: 1)."""
        if optimizer is None:  # backend.step(): the optimizers' own steps follow
            self._preceded = None
            return None
        if optimizer not in self._folded:
            self._ran_first(optimizer, owners)
            return None
        self._preceded = None
        self._put_back(optimizer)  # a pre-hook after the set-aside raised, last step
        why = why_not(optimizer)  # fold() checked it; add_param_group or load_state_dict can change it
        if why is not None:
            self._tell(optimizer, why)
            return None
        foreign = foreign_hooks(optimizer)
        if foreign:
            self._tell(
                optimizer,
                f"{foreign} optimizer step hook(s) besides fxgrad's: a pre-hook would edit the gradients or "
                "the learning rate after the update, and a hook would find no parameter group",
            )
            return None
        param_groups = optimizer.param_groups
        stepped = group_ids(optimizer)
        layout = self._layouts.get(optimizer)
        if layout is None or layout.owners is not owners or layout.stepped != stepped:
            layout = self._layout(optimizer, owners, stepped)
            if layout is None:
                return None
        if any(p.grad is not None for p in layout.outside):
            self._tell(optimizer, "it also steps parameters outside the backend's models")
            return None
        adam = isinstance(optimizer, ADAM)
        read = _state(optimizer, layout)
        if read is None:
            return None  # some momentum buffers are new: torch's own step starts them
        tensors, made = read
        device = layout.params[0].device
        if not adam:
            tensors.append(self._scalar(("first", device), torch.float32, device, 1.0 if made else 0.0))
        for i, group in enumerate(param_groups):  # device tensors: a scheduler changes them (OneCycleLR)
            for name in _NUMBERS[adam]:
                tensors.append(self._scalar((name, i, device), torch.float64, device, _number(group, name)))
        scale = getattr(optimizer, "grad_scale", None)  # a GradScaler's, set around optimizer.step()
        found_inf = getattr(optimizer, "found_inf", None)
        one = self._scalar(("one", device), torch.float32, device, 1.0)
        zero = self._scalar(("zero", device), torch.float32, device, 0.0)
        tensors.append(one if scale is None else torch.reciprocal(scale.to(torch.float32)))
        tensors.append(zero if found_inf is None else found_inf.to(torch.float32))
        kinds = tuple(_kinds(optimizer, group) for group in param_groups)
        if left is not None:
            tensors.append(left[0])
        return Update((adam, kinds, layout.groups, left and left[1]), tensors, made)

    def _layout(
        self, optimizer: torch.optim.Optimizer, owners: Sequence[Owner], stepped: tuple[tuple[int, ...], ...]
    ) -> _Layout | None:
        """Where ``owners``' parameters sit in ``optimizer``'s parameter groups (``stepped``: the
        ids of the parameters it steps, in order), kept for the next steps; ``None``, told why,
        when the program cannot run its update."""
        params = list(map(_TENSOR, owners))
        if any(isinstance(p, DTensor) for p in params):
            self._tell(optimizer, "the parameters are DTensors (FSDP2, tensor parallelism)")
            return None
        param_groups = optimizer.param_groups
        group_of = {id(p): i for i, group in enumerate(param_groups) for p in group["params"]}
        groups = tuple(group_of.get(id(p), -1) for p in params)
        if -1 in groups:
            self._tell(optimizer, "another optimizer steps some of the models' parameters")
            return None
        ours = set(map(id, params))
        outside = [p for group in param_groups for p in group["params"] if id(p) not in ours]
        layout = self._layouts[optimizer] = _Layout(owners, stepped, params, groups, outside)
        return layout

    def _ran_first(self, other: torch.optim.Optimizer, owners: Sequence[Owner]) -> None:
        """``other``, not folded, ran the policy over ``owners`` at its step: a folded optimizer
        that steps some of their parameters before the policy runs again runs its own update
        (said by :meth:`_set_aside`; not before: the folded one may step in a later phase alone,
        a linear probe's optimizer before the fine-tuning's)."""
        if any(optimizer not in self._told for optimizer in self._folded):
            self._preceded = type(other).__name__, set(map(id, map(_TENSOR, owners)))

    def _tell(self, optimizer: torch.optim.Optimizer, why: str) -> None:
        """Say once per optimizer why its update runs in its own step, after the policy."""
        warn_once(
            self._told,
            optimizer,
            f"fxgrad: fold({type(optimizer).__name__}): the step program cannot run its update: {why}. "
            "The policy runs, then the optimizer's own step, as unfolded",
            RuntimeWarning,
        )

    def ran(self, optimizer: torch.optim.Optimizer) -> None:
        """The program ran ``optimizer``'s update for the step beginning now."""
        self._ran.add(optimizer)

    def updated(self, optimizer: torch.optim.Optimizer) -> bool:
        """Whether the program ran ``optimizer``'s update for the step beginning now."""
        return optimizer in self._ran

    def _scalar(
        self, key: tuple, dtype: torch.dtype, device: torch.device, value: float | torch.Tensor
    ) -> torch.Tensor:
        """The 0-dim input kept under ``key``, holding ``value`` (filled when it changed)."""
        kept = self._scalars.get(key)
        if kept is None:
            kept = self._scalars[key] = torch.empty((), dtype=dtype, device=device)
        number = None if isinstance(value, torch.Tensor) else value  # a tensor's value may have changed
        if number is None or self._values.get(key) != number:
            kept.fill_(value)
            self._values[key] = number
        return kept

    def _set_aside(self, optimizer: torch.optim.Optimizer) -> None:
        """The last pre-hook of a step whose update the program ran: leave the step no group.
        Of one whose update it did not run, after another optimizer's step ran the policy over
        parameters it steps: say so (:meth:`_ran_first`)."""
        self._put_back(optimizer)
        if optimizer in self._ran:
            self._ran.discard(optimizer)
            self._aside[optimizer], optimizer.param_groups = optimizer.param_groups, []
        elif self._preceded is not None and optimizer not in self._told:
            other, ids = self._preceded
            if any(id(p) in ids and p.grad is not None for group in optimizer.param_groups for p in group["params"]):
                self._tell(optimizer, f"{other} steps some of the models' parameters, and stepped first")

    def _put_back(self, optimizer: torch.optim.Optimizer, *args: Any) -> None:
        """After the step (a post-hook), or before the next if a hook raised in between."""
        groups = self._aside.pop(optimizer, None)
        if groups is not None:
            optimizer.param_groups = groups


@dataclasses.dataclass(frozen=True)
class _Layout:
    """Where the owners of one step sit in one optimizer's parameter groups: the same for a
    later step with the same owners list and the same parameters stepped, in the same order."""

    owners: Sequence[Owner]
    stepped: tuple[tuple[int, ...], ...]  # the ids of the parameters the optimizer steps, by group
    params: list[torch.Tensor]  # the owners' parameters
    groups: tuple[int, ...]  # each one's parameter group
    outside: list[torch.Tensor]  # parameters the optimizer steps that are not the owners'


def _state(optimizer: torch.optim.Optimizer, layout: _Layout) -> tuple[list[torch.Tensor], list] | None:
    """The weights, then the state the update reads of them, read at each step (a parameter's
    state may be a new dict, a checkpoint's or a reset's), and the state it started (``(a
    parameter's state, keys)``) where a parameter had none; ``None`` when only some momentum
    buffers are new (torch's own step starts them: the first is the gradient)."""
    params, made = layout.params, []
    if isinstance(optimizer, ADAM):
        states = list(map(optimizer.state.__getitem__, params))  # a defaultdict: it adds them
        for p, state in zip(params, states):
            if not state:  # as torch's fused Adam makes it at a parameter's first step
                state["step"] = torch.zeros((), dtype=torch.float32, device=p.device)
                state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                made.append((state, ("step", "exp_avg", "exp_avg_sq")))
        return [*params, *map(_EXP_AVG, states), *map(_EXP_AVG_SQ, states), *map(_STEP, states)], made
    moves = [_moves(group) for group in optimizer.param_groups]
    moving = [(p, optimizer.state[p]) for p, g in zip(params, layout.groups) if moves[g]]
    new = sum("momentum_buffer" not in state for _, state in moving)
    if new not in (0, len(moving)):
        return None
    for p, state in moving:
        if new:  # the program starts them at the gradient (first = 1), as torch's first step does
            state["momentum_buffer"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            made.append((state, ("momentum_buffer",)))
    return [*params, *(state["momentum_buffer"] for _, state in moving)], made


_TENSOR = operator.attrgetter("tensor")
_EXP_AVG, _EXP_AVG_SQ, _STEP = map(operator.itemgetter, ("exp_avg", "exp_avg_sq", "step"))


def _number(group: dict, name: str) -> float | torch.Tensor:
    """A parameter group's hyperparameter ``name`` (``beta1`` and ``beta2`` are ``betas``')."""
    betas = {"beta1": 0, "beta2": 1}
    return group["betas"][betas[name]] if name in betas else group[name]


def _decays(group: dict) -> bool:
    """Whether the program's code for ``group`` applies weight decay: a tensor may change, and a
    decay of 0 leaves the weights exactly as none does."""
    return isinstance(group["weight_decay"], torch.Tensor) or group["weight_decay"] != 0


def _moves(group: dict) -> bool:
    """Whether ``group`` keeps momentum buffers (a Python number: see :func:`why_not`)."""
    return group["momentum"] != 0


def _kinds(optimizer: torch.optim.Optimizer, group: dict) -> tuple[bool, ...]:
    """What of ``group`` the program's code depends on (Python values, in its key): for Adam(W)
    whether it decays the weights and whether decoupled; for SGD whether it keeps momentum
    buffers, Nesterov, and whether it decays."""
    if isinstance(optimizer, ADAM):
        return _decays(group), isinstance(optimizer, torch.optim.AdamW) or group["decoupled_weight_decay"]
    return _moves(group), bool(group["nesterov"]), _decays(group)


# the hyperparameters the program takes as device tensors, each group's: Adam(W)'s, SGD's
_NUMBERS = {
    True: ("lr", "beta1", "beta2", "eps", "weight_decay"),
    False: ("lr", "momentum", "dampening", "weight_decay"),
}


def record(
    key: tuple,
    replay: Callable[..., Any],
    grads: Sequence[Any],
    new_grads: Sequence[Any],
    inputs: Sequence[Any],
    factor: Any = None,
) -> list[tuple[Any, Any]]:
    """Record the update :attr:`Update.key` describes, reading ``new_grads`` (the policy's
    results for ``grads``) and ``inputs`` (:attr:`Update.tensors`), all fake tensors, with
    ``replay`` (:meth:`~fxgrad.passes.record.GraphRecorder.replay`); the pairs ``(tensor,
    new value)`` the program writes back, gradients included. ``factor``, the global factor
    the policy left to the update (:mod:`fxgrad.frontend.fold`), multiplies each gradient, as
    does each gradient's factor that the backward left (the key's offsets into the last
    input): in the update's dtype (float64 for float64 weights, where a fused optimizer's
    float32 ``grad_scale`` would round it), before the inverse loss scale."""
    adam, kinds, groups, offsets = key
    n, width = len(grads), len(_NUMBERS[adam])
    if offsets is not None:
        inputs, left = inputs[:-1], inputs[-1]
    params, writes = inputs[:n], []
    hyper, (inverse, found_inf) = inputs[-2 - width * len(kinds) : -2], inputs[-2:]
    factors = [factor] * n
    if offsets is not None:
        factors = [None if at is None else left[at] for at in offsets]
    numbers = [hyper[i * width : (i + 1) * width] for i in range(len(kinds))]  # each group's
    if adam:
        exp_avgs, exp_avg_sqs, steps = inputs[n : 2 * n], inputs[2 * n : 3 * n], inputs[3 * n : 4 * n]
        scalars = _adam_scalars(numbers, groups, steps)
        for i in range(n):
            state = (params[i], exp_avgs[i], exp_avg_sqs[i], steps[i])
            args = (*scalars[i], *numbers[groups[i]], inverse, found_inf, *kinds[groups[i]])
            writes += zip((grads[i], *state), replay(_adam, new_grads[i], factors[i], *state, *args))
        return writes
    buffers = iter(inputs[n:])
    bufs = [next(buffers) if kinds[g][0] else None for g in groups]
    first = next(buffers)
    for i in range(n):
        (lr, momentum, dampening, wd), (_, nesterov, decays) = numbers[groups[i]], kinds[groups[i]]
        if bufs[i] is None:
            new = replay(_sgd, new_grads[i], factors[i], params[i], lr, wd, inverse, found_inf, decays)
            writes += zip((grads[i], params[i]), new)
        else:
            args = (first, lr, momentum, dampening, wd, inverse, found_inf, nesterov, decays)
            new = replay(_momentum_sgd, new_grads[i], factors[i], params[i], bufs[i], *args)
            writes += zip((grads[i], params[i], bufs[i]), new)
    return writes


def _adam_scalars(numbers: Sequence[Sequence[Any]], groups: Sequence[int], steps: Sequence[Any]) -> list[tuple]:
    """Each parameter's new step count, step size and bias correction's square root (float64),
    each group's computed in one op over its parameters' step counts. ``beta ** step`` is written
    ``exp(step * log(beta))``: a reused result of ``exp`` is one Inductor computes once on the
    CPU (``should_realize_on_reuse``), where a power is inlined into the loop over each gradient
    and computed again for every vector of it (the deep MLP's program: 1.2 ms against 0.2 ms)."""
    out: list[tuple] = [()] * len(steps)
    for group, (lr, beta1, beta2, *_) in enumerate(numbers):
        members = [i for i, g in enumerate(groups) if g == group]
        if not members:
            continue
        new_steps = torch.stack([steps[i] for i in members]) + 1
        exponents = new_steps.double()
        step_sizes = lr / (1 - torch.exp(exponents * torch.log(beta1)))
        bias2_sqrts = torch.sqrt(1 - torch.exp(exponents * torch.log(beta2)))
        for j, i in enumerate(members):
            out[i] = new_steps[j], step_sizes[j], bias2_sqrts[j]
    return out


def _adam(
    g, factor, p, exp_avg, exp_avg_sq, step, new_step, step_size, bias2_sqrt, lr, beta1, beta2, eps, wd, inverse,
    found_inf, decays, decoupled,
):  # fmt: skip
    """One parameter's fused Adam(W) update of the policy's gradient ``g`` times ``factor`` (the
    scalars from :func:`_adam_scalars`); the gradient to write back, and the new weight, moments
    and step."""
    dtype = _opmath(p)
    applied = grad = _applied(g, factor, inverse, dtype)
    param = p.to(dtype)
    if decays and decoupled:
        param = param * (1 - lr * wd).to(dtype)
    elif decays:
        grad = grad + param * wd.to(dtype)
    m = exp_avg.to(dtype) + (grad - exp_avg.to(dtype)) * (1 - beta1).to(dtype)
    v = exp_avg_sq.to(dtype) * beta2.to(dtype) + grad * grad * (1 - beta2).to(dtype)
    param = param - step_size.to(dtype) * m / (torch.sqrt(v) / bias2_sqrt.to(dtype) + eps.to(dtype))
    return _unless(found_inf, g, applied, (p, param), (exp_avg, m), (exp_avg_sq, v), (step, new_step))


def _sgd(g, factor, p, lr, wd, inverse, found_inf, decays):
    """One parameter's fused SGD update without momentum; the gradient to write back, the weight."""
    dtype = _opmath(p)
    applied = grad = _applied(g, factor, inverse, dtype)
    param = p.to(dtype)
    if decays:
        grad = grad + param * wd.to(dtype)
    return _unless(found_inf, g, applied, (p, param - lr.to(dtype) * grad))


def _momentum_sgd(g, factor, p, buf, first, lr, momentum, dampening, wd, inverse, found_inf, nesterov, decays):
    """One parameter's fused SGD update with momentum (``first``: the buffers are new, and start
    at the gradient, as at torch's first step); the gradient to write back, the weight, the buffer."""
    dtype = _opmath(p)
    applied = grad = _applied(g, factor, inverse, dtype)
    param = p.to(dtype)
    if decays:
        grad = grad + param * wd.to(dtype)
    momentum = momentum.to(dtype)
    new_buf = torch.where(first != 0, grad, buf.to(dtype) * momentum + grad * (1 - dampening).to(dtype))
    grad = grad + new_buf * momentum if nesterov else new_buf
    return _unless(found_inf, g, applied, (p, param - lr.to(dtype) * grad), (buf, new_buf))


def _opmath(tensor: Any) -> torch.dtype:
    """The dtype torch's fused kernels compute ``tensor``'s update in: float64's own, else float32."""
    return torch.float64 if tensor.dtype == torch.float64 else torch.float32


def _applied(g, factor, inverse, dtype):
    """The gradient the update applies, in ``dtype``: ``g`` times the factor left to the update
    (``None``: none), first, as the unfolded path scales the gradient before the update, then
    times the inverse loss scale."""
    grad = g.to(dtype) if factor is None else g.to(dtype) * factor.to(dtype)
    return grad * inverse.to(dtype)


def _unless(found_inf, g, applied, *pairs):
    """The gradient to write back (``applied``, in ``g``'s dtype) and each pair's new value,
    unless ``found_inf``: then torch's fused kernels leave the gradient scaled and every
    weight and state as it was."""
    skip = found_inf != 0
    return (
        torch.where(skip, g, applied.to(g.dtype)),
        *(torch.where(skip, old, new.to(old.dtype)) for old, new in pairs),
    )
