"""fxgrad's gradient policies in the Hugging Face ``Trainer``: :func:`prepare` and :class:`FxgradTrainerCallback`.

::

    import fxgrad
    from transformers import Trainer, TrainingArguments
    from fxgrad.integrations.transformers import prepare

    args = TrainingArguments(output_dir="out", logging_steps=10)
    policy = fxgrad.chain(fxgrad.monitor(), fxgrad.clip_by_global_norm(1.0))
    model, callback = prepare(model, policy, args)  # compiles the model in place; sets max_grad_norm=0
    Trainer(model=model, args=args, train_dataset=data, callbacks=[callback]).train()

``prepare`` compiles the model in place with fxgrad's backend before the Trainer sees it (it keeps
its class, its ``state_dict`` keys and its forward's signature, as the Trainer's own compile does,
so checkpoints load with ``from_pretrained`` and evaluation finds the labels): the Trainer's own
``torch_compile_backend="fxgrad"`` is refused by accelerate (``ValueError: 'FXGRAD' is not a valid
DynamoBackend``, accelerate 1.15). The policy runs inside the backward graph, or in step scope (at
``optimizer.step()``, on the accumulated, unscaled gradient) when ``gradient_accumulation_steps > 1`` or
``fp16`` ask for it. The callback adds the statistics to the Trainer's log entries at ``logging_steps``.

Reference: docs/integrations.md.
"""

from __future__ import annotations

import dataclasses
import inspect
import os
from typing import Any, Iterable

import torch
import torch.nn as nn
from transformers import TrainerCallback, TrainingArguments
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR

from fxgrad.core import validate
from fxgrad.core.layers import DEFAULT_SKIP, SkipEntry
from fxgrad.core.rule import Transform, check_transform
from fxgrad.core.warn import warn
from fxgrad.frontend.backend import Backend
from fxgrad.integrations import StatsLog, check_prefix, check_stats

__all__ = ["FxgradTrainerCallback", "prepare"]


class FxgradTrainerCallback(TrainerCallback):
    """Checks the ``TrainingArguments`` against ``backend`` and logs its statistics with the Trainer's.

    * ``stats``: fnmatch patterns choosing which of ``backend.stats()`` to log (default all; ``()`` none).
    * ``prefix``: prepended to each logged name (``"fxgrad/grad_norm/total"``).

    When the Trainer logs the training loss (every ``logging_steps``), the statistics are copied to the host
    (one copy, the only sync) and added to that log entry: ``trainer.state.log_history`` and the callbacks
    after this one see them. Reporting integrations (``report_to``) run before user callbacks; to send the
    statistics to them, put this callback first:
    ``trainer.callback_handler.callbacks.insert(0, trainer.pop_callback(FxgradTrainerCallback))``.

    Each checkpoint the Trainer saves gets the backend's state (``fxgrad_state.pt``: autoclip's history,
    zclip's statistics, ...), and ``trainer.train(resume_from_checkpoint=...)`` loads it back from
    ``<output_dir>/checkpoint-<step>`` or ``TrainingArguments.resume_from_checkpoint``, if it was saved with
    the weights the Trainer resumed from. A resumed run that finds none, or only another run's, warns that
    the policy's state starts over.

    When the Trainer is built it raises ``ValueError`` naming a setting that conflicts with the policy (see
    :func:`prepare`). Usually made by :func:`prepare`::

        model, callback = prepare(model, fxgrad.clip_by_global_norm(1.0), args)
    """

    def __init__(self, backend: Backend, *, stats: Iterable[str] = ("*",), prefix: str = "fxgrad/") -> None:
        if not isinstance(backend, Backend):
            raise TypeError(f"backend must be an fxgrad.backend(...), got {type(backend).__name__}")
        self.backend = backend
        self.stats = check_stats(stats)
        self.prefix = check_prefix(prefix)
        self._stats_log = StatsLog(self.stats, self.prefix)
        self._resumed_without: tuple[int, str] | None = None  # a resumed run's step and where no state was

    def check(self, args: TrainingArguments, model: nn.Module | None = None) -> None:
        """Raise ``ValueError`` naming the first setting of ``args`` that conflicts with the backend
        (and with ``model``, the one the Trainer trains, when given)."""
        conflicts = {
            "max_grad_norm": (
                args.max_grad_norm > 0,
                "clips the gradients again after fxgrad's policy: set max_grad_norm=0 (for the same clipping, "
                f"put fxgrad.clip_by_global_norm({args.max_grad_norm}) in the policy)",
            ),
            "torch_compile": (
                args.torch_compile,
                "compiles the model a second time, with a backend other than fxgrad's: leave torch_compile, "
                "torch_compile_backend and torch_compile_mode unset (setting either of the last two sets it); "
                "fxgrad's backend compiles the model (prepare() or backend.compile)",
            ),
            "fsdp": (
                bool(args.fsdp),
                "shards the parameters through accelerate, and prepare() compiled the unsharded model: fxgrad "
                "would see one rank's shards, unreduced (FSDP1 flattens them too); train with DDP, or shard with "
                "FSDP2's fully_shard in your own loop (docs/distributed.md)",
            ),
            "deepspeed": (
                args.deepspeed is not None,
                "partitions the gradients (ZeRO) and clips them itself, where fxgrad sees no layers; train with "
                "DDP, or leave the gradient policy to DeepSpeed",
            ),
            "remove_unused_columns": (
                args.remove_unused_columns and model is not None and _hides_signature(model),
                "drops every input: the compiled module's forward takes (*args, **kwargs); set it to False and "
                "give the Trainer only the model's inputs, or compile the model in place "
                "(prepare() does: backend.compile(model, in_place=True))",
            ),
        }
        if self.backend.current_scope() == "graph":
            conflicts["gradient_accumulation_steps"] = (
                args.gradient_accumulation_steps > 1,
                "sums several backwards, and scope='graph' transforms each one: use scope='step' (prepare(..., "
                "args) picks it)",
            )
            checkpointed = (
                "breaks the graph at each checkpointed layer, and a cross-layer rule in scope='graph' would see "
                "one layer at a time: use scope='step' (prepare(..., args) picks it)"
            )
            across = self.backend.transform.reduces_across_layers()
            conflicts["gradient_checkpointing"] = (args.gradient_checkpointing and across, checkpointed)
            conflicts["model.gradient_checkpointing_enable()"] = (_checkpointed(model) and across, checkpointed)
            conflicts["fp16"] = (
                args.fp16,
                "scales the loss with accelerate's GradScaler, which scope='graph' cannot read: use scope='step' "
                "(prepare(..., args) picks it)",
            )
        for name, (conflict, why) in conflicts.items():
            if conflict:
                setting = f"TrainingArguments({name}={getattr(args, name)!r})" if hasattr(args, name) else name
                raise ValueError(f"{setting} {why}")

    def on_init_end(self, args: TrainingArguments, state: Any, control: Any, **kwargs: Any) -> None:
        self.check(args, kwargs.get("model"))

    def on_save(self, args: TrainingArguments, state: Any, control: Any, **kwargs: Any) -> None:
        if not args.should_save:  # another process of the job saves
            return
        saved = self.backend.state_dict()
        if saved:
            folder = _checkpoint(args, state)
            os.makedirs(folder, exist_ok=True)
            torch.save({"state": saved, "weights": _fingerprint(kwargs["model"])}, os.path.join(folder, STATE_FILE))

    def on_train_begin(self, args: TrainingArguments, state: Any, control: Any, **kwargs: Any) -> None:
        self._resumed_without = None
        if state.global_step == 0:  # not resumed
            return
        # The Trainer tells callbacks the step it resumed at, not the checkpoint it loaded: look where it
        # saves, and where TrainingArguments(resume_from_checkpoint=...) points (HF's example scripts set it).
        folders = dict.fromkeys(f for f in (args.resume_from_checkpoint, _checkpoint(args, state)) if f)
        weights = _fingerprint(kwargs["model"])
        for path in (os.path.join(folder, STATE_FILE) for folder in folders):
            if not os.path.exists(path):
                continue
            saved = torch.load(path, map_location="cpu", weights_only=True)
            if torch.equal(saved["weights"], weights):
                self.backend.load_state_dict(saved["state"])
                return
            warn(
                f"fxgrad: {path} was saved with other weights than those the Trainer resumed from (another run's "
                "checkpoint at the same step?): not loaded",
                RuntimeWarning,
            )
        self._resumed_without = (state.global_step, " or ".join(folders))

    def on_step_end(self, args: TrainingArguments, state: Any, control: Any, **kwargs: Any) -> None:
        # Whether the policy keeps state shows once it ran: say then that a resumed run's starts over.
        if self._resumed_without is not None and self.backend.state_dict():
            step, folders = self._resumed_without
            warn(
                f"fxgrad: the Trainer resumed at step {step}, and no {STATE_FILE} of that checkpoint was found in "
                f"{folders}: the policy's state (autoclip's history, zclip's statistics, ...) started over. Set "
                "TrainingArguments(resume_from_checkpoint=<checkpoint>), or load it before train(): "
                f"callback.backend.load_state_dict(torch.load('<checkpoint>/{STATE_FILE}')['state'])",
                RuntimeWarning,
            )
        self._resumed_without = None

    def on_train_end(self, args: TrainingArguments, state: Any, control: Any, **kwargs: Any) -> None:
        self._stats_log.tell_unmatched(self.backend)

    def on_log(self, args: TrainingArguments, state: Any, control: Any, logs: dict | None = None, **kwargs) -> None:
        if logs is None or "loss" not in logs:  # evaluation and end-of-training entries
            return
        stats = self._stats_log.select(self.backend)
        if not stats:
            return
        values = dict(zip(stats, torch.stack(list(stats.values())).tolist()))  # the sync, at logging steps only
        logs.update(values)
        if state.log_history:  # Trainer.log appended its copy of logs just before calling on_log
            state.log_history[-1].update(values)


def prepare(
    model: nn.Module,
    policy: Transform,
    args: TrainingArguments | None = None,
    *,
    scope: str = "auto",
    skip: Iterable[SkipEntry] = DEFAULT_SKIP,
    compiler: str = "inductor",
    strict: bool = True,
    stats: Iterable[str] = ("*",),
    prefix: str = "fxgrad/",
    **compile_kwargs: Any,
) -> tuple[nn.Module, FxgradTrainerCallback]:
    """``model`` compiled in place with ``fxgrad.backend(policy)`` (:meth:`fxgrad.Backend.compile`,
    ``in_place=True``), and the callback to give the Trainer.

    With ``args``, it sets ``max_grad_norm=0`` when it has its default (1.0; the policy replaces the
    Trainer's clipping, and a ``UserWarning`` says so when the policy clips nothing); and with
    ``scope="auto"`` it picks ``scope="step"`` when ``gradient_accumulation_steps > 1``, ``fp16`` or
    ``gradient_checkpointing`` (in ``args``, or turned on on the model, as LoRA recipes do) (then the policy
    runs once per optimizer step on the accumulated, unscaled gradient, whatever graph breaks checkpointing
    makes), else the in-graph scope.
    A setting it cannot reconcile (another ``max_grad_norm``, ``torch_compile=True``, ``fsdp``, ``deepspeed``,
    ``scope="graph"`` with accumulation, ``fp16``, or checkpointing under a cross-layer rule) raises
    ``ValueError`` naming it, here or when the Trainer is built.

    ``scope``, ``skip``, ``compiler`` and ``strict`` are :func:`fxgrad.backend`'s; ``stats`` and ``prefix``
    the callback's; ``compile_kwargs`` (``dynamic=``, ``mode=``, ...) go to :meth:`fxgrad.Backend.compile`.
    """
    check_transform("policy", policy)
    validate.module("model", model)
    if args is not None:
        if not isinstance(args, TrainingArguments):
            raise TypeError(f"args must be transformers.TrainingArguments, got {type(args).__name__}")
        checkpointing = args.gradient_checkpointing or _checkpointed(model)
        if scope == "auto" and (args.gradient_accumulation_steps > 1 or args.fp16 or checkpointing):
            scope = "step"
    backend = Backend(policy, skip=skip, compiler=compiler, strict=strict, scope=scope)
    callback = FxgradTrainerCallback(backend, stats=stats, prefix=prefix)
    before = None if args is None else args.max_grad_norm
    try:  # a refused call leaves args, and the model, as they were
        if args is not None:  # the arguments are checked: now set args, unless a setting conflicts
            if args.max_grad_norm == _default(args, "max_grad_norm"):
                args.max_grad_norm = 0.0
            callback.check(args, model)  # compiled in place, it keeps its forward's signature
        compiled = backend.compile(model, in_place=True, **compile_kwargs)
    except BaseException:
        if args is not None:
            args.max_grad_norm = before
        raise
    if args is not None and args.max_grad_norm != before and not any(leaf.clips for leaf in policy.leaves()):
        warn(
            f"fxgrad: prepare() turned the Trainer's clipping off (TrainingArguments(max_grad_norm={before}) -> 0), "
            f"which the policy replaces, and the policy {policy!r} clips nothing: no gradient is clipped now. To "
            f"keep the Trainer's clip, put it in the policy: fxgrad.chain(policy, "
            f"fxgrad.clip_by_global_norm({before})); to train without clipping, pass max_grad_norm=0",
            UserWarning,
        )
    return compiled, callback


STATE_FILE = "fxgrad_state.pt"


def _checkpoint(args: TrainingArguments, state: Any) -> str:
    """The folder the Trainer saves the checkpoint of ``state.global_step`` in."""
    return os.path.join(args.output_dir, f"{PREFIX_CHECKPOINT_DIR}-{state.global_step}")


def _fingerprint(model: nn.Module) -> torch.Tensor:
    """The sum of each parameter, in float64 on the CPU: a checkpoint's weights, told apart from
    another run's at the same step (one pass over the weights, at checkpoints only)."""
    with torch.no_grad():
        return torch.stack([p.detach().to(torch.float64).sum() for p in model.parameters()]).cpu()


def _checkpointed(model: nn.Module | None) -> bool:
    """Whether gradient checkpointing is turned on on the model itself
    (``model.gradient_checkpointing_enable()``, as LoRA recipes do), not by ``TrainingArguments``."""
    return bool(getattr(model, "is_gradient_checkpointing", False))


def _hides_signature(model: nn.Module) -> bool:
    """Whether ``model``'s forward takes only ``*args, **kwargs`` (a ``torch.compile`` wrapper's), so
    that the Trainer cannot tell the dataset's columns it takes. For a PEFT model the Trainer reads
    the base model's (a ``PeftModel``'s own forward takes ``*args, **kwargs``)."""
    if _is_peft_model(model):
        model = model.get_base_model()
    kinds = {p.kind for p in inspect.signature(model.forward).parameters.values()}
    return kinds <= {inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD}


def _is_peft_model(model: nn.Module) -> bool:
    """Whether ``model`` is a ``peft`` ``PeftModel`` or ``PeftMixedModel``, as the Trainer asks (by
    name: fxgrad does not import peft)."""
    return any(
        kind.__module__.split(".")[0] == "peft" and kind.__name__ in ("PeftModel", "PeftMixedModel")
        for kind in type(model).__mro__
    )


def _default(args: TrainingArguments, name: str) -> Any:
    return next(field.default for field in dataclasses.fields(args) if field.name == name)
