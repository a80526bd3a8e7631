"""The optimizer's update inside the step program: per-layer factors folded.

A fused optimizer takes one ``grad_scale`` per call, so only a single global factor
folds there (:mod:`fxgrad.frontend.fold`). A policy with per-layer factors (``rescale``,
``clip_by_norm``, AGC, ...) or any other per-gradient transform folds in step scope
another way: the step program that runs the policy also runs the update of torch's
fused ``Adam``, ``AdamW`` or ``SGD``, on the gradient it has just transformed, in the
same loops. The norms are read once; the scaled gradient is never a pass of its own.
The program writes the weights, the optimizer's state (``exp_avg``, ``exp_avg_sq`` and
``step``; ``momentum_buffer``) and the transformed gradient to ``.grad``, where torch's
fused update would; the optimizer's own ``step()`` then finds no parameter group to
update (they are put back after it). Hyperparameters are read from the parameter
groups at each step (the learning rate as a device tensor: a scheduler recompiles
nothing). A ``GradScaler``'s ``grad_scale`` and ``found_inf`` are honoured as torch's
fused kernels honour them: a step with an overflow changes no weight, state or step
count.

    backend = fxgrad.backend(fxgrad.rescale(alpha=0.5), scope="step")
    model = torch.compile(model, backend=backend)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
    backend.fold(optimizer)   # the step program now runs AdamW's update too

The math is that of torch's fused kernels (``aten/src/ATen/native/cpu/FusedAdamKernel.cpp``,
``FusedSGDKernel.cpp``), in float32 with the step size in float64; the weights after
each step equal the policy then torch's fused step to float32 rounding
(``tests/test_update_program.py``). What does not fold this way, and runs the policy
then torch's own step, is in docs/performance.md ("The optimizer fold").
"""

from __future__ import annotations

import dataclasses
import math
import operator
import weakref
from typing import Any, Callable, Sequence

import torch
from torch.distributed.tensor import DTensor

from fxgrad.core.layers import Owner
from fxgrad.core.warn import warn
from fxgrad.frontend.step_check import after_closure

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
        tensors = [name for name in _HYPER[type(optimizer)] if _holds_tensor(group[name])]
        if tensors:
            return (
                f"{type(optimizer).__name__} with tensors for {', '.join(tensors)} (the program takes Python numbers)"
            )
    return None


@dataclasses.dataclass(frozen=True)
class Update:
    """One step's update of one optimizer, as the step program takes it: ``key`` (the
    optimizer's class and hyperparameters, each gradient's parameter group) goes into the
    program's key, and ``tensors`` are its inputs after the gradients (weights, state, then each
    group's learning rate, the scaler's inverse scale and ``found_inf``): see :func:`record`."""

    key: tuple
    tensors: list[torch.Tensor]


class UpdateFolds:
    """The optimizers whose update the step program runs, for one backend.

    ``add(optimizer)`` once :func:`why_not` allows it; at each step, ``update(optimizer,
    owners)`` gives the step program its :class:`Update` (``None``: this step cannot fold,
    and the optimizer steps as usual); ``ran(optimizer)`` after the program ran it. The
    optimizer's own ``step()`` then finds no parameter group (they are set aside from the
    end of its pre-hooks to its post-hooks), so it updates nothing: the program updated every
    parameter it steps that has a gradient."""

    def __init__(self) -> None:
        self._folded: weakref.WeakSet[torch.optim.Optimizer] = weakref.WeakSet()
        self._ran: weakref.WeakSet[torch.optim.Optimizer] = weakref.WeakSet()  # for its step now beginning
        # its parameter groups, set aside during its step
        self._aside: weakref.WeakKeyDictionary[torch.optim.Optimizer, list] = weakref.WeakKeyDictionary()
        self._scalars: dict[tuple, torch.Tensor] = {}  # kept 0-dim inputs: learning rates, 1 and 0
        self._told: weakref.WeakSet[torch.optim.Optimizer] = weakref.WeakSet()  # see _tell

    def __contains__(self, optimizer: torch.optim.Optimizer) -> bool:
        return optimizer in self._folded

    def optimizers(self) -> list[torch.optim.Optimizer]:
        return list(self._folded)

    def add(self, optimizer: torch.optim.Optimizer) -> None:
        if optimizer not in self._folded:
            self._folded.add(optimizer)
            optimizer.register_step_pre_hook(after_closure(self._set_aside))
            optimizer.register_step_post_hook(torch.compiler.disable(self._put_back))

    def update(self, optimizer: torch.optim.Optimizer | None, owners: Sequence[Owner]) -> Update | None:
        """The update of ``optimizer`` over ``owners``' parameters, if it steps exactly those
        with a gradient and can run in the program now; else ``None``."""
        if optimizer is None or optimizer not in self._folded:
            return None
        self._put_back(optimizer)  # a pre-hook after the set-aside raised, last step
        why = why_not(optimizer)  # fold() checked it; add_param_group or load_state_dict can change it
        if why is not None:
            self._tell(optimizer, why)
            return None
        params = list(map(_TENSOR, owners))
        if any(isinstance(p, DTensor) for p in params):
            self._tell(optimizer, "the parameters are DTensors (FSDP2, tensor parallelism)")
            return None
        param_groups = optimizer.param_groups
        group_of = {id(p): i for i, group in enumerate(param_groups) for p in group["params"]}
        groups = [group_of.get(id(p), -1) for p in params]
        stepped = sum(p.grad is not None for group in param_groups for p in group["params"])
        if -1 in groups:
            self._tell(optimizer, "another optimizer steps some of the models' parameters")
            return None
        if stepped != len(owners):
            self._tell(optimizer, "it also steps parameters outside the backend's models")
            return None
        device = params[0].device
        if isinstance(optimizer, ADAM):
            states = list(map(optimizer.state.__getitem__, params))  # a defaultdict: it adds them
            for p, state in zip(params, states):
                if not state:  # as torch's fused Adam makes it at a parameter's first step
                    state["step"] = torch.zeros((), dtype=torch.float32, device=p.device)
                    state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                    state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            tensors = [*params, *map(_EXP_AVG, states), *map(_EXP_AVG_SQ, states), *map(_STEP, states)]
        else:
            moving = [(p, optimizer.state[p]) for p, g in zip(params, groups) if param_groups[g]["momentum"]]
            new = sum("momentum_buffer" not in state for _, state in moving)
            if new not in (0, len(moving)):
                return None  # some buffers are new: torch's own step starts them
            for p, state in moving:
                state.setdefault("momentum_buffer", torch.zeros_like(p, memory_format=torch.preserve_format))
            first = self._scalar(("first", device), torch.float32, device)
            first.fill_(1.0 if new else 0.0)
            tensors = [*params, *(state["momentum_buffer"] for _, state in moving), first]
        for i, group in enumerate(param_groups):
            lr = self._scalar(("lr", i, device), torch.float64, device)
            lr.fill_(group["lr"])
            tensors.append(lr)
        scale = getattr(optimizer, "grad_scale", None)  # a GradScaler's, set around optimizer.step()
        found_inf = getattr(optimizer, "found_inf", None)
        one = self._scalar(("one", device), torch.float32, device, 1.0)
        zero = self._scalar(("zero", device), torch.float32, device, 0.0)
        tensors.append(one if scale is None else torch.reciprocal(scale.to(torch.float32)))
        tensors.append(zero if found_inf is None else found_inf.to(torch.float32))
        hyper = tuple(tuple(group[name] for name in _HYPER[type(optimizer)]) for group in param_groups)
        return Update((type(optimizer), hyper, tuple(groups)), tensors)

    def _tell(self, optimizer: torch.optim.Optimizer, why: str) -> None:
        """Say once per optimizer why its update runs in its own step, after the policy."""
        if optimizer not in self._told:
            self._told.add(optimizer)
            warn(
                f"fxgrad: fold({type(optimizer).__name__}): the step program cannot run its update: {why}. "
                "The policy runs, then the optimizer's own step, as unfolded",
                RuntimeWarning,
            )

    def ran(self, optimizer: torch.optim.Optimizer) -> None:
        """The program ran ``optimizer``'s update for the step beginning now."""
        self._ran.add(optimizer)

    def _scalar(self, key: tuple, dtype: torch.dtype, device: torch.device, value: float = 0.0) -> torch.Tensor:
        kept = self._scalars.get(key)
        if kept is None:
            kept = self._scalars[key] = torch.full((), value, dtype=dtype, device=device)
        return kept

    def _set_aside(self, optimizer: torch.optim.Optimizer) -> None:
        self._put_back(optimizer)
        if optimizer in self._ran:
            self._ran.discard(optimizer)
            self._aside[optimizer], optimizer.param_groups = optimizer.param_groups, []

    def _put_back(self, optimizer: torch.optim.Optimizer, *args: Any) -> None:
        groups = self._aside.pop(optimizer, None)
        if groups is not None:
            optimizer.param_groups = groups


def _holds_tensor(value: Any) -> bool:
    return isinstance(value, torch.Tensor) or (isinstance(value, tuple) and any(map(_holds_tensor, value)))


_TENSOR = operator.attrgetter("tensor")
_EXP_AVG, _EXP_AVG_SQ, _STEP = map(operator.itemgetter, ("exp_avg", "exp_avg_sq", "step"))
_HYPER = {
    torch.optim.Adam: ("betas", "eps", "weight_decay", "decoupled_weight_decay"),
    torch.optim.AdamW: ("betas", "eps", "weight_decay"),
    torch.optim.SGD: ("momentum", "dampening", "nesterov", "weight_decay"),
}


def record(
    key: tuple, replay: Callable[..., Any], grads: Sequence[Any], new_grads: Sequence[Any], inputs: Sequence[Any]
) -> list[tuple[Any, Any]]:
    """Record the update :attr:`Update.key` describes, reading ``new_grads`` (the policy's
    results for ``grads``) and ``inputs`` (:attr:`Update.tensors`), all fake tensors, with
    ``replay`` (:meth:`~fxgrad.passes.record.GraphRecorder.replay`); the pairs ``(tensor,
    new value)`` the program writes back, gradients included."""
    kind, hyper, groups = key
    n = len(grads)
    params, writes = inputs[:n], []
    if kind in ADAM:
        exp_avgs, exp_avg_sqs, steps = inputs[n : 2 * n], inputs[2 * n : 3 * n], inputs[3 * n : 4 * n]
        lrs, (inverse, found_inf) = inputs[4 * n : -2], inputs[-2:]
        scalars = _adam_scalars(hyper, groups, steps, lrs)
        for i in range(n):
            beta1_beta2, eps, wd = hyper[groups[i]][:3]
            decoupled = kind is torch.optim.AdamW or hyper[groups[i]][3]
            state = (params[i], exp_avgs[i], exp_avg_sqs[i], steps[i])
            args = (*scalars[i], lrs[groups[i]], inverse, found_inf, *beta1_beta2, eps, wd, decoupled)
            writes += zip((grads[i], *state), replay(_adam, new_grads[i], *state, *args))
        return writes
    buffers = iter(inputs[n:])
    bufs = [next(buffers) if hyper[g][0] != 0 else None for g in groups]
    rest = list(buffers)  # the flag of a first step, then the learning rates, the inverse scale, found_inf
    for i in range(n):
        momentum, dampening, nesterov, wd = hyper[groups[i]]
        if bufs[i] is None:
            new = replay(_sgd, new_grads[i], params[i], rest[1 + groups[i]], *rest[-2:], wd)
            writes += zip((grads[i], params[i]), new)
        else:
            args = (momentum, dampening, nesterov, wd)
            new = replay(
                _momentum_sgd, new_grads[i], params[i], bufs[i], rest[0], rest[1 + groups[i]], *rest[-2:], *args
            )
            writes += zip((grads[i], params[i], bufs[i]), new)
    return writes


def _adam_scalars(hyper: tuple, groups: Sequence[int], steps: Sequence[Any], lrs: Sequence[Any]) -> list[tuple]:
    """Each parameter's new step count, step size and bias correction's square root, each
    group's computed in one op over its parameters' step counts. ``beta ** step`` is written
    ``exp(step * log(beta))``: a reused result of ``exp`` is one Inductor computes once on
    the CPU (``should_realize_on_reuse``), where a power is inlined into the loop over each
    gradient and computed again for every vector of it (the deep MLP's program: 1.2 ms
    against 0.2 ms)."""
    out: list[tuple] = [()] * len(steps)
    for group, (betas, *_) in enumerate(hyper):
        members = [i for i, g in enumerate(groups) if g == group]
        if not members:
            continue
        new_steps = torch.stack([steps[i] for i in members]) + 1
        exponents = new_steps.double()
        step_sizes = (lrs[group] / (1 - torch.exp(exponents * math.log(betas[0])))).float()
        bias2_sqrts = torch.sqrt(1 - torch.exp(exponents * math.log(betas[1]))).float()
        for j, i in enumerate(members):
            out[i] = new_steps[j], step_sizes[j], bias2_sqrts[j]
    return out


def _adam(
    g,
    p,
    exp_avg,
    exp_avg_sq,
    step,
    new_step,
    step_size,
    bias2_sqrt,
    lr,
    inverse,
    found_inf,
    beta1,
    beta2,
    eps,
    wd,
    decoupled,
):
    """One parameter's fused Adam(W) update of the policy's gradient ``g`` (the scalars from
    :func:`_adam_scalars`); the gradient to write back, and the new weight, moments and step."""
    grad = g.float() * inverse
    param = p.float()
    if wd != 0:
        if decoupled:
            param = param * (1 - lr * wd).float()
        else:
            grad = grad + param * wd
    m = exp_avg + (grad - exp_avg) * (1 - beta1)
    v = exp_avg_sq * beta2 + grad * grad * (1 - beta2)
    param = param - step_size * m / (torch.sqrt(v) / bias2_sqrt + eps)
    return _unless(found_inf, g, inverse, (p, param), (exp_avg, m), (exp_avg_sq, v), (step, new_step))


def _sgd(g, p, lr, inverse, found_inf, wd):
    """One parameter's fused SGD update without momentum; the gradient to write back, the weight."""
    grad = g.float() * inverse
    param = p.float()
    if wd != 0:
        grad = grad + param * wd
    return _unless(found_inf, g, inverse, (p, param - lr.float() * grad))


def _momentum_sgd(g, p, buf, first, lr, inverse, found_inf, momentum, dampening, nesterov, wd):
    """One parameter's fused SGD update with momentum (``first``: the buffers are new, and start
    at the gradient, as at torch's first step); the gradient to write back, the weight, the buffer."""
    grad = g.float() * inverse
    param = p.float()
    if wd != 0:
        grad = grad + param * wd
    new_buf = torch.where(first != 0, grad, buf * momentum + grad * (1 - dampening))
    grad = grad + new_buf * momentum if nesterov else new_buf
    return _unless(found_inf, g, inverse, (p, param - lr.float() * grad), (buf, new_buf))


def _unless(found_inf, g, inverse, *pairs):
    """The gradient to write back and each pair's new value, unless ``found_inf``: then torch's
    fused kernels leave the gradient scaled and every weight and state as it was."""
    skip = found_inf != 0
    return (torch.where(skip, g, g * inverse), *(torch.where(skip, old, new.to(old.dtype)) for old, new in pairs))
