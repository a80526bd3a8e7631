"""Every private torch API fxgrad touches, in one place.

fxgrad is tested against torch 2.13. When torch moves, this is the only module
that should need to change; the facts it relies on are listed in
``docs/design.md``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import inspect
import operator
import re
import sys
import types
from typing import Any, Callable, Iterator, Sequence

import torch
import torch._dynamo  # noqa: F401  (registers torch._dynamo.* submodules)
import torch._dynamo.symbolic_convert as _symbolic_convert
import torch._functorch.config as _functorch_config
import torch._guards
import torch._inductor.compile_fx as _compile_fx
import torch._inductor.config as _inductor_config
from torch._dynamo.backends.common import aot_autograd as _aot_autograd
from torch._guards import detect_fake_mode as _detect_fake_mode
from torch._inductor.custom_graph_pass import CustomGraphPass as _CustomGraphPass

try:
    from torch._inductor.custom_graph_pass import get_custom_graph_passes as _custom_graph_passes
except ImportError:  # torch before 2.13 (bench/gpu.sh's device image): the setting takes one pass
    _custom_graph_passes = None
from torch._inductor.decomposition import select_decomp_table
from torch._subclasses.fake_tensor import FakeTensor as _FakeTensor
from torch._subclasses.fake_tensor import FakeTensorConfig as _FakeTensorConfig
from torch._subclasses.fake_tensor import FakeTensorMode as _FakeTensorMode
from torch.distributed.tensor import DTensor
from torch.export.unflatten import InterpreterModule as _InterpreterModule
from torch.export.unflatten import UnflattenedModule as _UnflattenedModule
from torch.utils import _pytree
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._python_dispatch import (
    _disable_current_modes as outside_dispatch_modes,
)

_UNFLATTENED = (_InterpreterModule, _UnflattenedModule)

__all__ = [
    "TorchDispatchMode",
    "outside_dispatch_modes",
    "grad_scaler_scale",
    "grad_scaler_stepped",
    "grad_scaler_unscaled",
    "optimizer_step_hooks",
    "initialising_optimizer_state",
    "tensor_version",
    "gradient_version",
    "gradient_versions",
    "has_grad_hooks",
    "accumulated_leaves",
    "backward_pass_id",
    "running_autograd_node",
    "backward_computes",
    "compiled_backward_nodes",
    "layout_check",
    "may_record_grad",
    "may_have_backward",
    "foreach_mul_",
    "foreach_norm",
    "data_parallel_world_size",
    "all_reduce",
    "compiled_autograd_requested",
    "compiled_autograd_running",
    "compiled_autograd",
    "aot_eager_compile",
    "autograd_cache_bypassed",
    "autograd_cache_enabled",
    "cache_keyed",
    "compile_id",
    "current_frame_scope",
    "compile_call",
    "exported_class",
    "detect_fake_mode",
    "new_fake_mode",
    "fake_of",
    "no_dispatch",
    "tensor_layout",
    "new_fake_like",
    "new_fake_view",
    "set_node_arguments",
    "VIEWS",
    "returns_new_tensors",
    "shape_arguments",
    "tensors_in",
    "generated_code",
    "inductor_compile",
    "inductor_compile_program",
    "program_settings",
    "inductor_decompositions",
    "reset_dynamo",
    "source_chain",
]

Compiler = Callable[[torch.fx.GraphModule, list], Any]
BackwardRewrite = Callable[[torch.fx.GraphModule], bool]
"""Rewrites a backward graph in place; returns whether its compiled code may go to the on-disk caches."""


def inductor_decompositions() -> dict:
    """The decomposition table Inductor lowers with.

    Rules are traced with it so that they only contain ops Inductor accepts
    (inserting e.g. ``aten.clamp`` undecomposed fails with "both a fallback and a
    decomp for same op").
    """
    return select_decomp_table()


def new_fake_mode() -> Any:
    """A fresh FakeTensorMode, for a graph fxgrad builds itself (the step program): static
    shapes, with a shape environment, which Inductor's caches need (see
    :func:`inductor_compile_program`)."""
    from torch.fx.experimental.symbolic_shapes import ShapeEnv

    return _FakeTensorMode(shape_env=ShapeEnv(), static_shapes=True)


def detect_fake_mode(values: list) -> Any:
    """The FakeTensorMode that owns ``values`` (the ``meta["val"]`` of graph nodes)."""
    return _detect_fake_mode(values)


def is_fake(value: Any) -> bool:
    """Whether ``value`` is a fake tensor (of any fake mode)."""
    return isinstance(value, _FakeTensor)


def fake_of(value: Any, fake_mode: Any) -> bool:
    """Whether ``value`` is a plain fake tensor of ``fake_mode`` (not a subclass such as DTensor)."""
    return type(value) is _FakeTensor and value.fake_mode is fake_mode


no_dispatch = torch._C._DisableTorchDispatch
"""A context in which torch ops skip dispatch modes (the fake mode, fxgrad's recorder)."""


def tensor_layout(tensor: torch.Tensor) -> tuple:
    """A tensor's shape, strides, dtype and device: what the recorder keys fake results by and
    :func:`new_fake_like` copies, and what a step program is built for."""
    return tensor.shape, tensor.stride(), tensor.dtype, tensor.device


def new_fake_like(fake_mode: Any, layout: tuple) -> torch.Tensor:
    """A new fake tensor of ``layout`` (:func:`tensor_layout`), made without a fake dispatch
    (~3 us instead of ~80 us). Call it inside :data:`no_dispatch`."""
    shape, stride, dtype, device = layout
    return _wrap_meta(fake_mode, torch.empty_strided(shape, stride, dtype=dtype, device="meta"), device)


def new_fake_view(base: torch.Tensor, layout: tuple, storage_offset: int) -> torch.Tensor:
    """A fake view of ``base`` (sharing its storage) with the shape and strides of ``layout``
    at ``storage_offset``, made without a fake dispatch. Call it inside :data:`no_dispatch`."""
    shape, stride, _, device = layout
    return _wrap_meta(base.fake_mode, torch.Tensor.as_strided(base, shape, stride, storage_offset), device)


# device -> a new FakeTensor's normalized device and attributes
_FAKE_FIELDS: dict[torch.device, tuple[torch.device, dict[str, Any]]] = {}


def _wrap_meta(fake_mode: Any, meta: torch.Tensor, device: torch.device) -> torch.Tensor:
    """``FakeTensor(fake_mode, meta, device)``, at a third of the cost: the attributes its
    constructor sets one by one (devices, empty memos) are copied from the first one made
    for ``device``. Recording a 1000-layer policy makes tens of thousands of these."""
    known = _FAKE_FIELDS.get(device)
    if known is None or _FakeTensorConfig.debug:  # debug mode records a traceback per tensor
        fake = _FakeTensor(fake_mode, meta, device)
        if not _FakeTensorConfig.debug:
            _FAKE_FIELDS[device] = fake.fake_device, {k: v for k, v in vars(fake).items() if k != "fake_mode"}
        return fake
    fake_device, fields = known
    fake = torch.Tensor._make_subclass(
        _FakeTensor, meta, meta.requires_grad, dispatch_device=True, device_for_backend_keys=fake_device
    )
    if fake_mode._allow_unsafe_data_ptr_access:
        torch._C._set_warn_deprecated_on_mutable_data_ptr(fake)
    else:
        torch._C._set_throw_on_mutable_data_ptr(fake)
    vars(fake).update(fields)
    fake.fake_mode = fake_mode
    return fake


def set_node_arguments(node: torch.fx.Node, args: tuple, kwargs: dict) -> None:
    """``node.args, node.kwargs = args, kwargs`` for a node just created. Assigning them
    also takes the node out of and back into the graph's lookup table by op and target,
    which do not change: a third of the cost of recording a node."""
    node._update_args_kwargs(args, kwargs)


# View ops whose result's storage offset is the input's plus an amount that depends only on
# the arguments and the input's shape and strides (not as_strided: its offset is absolute).
_aten = torch.ops.aten
VIEWS = frozenset(
    {
        _aten.view.default,
        _aten.squeeze.default,
        _aten.squeeze.dim,
        _aten.squeeze.dims,
        _aten.unsqueeze.default,
        _aten.expand.default,
        _aten.permute.default,
        _aten.t.default,
        _aten.transpose.int,
        _aten.alias.default,
        _aten.slice.Tensor,
        _aten.select.int,
    }
)


def shape_arguments(func: Any, args: tuple) -> tuple:
    """``args`` with what does not affect the result's metadata left out: for
    ``constant_pad_nd``, only each dimension's total padding (the pieces that
    ``fxgrad.runtime.state.flat`` pads to different offsets share one signature)."""
    if func is _aten.constant_pad_nd.default and len(args) >= 2:
        pad = list(args[1])
        return (args[0], tuple(pad[i] + pad[i + 1] for i in range(0, len(pad) - 1, 2)), *args[2:])
    return args


@functools.cache
def returns_new_tensors(func: Any) -> bool:
    """Whether ``func`` returns new tensors whose metadata follows from its arguments'
    metadata alone: an ATen or prims op that mutates nothing, aliases nothing, and whose
    output shape does not depend on tensor values (``nonzero`` does)."""
    if not isinstance(func, torch._ops.OpOverload) or func.namespace not in ("aten", "prims"):
        return False
    schema = func._schema
    value_dependent = {torch.Tag.dynamic_output_shape, torch.Tag.data_dependent_output}
    return (
        not schema.is_mutable
        and not value_dependent.intersection(func.tags)
        and len(schema.returns) > 0
        and all(r.alias_info is None and str(r.type) == "Tensor" for r in schema.returns)
        and all(a.alias_info is None for a in schema.arguments)
    )


def tensors_in(value: Any) -> list[torch.Tensor]:
    """The tensors in a nested output (tuples, dicts, Hugging Face ``ModelOutput``, and the
    dataclasses and ``SimpleNamespace`` objects no pytree registration opens)."""
    found = []
    for leaf in _pytree.tree_leaves(value):
        if isinstance(leaf, torch.Tensor):
            found.append(leaf)
        elif dataclasses.is_dataclass(leaf) and not isinstance(leaf, type):
            found += tensors_in([getattr(leaf, field.name) for field in dataclasses.fields(leaf)])
        elif isinstance(leaf, types.SimpleNamespace):
            found += tensors_in(list(vars(leaf).values()))
    return found


def inductor_compile(
    gm: torch.fx.GraphModule,
    example_inputs: list,
    rewrite_backward: BackwardRewrite,
    config_patches: dict | None = None,
) -> Any:
    """Compile with Inductor, calling ``rewrite_backward(bw_gm)`` on the backward graph.

    The hook runs on the decomposed backward graph before Inductor's
    post-grad passes, scheduling and fusion, so inserted ops are fused.
    ``config_patches`` come from :func:`inductor_config_patches`. A backward the
    hook says must not be cached compiles without Inductor's FX graph cache, and
    AOTAutograd saves no entry for a compile whose graphs that cache did not hold.
    """

    def inner_compile(graph: torch.fx.GraphModule, inputs: list, **kwargs: Any) -> Any:
        if kwargs.get("is_backward") and not rewrite_backward(graph):
            with _inductor_config.patch(fx_graph_cache=False):
                return _compile_fx.compile_fx_inner(graph, inputs, **kwargs)
        return _compile_fx.compile_fx_inner(graph, inputs, **kwargs)

    return _compile_fx.compile_fx(gm, example_inputs, inner_compile=inner_compile, config_patches=config_patches)


def inductor_compile_program(gm: torch.fx.GraphModule, updates: bool = False) -> Callable[..., Any]:
    """Compile a graph that is no model's forward (the step program) with Inductor.

    The graph is already what AOTAutograd hands Inductor: ATen ops after Inductor's
    decompositions, functional but for the ``aten.copy_`` into inputs that end it,
    fake values in ``meta["val"]``, returning a tuple. So it goes to ``compile_fx_inner``
    directly (a quarter less compile time than tracing it again with ``compile_fx``),
    in a tracing context holding its fake mode, whose shape environment Inductor's FX
    graph cache needs (without one the cache passes the graph by, and every new
    process would compile it again). Called with the inputs as positional arguments;
    the ``copy_`` write into the caller's tensors. Without Inductor's check of each
    input's size and strides on every call (a tenth of a 98-gradient program's time on
    the CPU): the caller runs a program only on the layout it was built for.

    Inductor's settings for it (``updates``: it runs an optimizer's update): :func:`program_settings`.
    """
    fakes = [node.meta["val"] for node in gm.graph.find_nodes(op="placeholder")]
    devices = {fake.device.type for fake in fakes}
    # Dynamo's lock: Inductor compiles one graph at a time per process (a loop in another thread
    # may be compiling), and the settings patched here are the process's
    with torch._dynamo.convert_frame.compile_lock:
        with torch._guards.tracing(torch._guards.TracingContext(detect_fake_mode(fakes))):
            with _inductor_config.patch(program_settings(devices, updates)):
                compiled = _compile_fx.compile_fx_inner(gm, fakes)
    return lambda *args: compiled(list(args))


def program_settings(devices: set[str], updates: bool = False) -> dict[str, Any]:
    """The Inductor settings a step program over gradients on ``devices`` compiles with
    (``updates``: it runs an optimizer's update too).

    On the CPU, one OpenMP region per small gradient costs more than its reduction: the deep
    MLP's 98-gradient program took 1.7x as long as with each thread given 4096 elements. An
    update reads and writes four tensors per gradient, and pays for the region from 1024
    elements: the deep MLP's program with AdamW's update took 0.42-0.43 ms a call against
    0.56-0.61 ms with 4096 (2 threads, 2026-12-05). On a
    GPU the program's kernels are independent per gradient (a norm each, then a scale each),
    and Inductor's combo kernels launch up to eight of them as one: GPT-2 124M's global clip
    went from 287 launches to 42, and step scope from 1.20 to 1.11 of the step without a
    policy (H200, docs/performance.md, "On a GPU"). The C++ backend leaves CPU kernels out
    of combo kernels, but torch 2.13 would still estimate their peak memory: the CPU's
    programs compile without them.
    """
    settings: dict[str, Any] = {
        "size_asserts": False,
        "cpp.min_chunk_size": max(_inductor_config.cpp.min_chunk_size, 1024 if updates else 4096),
    }
    if devices - {"cpu"}:
        settings["combo_kernels"] = True
    return settings


def inductor_config_patches(mode: str | None, options: dict | None) -> dict:
    """The Inductor settings ``torch.compile(mode=..., options=...)`` asks for, as its
    own Inductor backend applies them (torch passes both to a custom backend)."""
    import torch._inductor as inductor

    try:
        patches = dict(inductor.list_mode_options(mode)) if mode and mode != "default" else {}
    except RuntimeError as error:  # "Unrecognized mode=..., should be one of: ..."
        raise ValueError(f"mode: {error}") from None
    if options is None:
        return patches
    if not isinstance(options, dict):
        raise TypeError(f"options must be a dict of Inductor settings, got {type(options).__name__}")
    known = inductor.config.get_config_copy()
    for key, value in options.items():
        if not isinstance(key, str):
            raise TypeError(f"options keys must be Inductor setting names (str), got {key!r}")
        name = key.replace("-", "_")
        if name not in known:
            raise ValueError(f"options: {key!r} is not an Inductor setting (see torch._inductor.list_options())")
        patches[name] = value
    return patches


def aot_eager_compile(
    gm: torch.fx.GraphModule,
    example_inputs: list,
    rewrite_backward: BackwardRewrite,
    config_patches: dict | None = None,
) -> Any:
    """AOTAutograd without codegen: both graphs run as plain FX code (no Inductor
    settings apply: ``config_patches`` must be empty)."""
    if config_patches:
        raise ValueError("mode= and options= configure Inductor; this backend has compiler='aot_eager'")
    from functorch.compile import make_boxed_func

    def forward_compiler(graph: torch.fx.GraphModule, inputs: list) -> Any:
        return make_boxed_func(graph.forward)

    def backward_compiler(graph: torch.fx.GraphModule, inputs: list) -> Any:
        rewrite_backward(graph)
        return make_boxed_func(graph.forward)

    backend = _aot_autograd(fw_compiler=forward_compiler, bw_compiler=backward_compiler)
    return backend(gm, example_inputs)


@contextlib.contextmanager
def autograd_cache_bypassed() -> Iterator[None]:
    """Keep AOTAutograd's on-disk cache out of one compile.

    That cache is keyed on the forward (Dynamo) graph, not on the rewritten
    backward, so without a key that holds the policy (:func:`cache_keyed`)
    another policy's backward could come back from disk. Inductor's FX graph
    cache still applies: it is keyed on the graph after fxgrad's rewrite.
    """
    with _functorch_config.patch(enable_autograd_cache=False, enable_remote_autograd_cache=False):
        yield


def autograd_cache_enabled() -> bool:
    """Whether AOTAutograd's on-disk cache is on (it needs Inductor's FX graph cache)."""
    return bool(_functorch_config.enable_autograd_cache and _inductor_config.fx_graph_cache)


# torch.compile(..., isolate_recompiles=) came in torch 2.13; bench/gpu.sh's device image has 2.11.
TORCH_COMPILE_ISOLATES = "isolate_recompiles" in inspect.signature(torch.compile).parameters


class _CacheKey(_CustomGraphPass):
    """A post-grad pass that adds ``key`` to both on-disk cache keys and otherwise runs
    ``passes`` (those the settings held, where torch takes a single pass)."""

    def __init__(self, key: str, passes: Sequence[_CustomGraphPass] = ()) -> None:
        self.key, self.passes = key, tuple(passes)

    def __call__(self, graph: torch.fx.Graph) -> None:
        for graph_pass in self.passes:
            graph_pass(graph)

    def uuid(self) -> Any:
        # a plain function there has no uuid: Inductor then does not cache, and neither does this
        uuids = tuple(getattr(graph_pass, "uuid", lambda: None)() for graph_pass in self.passes)
        return None if None in uuids else (*uuids, self.key) if uuids else self.key  # None: do not cache


def cache_keyed(config_patches: dict, key: str) -> dict:
    """``config_patches`` plus ``key`` in the keys of AOTAutograd's and Inductor's on-disk caches.

    Both hash Inductor's settings, and in them each custom post-grad pass's ``uuid()``; this
    adds a pass that does nothing, after any the settings already hold (before torch 2.13,
    which takes one pass, the added pass runs those)."""
    current = config_patches.get("post_grad_custom_post_pass", _inductor_config.post_grad_custom_post_pass)
    if _custom_graph_passes is not None:
        passes = (*_custom_graph_passes(current), _CacheKey(key))
    else:
        passes = _CacheKey(key, () if current is None else (current,))
    return {**config_patches, "post_grad_custom_post_pass": passes}


def current_frame_scope() -> tuple[dict, dict] | None:
    """``(f_locals, f_globals)`` of the frame Dynamo is compiling, if any."""
    tx = getattr(_symbolic_convert.tls, "current_tx", None)
    if tx is None:
        return None
    return tx.f_locals, tx.f_globals


def wrap_compiled_call(model: torch.nn.Module, wrap: Callable[[Callable[..., Any]], Any]) -> Any:
    """Replace the call that ``model.compile()`` installed (``model(x)`` runs it instead of the
    eager ``_call_impl``) with ``wrap(call)``, and return that: code around each compiled call,
    outside Dynamo."""
    model._compiled_call_impl = wrapped = wrap(model._compiled_call_impl)
    return wrapped


@contextlib.contextmanager
def compiled_call_set_aside(model: torch.nn.Module) -> Iterator[None]:
    """Within the block ``model(x)`` runs its eager ``_call_impl``, not the call ``model.compile()``
    installed (a compile of the model around it would otherwise meet the compiled call inside,
    and Dynamo runs such a frame eagerly)."""
    call, model._compiled_call_impl = model._compiled_call_impl, None
    try:
        yield
    finally:
        model._compiled_call_impl = call


def compile_call() -> tuple[Any, bool]:
    """The ``model`` and ``disable`` arguments of the ``torch.compile(model, ...)`` call on the
    stack, or ``(None, False)``.

    ``torch.compile`` reads a callable backend's ``__name__`` once, while it wraps
    the backend (``_TorchCompileWrapper``; with ``disable=True`` too); a backend calls this
    from there to learn what it compiles: a module, ``Module.compile``'s bound
    ``_call_impl``, another bound method or a function (docs/design.md, fact 14).
    """
    frame = sys._getframe(1)
    while frame is not None:  # torch's own function, by its file: Lightning's Trainer wraps torch.compile
        code = frame.f_code
        if code.co_name == "compile" and code.co_filename == torch.__file__:
            return frame.f_locals.get("model"), bool(frame.f_locals.get("disable"))
        frame = frame.f_back
    return None, False


def source_chain(placeholder: torch.fx.Node) -> list[str]:
    """Names of a Dynamo placeholder's source and of its ancestors, root first.

    E.g. ``["L['self']", "L['self']._modules['fc1']", ...]``. Each name is a
    Python expression over ``L`` (the frame's locals) and ``G`` (its globals).
    """
    grapharg = placeholder.meta.get("grapharg")
    source = getattr(grapharg, "source", None)
    names = []
    while source is not None:
        names.append(source.name)
        source = getattr(source, "base", None)
    return names[::-1]


def compile_id(gm: torch.fx.GraphModule) -> tuple[tuple[int | None, int | None], int]:
    """``((frame_id, frame_compile_id), attempt)`` of the Dynamo graph being compiled.

    A graph break continues the forward in a new frame (new ``frame_id``); a
    recompile of a frame gets a new ``frame_compile_id``; Dynamo may restart
    the analysis of one compile, and graphs of an earlier ``attempt`` are
    then thrown away.
    """
    trace = torch._guards.CompileContext.current_trace_id()
    cid = trace.compile_id if trace is not None else gm.meta.get("dynamo_compile_id")
    frame = (getattr(cid, "frame_id", None), getattr(cid, "frame_compile_id", None))
    return frame, trace.attempt if trace is not None else 0


def generated_code(fn: Callable[[], Any]) -> list[str]:
    """Run ``fn`` and return the source of every module Inductor generated meanwhile.

    Unlike ``torch._inductor.utils.run_and_get_code`` this does not reset Dynamo first,
    which would drop every other compiled model's graphs and turn compiled autograd off.
    Torch's compile caches are off inside, so that a graph an earlier process compiled
    is generated again rather than loaded without its source.
    """
    from unittest import mock

    from torch._inductor.graph import GraphLowering

    sources: list[str] = []
    with (
        torch.compiler.config.patch(force_disable_caches=True),
        mock.patch.object(GraphLowering, "save_output_code", sources.append),
    ):
        fn()
    return list(dict.fromkeys(sources))


def reset_dynamo() -> None:
    """Forget every compiled frame (tests use it between cases)."""
    torch._dynamo.reset()


def rnn_capture_enabled() -> bool:
    """Whether Dynamo traces ``nn.RNN``/``nn.LSTM``/``nn.GRU`` (off by default)."""
    return bool(torch._dynamo.config.allow_rnn)


def dynamo_config() -> Any:
    """``torch._dynamo.config``, for the settings fxgrad documents."""
    return torch._dynamo.config


def compiled_autograd_requested() -> bool:
    """Whether a backward may run under compiled autograd: its context is active now, or
    ``torch._dynamo.config.compiled_autograd`` asks for it in compiled functions."""
    from torch._dynamo import compiled_autograd

    return compiled_autograd.compiled_autograd_enabled or torch._dynamo.config.compiled_autograd


def compiled_autograd_running() -> bool:
    """Whether compiled autograd runs the backward now (asked from an autograd hook, which its
    graph calls): the config alone does not make an eager ``backward()`` run under it."""
    from torch._dynamo import compiled_autograd

    return compiled_autograd.in_compiled_autograd_region


def compiled_autograd(compiler: Callable) -> contextlib.AbstractContextManager:
    """A context in which backward passes run under compiled autograd, compiled by
    ``compiler`` (e.g. ``torch.compile(backend="inductor")``). Module backward hooks need it
    under ``torch.compile``; fxgrad's in-graph scope refuses it (docs/design.md, fact 12)."""
    from torch._dynamo import compiled_autograd as _compiled_autograd

    return _compiled_autograd._enable(compiler)


def grad_scaler_scale(scaler: Any) -> torch.Tensor | None:
    """The device tensor holding a ``torch.amp.GradScaler``'s current scale.

    ``None`` until the scaler's first ``scale()`` call creates it; ``update()``
    changes it in place.
    """
    return scaler._scale


def grad_scaler_unscaled(scaler: Any) -> set[int]:
    """The ids of the optimizers whose gradients ``scaler`` unscaled and that have not stepped
    since (``scaler.unscale_(optimizer)``, or ``scaler.step(optimizer)`` of a non-fused one, in
    its update): a later backward writes scaled gradients again, until ``scaler.update()``."""
    return _grad_scaler_at("UNSCALED", scaler)


def grad_scaler_stepped(scaler: Any) -> set[int]:
    """The ids of the optimizers ``scaler.step()`` stepped since the last ``scaler.update()``."""
    return _grad_scaler_at("STEPPED", scaler)


def _grad_scaler_at(stage: str, scaler: Any) -> set[int]:
    from torch.amp.grad_scaler import OptState

    wanted = OptState[stage]
    return {key for key, state in scaler._per_optimizer_states.items() if state["stage"] is wanted}


def optimizer_step_hooks(optimizer: torch.optim.Optimizer) -> int:
    """How many step pre- and post-hooks ``optimizer`` has of its own (``register_step_pre_hook``,
    ``register_step_post_hook``), and of every optimizer (``register_optimizer_step_pre_hook``, ...)."""
    from torch.optim import optimizer as module

    own = len(optimizer._optimizer_step_pre_hooks) + len(optimizer._optimizer_step_post_hooks)
    return own + len(module._global_optimizer_pre_hooks) + len(module._global_optimizer_post_hooks)


def initialising_optimizer_state() -> bool:
    """Whether ``torch.distributed.checkpoint``'s ``_init_optim_state`` is on the stack: the
    ``optimizer.step()`` it makes with zero gradients and learning rate 0 to create the state
    of an optimizer that has none (``get_state_dict``, ``set_state_dict`` and their optimizer
    variants do, before any training step of a fresh process). No training step: fxgrad's
    hooks leave it alone."""
    module = sys.modules.get("torch.distributed.checkpoint.state_dict")
    if module is None:  # not imported: not on the stack
        return False
    code = module._init_optim_state.__code__
    frame = sys._getframe(1)
    while frame is not None:
        if frame.f_code is code:
            return True
        frame = frame.f_back
    return False


def stepping_grad_scaler() -> Any:
    """The enabled ``GradScaler`` whose ``step()`` is calling ``optimizer.step()`` now, or ``None``.

    Read from the call stack (``scaler.step(optimizer)`` leaves no other trace on a non-fused
    optimizer once it has unscaled the gradients): for a check run once per optimizer."""
    from torch.amp.grad_scaler import GradScaler

    codes = {GradScaler.step.__code__, GradScaler._maybe_opt_step.__code__}
    frame = sys._getframe(1)
    while frame is not None:
        scaler = frame.f_locals.get("self") if frame.f_code in codes else None
        if isinstance(scaler, GradScaler) and scaler.is_enabled():
            return scaler
        frame = frame.f_back
    return None


def is_compiled_module(model: Any) -> bool:
    """Whether ``model`` is the module ``torch.compile(module)`` returned."""
    return isinstance(model, torch._dynamo.eval_frame.OptimizedModule)


def unwrap_model(model: Any) -> Any:
    """The model inside the wrappers that prefix its layers' names: data parallel's ``module``,
    ``torch.compile``'s ``_orig_mod`` and Lightning Fabric's ``_forward_module``
    (``fabric.setup(model)`` returns the model in a ``_FabricModule``, compiled again inside it
    when it was compiled before)::

        unwrap_model(torch.compile(DDP(model)))  # model
    """
    while True:
        if isinstance(model, (torch.nn.parallel.DistributedDataParallel, torch.nn.DataParallel)):
            model = model.module
        elif is_compiled_module(model):
            model = model._orig_mod
        elif type(model).__name__ == "_FabricModule" and hasattr(model, "_forward_module"):
            model = model._forward_module
        else:
            return model


def module_path(name: str) -> str:
    """A ``named_modules()`` name without the ``_orig_mod`` step of each submodule wrapped by
    ``torch.compile`` (``layers.0._orig_mod.attn`` -> ``layers.0.attn``, as in the eager model)."""
    if "_orig_mod" not in name:
        return name
    return ".".join(part for part in name.split(".") if part != "_orig_mod")


def exported_class(module: torch.nn.Module) -> type | str | None:
    """The class ``module`` was exported from, when ``torch.export.unflatten`` rebuilt it (the
    stages ``torch.distributed.pipelining.pipeline()`` makes are such modules): the class
    itself, its qualified name when no imported module holds it (a program loaded in a
    process that never imported the model's code), or ``None`` for other modules.

    An unflattened module is an ``InterpreterModule`` that keeps its original class's qualified
    name in ``_ty``. The class is looked up in the ``__dict__`` of modules already imported:
    never through ``getattr``, which would import a lazy package's submodule."""
    name = getattr(module, "_ty", None) if isinstance(module, _UNFLATTENED) else None
    if not isinstance(name, str) or not name:
        return None
    parts = name.split(".")
    for cut in range(len(parts) - 1, 0, -1):  # the longest imported prefix, then its attributes
        found: Any = sys.modules.get(".".join(parts[:cut]))
        if found is None:
            continue
        for attribute in parts[cut:]:
            found = vars(found).get(attribute) if hasattr(found, "__dict__") else None
        if found is None:  # not imported (yet), or out of reach (a class defined in a function)
            return name
        return found if isinstance(found, type) and issubclass(found, torch.nn.Module) else None
    return name


tensor_version: Callable[[torch.Tensor], int] = operator.attrgetter("_version")
"""The in-place modification counter of a tensor (bumped by ``add_``, ``copy_``, ...); a C
getter, which ``map`` runs over a step's gradients without a Python frame per tensor."""


def gradient_version(grad: torch.Tensor) -> int:
    """:data:`tensor_version` of a gradient, a count that grows with every in-place change. A
    DTensor's is the sum of its own and its local tensor's: FSDP2 adds a micro-batch's gradient
    into an existing ``.grad`` through ``_local_tensor``, which leaves the DTensor's counter as it
    was, and a DTensor's own in-place ops (``zero_``) leave the local tensor's."""
    return grad._version + grad._local_tensor._version if isinstance(grad, DTensor) else grad._version


def gradient_versions(grads: Sequence[torch.Tensor]) -> list[int]:
    """:func:`gradient_version` of each of ``grads``. Told by the first gradient (FSDP2's are all
    DTensors), so a plain list costs one C map."""
    if grads and isinstance(grads[0], DTensor):
        return list(map(gradient_version, grads))
    return list(map(tensor_version, grads))


def compiler_stance() -> str | None:
    """The arguments of the ``torch.compiler.set_stance`` in effect (``"'force_eager'"``,
    ``"force_backend='eager'"``), or ``None`` under the default stance."""
    stance = torch._dynamo.eval_frame._stance  # set_stance replaces the object
    if stance.backend is not None:
        return f"force_backend={getattr(stance.backend, '__name__', stance.backend)!r}"
    return None if stance.stance == "default" else repr(stance.stance)


def backward_pass_id() -> int:
    """The id of the backward pass running now (autograd's graph task), -1 outside one: hooks
    that fire in one ``backward()`` see the same id, and each pass a new one."""
    return torch._C._current_graph_task_id()


def running_autograd_node() -> Any:
    """The autograd node whose hooks run now, ``None`` between nodes: in a backward pass's
    final callbacks (``queue_callback``), and outside one."""
    return torch._C._current_autograd_node()


def compiled_backward_nodes(outputs: Any) -> set:
    """The autograd nodes of AOTAutograd's compiled backward that ``outputs`` (the results of
    one call of a compiled graph) come straight from; outputs that are views have a view
    node of their own in front, and are left out."""
    return {
        t.grad_fn
        for t in tensors_in(outputs)
        if t.grad_fn is not None and type(t.grad_fn).__name__ == "CompiledFunctionBackward"
    }


def backward_computes(leaf: torch.Tensor) -> bool:
    """Whether the backward pass running now computes ``leaf``'s gradient: ``False`` for a
    ``torch.autograd.grad`` of other tensors (an input's) or a ``backward(inputs=...)`` without
    it; ``True`` where autograd cannot tell (``torch.autograd.grad`` of ``leaf`` itself)."""
    try:
        return torch._C._will_engine_execute_node(torch.autograd.graph.get_gradient_edge(leaf).node)
    except RuntimeError:  # "a leaf node was passed ... while running autograd.grad()"
        return True


def accumulated_leaves(node: Any) -> list[torch.Tensor | None]:
    """For each input of the autograd ``node``, in the order of the gradients it returns: the
    leaf tensor whose ``.grad`` that gradient goes to (its next function is an
    ``AccumulateGrad``), else ``None``."""
    return [
        fn.variable if fn is not None and type(fn).__name__ == "AccumulateGrad" else None
        for fn, _ in node.next_functions
    ]


def has_grad_hooks(tensor: torch.Tensor) -> bool:
    """Whether ``tensor`` has hooks from ``Tensor.register_hook``: autograd runs them on a
    leaf's gradient after the backward that produced it, before accumulating it into ``.grad``."""
    return bool(tensor._backward_hooks)


def layout_check(tensors: Sequence[torch.Tensor]) -> Callable[[Sequence[torch.Tensor]], bool]:
    """A check that other tensors match ``tensors`` one to one in size, strides, dtype, device,
    ``requires_grad`` and dispatch keys: Dynamo's own guard, in C++ (5 us for 98 tensors
    where a Python tuple of the same takes 40 us)."""
    from torch._C._dynamo.guards import TensorGuards

    guards = TensorGuards(
        *tensors,
        dynamic_dims_sizes=[list(t.shape) for t in tensors],
        dynamic_dims_strides=[list(t.stride()) for t in tensors],
    )
    count = len(tensors)
    return lambda others: len(others) == count and guards.check(*others)


def may_record_grad(gm: torch.fx.GraphModule) -> bool:
    """Whether running Dynamo's graph ``gm`` may record autograd history: grad mode is on as
    the backend compiles it (Dynamo compiles a graph in the mode its code starts in), or the
    graph turns it on. A compiled ``optimizer.step()`` runs under ``no_grad`` throughout."""
    return torch.is_grad_enabled() or any(
        bool(node.args and node.args[0])
        for node in gm.graph.find_nodes(op="call_function", target=torch._C._set_grad_enabled)
    )


def may_have_backward(gm: torch.fx.GraphModule) -> bool:
    """Whether Dynamo's graph ``gm``, compiled in grad mode, may have a backward: an output may
    require grad (its example value does, or has none to tell), or the graph writes into a
    tensor in place (a forward that copies its result into a buffer it was given returns
    nothing). A graph that does neither (its code under ``torch.no_grad``, a target network's
    after a graph break) has none, whatever its inputs require."""
    if any(_writes_in_place(node) for node in gm.graph.nodes):
        return True
    outputs = torch.utils._pytree.tree_leaves(gm.graph.output_node().args)
    return any(
        isinstance(node, torch.fx.Node)
        and (not isinstance(value := node.meta.get("example_value"), torch.Tensor) or value.requires_grad)
        for node in outputs
    )


def _writes_in_place(node: torch.fx.Node) -> bool:
    """Whether a node of a Dynamo graph may write a tensor in place (``x.copy_(y)``, ``x[i] = y``)."""
    if node.op not in ("call_method", "call_function"):
        return False
    name = node.target if node.op == "call_method" else getattr(node.target, "__name__", "")
    return name == "setitem" or (name.endswith("_") and not name.startswith("_"))


def foreach_norm(tensors: list[torch.Tensor], dtype: torch.dtype | None = None) -> list[torch.Tensor]:
    """The L2 norm of each tensor, in as few kernels as torch can; computed in ``dtype`` when
    given (else each tensor's own)."""
    return list(torch._foreach_norm(tensors, 2, dtype=dtype))


def foreach_mul_(tensors: list[torch.Tensor], factor: torch.Tensor) -> None:
    """Multiply each of ``tensors`` by the 0-dim ``factor`` in place, in as few kernels as torch can."""
    torch._foreach_mul_(tensors, factor)


def data_parallel_world_size() -> int:
    """Processes in the default process group (1 outside torch.distributed)."""
    import torch.distributed as dist

    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def all_reduce(value: torch.Tensor, op: str, group: str) -> torch.Tensor:
    """``value`` all-reduced (``op``: ``"sum"``, ``"max"``) over the process group named
    ``group``, as the functional collective ops a traced graph records and Inductor
    compiles (the public ``torch.distributed._functional_collectives`` wraps the
    same ops in a tensor subclass that waits lazily)."""
    functional = torch.ops._c10d_functional
    return functional.wait_tensor(functional.all_reduce(value, op, group))


# ---------------------------------------------------------------------------
# Kernel origins, for fxgrad.explain(..., kernels=True) (fxgrad/frontend/kernels.py).
# Inductor's provenance tracking (config.trace.provenance_tracking_level) records, for
# every kernel it launches, the post-grad FX nodes the kernel came from, and writes one
# "[Provenance debug handles] <kernel>:<handle>" comment per launch into the output code.


@dataclasses.dataclass
class GeneratedModule:
    """One module Inductor generated: ``launches`` holds, in launch order, each kernel's
    name, whether Inductor generated it (``False``: an extern kernel such as
    ``extern_kernels.mm`` or a fallback op), and the names of the post-grad FX nodes it
    came from; ``graph`` is that post-grad graph (``None`` if Inductor did not say)."""

    aot_id: str | None  # "0_forward", "0_backward", "1_inference"
    is_backward: bool
    code: str
    launches: list[tuple[str, bool, list[str]]]
    graph: torch.fx.Graph | None


_AOT_ID = re.compile(r"^# AOT ID: \['([^']+)'\]", re.MULTILINE)
_PROVENANCE_HANDLE = re.compile(r"\[Provenance debug handles\] (\S+):(\d+)\s*$", re.MULTILINE)


@contextlib.contextmanager
def inductor_kernel_origins(on_module: Callable[[GeneratedModule], None]) -> Iterator[None]:
    """Call ``on_module`` with every module Inductor generates inside the block.

    Turns on Inductor's provenance tracking and, so that every graph is lowered
    here rather than loaded with its kernels already named, off its FX graph
    cache; torch's provenance records are restored afterwards.
    """
    from unittest import mock

    import torch._inductor.config as inductor_config
    import torch._inductor.debug as inductor_debug
    from torch._inductor.graph import GraphLowering
    from torch._inductor.virtualized import V

    outer = GraphLowering.save_output_code  # e.g. generated_code() around the block

    def save(code: str) -> None:
        origins = inductor_debug._inductor_triton_kernel_to_post_grad_node_info  # replaced per compile: read now
        launches = []
        for match in _PROVENANCE_HANDLE.finditer(code):
            name = match.group(1)
            generated = re.search(rf"^{re.escape(name)} = async_compile\.", code, re.MULTILINE) is not None
            launches.append((name, generated, list(origins.get(f"{name}:{match.group(2)}", ()))))
        lowering = V.graph  # the GraphLowering that generated ``code``
        graph = getattr(getattr(lowering, "module", None), "graph", None)
        aot_id = _AOT_ID.search(code)
        is_backward = getattr(lowering, "is_backward", None)
        if is_backward is None:
            is_backward = aot_id is not None and aot_id.group(1).endswith("_backward")
        on_module(GeneratedModule(aot_id.group(1) if aot_id else None, bool(is_backward), code, launches, graph))
        if outer is not None:
            outer(code)

    import torch._inductor.codegen.triton as triton_codegen

    patches = {"trace.provenance_tracking_level": 2, "fx_graph_cache": False}
    record = triton_codegen.set_kernel_post_grad_provenance_tracing
    with (
        inductor_config.patch(patches),
        inductor_debug.reset_provenance_globals(),
        mock.patch.object(GraphLowering, "save_output_code", save),
        mock.patch.object(triton_codegen, "set_kernel_post_grad_provenance_tracing", fused_parts_recorded(record)),
    ):
        yield


def fused_parts_recorded(record: Callable[..., Any]) -> Callable[..., Any]:
    """``record`` (torch's provenance recorder for a Triton kernel) given the parts of fused
    scheduler nodes. torch records each scheduler node's own IR node, and a fused one has
    none: a combo kernel's sub-kernels that Inductor had fused first (a gradient's scale fused
    with the factor's math) went unrecorded, and their nodes looked as if no kernel held them
    (seen on an H200 under torch 2.11, bench/results/gpu_kernels.txt; torch 2.13 records the
    same way). Other kernels' schedules hold unfused nodes already and pass unchanged."""

    def recorded(node_schedule: Any, *args: Any, **kwargs: Any) -> Any:
        if isinstance(node_schedule, list):
            node_schedule = [
                part
                for node in node_schedule
                for part in (node.get_nodes() if getattr(node, "node", False) is None else (node,))
            ]
        return record(node_schedule, *args, **kwargs)

    return recorded
