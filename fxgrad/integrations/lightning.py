"""fxgrad's gradient policies in a PyTorch Lightning ``Trainer``: :class:`FxgradCallback`.

::

    import fxgrad
    import lightning.pytorch as pl  # or: import pytorch_lightning as pl
    from fxgrad.integrations.lightning import FxgradCallback

    policy = fxgrad.chain(fxgrad.monitor(), fxgrad.clip_by_global_norm(1.0))
    trainer = pl.Trainer(callbacks=[FxgradCallback(policy)], accumulate_grad_batches=4, precision="bf16-mixed")
    trainer.fit(module)  # no gradient_clip_val: the policy clips; its statistics go to the Trainer's loggers

The policy runs in step scope (docs/distributed.md), once per optimizer step, in the
``on_before_optimizer_step`` hook: where Lightning's own ``gradient_clip_val`` clipping runs, on every
``.grad`` of the LightningModule, summed over ``accumulate_grad_batches``, unscaled by ``"16-mixed"``'s
GradScaler, all-reduced by DDP. So ``clip_by_global_norm(c)`` computes what ``gradient_clip_val=c,
gradient_clip_algorithm="norm"`` does. The rules run as one compiled program over the gradients (``compiler``);
nothing syncs with the host except on the steps whose statistics Lightning writes to its loggers.

Reference: docs/integrations.md.
"""

from __future__ import annotations

from typing import Any, Iterable

import torch

from fxgrad import _compat
from fxgrad.core.layers import DEFAULT_SKIP, SkipEntry
from fxgrad.core.rule import Transform, check_transform
from fxgrad.frontend.backend import Backend
from fxgrad.integrations import StatsLog, check_prefix, check_stats

try:
    import lightning.pytorch as pl
except ImportError:  # the standalone package, without the lightning umbrella
    import pytorch_lightning as pl

__all__ = ["FxgradCallback"]


class FxgradCallback(pl.Callback):
    """Applies ``policy`` to the LightningModule's gradients once per optimizer step, and logs its statistics.

    * ``policy``: an fxgrad transform (``fxgrad.clip_by_global_norm(1.0)``, a ``chain``, ...).
    * ``skip``, ``compiler``: as in :func:`fxgrad.backend`; ``compiler`` compiles the step program
      (``"inductor"``, or ``"aot_eager"`` to run it as FX code).
    * ``stats``: fnmatch patterns choosing which of ``backend.stats()`` to log (default all; ``()`` none).
    * ``prefix``: prepended to each logged name (``"fxgrad/grad_norm/total"``).

    The statistics go through ``LightningModule.log_dict`` at the optimizer steps of the batches whose
    metrics Lightning writes (every ``log_every_n_steps``-th), when the Trainer has a logger: Lightning
    copies them to the host then, and only then.
    ``callback.backend`` holds the state; the callback's ``state_dict`` puts it in Lightning's checkpoints.

    At ``Trainer.fit`` it raises ``ValueError`` for ``Trainer(gradient_clip_val=...)`` or a
    ``configure_gradient_clipping`` override (they would clip again after the policy), for more than one
    optimizer, for ``callback.backend.fold(...)`` (the hook runs before the update could take a factor),
    under a GradScaler (``"16-mixed"`` on CUDA) for rules that hide Inf/NaN from it, and for
    the FSDP1 and DeepSpeed strategies (flat parameter shards).
    """

    def __init__(
        self,
        policy: Transform,
        *,
        skip: Iterable[SkipEntry] = DEFAULT_SKIP,
        compiler: str = "inductor",
        stats: Iterable[str] = ("*",),
        prefix: str = "fxgrad/",
    ) -> None:
        check_transform("policy", policy)
        # Step scope, run from on_before_optimizer_step by transform_grads: the hook Lightning gives for
        # code that reads the final gradients, whatever optimizer (or strategy) then steps.
        self.backend = Backend(policy, skip=skip, compiler=compiler, scope="step")
        self.stats = check_stats(stats)
        self.prefix = check_prefix(prefix)
        self._stats_log = StatsLog(self.stats, self.prefix)
        self._unlogged = False  # whether the last optimizer step's statistics reached no row

    def __repr__(self) -> str:
        return f"FxgradCallback({self.backend.transform!r})"

    def __getstate__(self) -> dict[str, Any]:
        """Spawning strategies (``strategy="ddp_spawn"``) pickle the callbacks into each process. A
        backend cannot be pickled (it holds Dynamo's caches): it goes as its policy, settings and
        state, and each process builds its own."""
        state = dict(self.__dict__)
        backend = state.pop("backend")
        state["backend_made_of"] = (backend.transform, backend.skip, backend.compiler, backend.state_dict())
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        state = dict(state)
        policy, skip, compiler, saved = state.pop("backend_made_of")
        self.__dict__.update(state)
        self.backend = Backend(policy, skip=skip, compiler=compiler, scope="step")
        if saved:
            self.backend.load_state_dict(saved)

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage != "fit":
            return
        if isinstance(trainer.strategy, (pl.strategies.FSDPStrategy, pl.strategies.DeepSpeedStrategy)):
            raise ValueError(
                f"Trainer(strategy={type(trainer.strategy).__name__}) flattens the parameters into shards "
                "(FSDP1, DeepSpeed ZeRO): FxgradCallback would see no layers, and norms of each rank's shard "
                "only; use strategy='ddp', or FSDP2 (ModelParallelStrategy)"
            )
        if trainer.gradient_clip_val:  # None and 0 turn Lightning's clipping off
            raise ValueError(
                f"Trainer(gradient_clip_val={trainer.gradient_clip_val}) would clip the gradients again after "
                f"FxgradCallback's policy {self.backend.transform!r}; remove gradient_clip_val (for the same "
                f"clipping, put fxgrad.clip_by_global_norm({trainer.gradient_clip_val}) in the policy)"
            )
        hook = type(pl_module).configure_gradient_clipping
        if hook.__qualname__ != "LightningModule.configure_gradient_clipping":
            raise ValueError(
                f"{hook.__qualname__} overrides configure_gradient_clipping, which runs after FxgradCallback's "
                "policy: remove the override, or do that clipping in the policy"
            )
        scaler = _scaler(trainer)
        hiding = sorted({leaf.name for leaf in self.backend.transform.leaves() if leaf.hides_nonfinite})
        if scaler is not None and hiding:
            raise ValueError(
                f"Trainer(precision={trainer.precision!r}) scales the loss with a GradScaler, and {hiding} would "
                "hide the Inf/NaN it needs to see to skip the step; leave non-finite handling to the scaler"
            )

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if len(trainer.optimizers) > 1:
            raise ValueError(
                f"configure_optimizers returned {len(trainer.optimizers)} optimizers; FxgradCallback applies its "
                "policy to all of the module's gradients before each step, so it supports one optimizer"
            )
        if self.backend.folded_into():
            raise ValueError(
                "callback.backend.fold(optimizer): FxgradCallback runs its policy in on_before_optimizer_step, "
                "before the optimizer's step and before a GradScaler hands it its scale, so no fold can leave the "
                "factor to the update (the policy's factor would be lost). Remove the fold: the callback clips as "
                "an unfolded step scope does. To fold, compile the module's network with "
                "fxgrad.backend(policy, scope='step') in the LightningModule and fold that backend in "
                "configure_optimizers, without the callback"
            )

    def on_before_optimizer_step(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: torch.optim.Optimizer
    ) -> None:
        scaler = _scaler(trainer)
        if scaler is not None and id(optimizer) in _compat.grad_scaler_unscaled(scaler):
            scaler = None  # Lightning unscaled the gradients before this hook (not for a fused optimizer)
        self.backend.transform_grads(pl_module, scaler, optimizer)
        self._unlogged = True
        if trainer.loggers and _writes_logs_now(trainer):
            self._log(pl_module)

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: Any) -> None:
        """Under manual optimization a row can be written on a batch with no optimizer step (one that
        steps on every other batch, at even indices, with ``log_every_n_steps=2``): it gets the last
        step's statistics, if no row had them. Automatic optimization writes rows on stepping batches."""
        if self._unlogged and not pl_module.automatic_optimization and trainer.loggers and _writes_logs_now(trainer):
            self._log(pl_module)

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._stats_log.tell_unmatched(self.backend)

    def _log(self, pl_module: pl.LightningModule) -> None:
        self._unlogged = False
        logged = self._stats_log.select(self.backend)
        if logged:
            pl_module.log_dict(logged, on_step=True, on_epoch=False)

    def state_dict(self) -> dict[str, Any]:
        return self.backend.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.backend.load_state_dict(state_dict)


def _writes_logs_now(trainer: pl.Trainer) -> bool:
    """Whether Lightning writes this batch's step metrics to the loggers. It counts batches that
    stepped, not optimizer steps: under manual optimization that steps every other batch, the
    optimizer's count would log on batches whose row Lightning does not write, and the value
    would reach the next row written, stale. Its own test is not public API (Lightning 2.6);
    without it, every ``log_every_n_steps``-th optimizer step."""
    connector = getattr(trainer, "_logger_connector", None)
    if connector is not None and hasattr(connector, "should_update_logs"):
        return connector.should_update_logs
    every = trainer.log_every_n_steps
    return every > 0 and (trainer.global_step + 1) % every == 0


def _scaler(trainer: pl.Trainer) -> Any:
    """The enabled GradScaler of the Trainer's precision plugin (``"16-mixed"`` on CUDA), else ``None``."""
    scaler = getattr(trainer.precision_plugin, "scaler", None)
    return scaler if scaler is not None and scaler.is_enabled() else None
