"""Graph scope: gradients that something outside the compiled model adds to or changes.

In graph scope each compiled backward returns its parameters' gradients transformed. What
autograd adds to them afterwards, the policy never sees: the gradient of the same
parameter's other uses in the backward (an eager L2 penalty over ``model.parameters()``
added to the loss, a weight reused by code outside the compiled forward), and an in-place
change before ``optimizer.step()`` (a second ``clip_grad_norm_``). A global clip was 3.5x
off its eager reference with such a penalty, silently.

For its first two steps a backend notes, with a post-hook on each compiled backward, the
memory and version of the gradient it returned for each parameter whose ``.grad`` was
empty. Autograd stores a lone gradient as ``.grad`` as it is; at the optimizer's step a
``.grad`` in other memory (a sum), or the same one changed (a sum into it, a clip), is
reported once. A GradScaler's ``unscale_`` leaves the version as it was (torch 2.13), so
AMP's usual loop is silent, and a clip after it is seen. Not checked: accumulation and two
forwards in one loss (their own warnings), parameters with gradient hooks (warned about),
gradients autograd copies into ``.grad`` anyway (in another layout than the parameter's,
one tensor returned for two parameters, ``backward(create_graph=True)``), changes through
``.grad.data`` (they leave the version as it was too), and multi-process jobs (DDP's
buckets replace ``.grad``)::

    uses = OutsideUses()
    if uses.watching:
        uses.watch(outputs)  # each call of a compiled graph in graph scope, grad mode on
    if uses.pending:  # at an optimizer's step, before it updates
        uses.check(optimizer, transform, layer_of)
"""

from __future__ import annotations

import collections
import functools
import weakref
from typing import Any, Callable

import torch
import torch.distributed

from fxgrad import _compat
from fxgrad.core.warn import warn
from fxgrad.frontend.coverage import CoverageWarning
from fxgrad.frontend.step_check import stepped_ids

CHANGED = (
    "fxgrad: the gradients of {layers} are not the ones the compiled backward returned, transformed by "
    "{transform!r}: code outside the compiled model added to them in the same backward (an eager L2 penalty "
    "over model.parameters() added to the loss, a weight also used outside the compiled forward), or changed "
    "them in place before optimizer.step() (a clip_grad_norm_ after the policy), or replaced them (gradients of "
    "several backward passes combined by hand, as PCGrad does, and assigned to .grad). The policy did not see "
    "that part, or the combination. Use fxgrad.backend(..., scope='step'), which transforms the final .grad at "
    "the step; or move that use into the compiled forward (weight decay: into the optimizer)."
)


class OutsideUses:
    """Reports, once, gradients changed after the compiled backward returned them (see the module)."""

    STEPS = 2  # steps found clean before the watch ends
    UNCHECKED = 8  # backward passes with no optimizer step of theirs (torch.autograd.grad) before it ends

    def __init__(self) -> None:
        self._clean = 0
        self._told = False
        self._passes: set[int] = set()  # the backward passes noted since the last check
        # id(parameter) -> (the parameter, weakly; the gradient returned for it: its data pointer (None:
        # not checked) and version; the backward pass). Not the gradient itself: holding it, autograd
        # would copy it into .grad.
        self._returned: dict[int, tuple[weakref.ref, int | None, int, int]] = {}

    @property
    def watching(self) -> bool:
        return (
            not self._told
            and self._clean < self.STEPS
            and len(self._passes) <= self.UNCHECKED
            and not torch.distributed.is_initialized()
        )

    def told(self) -> None:
        """Something else reported the change: watch no more."""
        self._told = True
        self._returned.clear()

    @property
    def pending(self) -> bool:
        """Whether gradients wait for :meth:`check`."""
        return bool(self._returned)

    def watch(self, outputs: Any) -> None:
        """Note what the backwards of one call of a compiled graph (its ``outputs``) return."""
        for node in _compat.compiled_backward_nodes(outputs):
            leaves = [None if leaf is None else weakref.ref(leaf) for leaf in _compat.accumulated_leaves(node)]
            node.register_hook(functools.partial(self._returned_grads, leaves))

    @torch.compiler.disable  # an autograd hook (see fxgrad.frontend.watch)
    def _returned_grads(self, leaves: list[weakref.ref | None], grads: tuple, grad_outputs: Any) -> None:
        pass_id = _compat.backward_pass_id()
        self._passes.add(pass_id)
        if torch.is_grad_enabled():  # backward(create_graph=True): autograd copies every gradient into .grad
            return
        pointers = [None if grad is None or grad.layout != torch.strided else grad.data_ptr() for grad in grads]
        repeated = {pointer for pointer, count in collections.Counter(pointers).items() if count > 1}
        for ref, grad, pointer in zip(leaves, grads, pointers):
            param = None if ref is None or pointer is None else ref()
            if param is None or _compat.has_grad_hooks(param):
                continue
            key = id(param)
            # Left unchecked: accumulation and two forwards in one loss (said elsewhere), and what
            # autograd copies into .grad: a gradient in another layout than its parameter's, or
            # one returned for two parameters (a shared expression). A pass after the gradient was
            # zeroed is checked anew: gradients of several passes combined by hand and assigned
            # to .grad (PCGrad, micro-batches summed from torch.autograd.grad) are a change.
            copied = grad.stride() != param.stride() or pointer in repeated
            twice = key in self._returned and self._returned[key][3] == pass_id
            if param.grad is not None or twice or copied:
                self._returned[key] = (ref, None, 0, pass_id)
            else:
                self._returned[key] = (ref, pointer, _compat.tensor_version(grad), pass_id)

    def check(self, optimizer: torch.optim.Optimizer, transform: Any, layer_of: Callable[[], dict[int, str]]) -> None:
        """At ``optimizer``'s step, before it updates; ``layer_of()``: the layer of each
        parameter, by id, for the warning."""
        unwatched = len(self._passes) > self.UNCHECKED  # the watch stopped before the last passes (PGD-10)
        self._passes.clear()
        if unwatched:
            self._returned.clear()
            return
        stepped = stepped_ids(optimizer)
        checked = [key for key in self._returned if key in stepped]
        if not checked:
            return
        changed = []
        for key in checked:
            param_ref, pointer, version, _ = self._returned.pop(key)
            param = param_ref()
            grad = None if param is None or pointer is None else param.grad
            if grad is None:
                continue
            if grad.data_ptr() != pointer or _compat.tensor_version(grad) != version:
                changed.append(key)
        if not changed:
            self._clean += 1
            if not self.watching:  # the passes from now on go unnoted: what the last ones noted cannot be checked
                self._returned.clear()
            return
        self._told = True
        self._returned.clear()
        names = layer_of()
        layers = sorted({names.get(key, "?") for key in changed})
        shown = ", ".join(layers[:5]) + (f" and {len(layers) - 5} more" if len(layers) > 5 else "")
        warn(CHANGED.format(layers=shown, transform=transform), CoverageWarning)
