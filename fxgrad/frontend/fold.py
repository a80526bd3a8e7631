"""The optimizer fold: the policy's final factor applied by the optimizer's own update.

A global factor (``clip_by_global_norm``, ``autoclip``, ``zclip``) multiplies
every gradient by one number: one more read and write of every gradient, after
the last one exists. torch's fused optimizers (``Adam``, ``AdamW`` and ``SGD``
with ``fused=True``) already divide each gradient by ``optimizer.grad_scale``
inside their update (``GradScaler`` sets it to the loss scale), so the factor
can ride there for free: ``grad_scale = loss_scale / factor``. A program that runs the
update itself (:mod:`fxgrad.frontend.update_program`) does better, the factor
multiplying each gradient in its loops: in graph scope the backward graph reads the norms
where it produces the gradients and returns them unscaled, leaving the factor, if one
backward through one graph makes each step's gradient (the step refuses more: each
backward had a factor of its own), and a program runs the update with it at the step;
in step scope the step program reads the norms and runs the update. ``grad_scale``
carries the factor in a step no program can run the update of.

Per-layer factors (``clip_by_norm``, ``rescale``, a global clip under ``by_type``) fold
into a program that runs the update (:mod:`fxgrad.frontend.update_program`): in step
scope the step program, after the policy; in graph scope the backward leaves each
layer's factor as the statistic ``folded_factor/<layer>`` (when every rule that changes
gradients scales each layer by one factor: :func:`not_factors`), and at the step a
program runs the update with them.

    backend = fxgrad.backend(fxgrad.clip_by_global_norm(1.0), scope="step")
    model = torch.compile(model, backend=backend)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
    backend.fold(optimizer)

While folded, ``.grad`` holds the gradient *before* the factor between
``backward()`` and ``optimizer.step()`` (the fused update writes the
multiplied gradient back to ``.grad``); ``backend.stats()["folded_factor"]``
is the factor and :meth:`fxgrad.Backend.scaled_grads` the gradients with it,
with no sync. Every other combination runs the policy as before, after one warning
that says why (docs/performance.md, "The optimizer fold").

:class:`Folds` keeps one backend's folded optimizers: the factors each update has
applied, the checks before each step, and the hand-over of the factor to ``grad_scale``.

:func:`cancelled` is the other side of the same question, what the update does
to the policy's factors: an Adam-type update divides out a factor that is the
same for a layer on every step (docs/transforms.md, "Under which optimizers a
rule acts").
"""

from __future__ import annotations

import dataclasses
import weakref
from typing import Any, Callable, Collection, Sequence

import torch

from fxgrad import _compat
from fxgrad.core import match, validate
from fxgrad.core.layers import Layer
from fxgrad.core.rule import ScaleLeaf, Transform
from fxgrad.core.warn import warn, warn_once
from fxgrad.frontend.coverage import CoverageWarning
from fxgrad.frontend.step_check import group_ids, hook_step
from fxgrad.runtime import norm_math

FUSED = (torch.optim.Adam, torch.optim.AdamW, torch.optim.SGD)  # their fused update reads grad_scale

# Updates that divide by a running RMS of the gradient from their first step, or (Muon) each
# matrix's momentum by its norm: a constant per-layer factor cancels. Not RAdam: its first
# steps (rho_t <= 5) are momentum SGD's.
NORMALIZING = (
    torch.optim.Muon,
    torch.optim.Adam,
    torch.optim.AdamW,
    torch.optim.Adamax,
    torch.optim.NAdam,
    torch.optim.RMSprop,
    torch.optim.Adagrad,
    torch.optim.Adafactor,
    torch.optim.SparseAdam,
)
# The same, of other libraries, by name (fxgrad does not import them); torchao's keep Adam's
# state in 8 or 4 bits or float8, and its Adams without a W couple the decay (COUPLED_DECAY).
COUPLED_DECAY_ELSEWHERE = {f"torchao.optim.adam.{name}" for name in ("Adam8bit", "Adam4bit", "AdamFp8")}
NORMALIZING_ELSEWHERE = {
    "transformers.optimization.Adafactor",
    *(f"torchao.optim.adam.{name}" for name in ("AdamW8bit", "AdamW4bit", "AdamWFp8", "_AdamW")),
    *COUPLED_DECAY_ELSEWHERE,
}
SIGN_ONLY = (torch.optim.Rprop,)  # moves each weight by the sign of its gradient
# Updates that add weight_decay * w to the gradient before they normalize it (unless a group says
# decoupled_weight_decay, as AdamW's do): a factor on the gradient then changes its share, and acts.
COUPLED_DECAY = (torch.optim.Adam, torch.optim.NAdam, torch.optim.Adamax, torch.optim.RMSprop, torch.optim.Adagrad)

_SET_HERE: weakref.WeakSet[torch.optim.Optimizer] = weakref.WeakSet()  # grad_scale set by fxgrad, not a GradScaler
_FOLDED_BY: weakref.WeakKeyDictionary[torch.optim.Optimizer, weakref.ref] = weakref.WeakKeyDictionary()


def check(optimizer: Any) -> None:
    """Refuse an optimizer no fold can ever apply to (``TypeError`` / ``ValueError``)."""
    validate.optimizer("optimizer", optimizer)
    if type(optimizer) not in FUSED:
        inner = getattr(optimizer, "optimizer", None)  # a framework's wrapper: Lightning Fabric's, accelerate's
        hint = (
            f"; it wraps torch.optim.{type(inner).__name__}: fold that one, fold(optimizer.optimizer)"
            if type(inner) in FUSED
            else "; step it without fold()"
        )
        raise ValueError(
            f"optimizer: fxgrad cannot fold into {type(optimizer).__name__}: only torch.optim.Adam, AdamW and SGD "
            f"(with fused=True) take the factor in their own update{hint}"
        )


def blocked(optimizer: torch.optim.Optimizer, scope: str, compiled: bool) -> str | None:
    """Why no factor of any policy can fold into ``optimizer`` now, or ``None``
    (``compiled``: backward graphs holding parameters exist already)."""
    if scope == "graph" and _compat.data_parallel_world_size() > 1:
        return (
            "in graph scope each rank's backward reads its own gradients, so each rank would have a factor of its "
            "own, and the update would apply it to the averaged gradients: the replicas would drift apart. The "
            "backward graph applies the factor (each rank's own, as graph scope under DDP does); step scope "
            "(scope='auto' or 'step') folds one factor for all ranks"
        )
    if scope == "graph" and compiled:
        return (
            "in graph scope, call fold() before the model's first forward: the backward graphs compiled "
            "so far apply the factor themselves"
        )
    if not _fused(optimizer):
        return (
            f"{type(optimizer).__name__} without fused=True has no grad_scale input: "
            f"{applies(scope)} the factor (pass fused=True to fold it)"
        )
    return None


def applies(scope: str) -> str:
    """What applies the policy's factors in ``scope`` when they do not fold."""
    return "the step program applies" if scope == "step" else "the backward graph applies"


def nothing_to_fold(transform: Transform | None) -> str | None:
    """Why ``transform``, which has no factors of its own per layer (:func:`per_layer`), leaves
    the update nothing to apply, or ``None``."""
    if transform is None or not any(leaf.folds == "global" for leaf in transform.leaves()):
        return "the policy changes no gradient (monitor, apply_to='update' rules): nothing to fold"
    return None


def not_factors(transform: Transform) -> str | None:
    """Why graph scope's backward cannot leave ``transform``'s changes of the gradients to the
    update as one factor per layer (:mod:`fxgrad.runtime.executor`, ``fold="layers"``), or
    ``None``: a leaf changes them otherwise (per element, ``sinkhorn``, ``clip_by_value``)."""
    others = [
        leaf
        for leaf in transform.leaves()
        if leaf.apply_to == "grad" and leaf.folds != "identity" and not isinstance(leaf, ScaleLeaf)
    ]
    if not others:
        return None
    return (
        f"{', '.join(map(repr, others))} change(s) gradients otherwise than by one factor per layer, which "
        "graph scope's backward leaves to the update (scope='step' runs any policy in the update's program)"
    )


def per_layer(transform: Transform | None) -> bool:
    """Whether ``transform`` scales some gradients by factors of their own (per layer, per
    element, or a global clip over the layers routed to it by ``by_type``/``by_name``): what
    ``grad_scale``, which scales every gradient, cannot carry, and the update in a program takes
    (:mod:`fxgrad.frontend.update_program`)."""
    if transform is None:
        return False
    leaves = transform.leaves()
    if any(leaf.folds is None and leaf.apply_to == "grad" for leaf in leaves):
        return True
    folding = [leaf for leaf in leaves if leaf.folds == "global"]
    return len([leaf for leaf in transform.unrouted_leaves() if leaf.folds == "global"]) < len(folding)


def _one_of(optimizer: torch.optim.Optimizer, classes: tuple[type, ...], elsewhere: set[str]) -> bool:
    """Whether ``optimizer`` is one of ``classes``, or of the classes named in ``elsewhere``."""
    return isinstance(optimizer, classes) or match.key_repr(type(optimizer)) in elsewhere


def coupled_decay(optimizer: torch.optim.Optimizer) -> set[int]:
    """The ids of the parameters whose update adds ``weight_decay * w`` to the gradient before
    it normalizes it (:data:`COUPLED_DECAY`): a gradient factor changes the decay's share there."""
    if not _one_of(optimizer, COUPLED_DECAY, COUPLED_DECAY_ELSEWHERE):
        return set()
    return {
        id(p)
        for group in optimizer.param_groups
        if group.get("weight_decay") and not group.get("decoupled_weight_decay")
        for p in group["params"]
    }


def cancelled(
    optimizer: torch.optim.Optimizer, transform: Transform | None, layers: Sequence[Layer], decayed: Collection[str]
) -> str | None:
    """A warning when ``optimizer``'s update divides out everything ``transform`` does to
    ``layers`` (those it steps; ``decayed``: the names of those with a parameter in
    :func:`coupled_decay`, where a factor acts), or, for a sign-only update (``Rprop``), what
    any of its gradient-scaling leaves does to them.

    A per-layer factor that holds across steps scales a layer's ``m`` and
    ``sqrt(v)`` alike, so Adam's ``m / sqrt(v)`` is unchanged: ``rescale(alpha=0,
    multipliers=...)`` moved an MLP's weights by 5e-7 under AdamW over 50 steps.
    """
    if transform is None:
        return None
    acting = [route for route in transform.routes(layers) if route.layers and route.leaf.folds != "identity"]
    if isinstance(optimizer, SIGN_ONLY):
        moot = list({id(r.leaf): r.leaf for r in acting if r.leaf.apply_to == "grad" and r.leaf.keeps_signs}.values())
        if not moot:
            return None
        movable = [leaf for leaf in moot if "apply_to" in {f.name for f in dataclasses.fields(leaf)}]
        fix = "Use another optimizer" + (
            f", or put the factors of {', '.join(map(repr, movable))} on the update (apply_to='update')"
            if movable
            else ""
        )
        return (
            f"fxgrad: {type(optimizer).__name__} moves each weight by the sign of its gradient alone, and these "
            f"rules only multiply gradient elements by factors > 0: {', '.join(map(repr, moot))}. The weights "
            f"move as without them. {fix}."
        )
    if not _one_of(optimizer, NORMALIZING, NORMALIZING_ELSEWHERE):
        return None
    on_grads = [route for route in acting if route.leaf.apply_to == "grad"]  # not those scaling the update
    factors = [(route.leaf.fixed_factor(layer), layer.name) for route in on_grads for layer in route.layers]
    if any(factor is None or (factor != 1 and name in decayed) for factor, name in factors):  # one acts
        return None
    if all(factor == 1 for factor, _ in factors):  # none on these layers
        return None
    leaves = list(dict.fromkeys(repr(route.leaf) for route in on_grads))
    one = len(leaves) == 1
    how = (
        "divides each matrix's momentum by its norm (before orthogonalizing it)"
        if isinstance(optimizer, torch.optim.Muon)
        else "divides the gradient by its running RMS"
    )
    return (
        f"fxgrad: {', '.join(leaves)} only multipl{'ies' if one else 'y'} each layer's gradient by a factor that is "
        f"the same on every step, and {type(optimizer).__name__}'s update {how}, so the factor cancels: the "
        f"weights move as without {'it' if one else 'them'} (up to its eps and float rounding). Put the factor on "
        "the update instead (apply_to='update': a per-layer learning-rate scale), or use SGD, where it acts."
    )


def claim(optimizer: torch.optim.Optimizer, backend: object) -> None:
    """Record that ``backend`` folds into ``optimizer``; ``ValueError`` if another backend does:
    its ``grad_scale`` holds one factor, which would multiply both backends' gradients."""
    owner = _FOLDED_BY.get(optimizer)
    if owner is not None and owner() is not None and owner() is not backend:
        raise ValueError(
            f"optimizer: this {type(optimizer).__name__} is folded into another fxgrad backend already, and its "
            "grad_scale holds one factor, which would multiply the gradients of both backends' models. Give "
            "each backend an optimizer of its own, or fold into one backend only"
        )
    _FOLDED_BY[optimizer] = weakref.ref(backend)


def step_fallback(optimizer: torch.optim.Optimizer, ours: frozenset[int]) -> str | None:
    """Why this step of a folded ``optimizer`` cannot carry the factor in ``grad_scale``
    (``ours``: the ids of the backend's models' parameters), or ``None``: parameter groups
    can change after :func:`fallback` approved the optimizer."""
    if not _fused(optimizer):
        return (
            "a parameter group without fused=True (added after fold(), or unset by load_state_dict of a "
            "checkpoint of an unfused optimizer) has no grad_scale input"
        )
    outside = sum(id(p) not in ours for group in optimizer.param_groups for p in group["params"])
    if outside:
        return (
            f"it also steps {outside} parameter(s) outside the models of this backend, whose gradients "
            "grad_scale would multiply by the factor too"
        )
    return None


def _fused(optimizer: torch.optim.Optimizer) -> bool:
    """Whether every parameter group steps with the fused update, the one that reads ``grad_scale``."""
    return all(group.get("fused") for group in optimizer.param_groups)


def give(optimizer: torch.optim.Optimizer, inverse: torch.Tensor) -> None:
    """Make the fused update multiply the gradients by the factor whose ``inverse`` (a float32
    device tensor) it is given; no sync.

    Within ``GradScaler.step`` (it calls ``optimizer.step()``, whose pre-hook calls this),
    ``grad_scale`` is the loss scale, which the factor divides, or ``None`` after
    ``scaler.unscale_(optimizer)``; the scaler deletes it after the step."""
    if optimizer in _SET_HERE or not hasattr(optimizer, "grad_scale"):
        optimizer.grad_scale = inverse
        _SET_HERE.add(optimizer)
    else:
        scale = optimizer.grad_scale
        optimizer.grad_scale = inverse if scale is None else scale * inverse


def scaled_by_a_scaler(optimizer: torch.optim.Optimizer) -> bool:
    """Whether a ``GradScaler`` is stepping ``optimizer`` on gradients it left scaled: it hands a
    fused optimizer its scale as ``grad_scale`` instead of unscaling them first."""
    return getattr(optimizer, "grad_scale", None) is not None and optimizer not in _SET_HERE


def after_step(optimizer: torch.optim.Optimizer) -> None:
    """Drop the ``grad_scale`` fxgrad set (a ``GradScaler`` drops its own)."""
    if optimizer in _SET_HERE:
        _SET_HERE.discard(optimizer)
        del optimizer.grad_scale


class Folds:
    """The optimizers one backend folds into, and the factors each update has applied.

    ``left()`` counts the factors the policy has left to folded updates so far (one per
    backward through the graphs in graph scope, one per run of the policy in step scope);
    ``alone(optimizer)``, in graph scope, whether the gradients ``optimizer`` steps are the
    latest backward's alone (``zero_grad()`` dropped the earlier ones' with their factors);
    ``factor()`` is the latest (the statistic ``folded_factor``, a device tensor); ``ours()``
    the ids of the parameters of the backend's models; ``in_graph()`` whether the policy runs
    in the backward graphs now::

        folds = Folds(transform, left, alone, factor, ours, in_graph)
        folds.add(optimizer)                    # once check(), claim() and fallback() allow it
        factors = folds.check_step(optimizer)   # before each update; raises on one it cannot fold
        if factors is not None:
            folds.give_factor(optimizer, factors)  # grad_scale carries the factor
    """

    def __init__(
        self,
        transform: Transform | None,
        left: Callable[[], int],
        alone: Callable[[torch.optim.Optimizer], bool],
        factor: Callable[[], torch.Tensor],
        ours: Callable[[], frozenset[int]],
        in_graph: Callable[[], bool],
    ) -> None:
        self.transform = transform
        self._left, self._alone, self._factor = left, alone, factor
        self._ours, self._in_graph = ours, in_graph
        # per folded optimizer: the count of factors left as of its last step (see left) ...
        self._counts: weakref.WeakKeyDictionary[torch.optim.Optimizer, int] = weakref.WeakKeyDictionary()
        # ... and as of the last update that applied a factor (after the step: see as_applied)
        self._applied: weakref.WeakKeyDictionary[torch.optim.Optimizer, int] = weakref.WeakKeyDictionary()
        # its param groups' parameters as last checked, why grad_scale cannot carry the factor then (None:
        # it can), and the ids of the backend's parameters then
        self._checks: weakref.WeakKeyDictionary[torch.optim.Optimizer, tuple] = weakref.WeakKeyDictionary()
        self._given: weakref.WeakSet[torch.optim.Optimizer] = weakref.WeakSet()  # this step, by the policy
        self._told_scaling: weakref.WeakSet[torch.optim.Optimizer] = weakref.WeakSet()
        self._told_unreached: weakref.WeakSet[torch.optim.Optimizer] = weakref.WeakSet()
        self._inverses: dict[torch.device, torch.Tensor] = {}  # the factor's inverse, kept per device
        self._graphs_leave_it = False  # see graphs_leave_factor

    def __bool__(self) -> bool:
        return bool(self._counts)

    @property
    def graphs_leave_factor(self) -> bool:
        """Graph scope: whether the backward graphs leave the factor to folded updates. It holds
        from the first fold on, for good: graphs compiled then keep leaving it when the folded
        optimizer is gone (replaced by a new one, which must be folded again)."""
        return self._graphs_leave_it

    def behind(self, count: int) -> bool:
        """Whether a folded optimizer has not stepped since ``count`` factors were left."""
        return any(last < count for last in self._counts.values())

    def optimizers(self) -> list[torch.optim.Optimizer]:
        """The folded optimizers (while they live)."""
        return list(self._counts)

    def add(self, optimizer: torch.optim.Optimizer) -> None:
        """Fold into ``optimizer`` from its next step on (again: a no-op)."""
        if optimizer not in self._counts:
            self._graphs_leave_it = self._graphs_leave_it or self._in_graph()
            self._counts[optimizer] = self._applied[optimizer] = self._left()
            hook_step(optimizer, self._stepping, self._stepped)  # after the global hooks that give the factor

    def as_applied(
        self,
        params: dict[str, torch.nn.Parameter],
        factor_of: Callable[[torch.nn.Parameter], torch.Tensor | None] | None = None,
    ) -> dict[str, torch.Tensor]:
        """Each of ``params``' ``.grad`` as its optimizer's update applies it (no sync): times the
        latest factor for the parameters of folded optimizers whose update has not applied it
        yet (their ``.grad`` still lacks it), as it is for the others. ``factor_of(parameter)``:
        its layer's factor where the backward left one per layer (``None``: none)."""
        count = self._left()
        owed = {
            id(p) for opt, last in self._applied.items() if count > last for g in opt.param_groups for p in g["params"]
        }
        if factor_of is None:
            factor = self._factor() if owed else None
            factor_of = lambda p: factor  # noqa: E731
        out = {}
        for name, p in params.items():
            factor = factor_of(p) if id(p) in owed else None
            out[name] = p.grad if factor is None else norm_math.scaled([p.grad], factor)[0]
        return out

    def check_step(self, optimizer: torch.optim.Optimizer) -> int | None:
        """Before ``optimizer``'s update: how many factors the policy left since its last step
        (``None``: it is not folded). Raises ``ValueError`` for an update that would apply the
        gradients without the factor, or with one that does not describe them."""
        if optimizer not in self._counts:
            if self._counts or (self._graphs_leave_it and self._in_graph()):
                self._check_unfolded(optimizer)
            return None
        count = self._left()
        factors, self._counts[optimizer] = count - self._counts[optimizer], count
        if self._in_graph() and factors > 1 and not self._alone(optimizer):
            raise ValueError(
                f"fold in graph scope: {factors} backward passes through the compiled graphs since the last "
                "step, and .grad does not hold the latest one's gradients alone (accumulated micro-batches, "
                "a graph break, a model called twice in one loss (a GAN's discriminator on the real and the "
                "fake batch: call it once, on torch.cat([real, fake])), retain_graph, an adversarial "
                "attack's torch.autograd.grad after the backward, a step skipped without zero_grad() or "
                "with zero_grad(set_to_none=False), a GAN's generator step backpropagating through the "
                "discriminator: freeze it for that step, requires_grad_(False), or one backend folded into "
                "the optimizers of two models: give each model a backend of its own): each left its own "
                "factors, which the update cannot apply to their sum. Use fxgrad.backend(..., scope='step'), "
                "which applies the factors of the whole step's gradient, or do not fold."
            )
        return factors

    def give_factor(self, optimizer: torch.optim.Optimizer, factors: int) -> None:
        """Hand the policy's factor to ``optimizer``'s update (``factors``: :meth:`check_step`'s;
        none: a second step on the same gradients, which the last update multiplied). When its
        parameter groups changed since :meth:`add` so that ``grad_scale`` cannot carry the factor,
        multiply the gradients of the backend's parameters it steps instead (warned once)."""
        self._given.add(optimizer)
        if not factors:
            return
        # the groups' parameters, and whether each is fused (load_state_dict of a plain AdamW's checkpoint unsets it)
        shape = group_ids(optimizer), tuple(bool(group.get("fused")) for group in optimizer.param_groups)
        checked = self._checks.get(optimizer)
        if checked is None or checked[0] != shape:
            ours = self._ours()
            checked = self._checks[optimizer] = shape, step_fallback(optimizer, ours), ours
        if checked[1] is None:
            factor = self._factor()
            out = self._inverses.get(factor.device)
            if out is None:
                out = self._inverses[factor.device] = torch.empty((), dtype=torch.float32, device=factor.device)
            # 1 / the float64 factor into grad_scale's float32, rounded once: one op, into a kept tensor
            give(optimizer, torch.reciprocal(factor, out=out))
            return
        ours = checked[2]
        warn_once(
            self._told_scaling,
            optimizer,
            f"fxgrad: fold({type(optimizer).__name__}): {checked[1]}: while it does, the factor "
            "multiplies the gradients of the backend's models in a pass of its own",
            RuntimeWarning,
        )
        grads = [
            p.grad for group in optimizer.param_groups for p in group["params"] if id(p) in ours and p.grad is not None
        ]
        if grads:
            _compat.foreach_mul_(grads, self._factor())

    def _stepping(self, optimizer: torch.optim.Optimizer) -> None:
        """A folded optimizer steps: say once if the policy gave it no factor (a silent no-op)."""
        if optimizer in self._given:
            self._given.discard(optimizer)
            return
        if optimizer in self._told_unreached:
            return
        if all(p.grad is None for group in optimizer.param_groups for p in group["params"]):
            return  # no backward since zero_grad: nothing for the policy to act on
        self._told_unreached.add(optimizer)
        warn(
            f"fxgrad: fold({type(optimizer).__name__}): optimizer.step() ran and the policy {self.transform!r} "
            "did not: no model this backend compiled or stepped has parameters in this optimizer. Compile the "
            "model with the backend (backend.compile(model), torch.compile(model, backend=backend)), or call "
            "backend.step(model) before optimizer.step().",
            CoverageWarning,
        )

    def _stepped(self, optimizer: torch.optim.Optimizer, args: tuple, kwargs: dict) -> None:
        """A folded optimizer stepped: its update applied the factors left so far, and wrote the
        product back to ``.grad``; drop the ``grad_scale`` fxgrad set."""
        self._applied[optimizer] = self._counts[optimizer]
        after_step(optimizer)

    def _check_unfolded(self, optimizer: torch.optim.Optimizer) -> None:
        """Refuse the step of an optimizer that is not folded while another is: it would apply the
        gradients of the backend's models without the factors the policy left to the folded
        updates (two optimizers over one model, one of them folded)."""
        ours = self._ours()
        stepped = [p for group in optimizer.param_groups for p in group["params"] if id(p) in ours]
        if not any(p.grad is not None for p in stepped):
            return
        name = type(optimizer).__name__
        if not self._counts:  # graph scope, the folded optimizer gone
            raise ValueError(
                f"fold: {name} steps parameters of the models of this backend and is not folded, and the backward "
                f"graphs were compiled folded: they leave the factors of {self.transform!r} to the update, "
                "so this one would apply unscaled gradients. An optimizer that replaces a folded one (a resume "
                "with load_state_dict) must be folded too: backend.fold(optimizer)."
            )
        raise ValueError(
            f"fold: {name} steps parameters of the models of this backend, and is not folded (not given to "
            "fold(), or fold() fell back for it, with a RuntimeWarning saying why) while "
            f"{len(self._counts)} other optimizer(s) are: the policy {self.transform!r} left its factors "
            "to the folded updates, so this one would apply unscaled gradients. Fold every optimizer that steps "
            "the model (backend.fold(optimizer) for each, of a kind it folds into), or none; an optimizer that "
            "wraps a folded one "
            "(Lookahead, ZeroRedundancyOptimizer) cannot be folded itself: do not fold the one inside it."
        )
