"""The ``torch.compile`` backend that rewrites backward graphs.

    >>> import torch, fxgrad
    >>> model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.LayerNorm(4))
    >>> backend = fxgrad.backend(fxgrad.clip_by_global_norm(1.0), compiler="aot_eager")
    >>> compiled = backend.compile(model)          # or torch.compile(model, backend=backend)
    >>> compiled(torch.randn(2, 4)).sum().backward()
    >>> [graph.routes[0].label for graph in backend.graphs]
    ['clip_by_global_norm(max_norm=1.0) on [0, 1]']

For every graph Dynamo hands it, the backend records which inputs are which
parameters, then compiles with Inductor (or AOTAutograd's eager runner). When
AOTAutograd builds the backward graph, fxgrad plans the policy over that
graph's layers, checks coverage, and records the rules into the graph before
Inductor lowers and fuses it.
"""

from __future__ import annotations

import contextlib
import functools
import weakref
from typing import Any, Iterable, Literal, Mapping

import torch
import torch.fx
import torch.nn as nn
from torch.distributed.tensor import DTensor
from torch.utils.weak import WeakIdKeyDictionary

from fxgrad import _compat, passes
from fxgrad.core import match, validate
from fxgrad.core.layers import DEFAULT_SKIP, Layer, Owner, SkipEntry, validate_skip
from fxgrad.core.rule import Transform, check_transform, listed
from fxgrad.core.warn import warn
from fxgrad.frontend import fold as folding
from fxgrad.frontend import update_program
from fxgrad.frontend.coverage import (
    CoverageCheck,
    CoverageError,
    CoverageWarning,
    frozen_named,
    fsdp2_sharded,
    model_layers,
    policy_misses,
    refuse_flat_parameters,
    refuse_fsdp2_in_graph_scope,
)
from fxgrad.frontend.graphs import GraphRegistry
from fxgrad.frontend.outside_uses import OutsideUses
from fxgrad.frontend.plan import GraphPlan, acted_on, misrouted, plan_graph
from fxgrad.frontend.rewrite import rewrite_backward
from fxgrad.frontend.step_check import (
    LOOSE,
    TRAINER_CLIPS,
    ModelsApart,
    StepCheck,
    group_ids,
    hand_over,
    policed_elsewhere,
    remove_optimizer_hooks,
    report_outside,
    stepped_ids,
    superseded,
    trainer_clip,
)
from fxgrad.frontend.step_program import StepPrograms
from fxgrad.frontend.step_scope import (
    PolicyRuns,
    StepScope,
    apply_to_grads,
    models_owners,
    owners_layers,
    step_routes,
)
from fxgrad.frontend.update_factors import UpdateFactors
from fxgrad.frontend.update_program import UpdateFolds
from fxgrad.frontend.warm_start import StandIn
from fxgrad.frontend.watch import ForwardWatch, GradWrites, OncePerPass, WatchedCall, track_wrapper
from fxgrad.passes.capture import CapturedGraph, Root, capture, live_root
from fxgrad.passes.graphtext import normalize_code, render_inserted
from fxgrad.passes.record import gc_paused
from fxgrad.runtime import norm_math
from fxgrad.runtime.context import Fold
from fxgrad.runtime.executor import FOLDED
from fxgrad.runtime.state import StateStore, group_label

SCOPE_CHANGED = (
    "fxgrad: this backward graph applies the policy itself: scope='auto' compiled it in graph scope, before "
    "torch.distributed was initialized. Now scope='auto' is step scope and also runs the policy at "
    "optimizer.step(), so it would apply twice. Compile and run the model after init_process_group, call "
    "torch.compiler.reset() once it is initialized, or pass scope='step' to fxgrad.backend()"
)

SCALED_FUSED = (
    "fxgrad: a GradScaler steps this fused {optimizer} on gradients it left scaled (a fused optimizer "
    "unscales in its own update), and the policy {transform!r} read them as they are: its norms are the "
    "loss scale times too large. Build the backend with fxgrad.backend(..., scaler=scaler), which reads "
    "the scale on the device."
)

SCALED_IN_GRAPH = (
    "fxgrad: a GradScaler steps this {optimizer}, and the backend was built without scaler=: in graph scope "
    "the backward graph ran the policy {transform!r} on the gradients the scaler had scaled, so its norms "
    "were the loss scale times too large. Build the backend with fxgrad.backend(..., scaler=scaler), which "
    "reads the scale on the device, or use scope='step', which runs after scaler.unscale_()."
)

TWO_SCALES = (
    "fxgrad: at {optimizer}'s first step the policy {transform!r} runs once over the whole model, and a "
    "GradScaler has unscaled {unscaled}, not {scaled}: the policy would read gradients of two scales. If "
    "another optimizer steps them, call scaler.unscale_(o) for every optimizer before the first "
    "scaler.step(), as clip_grad_norm_ over the model needs too; if none does, freeze them "
    "(requires_grad_(False)) (docs/distributed.md, At optimizer.step())"
)

READ_STEPPED = (
    "fxgrad: at {optimizer}'s first step the policy {transform!r}, which reduces over layers, runs over the "
    "whole model and would read {count} gradient(s) of parameters that another optimizer stepped since the "
    "GradScaler's last update() (a GAN's discriminator held in one module with its generator, whose "
    "backward wrote them since), which clip_grad_norm_ over the parameters {optimizer} steps would not. "
    "Compile the networks as models of their own (docs/distributed.md, At optimizer.step())"
)

DTENSOR_IN_GRAPH = (
    "The parameters are DTensors (tensor parallelism), and the backward returns their inner tensors: "
    "scope='graph' cannot place their gradients. Use fxgrad.backend(..., scope='step') (the default, "
    "scope='auto', in a multi-process job), which applies the policy to the DTensor gradients at "
    "optimizer.step() (docs/distributed.md, Tensor parallelism)"
)

MID_BACKWARD = (
    "fxgrad: {optimizer}.step() ran inside a backward pass and steps part of the model ({how}), where step "
    "scope's policy {transform!r} may read the gradients written so far alone: each parameter's step would apply "
    "it to its own gradient (a global clip by that gradient's norm, stateful rules one step per parameter). "
    "{remedy} (docs/distributed.md, An optimizer in the backward)"
)
MID_BACKWARD_HOOK = "an optimizer in the backward, stepped from each parameter's gradient hook"
MID_BACKWARD_CALLBACK = (
    "from the pass's final callback, which fxgrad cannot tell from a step of one part in a job of several "
    "processes or under FSDP2: DDP and FSDP2 step a part from their own final callbacks"
)
MID_BACKWARD_REMEDY = (
    "Compile the model with scope='graph', where the backward graph applies the policy before the hooks see the "
    "gradients, or step after backward()"
)
MID_BACKWARD_SHARDED = (
    "Step after backward(): {model} is sharded with FSDP2's fully_shard ({where}), which runs each parameter's "
    "hooks from the pass's final callback and which graph scope cannot police"
)

EMPTY_LOAD = (
    "(the state given was empty). backend.state_dict() has no entries until the policy first runs (at the "
    "first backward in graph scope, the first optimizer.step() in step scope), and "
    "torch.distributed.checkpoint.load fills only the keys of the state dict it is given: a template "
    "taken before then loads nothing. Save and load the backend's state with torch.save, or take the "
    "template after the first step (docs/transforms.md, Checkpoints)."
)

COMPILERS = {"inductor": _compat.inductor_compile, "aot_eager": _compat.aot_eager_compile}
SCOPES = ("auto", "graph", "step")


def _in_a_hook() -> bool:
    """Whether an autograd node's hook runs now (compiled autograd calls them from its graph),
    rather than a backward pass's final callback or code outside a pass."""
    return _compat.running_autograd_node() is not None or _compat.compiled_autograd_running()


class Backend:
    """A ``torch.compile`` backend applying a gradient policy inside the backward graph.

    Build it with :func:`fxgrad.backend`. ``graphs`` lists every graph compiled
    so far; ``stats()`` and ``state_dict()`` expose its device-side state.
    """

    def __init__(
        self,
        transform: Transform | None = None,
        *,
        skip: Iterable[SkipEntry] = DEFAULT_SKIP,
        compiler: str = "inductor",
        strict: bool = True,
        keep_code: bool = False,
        scaler: Any = None,
        scope: str = "auto",
    ) -> None:
        check_transform("transform", transform, optional=True)
        validate.choice("scope", scope, SCOPES)
        validate.choice("compiler", compiler, tuple(COMPILERS))
        for name, flag in (("strict", strict), ("keep_code", keep_code)):
            if not isinstance(flag, bool):
                raise TypeError(f"{name} must be a bool, got {flag!r}")
        leaves = transform.leaves() if transform is not None else []
        for position, leaf in enumerate(leaves):
            leaf.check_followers(leaves[position + 1 :])
        self.transform = transform
        self.skip: tuple[SkipEntry, ...] = validate_skip(skip)
        self.compiler = compiler
        self.strict = strict
        self.keep_code = keep_code
        self.scaler = _check_scaler(scaler, transform)
        self.scope = scope
        self.store = StateStore(lambda: self.current_scope() == "graph", self._idle_pass)
        self._idle_asked, self._pass_idle = OncePerPass(), False  # see _idle_pass
        self.registry = GraphRegistry()
        self._models: list[weakref.ref] = []  # models handed to torch.compile with it, or to step()
        self._graph_runs = 0  # calls of compiled forwards
        self._training_runs = 0  # ... of those that train parameters (a layer's graph, not a ReLU's or a frozen one's)
        self._grad_mode_runs = 0  # ... of those compiled in grad mode (not an evaluation under no_grad)
        self._backwards = 0  # backward passes through its graphs
        # graph scope, folded: the latest backward pass through them (see _note_pass)
        self._last_pass: tuple[int | None, int, bool, frozenset[int]] = (None, 0, False, frozenset())
        self._watched: weakref.WeakSet[nn.Module] = weakref.WeakSet()  # models compile() watches per forward
        # Gradients summed over backward passes or forwards in graph scope (a parameter per graph
        # call, or per model that compile() watches), each with the warning the next step of an
        # optimizer that steps it gives; and the probes' writes, on the plain path.
        self._summed: WeakIdKeyDictionary = WeakIdKeyDictionary()
        self._writes = GradWrites(self._note_summed)
        in_graph = transform is not None and scope != "step"
        self._coverage = CoverageCheck(transform, self.skip, strict) if in_graph else None
        self._step_check = None  # the optimizer.step() check of the plain torch.compile path
        if self._coverage is not None:
            self._step_check = StepCheck(
                self,
                self.registry,
                self._coverage,
                lambda: [model for model, _ in self._step_models()],
                self._watched,
                lambda: self._backwards,
                lambda: self.current_scope() == "graph",
                self._idle,
                self._before_update,
            )
        # graph scope: gradients changed after the backward returned them (a policy that changes some)
        self._outside = OutsideUses() if in_graph and transform.changes_gradients() else None
        self._step = None  # runs the policy on .grad in step scope
        self._nesting: tuple[list[weakref.ref], list[int]] = ([], [])  # see _step_models
        self._policy_runs = PolicyRuns()  # ... and tells when a loop never lets it run
        self._programs = StepPrograms(compiler, keep_code)  # ... as compiled programs, by gradient layout
        self._step_runs = 0  # runs of the policy in step scope
        self._told_mid_backward = False  # see _refuse_mid_backward
        self._folds = folding.Folds(  # see fold()
            transform,
            self._factors_left,
            self._holds_last_pass_alone,
            lambda: self.store.stat(FOLDED),
            self._our_ids,
            lambda: self.current_scope() == "graph",
        )
        self._updates = UpdateFolds()  # optimizers whose update the step program runs (see fold())
        self._per_layer = folding.per_layer(transform)  # its factors fold into a program's update only
        # graph scope, folded into a program's update: the parameters the graphs hold that an optimizer
        # steps (by the graphs' generation and its groups), and, by which have a gradient, those
        # with one, the statistics of their factors, their routes and the factors' offsets (see _apply_left)
        self._left_owners: tuple[tuple, list[Owner], dict[tuple, tuple]] = ((), [], {})
        self._held: tuple[int, dict[int, Owner]] = (-1, {})  # see _held_owners
        self._first_step_seen: weakref.WeakSet[torch.optim.Optimizer] = weakref.WeakSet()
        self._apart = ModelsApart()  # ... of optimizers that step different models of this backend
        self._told_scaled: weakref.WeakSet[torch.optim.Optimizer] = weakref.WeakSet()
        self._met: weakref.WeakSet[nn.Module] = weakref.WeakSet()  # models checked by _meet
        self._tracked: weakref.WeakSet[nn.Module] = weakref.WeakSet()  # see _track
        self._models_died = False  # ... and one of them died since
        self._loose = False  # a graph holds parameters of no model (see _idle)
        # load_state_dict() ran, and no optimizer step has checked what it placed: False, or what it got
        self._loaded: Literal[False, "state", "empty"] = False
        if transform is not None:
            in_step = lambda: self.current_scope() == "step"  # noqa: E731
            self._step = StepScope(
                self._step_models,
                self._apply_to_grads,
                self.scaler,
                self._before_update,
                in_step,
                self._drop_kept,
                lambda: self._grad_mode_runs,
            )
            if scope == "step":
                self._step.arm()
        on_update = any(leaf.apply_to == "update" for leaf in leaves)
        self._update_factors = UpdateFactors(self.store, self._step_models) if on_update else None

    def __copy__(self) -> Backend:
        return self

    def __deepcopy__(self, memo: dict) -> Backend:
        """The backend itself: ``copy.deepcopy(compiled_model)`` (an EMA copy, say) gives a model
        compiled with the same backend, as ``torch.compile(copy, backend=backend)`` would."""
        return self

    def __reduce__(self) -> Any:
        raise TypeError(
            "an fxgrad backend cannot be pickled, nor a model compiled with it (torch.save(compiled_model)): it "
            "holds hooks on live optimizers and models. Save model.state_dict() (or the model before "
            "compiling) and backend.state_dict(), and compile again after loading."
        )

    def current_scope(self) -> str:
        """``"graph"`` or ``"step"``: what ``scope="auto"`` resolves to in this process."""
        if self.scope != "auto":
            return self.scope
        return "step" if _compat.data_parallel_world_size() > 1 else "graph"

    @property
    def graphs(self) -> list[CapturedGraph]:
        """Every graph compiled so far (with its code if ``keep_code``)."""
        return self.registry.graphs

    def __repr__(self) -> str:
        """The call that builds it, but for the scaler (shown as ``<GradScaler>``)."""
        entries = ", ".join(map(match.key_repr, self.skip)) + ("," if len(self.skip) == 1 else "")
        skip = "" if self.skip == DEFAULT_SKIP else f", skip=({entries})"
        strict = "" if self.strict else ", strict=False"
        keep_code = ", keep_code=True" if self.keep_code else ""
        scaler = "" if self.scaler is None else f", scaler=<{type(self.scaler).__name__}>"
        scope = "" if self.scope == "auto" else f", scope={self.scope!r}"
        return f"fxgrad.backend({self.transform!r}{skip}, compiler={self.compiler!r}{strict}{keep_code}{scaler}{scope})"

    # ------------------------------------------------------------ compiling

    def __call__(
        self, gm: torch.fx.GraphModule, example_inputs: list, mode: str | None = None, options: dict | None = None
    ) -> Any:
        """Compile one Dynamo graph; ``mode`` and ``options`` are ``torch.compile``'s, for Inductor."""
        try:
            return self._compile(gm, example_inputs, mode, options)
        except Exception as error:
            if self._coverage is not None:  # under suppress_errors Dynamo runs the frame eagerly: a likely cause
                self._coverage.compile_error = f"{type(error).__name__}: {(str(error).splitlines() or [''])[0]}"
            raise

    def _compile(self, gm: torch.fx.GraphModule, example_inputs: list, mode: str | None, options: dict | None) -> Any:
        patches = _compat.inductor_config_patches(mode, options)
        graph = capture(gm, example_inputs, self.registry.roots)
        self.registry.add(graph)
        for key in graph.roots():
            self._track(graph.root_refs[key]())
        self._loose = self._loose or any(p.root is None for p in graph.params)
        if graph.renamed_roots and self._coverage is not None:
            self._coverage.warn(
                f"fxgrad: a graph's outermost module shares layer names with a module this backend met "
                f"before, so its layers are named {', '.join(graph.renamed_roots)}.<layer> (by_name patterns "
                "will not match them). Either a second model with the same names trains with this backend "
                "(a copy made with copy.deepcopy, a GAN's second network): give it a backend of its own if "
                "its layers need their names. Or a graph break inside a submodule's forward made Dynamo "
                "compile that forward alone: compile the model itself, torch.compile(model, backend=backend), "
                "so fxgrad knows its names."
            )
        # Backward passes are counted for the optimizer.step() check of models compile() does not
        # watch per forward (the plain torch.compile path), not on every call of every graph, and
        # not for a graph that computes no gradient (an EMA copy's).
        unwatched = self._step_check is not None and graph.trains and self._step_check.unwatched(graph)
        # A folded graph leaves its factor to the optimizer: .grad may hold one backward's, no more (see fold()).
        # Not one that trains nothing (a frozen discriminator's, in a GAN's generator step): it leaves none.
        folded = self._folds.graphs_leave_factor and self.current_scope() == "graph"
        step_scope = self.current_scope() == "step"
        count_backwards = unwatched or (folded and graph.trains)
        # what the backward leaves to the update: one global factor, or each layer's
        fold: Fold = ("layers" if self._per_layer else "global") if folded else None
        # Step scope: backwards are watched until the policy first runs, to see a loop that never runs it.
        watch_steps = step_scope and self._step is not None and bool(graph.params)
        if self._step_check is not None:
            self._step_check.arm()
        if step_scope and self._step is not None:
            self._step.arm()  # the policy runs on .grad at optimizer.step(); the backward is left alone
        # Left alone, the backward is a plain compile, which AOTAutograd's on-disk cache may serve. A
        # rewritten one may use that cache only under a key that holds the policy (warm_start), and
        # keep_code's record needs the rewrite to run, so it never does.
        plain = step_scope and not self.keep_code
        stand_in = None
        if not step_scope and graph.trains and self._keyed_cache():
            stand_in = StandIn.record(graph, example_inputs, functools.partial(self._rewrite_backward, graph, fold))
        if stand_in is not None:
            patches = _compat.cache_keyed(patches, stand_in.key(f"{self!r} scaler={self.scaler is not None}"))
        rewrite = functools.partial(self._rewrite_backward, graph, fold, stand_in=stand_in)
        with contextlib.nullcontext() if plain or stand_in is not None else _compat.autograd_cache_bypassed():
            try:
                compiled = COMPILERS[self.compiler](gm, example_inputs, rewrite, patches)
            except BaseException:
                # Dynamo answers with a graph break and runs the code eagerly: no graph holds these parameters
                self.registry.discard(graph)
                raise

        @functools.wraps(compiled)
        def run(*args: Any) -> Any:
            if graph.params and _compat.is_fake(args[graph.params[0].index]):
                return compiled(*args)  # Dynamo's DDP optimizer runs each bucket's graph on fake values once
            # Checked per call, not at compile: Dynamo would wrap the error in
            # BackendCompilerFailed, and the graph stays usable once it is off.
            scope = self.current_scope()
            if self._coverage is not None and scope == "graph":
                self._coverage.compiled_autograd()
            if not step_scope and graph.params and scope == "step":
                raise CoverageError(SCOPE_CHANGED)
            self._graph_runs += 1
            # lets compile() see forwards whose trained layers all ran eagerly (functional_call's tensors
            # stand in for parameters)
            self._training_runs += bool(graph.trains or graph.stand_ins)
            self._grad_mode_runs += graph.grad_mode  # new gradients may follow (step scope's check)
            graph.last_run = self._graph_runs  # which graphs ran in one forward (registry.parts_of_same_forward)
            if graph.params and not graph.bound_to(args):
                self._rebind(graph, args)
            outputs = compiled(*args)
            if not step_scope and graph.reads_weights is not False and graph.params and torch.is_grad_enabled():
                self._bind_before_backward(graph, args, outputs)
            if scope == "graph" and self._outside is not None and self._outside.watching and torch.is_grad_enabled():
                self._outside.watch(outputs)
            if (count_backwards or (watch_steps and self._policy_runs.watching)) and torch.is_grad_enabled():
                # This call's parameters: a graph reused for another module is rebound on each call.
                probe = next((t for p in graph.params if (t := args[p.index]).requires_grad), None)
                reached = functools.partial(self._backward_ran, graph, probe, unwatched, OncePerPass())
                for node in {t.grad_fn for t in outputs if isinstance(t, torch.Tensor) and t.grad_fn is not None}:
                    node.register_prehook(reached)
            return outputs

        graph.compiled = weakref.ref(run)
        return run

    def _rebind(self, graph: CapturedGraph, args: tuple) -> None:
        """Dynamo runs ``graph`` with parameters other than those it was compiled for.

        Weight reads follow the new ones. Parameters replaced in their modules
        (``load_state_dict(assign=True)``) need nothing else; another module
        running the graph shares the first one's per-layer state.
        """
        self.registry.rebound()
        before = graph.params  # rebind replaces the list
        replaced = graph.rebind(args)
        if self._coverage is not None and self.current_scope() == "graph" and self._tied(graph):
            return  # reported: the checks of another module running the graph would misread its slots
        if replaced or self._coverage is None or self.current_scope() == "step" or not graph.roots():
            # step scope: the graph is a plain one, and the policy's state is per layer of the model; no model it
            # was compiled for lives: the graph is the next one's (a trial's on a backbone that outlives it)
            return
        # a module not seen running it yet (by its first and last parameters: a weight every block takes can be either)
        if not (graph.reuses(args[graph.params[0].index]) and graph.reuses(args[graph.params[-1].index])):
            if self.registry.holds_as_compiled(graph, args):
                return  # the model's own layers, a module of it replaced by a new one (model.net[3] = nn.Linear(...))
            self.registry.note_reuse(graph, [p.tensor() for p in before] + [args[p.index] for p in graph.params])
            self._check_reuse(graph, before, args)
        self._coverage.warn(
            f"fxgrad: Dynamo reuses the graph compiled for layer {graph.params[0].layer!r} with the parameters "
            "of another module (a graph break inside a repeated block's forward, or a second model of the "
            "same class). The gradients are transformed and weight reads follow the module that runs, but "
            "per-layer state and statistics (monitor, rescale's EMA target, weight_norm_drift) are those of "
            "the first module's layers, and a state over all layers (zclip's, autoclip's, adagc's) is one for "
            "both. Remove the graph break, give each model its own "
            "fxgrad.backend(...), or use scope='step'."
        )

    def _tied(self, graph: CapturedGraph) -> bool:
        """Report slots of ``graph`` that now take one trained parameter, and say whether any do:
        weights tied after the graph was compiled (Dynamo compiles one input for a parameter two
        modules hold, and runs a graph compiled before without a new compile)."""
        if not graph.trains:  # an evaluation's graph, or a frozen model's: no gradient to transform
            return False
        slots: dict[int, list[str]] = {}
        for slot in graph.params:
            tensor = slot.tensor()
            if tensor is not None and tensor.requires_grad:
                slots.setdefault(id(tensor), []).append(slot.name)
        tied = [names for names in slots.values() if len(names) > 1]
        if tied:
            self._coverage.report(
                f"fxgrad: a compiled graph takes one parameter in several inputs: "
                f"{'; '.join(' and '.join(names) for names in tied)} are one parameter, and the graph was "
                "compiled with an input for each (weights tied after it was compiled, model.head.weight = "
                "model.embed.weight, or a model tied from the start running the graph of an untied model of "
                "its class); Dynamo runs it without compiling it again. The backward transforms each "
                "input's part of the gradient as a layer of its own before "
                f"autograd sums them, so {self.transform!r} never sees the tied weight's gradient. Tie the "
                "weights before the first forward, or call torch._dynamo.reset() and compile the model again; "
                "scope='step' is exact either way.",
                fatal=True,
            )
        return bool(tied)

    def _check_reuse(self, graph: CapturedGraph, before: list, args: tuple) -> None:
        """Another module runs ``graph`` (``before``: the slots of the call before, ``args`` this call's
        inputs): report the layers the policy would transform wrongly so, and why."""
        order = self.registry.forward_order()
        # a parameter every call takes (a module all the blocks of one model use): each call's backward gets
        # a part of its gradient, which the policy transforms apart, and autograd sums the parts
        both = set()
        if self.registry.same_model(graph, [args[p.index] for p in before if p.tensor() is not args[p.index]]):
            both = {p.layer for p in before if p.tensor() is args[p.index] and args[p.index].requires_grad}
            both &= acted_on(self.transform, graph, order, self.skip)
        if both:
            self._coverage.report(
                f"fxgrad: Dynamo runs the graph compiled for layer {graph.params[0].layer!r} once per module that "
                f"uses it in a forward, and each call takes the parameters of {listed(sorted(both), 5)} (a module "
                "every block uses, as DeBERTa's relative position embeddings): each call's backward transforms "
                f"its own part of their gradient and autograd sums the parts, so {self.transform!r} sees none of "
                "those layers' whole gradient. Use fxgrad.backend(..., scope='step'), or remove the graph break.",
                fatal=True,
            )
        names = [graph.reused.get(id(args[p.index]), (None, p.layer))[1] for p in graph.params]
        wrong = misrouted(self.transform, graph, names, order, self.skip)
        if wrong:
            self._coverage.report(
                f"fxgrad: Dynamo runs the graph compiled for layer {graph.params[0].layer!r} with the "
                f"parameters of another module (a graph break inside a repeated block's forward), whose layers "
                f"{listed(wrong, 5)} the policy {self.transform!r} treats otherwise (a by_name key, a skip "
                "pattern, a multiplier or a target names them, or depends on their depth): the graph does to "
                "them what the policy does to the layers it was compiled for. Use fxgrad.backend(..., "
                "scope='step'), which treats every layer by its own name and depth, or remove the graph break.",
                fatal=self.transform.reduces_across_layers(),
            )

    def _bind_before_backward(self, graph: CapturedGraph, args: tuple, outputs: Any) -> None:
        """Bind ``graph`` to this call's parameters when its backward starts: the backward reads
        weights, and when Dynamo runs the graph for several modules (a graph break inside a
        repeated block's forward), the last forward's are not this call's."""
        bind = functools.partial(_bind_when_reached, graph, [args[p.index] for p in graph.params])
        for node in _compat.compiled_backward_nodes(outputs):
            node.register_prehook(bind)

    @torch.compiler.disable  # an autograd hook (see fxgrad.frontend.watch)
    def _backward_ran(
        self, graph: CapturedGraph, probe: nn.Parameter | None, unwatched: bool, first: OncePerPass, grad_outputs: Any
    ) -> None:
        """A backward reached the outputs of one call of ``graph`` (``probe``: the call's first
        trainable parameter, if any; ``first()``: whether no output of that call was reached
        before in this backward pass).

        In step scope, whether it starts on the previous backward's gradient tells gradients
        dropped before the policy ran apart from accumulation (:class:`PolicyRuns`). On the
        plain ``torch.compile`` path in graph scope (``unwatched``: no per-forward watch does
        it), :class:`GradWrites` notes what the backward sums into ``.grad``."""
        if not first():
            return
        if self._coverage is not None and self.current_scope() == "graph":  # a policy in the graphs
            self._coverage.note_compiled_autograd(lambda: [p.tensor() for p in graph.params])
            if self._folds:
                self._note_pass(graph)
        self._backwards += 1
        if probe is None:
            return
        if self.current_scope() == "step":
            self._writes.watch(probe)
            writes = self._writes
            self._policy_runs.backward_started(
                probe,
                writes.holds_last_backward(probe),
                writes.written(probe),
                ours=lambda: id(probe) in self._our_ids(),
            )
        elif unwatched:
            self._writes.reaches(probe, self.registry.model_name(graph), graph)

    def _idle_pass(self) -> bool:
        """Whether the backward pass running now computes the gradient of no compiled graph's
        parameters (``torch.autograd.grad`` of an input: a saliency map, an attack; a
        ``backward(inputs=...)`` without them): no step takes it, so its state saves are dropped.
        Asked once per pass, of the graphs' trainable parameters until one is computed (the
        first, in a pass that computes them)."""
        if _compat.backward_pass_id() == -1:
            return False
        if self._idle_asked():
            trainable = (t for graph in self.registry.graphs for p in graph.params if (t := p.tensor()) is not None)
            self._pass_idle = not any(_compat.backward_computes(t) for t in trainable if t.requires_grad)
        return self._pass_idle

    def _note_pass(self, graph: CapturedGraph) -> None:
        """Graph scope, folded: note a backward through ``graph`` for :meth:`_holds_last_pass_alone`:
        the pass, its count of graphs, and, when a backward ran since a folded optimizer's last
        step (else no step will ask), whether ``graph`` found no gradient in ``.grad`` of its
        parameters (a walk of them: not on the steps of a loop with one backward per step)."""
        current = _compat.backward_pass_id()
        if self._last_pass[0] == current:  # a second graph in one pass: each left a factor of its own
            self._last_pass = current, self._last_pass[1] + 1, False, frozenset()
        elif self._folds.behind(self._backwards):
            params = [t for p in graph.params if (t := p.tensor()) is not None]
            fresh = all(t.grad is None for t in params)
            self._last_pass = current, 1, fresh, frozenset(map(id, params))
        else:
            self._last_pass = current, 1, False, frozenset()

    def _holds_last_pass_alone(self, optimizer: torch.optim.Optimizer) -> bool:
        """Whether the gradients ``optimizer`` steps are the latest backward pass's alone, so that
        the latest factor describes them though other passes ran since its last step (their
        gradients dropped by ``zero_grad()``: a step skipped after a loss spike; or never written:
        an adversarial attack's ``torch.autograd.grad``): one graph, which found no gradient in
        ``.grad`` of its parameters, and holds every parameter with one that ``optimizer`` steps."""
        _, graphs, fresh, params = self._last_pass
        if graphs != 1 or not fresh:
            return False
        return all(p.grad is None or id(p) in params for group in optimizer.param_groups for p in group["params"])

    def compile(self, model: nn.Module, *, in_place: bool = False, **compile_kwargs: Any) -> nn.Module:
        """``torch.compile(model, backend=self, **compile_kwargs)``, checked at each forward.

        ``in_place=True`` compiles the model itself, as ``model.compile(backend=self)`` does, and
        returns it: it keeps its class, its ``state_dict`` keys (no ``_orig_mod.``) and its
        ``forward``'s signature, for code that reads them (the Hugging Face Trainer saves
        checkpoints ``from_pretrained`` loads, finds the label columns, keeps the dataset's
        columns the forward takes), with the same checks at each call.

        ``torch.compile(model, backend=backend)`` gets the policy and the
        checks at ``optimizer.step()`` (see :attr:`__name__`). This
        adds a check at each forward: every forward whose outputs a backward
        reaches (and the first in any case) must run a graph this backend
        compiled. If none did, the policy did nothing: e.g. an ``nn.LSTM`` model
        under Dynamo's default ``allow_rnn=False`` runs entirely eagerly, Dynamo
        runs a frame eagerly once it was recompiled ``recompile_limit`` times,
        and ``torch.compiler.set_stance("force_eager")`` runs every one so. It
        warns (naming the stance, if one is in effect), or raises
        :class:`fxgrad.CoverageError` when ``strict`` and the policy reduces
        across layers. It also warns when a backward writes the
        gradient of ``model``'s first trainable parameter without passing
        through the compiled module (``model(x)`` called instead of the
        compiled module, or an eager method such as ``get_text_features``).
        Layer names are relative to ``model`` (to the model inside, for ``DataParallel`` and
        ``DistributedDataParallel``, as on the plain path). Compiled again with plain
        ``torch.compile`` and this backend (``fabric.setup`` does), the model also
        gets the plain path's checks at ``optimizer.step()``.

        The compiled module keeps its own Dynamo cache (``isolate_recompiles=True``
        unless given): each backend compiles its own graphs, and without it every
        backend compiling the same model class, or any ``nn.Sequential``, in one
        process (a sweep, a test suite) counts against one shared
        ``recompile_limit``, so the ninth would run eagerly.
        """
        validate.module("model", model, "; compile a function with torch.compile(fn, backend=backend)")
        if _compat.is_compiled_module(model):
            raise TypeError(
                "model is a module torch.compile returned; pass the model itself (its _orig_mod): "
                "backend.compile compiles it"
            )
        if _compat.TORCH_COMPILE_ISOLATES:
            compile_kwargs.setdefault("isolate_recompiles", True)
        patches = _compat.inductor_config_patches(compile_kwargs.get("mode"), compile_kwargs.get("options"))
        if patches and self.compiler != "inductor":
            raise ValueError(f"mode= and options= configure Inductor; this backend has compiler={self.compiler!r}")
        flags = {"in_place": in_place, **{k: compile_kwargs.get(k, False) for k in ("fullgraph", "disable")}}
        for name, flag in flags.items():
            if not isinstance(flag, bool):
                raise TypeError(f"{name} must be True or False, got {flag!r}")
        if not isinstance(compile_kwargs.get("dynamic"), (bool, type(None))):  # 1 == True: torch asserts a bool
            raise TypeError(f"dynamic must be None, True or False, got {compile_kwargs['dynamic']!r}")
        inner = _compat.unwrap_model(model)  # layers are named in the model inside DataParallel or DDP
        self._adopt(inner)
        if in_place:
            model.compile(backend=self, **compile_kwargs)
            compiled = _compat.wrap_compiled_call(model, WatchedCall)
        else:
            compiled = torch.compile(model, backend=self, **compile_kwargs)
        track_wrapper(inner, compiled)
        if self._coverage is not None:
            self._watched.add(inner)
            in_graph = lambda: self.current_scope() == "graph"  # noqa: E731
            watch = ForwardWatch(inner, self._coverage, lambda: self._training_runs, in_graph, self._note_summed)
            watch.install(compiled)
        return model if in_place else compiled

    @property
    def __name__(self) -> str:
        """``"fxgrad"``. Reading it is how fxgrad learns the model it compiles.

        ``torch.compile`` reads its backend's name once, when it is handed the
        backend (docs/design.md, fact 14). Then ``torch.compile(model,
        backend=backend)``, ``model.compile(backend=backend)`` and
        ``torch.compile(DDP(model), backend=backend)`` name layers relative to
        ``model`` (across graph breaks too), report routing keys that reach no
        layer, and check at each ``optimizer.step()`` that no layer the policy
        targets got its gradient outside the backend's graphs
        (:mod:`fxgrad.frontend.step_check`).
        """
        target, disabled = _compat.compile_call()
        module = _compat.unwrap_model(getattr(target, "__self__", target))  # Module.compile: its bound _call_impl
        if isinstance(module, nn.Module):
            if self._coverage is not None:  # for the report of a model that runs eagerly
                how = "disabled" if disabled else "module" if module is target else "other"
                self._coverage.compiled_as[module] = how
            # compiled again without the watch (fabric.setup does): the plain path's checks; in
            # compile() the watch comes after, the newest
            if module in self._watched:
                self._watched.discard(module)
                track_wrapper(module, None)
            self._adopt(module)
        return "fxgrad"

    def _adopt(self, model: nn.Module) -> None:
        """``model`` is compiled with this backend: learn its names, check the policy reaches it."""
        known = any(ref() is model for ref in self._models)
        if not known:
            self._meet(model)
        hand_over(model, self)
        if known:
            return
        self._models.append(weakref.ref(model))
        self._track(model)
        if live_root(self.registry.roots, model) is None:
            self.registry.roots[id(model)] = Root(weakref.ref(model), "")

    def check_policy_reaches(self, model: nn.Module) -> None:
        """Warn for each routing key, multiplier key or added skip entry that reaches no
        layer of ``model`` (each does nothing); compiling the model calls it."""
        validate.module("model", model)
        for miss in policy_misses(self.transform, self.skip, model):
            warn(miss, CoverageWarning)

    def _keyed_cache(self) -> bool:
        """Whether a graph-scope compile looks its backward up in AOTAutograd's on-disk cache,
        under a key that holds the policy (see :mod:`fxgrad.frontend.warm_start`)."""
        return (
            self.compiler == "inductor"
            and self.transform is not None
            and not self.keep_code
            and _compat.autograd_cache_enabled()
        )

    def _rewrite_backward(
        self, graph: CapturedGraph, fold: Fold, gm: torch.fx.GraphModule, stand_in: StandIn | None = None
    ) -> bool:
        """Rewrite ``gm``; whether its compiled code may be saved to the on-disk caches."""
        with gc_paused():
            self._rewrite(graph, gm, fold)
        return stand_in is None or stand_in.covers(gm)

    def _rewrite(self, graph: CapturedGraph, gm: torch.fx.GraphModule, fold: Fold) -> None:
        graph.reads_weights = False  # until a rule looks parameters up (graph.tensors)
        try:
            outputs = passes.gradient_outputs(gm, graph.num_inputs)
        except passes.GraphMismatchError as error:
            # DTensor parameters (tensor parallelism): the backward returns their inner tensors.
            # Step scope never touches the backward; graph scope cannot place the gradients.
            if self.transform is not None and self.current_scope() == "step":
                return
            if any(isinstance(slot.tensor(), DTensor) for slot in graph.params):
                raise passes.GraphMismatchError(f"{error}. {DTENSOR_IN_GRAPH}") from error
            raise
        has_grad = {i for i, node in enumerate(outputs) if node is not None}
        plan = plan_graph(self.transform, graph, has_grad, self.registry.forward_order(), self.skip)
        graph.layers = list(plan.layers)
        if self.transform is None:
            return
        if self.current_scope() == "step":  # "auto" in a data-parallel job: the policy runs on .grad (armed)
            return
        if self._coverage is not None:
            self._coverage.graph(self.registry, graph, plan, has_grad)
        graph.routes = plan.active_routes()
        if self.compiler == "inductor":
            _refuse_sparse(plan, outputs)
        if self.keep_code:
            graph.backward_before = normalize_code(gm.code, group_label)
        frame = self.registry.frame_index(graph)
        rewrite_backward(gm, plan, outputs, self.store, self.scaler, graph.tensors, frame, fold=fold)
        if self.keep_code:
            self._keep_code(graph, gm, outputs, has_grad)

    @staticmethod
    def _keep_code(graph: CapturedGraph, gm: torch.fx.GraphModule, outputs: list, has_grad: set[int]) -> None:
        graph.backward_after = normalize_code(gm.code, group_label)
        names = {p.index: p.name for p in graph.params}
        slots = [slot for slot in sorted(has_grad) if slot in names]
        returned = gm.graph.output_node().args[0]
        graph.inserted = render_inserted(
            gm,
            {outputs[slot]: names[slot] for slot in slots},
            {names[slot]: returned[slot] for slot in slots},
            group_label,
        )

    def step(self, model: nn.Module | None = None) -> None:
        """Apply the policy to the current ``.grad`` (step scope), once per optimizer step.

        Call it after the last ``backward()`` of the step (DDP has averaged the
        gradients by then); with a ``GradScaler``, before ``scaler.unscale_`` or after it
        unscaled every optimizer's.
        Optional when a ``torch.optim`` optimizer steps the model: ``optimizer.step()``
        runs it if it has not run on these gradients.
        ``model`` defaults to every model this backend compiled or stepped
        before. No host sync; see :mod:`fxgrad.frontend.step_scope`.
        """
        if model is not None:
            validate.module("model", model)
        if self.current_scope() != "step":
            raise RuntimeError(
                "step() needs fxgrad.backend(..., scope='step'); this backend rewrites the backward graphs instead"
            )
        if self._step is None:
            return
        model = _compat.unwrap_model(model) if model is not None else None
        if model is not None and all(ref() is not model for ref in self._models):
            self._meet(model, at_step=True)
            self._models.append(weakref.ref(model))  # later optimizer steps find it too
            self._track(model)
        models = [(model, "")] if model is not None else self._step_models()
        if not models:
            raise RuntimeError("step() has no model: pass step(model), or compile one with this backend first")
        self._step.arm()
        unscaled = self.scaler is not None and bool(_compat.grad_scaler_unscaled(self.scaler))  # called after unscale_
        self._step.apply(models, None if unscaled else self.scaler, by_hand=True)

    def fold(self, optimizer: torch.optim.Optimizer) -> None:
        """Let ``optimizer``'s own update apply the policy's final factor (no pass over the gradients).

        For a policy of one global factor (``clip_by_global_norm``, ``autoclip``,
        ``zclip``, with ``monitor``) and a fused ``Adam``, ``AdamW`` or ``SGD``, the
        factor divides ``optimizer.grad_scale`` (with a GradScaler's scale when there is
        one): the norms are read once and nothing is written. The weights after each
        step equal the unfolded path's (there, to float32 rounding of the factor: torch's
        fused kernels take ``grad_scale`` in float32 only, so float64 parameters see ~3e-8
        relative per step; where a program runs the update, below, to float64's). Until the
        step, ``.grad`` holds the gradient before the factor: ``stats()["folded_factor"]`` is
        the factor and :meth:`scaled_grads` the gradients with it.

        In step scope the norms are read at ``optimizer.step()``, by the step program, which
        also runs the optimizer's update where it can (:mod:`fxgrad.frontend.update_program`:
        neither ``amsgrad`` nor ``maximize``, no step hooks of others, one optimizer over the
        models' parameters, no DTensors): the factor multiplies each gradient there, and the
        optimizer's own ``step()`` updates nothing.
        Where it cannot, ``grad_scale`` carries the factor. In graph scope the
        backward graph reads them and returns the gradients unscaled, leaving the factor, and
        at ``optimizer.step()`` a program runs the update with it (the same conditions; else
        ``grad_scale``); call ``fold()`` before the model's first forward (the graphs compiled
        before keep scaling), and let ``.grad`` hold one backward through one graph at each
        step: the step refuses more (``ValueError``: each backward had its own factor, which
        the update cannot apply to their sum; accumulation and graph breaks need ``scope="step"``).
        Earlier backwards whose gradients ``zero_grad()`` dropped (a step skipped) or that
        wrote none (``torch.autograd.grad`` before the backward) are fine: the step's
        gradients are then the latest backward's alone, whose factor it takes.

        Other factors fold into a program that runs the optimizer's update (same conditions):
        in step scope the step program runs it on the gradients it has just transformed (any
        policy); in graph scope the backward leaves each layer's factor
        (``stats()["folded_factor/<layer>"]``) when every rule that changes gradients scales
        each layer by one factor (not AGC's rows, SinkGD's or ``clip_by_value``'s elements),
        and a program runs the update with them at the step. Other combinations keep the scaling pass,
        after one ``RuntimeWarning`` saying why; an optimizer other than those three raises.
        Several optimizers over one model (weights and biases apart, say) must all be folded:
        the step of one that is not raises ``ValueError``. So must one that replaces a folded
        optimizer in graph scope (the graphs compiled folded keep leaving the factor to the
        update). See :mod:`fxgrad.frontend.fold`.

            >>> import torch, fxgrad
            >>> model = torch.nn.Linear(4, 4)
            >>> backend = fxgrad.backend(fxgrad.clip_by_global_norm(1.0), scope="step")
            >>> backend.fold(torch.optim.AdamW(model.parameters(), fused=True))
        """
        folding.check(optimizer)
        scope = self.current_scope()
        # graphs compiled before the first fold apply the factor themselves; after it, they leave it
        compiled = any(graph.params for graph in self.registry.graphs) and not self._folds.graphs_leave_factor
        why = folding.blocked(optimizer, scope, compiled)
        if why is None and folding.per_layer(self.transform):  # grad_scale cannot carry them: a program's update
            why = self._update_why_not(optimizer, scope)
            if why is None:
                folding.claim(optimizer, self)
                self._updates.add(optimizer)
                if scope == "graph":  # Folds counts the backwards, each leaving its factors, and checks each step
                    self._folds.add(optimizer)
                else:
                    self._step.arm()
                return
            why = f"{why}: {folding.applies(scope)} the policy, and the optimizer steps as usual"
        elif why is None:
            why = folding.nothing_to_fold(self.transform)
        if why is not None:  # this backend keeps its scaling pass, and leaves the optimizer to others
            warn(f"fxgrad: fold({type(optimizer).__name__}): {why}.", RuntimeWarning)
            return
        folding.claim(optimizer, self)
        if self._update_why_not(optimizer, scope) is None:
            # the update in a program costs less than torch's step and its grad_scale, which
            # carries the factor in a step the program cannot run
            self._updates.add(optimizer, quiet=True)
        self._folds.add(optimizer)
        if scope == "step":
            self._step.arm()

    def _update_why_not(self, optimizer: torch.optim.Optimizer, scope: str) -> str | None:
        """Why a program cannot run ``optimizer``'s update with the policy's factors in ``scope``
        (step scope: the policy's program; graph scope: the factors its backward left), or ``None``."""
        why = update_program.why_not(optimizer)
        if why is None and self._update_factors is not None:
            why = "the policy also scales updates (apply_to='update'), which the step program does not run"
        if why is None and scope == "graph":
            why = folding.not_factors(self.transform)
        return why

    def folded_into(self) -> list[torch.optim.Optimizer]:
        """The optimizers :meth:`fold` folds into (while they live), each once: those whose
        ``grad_scale`` carries the global factor, then those whose update a program runs."""
        return list(dict.fromkeys(self._folds.optimizers() + self._updates.optimizers()))

    def runs_update_of(self, optimizer: torch.optim.Optimizer) -> bool:
        """Whether a program of fxgrad's runs ``optimizer``'s update at its steps now (:meth:`fold`,
        and nothing since keeps it out: ``amsgrad`` set, step hooks of others)."""
        return self._updates.runs(optimizer)

    def scaled_grads(self, model: nn.Module) -> dict[str, torch.Tensor]:
        """``model``'s gradients as the optimizer applies them (no sync): while :meth:`fold` is on,
        ``.grad`` times the folded factor (in graph scope with per-layer factors, its layer's)
        until the folded step, which writes that product back to ``.grad``; ``.grad`` itself
        otherwise. In step scope the policy runs first if it has not run on these gradients (as
        :meth:`step` does, advancing its state): call it once the step's gradients are complete
        (after the last micro-batch), not between micro-batches. Where the step program runs a
        folded optimizer's update (per-layer factors, step scope), that run
        writes the transformed gradients to ``.grad``, and the optimizer's own step follows, as
        after :meth:`step`: this step is not folded."""
        validate.module("model", model)
        if self.folded_into() and self.current_scope() == "step" and self._step_models():
            self.step()
        factor_of = None
        if self._leaves_layers():
            held = self._held_owners()
            factor_of = lambda p: self._left_factor(held.get(id(p)), p)  # noqa: E731
        return self._folds.as_applied(
            {name: p for name, p in model.named_parameters() if p.grad is not None}, factor_of
        )

    def _left_factor(self, owner: Owner | None, param: nn.Parameter) -> torch.Tensor | None:
        """The factor the backward graphs left to ``param``'s gradient (``owner``: its entry in
        :meth:`_held_owners`, if any), or ``None``."""
        if owner is None or owner.tensor is not param:
            return None
        try:
            return self.store.stat(f"{FOLDED}/{owner.layer}")
        except KeyError:
            return None

    def _factors_left(self) -> int:
        """How many factors the policy has left to folded updates so far: one per backward
        through the graphs in graph scope, one per run of the policy in step scope."""
        return self._backwards if self.current_scope() == "graph" else self._step_runs

    def _note_summed(self, param: nn.Parameter, message: str | None) -> None:
        """A backward wrote ``param.grad``, summing parts (``message`` says how) or not (``None``)."""
        if message is None:
            self._summed.pop(param, None)
        else:
            self._summed[param] = message

    def _before_update(self, optimizer: torch.optim.Optimizer) -> None:
        """Before the step of an optimizer of this backend's models, once the policy ran: warn if
        the update cancels the policy, if the policy read gradients a GradScaler had scaled, or if
        the update steps gradients accumulated over backward passes in graph scope (plain path);
        keep the weights that update-level factors scale the change of, and give a folded
        optimizer the factor the policy left."""
        self._drop_kept()
        if self._coverage is not None and self._coverage.unpoliced:
            self._coverage.refuse_unpoliced(stepped_ids(optimizer), type(optimizer).__name__)
        if self._loaded:
            self._report_unplaced(self._loaded == "empty")
            self._loaded = False
        self._check_scaler_given(optimizer, first_step=optimizer not in self._first_step_seen)
        if optimizer not in self._first_step_seen:  # checks of the optimizer and the policy, once
            self._first_step_seen.add(optimizer)
            decayed = {layer.name for layer in self._layers_stepped_by(optimizer, folding.coupled_decay(optimizer))}
            why = folding.cancelled(optimizer, self.transform, self._layers_stepped_by(optimizer), decayed)
            if why is not None:
                warn(why, CoverageWarning)
            max_norm = trainer_clip() if self.transform.changes_gradients() else None
            if max_norm is not None:
                when = "before" if self.current_scope() == "step" else "after"
                warn(TRAINER_CLIPS.format(max_norm=max_norm, when=when, transform=self.transform), CoverageWarning)
                if self._outside is not None:
                    self._outside.told()  # the Trainer's clip is the change it would report
            if self.current_scope() == "step":  # graph scope: the step check reports them
                loose = self._loose_parameters()
                if loose:
                    names = ", ".join(sorted(set(loose.values())))
                    warn(LOOSE.format(count=len(loose), names=names), CoverageWarning)
                report_outside(optimizer, self.transform, [model for model, _ in self._step_models()], loose)
            elif self._coverage is not None:
                self._coverage.stepped_together(self.registry, stepped_ids(optimizer), type(optimizer).__name__)
            self._apart.first_step(
                optimizer,
                self._step_models(),
                self.transform,
                self.store.spanning,
                self.store.keyed_by_layer(),
                None if self.current_scope() == "step" else self.registry.frames_of,
            )
        if self._outside is not None and self._outside.pending and self.current_scope() == "graph":
            self._outside.check(optimizer, self.transform, self.registry.layers_held)
        if self._summed:
            stepped = stepped_ids(optimizer)
            for probe, message in list(self._summed.items()):
                if id(probe) in stepped:
                    del self._summed[probe]
                    self._coverage.warn(message)
        self.store.commit()  # state moves once per step (fxgrad.runtime.state)
        factors = self._folds.check_step(optimizer)  # first: a refused step keeps no weight copy
        if self._update_factors is not None:
            self._update_factors.before_step(optimizer)
        if factors and optimizer in self._updates and self.current_scope() == "graph":
            self._apply_left(optimizer)
        if factors is not None and self._leaves_layers():
            factors = 0  # none for grad_scale: _apply_left applied them
        if factors is not None:  # none to give when a program ran the update with the factor
            self._folds.give_factor(optimizer, 0 if self._updates.updated(optimizer) else factors)

    def _leaves_layers(self) -> bool:
        """Whether the backward graphs leave each layer's factor to folded updates (graph scope,
        a policy of factors per layer: :meth:`fold`)."""
        return self._per_layer and self._folds.graphs_leave_factor and self.current_scope() == "graph"

    def _apply_left(self, optimizer: torch.optim.Optimizer) -> None:
        """Graph scope: apply the factors the backward graphs left (each layer's,
        ``folded_factor/<layer>``, or the global ``folded_factor``) to the gradients of the
        parameters the graphs hold that ``optimizer`` steps, in a program that runs its update
        too (:mod:`fxgrad.frontend.update_program`). Where it cannot, a layer's factors are
        applied in a pass of their own before the optimizer's own step (said once), and a
        global one rides in ``grad_scale``."""
        key = self.registry.generation, group_ids(optimizer)
        if self._left_owners[0] != key:
            stepped = stepped_ids(optimizer)
            held = [owner for owner in self._held_owners().values() if id(owner.tensor) in stepped]
            self._left_owners = key, held, {}
        _, held, by_grads = self._left_owners
        with_grad = tuple(owner.tensor.grad is not None for owner in held)
        found = by_grads.get(with_grad)
        if found is None:  # the routes of their program (none), kept with them: see StepPrograms._routing
            owners = [owner for owner, has in zip(held, with_grad) if has]
            stats = [f"{FOLDED}/{o.layer}" for o in owners] if self._per_layer else [FOLDED] * len(owners)
            found = owners, stats, [], None
        owners, stats, routes, offsets = found
        if not owners:
            return
        device = owners[0].tensor.device
        if offsets is None or None in offsets:  # kept once every factor has its place (they stay put)
            offsets = self.store.stat_offsets(stats, device)
            by_grads[with_grad] = owners, stats, routes, offsets
        left = self.store.stats_buffer(device), offsets
        update = self._updates.update(optimizer, owners, left)
        if update is not None and self._programs.run(routes, owners, self.store, None, update=update):
            self._updates.ran(optimizer)
            return
        if update is not None:
            update.unused()
        if not self._per_layer:
            return
        buffer, offsets = left
        with torch.no_grad():
            for owner, at in zip(owners, offsets):
                if at is not None:
                    grad = owner.tensor.grad
                    grad.copy_(norm_math.scaled([grad], buffer[at])[0])

    def _held_owners(self) -> dict[int, Owner]:
        """``id(parameter) -> Owner`` for the trainable parameters the compiled graphs hold, named
        as the graphs name their layers (under which their backward leaves a layer's factor; a
        graph that runs for another module keeps the names it was compiled with), kept until the
        graphs change."""
        if self._held[0] != self.registry.generation:
            held: dict[int, Owner] = {}
            for graph in self.registry.training():
                for slot in graph.params:
                    tensor = slot.tensor()
                    if tensor is not None and tensor.requires_grad:
                        held.setdefault(id(tensor), Owner(slot.layer, slot.name, None, tensor))
            self._held = self.registry.generation, held
        return self._held[1]

    def _check_scaler_given(self, optimizer: torch.optim.Optimizer, first_step: bool) -> None:
        """Say once per optimizer that a GradScaler steps it and the policy read the gradients the
        scaler had scaled, the backend not having been given it: a fused optimizer's, which the
        scaler leaves scaled (the update unscales), in either scope; in graph scope any
        optimizer's, which the backward read before ``scaler.step()`` unscaled them (looked for
        at the first step: the stack walk is not for every step)."""
        if self.scaler is not None or optimizer in self._told_scaled:
            return
        if folding.scaled_by_a_scaler(optimizer):
            message = SCALED_FUSED
        elif first_step and self.current_scope() == "graph" and _compat.stepping_grad_scaler() is not None:
            message = SCALED_IN_GRAPH
        else:
            return
        self._told_scaled.add(optimizer)
        warn(message.format(optimizer=type(optimizer).__name__, transform=self.transform), CoverageWarning)

    def _our_ids(self) -> frozenset[int]:
        """The ids of the parameters of the models this backend covers (the kept walk)."""
        return self._step.ids(self._step.parameters(self._step_models()))

    def transform_grads(
        self, model: nn.Module, scaler: Any = None, optimizer: torch.optim.Optimizer | None = None
    ) -> None:
        """Apply the policy to ``model``'s current ``.grad`` now (step scope's program).

        For frameworks that own the optimizer step (:mod:`fxgrad.integrations.lightning`):
        unlike :meth:`step`, the model is not remembered for later ``optimizer.step()``
        calls. ``scaler``: the ``GradScaler`` whose scale the gradients still carry, if any;
        ``optimizer``: the one about to step, which update-level factors (``apply_to="update"``)
        scale the step of, and whose update the step program runs if :meth:`fold` folded it.
        """
        validate.module("model", model)
        scaler = _scaler_type(scaler)
        if optimizer is not None:
            validate.optimizer("optimizer", optimizer)
        if self.transform is None:
            return
        self._meet(model, at_step=True)
        models = [(model, "")]
        self._apply_to_grads(models, scaler, self._step.parameters(models), optimizer)  # the kept walk: every step
        if optimizer is not None and self._update_factors is not None:
            self._update_factors.before_step(optimizer, models)

    def step_program_code(self) -> str | None:
        """With ``keep_code=True``: the nodes of the last step program built (``explain``)."""
        return self._programs.inserted

    def retire(self) -> None:
        """Act on no later ``optimizer.step()``: ``explain``'s own backend, done with its one
        backward, which Dynamo keeps alive until ``torch._dynamo.reset()`` (its step-scope hook
        would run the policy a second time on every later step of the model). Its step
        programs go: each call of ``explain`` kept one, and the weights it read (a model copy's)."""
        for owner in (self._step, self._step_check, self._update_factors):
            if owner is not None:
                remove_optimizer_hooks(owner)
        self._forget_models()
        self._programs.drop()

    def _meet(self, model: nn.Module, at_step: bool = False) -> None:
        """Check a model the first time this backend compiles it or runs the policy on it:
        refuse flattened parameters, and warn for policy keys that reach none of its layers.
        ``at_step`` (:meth:`step`, :meth:`transform_grads`): also warn if a module of it was
        compiled with another backend whose policy transforms its gradients already (a
        Lightning module compiling its network with ``fxgrad.backend(policy)``, and the
        callback given the policy too)."""
        if model in self._met:
            return
        self._met.add(model)
        refuse_flat_parameters(model)
        if self.current_scope() == "graph":
            refuse_fsdp2_in_graph_scope(model)
        self.check_policy_reaches(model)
        if self.current_scope() == "step" and self.transform is not None:  # graph scope: per graph (CoverageCheck)
            frozen = frozen_named(self.transform, *model_layers(model, self.skip))
            if frozen is not None:
                warn(frozen, CoverageWarning)
        elsewhere = policed_elsewhere(model, self) if at_step else None
        if elsewhere is not None:
            name, other = elsewhere
            where = type(model).__name__ + (f".{_compat.module_path(name)}" if name else "")
            when = "in the backward" if other.current_scope() == "graph" else "at the optimizer step (step scope)"
            warn(
                f"fxgrad: {where} is compiled with another fxgrad backend, whose policy transforms its gradients "
                f"{when} already, and this backend's {self.transform!r} runs on them again at the step: "
                "two policies, one after the other. Give the policy to one of them (compile with plain "
                "torch.compile when a callback or backend.step() holds it).",
                CoverageWarning,
            )
            if other._outside is not None:
                other._outside.told()  # this policy is the change it would report, with its own layer names

    def _track(self, model: nn.Module | None) -> None:
        """A model this backend serves: hook ``optimizer.step()`` for it, and once it dies, drop
        what step scope and the update factors keep from step to step (walks of the parameters,
        their routes) before the next step: torch._dynamo keeps every backend alive, and those
        would keep a freed model's parameters and gradients. The hooks of a backend left with
        no model unhook themselves at the next optimizer step (:meth:`_idle`)."""
        if model is None or model in self._tracked:
            return
        self._tracked.add(model)
        weakref.finalize(model, _model_died, weakref.ref(self)).atexit = False
        if self._step_check is not None:
            self._step_check.arm()
        if self._step is not None and self.scope != "graph":
            # Before any graph: in a data-parallel job step scope must run even if none ever comes
            # (torch.compile(DDP(nn.Sequential)) leaves torch.nn's own forward eager).
            self._step.arm()

    def _loose_parameters(self) -> dict[int, str]:
        """``id -> name`` of the parameters with a gradient that the compiled graphs take but no
        model holds (:mod:`fxgrad.passes.capture` names them after their variables): graph scope
        polices them as layers of their own, step scope reads the models' ``.grad`` only."""
        if not self._loose:
            return {}
        slots = [slot for graph in self.registry.current() for slot in graph.params if slot.root is None]
        tensors = [(slot.name, slot.tensor()) for slot in slots]
        return {id(t): name for name, t in tensors if t is not None and t.grad is not None}

    def _idle(self) -> bool:
        """No model of this backend lives, and no graph holds parameters of no model: a sweep's
        earlier trial, whose backend torch._dynamo keeps. Its optimizer-step hooks then remove
        themselves rather than walk every optimizer's parameters at every step of the process,
        and drop what it kept for its models; :meth:`_track` arms them again for a new model."""
        idle = not self._tracked and not self._loose
        if idle:
            self._drop_kept()
        return idle

    def _drop_kept(self) -> None:
        """Where no step runs (the garbage collector can free a model in the middle of one,
        while a step program reads the weights it was given): at this backend's next step, or
        at the next optimizer step of the process once its models are gone (a sweep's next
        trial; the walks of the parameters hold them, and their gradients)."""
        if self._models_died:
            self._models_died = False
            self._forget_models()

    def _forget_models(self) -> None:
        """Drop what step scope, the folded updates and the update factors keep from step to step
        for the models (walks of their parameters, routes), which holds the parameters."""
        if self._step is not None:
            self._step.forget()
        self._programs.forget()
        self._left_owners, self._held = ((), [], {}), (-1, {})
        if self._update_factors is not None:
            self._update_factors.forget()

    def _layers_stepped_by(self, optimizer: torch.optim.Optimizer, among: set[int] | None = None) -> list[Layer]:
        """The layers of this backend's models with parameters ``optimizer`` steps (``among``:
        with one of these parameters)."""
        stepped = stepped_ids(optimizer) if among is None else among
        owners = [owner for key, owner in models_owners(self._step_models()).items() if key in stepped]
        return owners_layers(owners, self.skip)

    def _step_models(self) -> list[tuple[nn.Module, str]]:
        """The models step scope covers: those given to :meth:`compile` or :meth:`step`, then the
        roots of the compiled graphs (a model compiled with ``backend.compile`` is both; it counts
        once), each model that holds another of them first, so its names win for the parameters
        both hold: torchtitan compiles each block alone, and ``backend.step(model)`` then names
        the blocks' layers as in the whole model."""
        models = {id(model): (model, "") for model in (ref() for ref in self._models) if model is not None}
        for root in self.registry.roots.values():
            model = root.module()
            if model is not None:
                models.setdefault(id(model), (model, root.prefix))
        pairs = [(model, prefix) for model, prefix in models.values() if not superseded(model, self)]
        if len(pairs) < 2:
            return pairs
        refs, order = self._nesting
        if len(refs) != len(pairs) or any(ref() is not model for ref, (model, _) in zip(refs, pairs)):
            inside = [{id(m) for m in model.modules()} for model, _ in pairs]
            held = [sum(id(other) in ids for other, _ in pairs) for ids in inside]  # itself included
            order = sorted(range(len(pairs)), key=lambda i: -held[i])
            self._nesting = [weakref.ref(model) for model, _ in pairs], order
        return [pairs[i] for i in order]

    def _apply_to_grads(
        self,
        models: list[tuple[nn.Module, str]],
        scaler: Any,
        params: list | None = None,
        optimizer: torch.optim.Optimizer | None = None,
    ) -> None:
        self._drop_kept()
        part = optimizer is not None and self._steps_part_in_backward(optimizer, models, params)
        if part and any(leaf.reach != "element" for leaf in self.transform.leaves()):
            self._refuse_mid_backward(optimizer, models)
        if optimizer is not None and optimizer not in self._first_step_seen:
            self._check_one_scale(optimizer, models)
        self._policy_runs.ran()
        self._step_runs += 1
        ran = apply_to_grads(
            self.transform,
            models,
            self.skip,
            self.store,
            scaler,
            self.registry.forward_order(),
            None if part else self._programs,  # not a program for each parameter
            params,
            fold="global" if self._folds else None,
            update=functools.partial(self._updates.update, optimizer),
        )
        if ran is not None:
            self._updates.ran(optimizer)

    def _steps_part_in_backward(
        self, optimizer: torch.optim.Optimizer, models: list[tuple[nn.Module, str]], params: list | None
    ) -> bool:
        """Whether ``optimizer`` steps while a backward pass runs and steps part of the models'
        trainable parameters from a parameter's hook: an optimizer in the backward, stepped from
        each parameter's hook before the others have their gradients. Optimizers stepped from
        the pass's final callback (``queue_callback``), outside any autograd node, run when every
        gradient is there, each over all or part of the models, as after ``backward()``. But
        compiled autograd calls the hooks from its graph, FSDP2 each sharded parameter's from its
        own final callback, and DDP may step a bucket's optimizer from its own (a comm hook's
        future, ``_apply_optimizer_in_backward``), outside any node too: there, and in any job of
        more than one process, any step inside the pass counts."""
        if _compat.backward_pass_id() == -1:
            return False
        if (
            not _in_a_hook()
            and _compat.data_parallel_world_size() == 1
            and not any(fsdp2_sharded(model) for model, _ in models)
        ):
            return False
        stepped = stepped_ids(optimizer)
        params = self._step.parameters(models) if params is None else params
        return any(p.requires_grad and id(p) not in stepped for p in params)

    def _refuse_mid_backward(self, optimizer: torch.optim.Optimizer, models: list[tuple[nn.Module, str]]) -> None:
        """Refuse (warn once, with ``strict=False``) a step-scope run for an optimizer in the
        backward, where a policy reading more than one element at a time sees one gradient."""
        sharded = next(((model, where) for model, _ in models if (where := fsdp2_sharded(model))), None)
        remedy = (
            MID_BACKWARD_REMEDY
            if sharded is None
            else MID_BACKWARD_SHARDED.format(model=type(sharded[0]).__name__, where=sharded[1])
        )
        how = MID_BACKWARD_HOOK if _in_a_hook() else MID_BACKWARD_CALLBACK
        message = MID_BACKWARD.format(
            optimizer=type(optimizer).__name__, transform=self.transform, how=how, remedy=remedy
        )
        if self.strict:
            raise CoverageError(message)
        if not self._told_mid_backward:
            self._told_mid_backward = True
            warn(message, CoverageWarning)

    def _check_one_scale(self, optimizer: torch.optim.Optimizer, models: list[tuple[nn.Module, str]]) -> None:
        """Refuse (warn, with ``strict=False``) the first step of ``optimizer`` that runs the policy
        over gradients it should not read together, as a GradScaler's stages tell:

        * a cross-layer policy over gradients of an optimizer that stepped since the scaler's last
          ``update()`` (a GAN's discriminator held in one module with its generator);
        * the gradients ``optimizer`` steps unscaled, others the policy reads not, or the other way
          round: two optimizers over one model, stepped by ``scaler.step()`` one after the other,
          unscale one at a time (an optimizer that unscaled counts for all the others: fxgrad
          cannot see which parameters a scaler's optimizers hold). A per-layer policy may read
          the scaled gradients of an optimizer that stepped already, which no update takes.
        """
        scaler = self.scaler if self.scaler is not None else _compat.stepping_grad_scaler()
        if scaler is None:
            return
        unscaled = _compat.grad_scaler_unscaled(scaler)
        stepped = _compat.grad_scaler_stepped(scaler) - {id(optimizer)}
        mixed = (id(optimizer) in unscaled) != bool(unscaled - {id(optimizer)})
        across = self.transform.reduces_across_layers()
        if not mixed and not (across and stepped):
            return
        with_grad, routes = step_routes(self.transform, models, self.skip, self.registry.forward_order())
        names = {name for _, route in routes for name in route.names}
        read = {id(owner.tensor) for owner in with_grad if owner.layer in names} - stepped_ids(optimizer)
        done = read & set().union(*(stepped_ids(other) for other in self._first_step_seen if id(other) in stepped))
        name = type(optimizer).__name__
        if across and done:
            message = READ_STEPPED.format(optimizer=name, transform=self.transform, count=len(done))
        elif mixed and read - done:
            count = len(read - done)
            ours, theirs = f"the gradients {name} steps", f"the {count} other gradient{'s' * (count > 1)} it reads"
            if id(optimizer) not in unscaled:
                ours, theirs = theirs, ours
            message = TWO_SCALES.format(optimizer=name, transform=self.transform, unscaled=ours, scaled=theirs)
        else:
            return
        if self.strict:
            raise CoverageError(message)
        warn(message, CoverageWarning)

    # ------------------------------------------------------------ state

    def stats(self) -> dict[str, torch.Tensor]:
        """The latest step's statistics: ``{name: 0-dim tensor}``, on the device.

        A snapshot (one copy of the statistics buffer, no host sync) that loggers take as is;
        ``.item()`` is a host sync, so read the values every N steps, not every step::

            if step % 100 == 0:
                wandb.log({k: v.item() for k, v in backend.stats().items()})

        Per-layer entries are ``<stat>/<layer>``. ``grad_norm/total`` and
        ``grad_norm/total_clipped`` are the global norm before and after the
        policy when :func:`fxgrad.monitor` is in it (derived from its per-layer
        norms, so they span graph breaks); otherwise the norm a global clipping
        transform saw, and after it. Layers without a gradient in the latest
        step (frozen, or in a branch not taken) have no entries.
        """
        snapshot = self.store.latest_stats()
        for statistic, total in (("grad_norm", "grad_norm/total"), ("grad_norm_clipped", "grad_norm/total_clipped")):
            layers = [v for k, v in snapshot.items() if (self.store.layer_stat(k) or ("",))[0] == statistic]
            if layers:  # monitor's view (before / after the whole policy) wins
                snapshot[total] = torch.stack(layers).square().sum().sqrt()
        return dict(sorted(snapshot.items()))

    def state_dict(self) -> dict[str, torch.Tensor]:
        """Histories, EMAs, thresholds and counters, by key, for checkpoints."""
        return self.store.state_dict()

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        """Restore :meth:`state_dict` (before or after the first compile).

        A key no transform of this policy owns (the checkpoint of another
        policy, or of this one with transforms added before it) raises
        ``ValueError``, and so does a shape that differs from this policy's; a
        load that raises changes nothing. Keys no compiled transform took by the
        first optimizer step after the load (a renamed layer) are warned about, and
        so are the policy's entries the state lacked (they start over).
        """
        if not isinstance(state, Mapping):
            raise TypeError(f"state must be a dict from state_dict(), got {type(state).__name__}")
        routes = [] if self.transform is None else self.transform.routes(())
        owners = [f"{index}.{route.leaf.name}/" for index, route in enumerate(routes)]
        unknown = sorted(key for key in state if not isinstance(key, str) or not key.startswith(tuple(owners)))
        if unknown:
            shown = listed(list(map(repr, unknown)), 5)
            raise ValueError(
                f"state has keys no transform of {self.transform!r} owns: {shown}. Its keys start "
                f"with <position>.<transform>/: {', '.join(owners) or 'none (no transform)'}"
            )
        self.store.load_state_dict(state)
        self.store.defer()  # a checkpoint's state has seen steps: a resumed run defers from its first
        self._loaded = "state" if state else "empty"

    def _report_unplaced(self, empty: bool) -> None:
        """Warn for loaded keys that no compiled transform took by the first optimizer step after
        the load (a layer renamed: the model wrapped, or its modules moved), and for the policy's
        state entries the load did not give (a rule or a layer added since the checkpoint; all of
        them, when the ``empty`` state given was a template taken before the first step)."""
        missing = self.store.not_loaded()
        if missing:
            why = EMPTY_LOAD if empty else "(a rule or a layer added since the checkpoint?)."
            warn(
                f"fxgrad: {len(missing)} state entries of the policy {self.transform!r} were not in the state "
                f"given to load_state_dict(), and start over: {listed(list(map(repr, missing)), 5)} {why}",
                CoverageWarning,
            )
        unplaced = self.store.pending()
        if unplaced:
            shown = listed(list(map(repr, unplaced)), 5)
            warn(
                f"fxgrad: {len(unplaced)} state entries given to load_state_dict() match no state of the policy "
                f"{self.transform!r} at the first optimizer step after loading: {shown}. Their layers or "
                "statistics are named otherwise here (a model wrapped or renamed since the checkpoint?), so the "
                "state they hold starts over. They wait, should a graph that needs them compile later.",
                CoverageWarning,
            )


def _model_died(backend: weakref.ref) -> None:
    """A model of ``backend`` died (see :meth:`Backend._track`); this runs wherever the
    garbage collector frees it, so it only says so."""
    alive = backend()
    if alive is not None:
        alive._models_died = True


@torch.compiler.disable  # an autograd hook (see _backward_ran)
def _bind_when_reached(graph: CapturedGraph, params: list[nn.Parameter], grad_outputs: Any) -> None:
    if graph.params[0].tensor() is not params[0]:
        graph.bind(params)


def _refuse_sparse(plan: GraphPlan, outputs: list[torch.fx.Node | None]) -> None:
    """Refuse a policy that acts on a sparse gradient (``nn.Embedding(sparse=True)``) in a
    backward graph for Inductor, which compiles ops on strided tensors only (it would fail
    on the first backward with a stride assertion that names no layer)."""
    sparse = [
        layer.name
        for layer in dict.fromkeys(layer for route in plan.routes for layer in route.layers)
        if any(outputs[slot].meta["val"].layout != torch.strided for slot in plan.slots[layer.name])
    ]
    if sparse:
        raise NotImplementedError(
            f"fxgrad: the gradients of {', '.join(map(repr, sparse))} are sparse (nn.Embedding(sparse=True)?), "
            "and Inductor cannot compile the policy's ops on them in the backward graph. Use scope='step' "
            "(the policy then runs on .grad, eagerly for sparse gradients), skip the "
            f"layer (skip=({sparse[0]!r},)), or a dense gradient (sparse=False)."
        )


def _scaler_type(scaler: Any) -> Any:
    """``scaler`` if it scales (``None`` for ``GradScaler(enabled=False)``, or a CUDA scaler
    without CUDA); ``TypeError`` for anything but a ``GradScaler`` or ``None``."""
    if scaler is None:
        return None
    if isinstance(scaler, type):
        raise TypeError(f"scaler must be a torch.amp.GradScaler, got the class {scaler.__name__}: pass an instance")
    if not isinstance(scaler, torch.amp.GradScaler):  # fxgrad reads its scale and found_inf (its subclasses' too)
        raise TypeError(f"scaler must be a torch.amp.GradScaler, got {type(scaler).__name__}")
    return scaler if scaler.is_enabled() else None


def _check_scaler(scaler: Any, transform: Transform | None) -> Any:
    scaler = _scaler_type(scaler)
    if scaler is None:
        return None
    leaves = transform.leaves() if transform is not None else []
    hiding = {leaf.name for leaf in leaves if leaf.hides_nonfinite}
    if hiding:
        raise ValueError(
            f"scaler: {sorted(hiding)} would hide the Inf/NaN the GradScaler needs to see to "
            "skip the step and lower the scale; leave non-finite handling to the scaler"
        )
    return scaler


def backend(
    transform: Transform | None = None,
    *,
    skip: Iterable[SkipEntry] = DEFAULT_SKIP,
    compiler: str = "inductor",
    strict: bool = True,
    keep_code: bool = False,
    scaler: Any = None,
    scope: str = "auto",
) -> Backend:
    """A ``torch.compile`` backend that applies ``transform`` inside the backward graph.

    * ``transform``: the policy (``None`` compiles without rewriting).
    * ``skip``: layers per-layer transforms leave alone: ``nn.Module`` types
      and fnmatch patterns matched against class names and layer names.
      Default :data:`fxgrad.DEFAULT_SKIP` (norm layers); ``skip=()`` turns it off.
    * ``compiler``: ``"inductor"`` (fused kernels) or ``"aot_eager"`` (runs the
      rewritten FX graphs as Python; fast to compile, for tests and debugging).
    * ``strict``: raise :class:`fxgrad.CoverageError` when a transform that
      reduces across layers would see only part of the model's gradients
      (graph breaks); ``False`` warns and applies it per graph.
    * ``keep_code``: keep each backward graph's code before and after the
      rewrite on ``backend.graphs`` (one code generation per graph;
      :func:`fxgrad.explain` turns it on).
    * ``scaler``: the ``torch.amp.GradScaler`` whose scaled loss you backprop.
      Transforms then act on unscaled values (reading the scale on the device
      every step) and leave Inf/NaN for the scaler to find.
    * ``scope``: ``"graph"`` rewrites each backward graph (fused into the
      backward kernels); ``"step"`` leaves the backward alone and applies the
      policy to ``.grad`` once per optimizer step (at ``optimizer.step()``, or
      earlier with :meth:`Backend.step`): for gradient accumulation, DDP's
      all-reduced gradients, FSDP2, and global transforms across graph
      breaks. ``"auto"`` (default) is ``"graph"`` in one process and
      ``"step"`` (exact) in a data-parallel job (see docs/distributed.md).

        >>> import torch, fxgrad
        >>> model = torch.compile(torch.nn.Linear(3, 3),
        ...                       backend=fxgrad.backend(fxgrad.clip_by_norm(1.0)))
    """
    return Backend(
        transform, skip=skip, compiler=compiler, strict=strict, keep_code=keep_code, scaler=scaler, scope=scope
    )
