"""FxgradCallback in a real Lightning Trainer: parity with Lightning's own clipping, logging, conflicts."""

import csv
import types
import warnings

import pytest
import torch
import torch.nn as nn

import fxgrad
from fxgrad.integrations.lightning import FxgradCallback, pl

STEPS = 20


class Regressor(pl.LightningModule):
    def __init__(self, fused: bool = False, optimizer=None) -> None:
        super().__init__()
        self.fused, self.optimizer = fused, optimizer
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(8, 16), nn.LayerNorm(16), nn.Tanh(), nn.Linear(16, 1))

    def training_step(self, batch, batch_idx):
        x, y = batch
        return (self.net(x) - y).square().mean()

    def configure_optimizers(self):
        if self.optimizer is not None:
            return self.optimizer(self)
        return torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9, fused=self.fused)


def _data(batches: int) -> torch.utils.data.DataLoader:
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(batches * 4, 8, generator=gen)
    data = torch.utils.data.TensorDataset(x, 3 * x[:, :1] + torch.randn(batches * 4, 1, generator=gen))
    return torch.utils.data.DataLoader(data, batch_size=4)


def _fit(
    *,
    accumulate: int = 1,
    logger=False,
    log_every: int = 50,
    fused: bool = False,
    optimizer=None,
    make=Regressor,
    **trainer_kwargs,
) -> Regressor:
    module = make(fused, optimizer)
    trainer = pl.Trainer(
        max_steps=STEPS,
        accelerator="cpu",
        accumulate_grad_batches=accumulate,
        logger=logger,
        log_every_n_steps=log_every,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        **trainer_kwargs,
    )
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*(num_workers|bottleneck|does not have many workers).*")
        trainer.fit(module, _data(STEPS * accumulate))
    return module


@pytest.mark.parametrize(
    "accumulate, precision", [(1, "32-true"), (2, "32-true"), (2, "bf16-mixed")], ids=["plain", "accumulate2", "bf16"]
)
def test_global_clip_matches_gradient_clip_val(accumulate, precision):
    max_norm = 0.2
    reference = _fit(
        accumulate=accumulate, precision=precision, gradient_clip_val=max_norm, gradient_clip_algorithm="norm"
    )
    callback = FxgradCallback(fxgrad.clip_by_global_norm(max_norm), compiler="aot_eager")
    ours = _fit(accumulate=accumulate, precision=precision, callbacks=[callback])
    for name, weight in reference.state_dict().items():
        torch.testing.assert_close(ours.state_dict()[name], weight, rtol=1e-6, atol=1e-8, msg=name)
    assert callback.backend.stats()["grad_norm/total"] > max_norm  # the clip was active


def test_the_callback_pickles_as_its_policy_settings_and_state():
    """Spawning strategies pickle the callbacks; the backend (Dynamo's caches) cannot be: each process
    gets a backend of its own, with the same policy, settings and state."""
    import pickle

    policy = fxgrad.chain(fxgrad.monitor(), fxgrad.zclip(warmup=2))
    callback = FxgradCallback(policy, compiler="aot_eager", skip=("net.3",), stats=("grad_norm*",), prefix="g/")
    _fit(callbacks=[callback])
    copied = pickle.loads(pickle.dumps(callback))
    assert copied.backend is not callback.backend
    assert (copied.backend.transform, copied.backend.skip, copied.backend.compiler) == (policy, ("net.3",), "aot_eager")
    assert (copied.stats, copied.prefix) == (callback.stats, callback.prefix)
    state = callback.state_dict()
    assert state.keys() == copied.state_dict().keys()
    for key, value in state.items():
        torch.testing.assert_close(copied.state_dict()[key], value, msg=key)
    _fit(callbacks=[copied])  # from the pickled state: zclip's count goes on
    assert copied.state_dict()["1.zclip/count"] == state["1.zclip/count"] + STEPS


@pytest.mark.slow
def test_ddp_spawn_matches_gradient_clip_val():
    """strategy="ddp_spawn" pickles the callback into two processes (CPU, gloo)."""
    spawned = {"devices": 2, "strategy": "ddp_spawn"}
    reference = _fit(gradient_clip_val=0.2, gradient_clip_algorithm="norm", **spawned)
    ours = _fit(callbacks=[FxgradCallback(fxgrad.clip_by_global_norm(0.2), compiler="aot_eager")], **spawned)
    untrained = Regressor().state_dict()
    assert not all(torch.equal(weight, untrained[name]) for name, weight in ours.state_dict().items())
    for name, weight in reference.state_dict().items():
        torch.testing.assert_close(ours.state_dict()[name], weight, rtol=1e-6, atol=1e-8, msg=name)


class CompiledInside(Regressor):
    """A module that compiles its network with a step-scope fxgrad backend itself, no callback."""

    def configure_model(self) -> None:
        backend = fxgrad.backend(fxgrad.clip_by_global_norm(0.2), compiler="aot_eager", scope="step")
        self.net = backend.compile(self.net)


@pytest.mark.parametrize("accumulate", [1, 2])
def test_a_step_scope_backend_inside_the_module_matches_gradient_clip_val(accumulate):
    """Lightning steps with optimizer.step(closure), the (last) backward inside the closure: the
    backend's optimizer.step() hook runs the policy when the closure returns."""
    reference = _fit(accumulate=accumulate, gradient_clip_val=0.2, gradient_clip_algorithm="norm")
    ours = _fit(accumulate=accumulate, make=CompiledInside)
    for name, weight in reference.state_dict().items():
        torch.testing.assert_close(ours.state_dict()[name.replace("net.", "net._orig_mod.")], weight, msg=name)


@pytest.mark.parametrize("fused", [False, True], ids=["unscaled_by_lightning", "fused_optimizer"])
def test_global_clip_under_a_grad_scaler(fused):
    """Lightning unscales before on_before_optimizer_step, except for a fused optimizer (it unscales in its step):
    then fxgrad reads the scale and clips in unscaled units. Lightning refuses to clip with a fused optimizer,
    so the reference clips for the unfused one."""

    def scaled():
        scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
        return pl.plugins.precision.MixedPrecision("16-mixed", "cpu", scaler=scaler)

    reference = _fit(plugins=[scaled()], gradient_clip_val=0.2, gradient_clip_algorithm="norm")
    callback = FxgradCallback(fxgrad.clip_by_global_norm(0.2), compiler="aot_eager")
    ours = _fit(plugins=[scaled()], fused=fused, callbacks=[callback])
    for name, weight in reference.state_dict().items():
        torch.testing.assert_close(ours.state_dict()[name], weight, rtol=1e-6, atol=1e-8, msg=name)


def test_update_level_factor_is_the_layer_learning_rate_under_adamw():
    """apply_to="update" through the callback: the first layer's AdamW step is 3x, as a parameter
    group with 3x the learning rate (the callback hands the optimizer over after the policy ran)."""

    def groups(module):
        first = list(module.net[0].parameters())
        rest = [p for layer in module.net[1:] for p in layer.parameters()]
        return torch.optim.AdamW([{"params": first, "lr": 3e-2}, {"params": rest}], lr=1e-2)

    reference = _fit(optimizer=groups)
    policy = fxgrad.rescale(alpha=0, multipliers={"net.0": 3.0}, apply_to="update")
    callback = FxgradCallback(policy, compiler="aot_eager")
    ours = _fit(optimizer=lambda module: torch.optim.AdamW(module.parameters(), lr=1e-2), callbacks=[callback])
    for name, weight in reference.state_dict().items():  # 3x the update vs 3x the rate: float32 rounding, 20 steps
        torch.testing.assert_close(ours.state_dict()[name], weight, rtol=1e-5, atol=1e-6, msg=name)


def test_per_layer_policy_logs_its_stats_to_csv(tmp_path):
    policy = fxgrad.chain(fxgrad.monitor(), fxgrad.clip_by_norm(0.1))
    callback = FxgradCallback(policy, compiler="aot_eager", stats=["grad_norm/*"])
    logger = pl.loggers.CSVLogger(tmp_path, name="run")
    _fit(logger=logger, log_every=5, callbacks=[callback])
    with open(tmp_path / "run" / "version_0" / "metrics.csv") as f:
        rows = list(csv.DictReader(f))
    layers = ["net.0", "net.1", "net.3"]  # monitor sees the LayerNorm net.1 too (clip_by_norm skips it)
    expected = {f"fxgrad/grad_norm/{layer}" for layer in layers} | {
        "fxgrad/grad_norm/total",
        "fxgrad/grad_norm/total_clipped",
    }
    assert expected == {column for column in rows[0] if column.startswith("fxgrad/")}
    assert [int(row["step"]) for row in rows] == [4, 9, 14, 19]  # log_every_n_steps=5
    last = {k: v.item() for k, v in callback.backend.stats().items()}
    for column in expected:
        assert float(rows[-1][column]) == pytest.approx(last[column.removeprefix("fxgrad/")], rel=1e-6)
    assert float(rows[-1]["fxgrad/grad_norm/total_clipped"]) < float(rows[-1]["fxgrad/grad_norm/total"])


class Branching(Regressor):
    """A head used on odd batches only: its per-layer statistics exist from the second step on."""

    def __init__(self, *args) -> None:
        super().__init__(*args)
        self.branch = nn.Linear(1, 1)

    def training_step(self, batch, batch_idx):
        loss = super().training_step(batch, batch_idx)
        return self.branch(loss.reshape(1, 1)).sum() if batch_idx % 2 else loss


def _unmatched_warnings(tmp_path, policy, stats, make=Regressor) -> list[str]:
    callback = FxgradCallback(policy, compiler="aot_eager", stats=stats)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _fit(logger=pl.loggers.CSVLogger(tmp_path, name="run"), log_every=1, callbacks=[callback], make=make)
    return [str(w.message) for w in caught if "no statistic of the policy" in str(w.message)]


def test_a_stats_pattern_that_matches_nothing_warns_once_at_the_end(tmp_path):
    """A pattern no statistic has would log nothing for ever (a typo, a rule the policy lacks)."""
    assert _unmatched_warnings(tmp_path, fxgrad.clip_by_global_norm(0.2), ["grad_norm/*", "zclip/*"]) == [
        "fxgrad: stats 'zclip/*' matched no statistic of the policy at any logging step, so nothing was logged for "
        "them; its statistics now: clip_coef, grad_norm/total, grad_norm/total_clipped"
    ]


def test_a_layer_whose_statistics_come_later_is_not_unmatched(tmp_path):
    """Per-layer statistics exist for the layers that got a gradient in the latest step: the first
    logged step has none of the branch's, the second has them."""
    assert not _unmatched_warnings(tmp_path, fxgrad.monitor(), ["grad_norm/branch"], make=Branching)
    assert not _unmatched_warnings(tmp_path, fxgrad.clip_by_norm(0.1), ["*"])  # keeps none: the default is no typo


class EveryOtherBatch(Regressor):
    """Manual optimization that steps on every second batch (accumulation written by hand)."""

    def __init__(self, callback: FxgradCallback, stepping: int = 1) -> None:
        super().__init__()
        self.automatic_optimization = False
        self.callback, self.norms, self.stepping = callback, {}, stepping

    def training_step(self, batch, batch_idx):
        self.manual_backward(super().training_step(batch, batch_idx) / 2)
        if batch_idx % 2 == self.stepping:
            optimizer = self.optimizers()
            optimizer.step()
            optimizer.zero_grad()
            self.norms[batch_idx] = self.callback.backend.stats()["grad_norm/total"].item()


@pytest.mark.parametrize("stepping", [1, 0], ids=["written-batches", "other-batches"])
def test_manual_optimization_logs_each_steps_own_stats(tmp_path, stepping):
    """Lightning writes a row every log_every_n_steps batches here, not optimizer steps: a value
    logged on a batch whose row is not written reached the next row, stale. Steps on the batches
    whose rows are not written reach the next row (they logged nothing before)."""
    callback = FxgradCallback(fxgrad.clip_by_global_norm(0.2), compiler="aot_eager", stats=["grad_norm/total"])
    module = EveryOtherBatch(callback, stepping)
    trainer = pl.Trainer(
        max_epochs=1,
        accelerator="cpu",
        logger=pl.loggers.CSVLogger(tmp_path, name="run"),
        log_every_n_steps=2,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[callback],
    )
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*(num_workers|bottleneck|does not have many workers).*")
        trainer.fit(module, _data(16))
    with open(tmp_path / "run" / "version_0" / "metrics.csv") as f:
        logged = {int(row["step"]): float(row["fxgrad/grad_norm/total"]) for row in csv.DictReader(f)}
    assert sorted(logged) == list(range(1, 16, 2))
    for step, value in logged.items():
        assert value == pytest.approx(module.norms[step - 1 + stepping], rel=1e-6), step


def test_lightning_clipping_is_refused():
    callback = FxgradCallback(fxgrad.clip_by_global_norm(1.0), compiler="aot_eager")
    with pytest.raises(ValueError, match=r"Trainer\(gradient_clip_val=0.5\) would clip the gradients again"):
        _fit(gradient_clip_val=0.5, callbacks=[callback])


def test_configure_gradient_clipping_override_is_refused():
    class Clipping(Regressor):
        def configure_gradient_clipping(self, optimizer, gradient_clip_val=None, gradient_clip_algorithm=None):
            self.clip_gradients(optimizer, 1.0, "norm")

    trainer = pl.Trainer(max_steps=1, accelerator="cpu", logger=False, enable_progress_bar=False)
    callback = FxgradCallback(fxgrad.clip_by_global_norm(1.0), compiler="aot_eager")
    trainer.callbacks.append(callback)
    with pytest.raises(ValueError, match="Clipping.configure_gradient_clipping overrides"):
        callback.setup(trainer, Clipping(), "fit")


@pytest.mark.parametrize("strategy", ["FSDPStrategy", "DeepSpeedStrategy"])
def test_flat_parameter_strategies_are_refused(strategy):
    """FSDP1 and DeepSpeed need an accelerator (and DeepSpeed) to build: a Trainer stand-in holds
    an unbuilt instance of the strategy."""
    cls = getattr(pl.strategies, strategy)
    trainer = types.SimpleNamespace(strategy=object.__new__(cls))
    callback = FxgradCallback(fxgrad.clip_by_global_norm(1.0), compiler="aot_eager")
    with pytest.raises(ValueError, match=rf"Trainer\(strategy={strategy}\) flattens the parameters"):
        callback.setup(trainer, Regressor(), "fit")


def test_bad_arguments_raise_at_construction():
    with pytest.raises(TypeError, match="policy must be an fxgrad transform"):
        FxgradCallback("clip_by_global_norm")
    with pytest.raises(TypeError, match="stats must be a list of name patterns"):
        FxgradCallback(fxgrad.monitor(), stats="grad_norm/total")
    with pytest.raises(ValueError, match="compiler must be one of"):
        FxgradCallback(fxgrad.monitor(), compiler="eager")
    with pytest.raises(TypeError, match="gradient_clip_val"):
        FxgradCallback(fxgrad.monitor(), gradient_clip_val=1.0)


# Lightning Fabric: a loop of the user's own, with fabric.setup() wrapping the model and optimizer.


class _Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 4))

    def forward(self, x):
        return self.net(x)


class _Recurrent(nn.Module):
    """Dynamo runs it eagerly (``allow_rnn=False``): no graph reaches the backend."""

    def __init__(self) -> None:
        super().__init__()
        self.inp, self.lstm, self.out = nn.Linear(8, 8), nn.LSTM(8, 8, batch_first=True), nn.Linear(8, 4)

    def forward(self, x):
        return self.out(self.lstm(self.inp(x))[0][:, -1])


def _fabric():
    from lightning_fabric import Fabric

    return Fabric(accelerator="cpu", devices=1)


def _fabric_steps(fabric, model, optimizer, steps: int = 4, micro: int = 1, seq: bool = False) -> None:
    gen = torch.Generator().manual_seed(1)
    for _ in range(steps):
        for i in range(micro):
            x = torch.randn(4, 3, 8, generator=gen) if seq else torch.randn(4, 8, generator=gen)
            loss = (model(x) - 1).square().mean()
            if i < micro - 1:
                with fabric.no_backward_sync(model):
                    fabric.backward(loss)
            else:
                fabric.backward(loss)
        optimizer.step()
        optimizer.zero_grad()


def test_fabric_setup_of_a_watched_model_keeps_the_checks():
    """``fabric.setup`` unwraps the module ``backend.compile`` returned and compiles the model
    again with plain ``torch.compile``: the checks of that path apply (before, the per-forward
    watch left behind on the discarded module stood for them, and the policy did nothing
    without a word)."""
    backend = fxgrad.backend(fxgrad.clip_by_global_norm(0.1), compiler="aot_eager")
    fabric, model = _fabric(), _Recurrent()
    model, optimizer = fabric.setup(backend.compile(model), torch.optim.SGD(model.parameters(), lr=0.1))
    with pytest.raises(fxgrad.CoverageError, match="no graph of _Recurrent reached the backend"):
        _fabric_steps(fabric, model, optimizer, seq=True)

    backend = fxgrad.backend(fxgrad.clip_by_global_norm(0.1), compiler="aot_eager")
    fabric, model = _fabric(), _Net()
    model, optimizer = fabric.setup(backend.compile(model), torch.optim.SGD(model.parameters(), lr=0.1))
    with pytest.warns(fxgrad.CoverageWarning, match="still held the previous backward's gradient"):
        _fabric_steps(fabric, model, optimizer, micro=2)


@pytest.mark.parametrize("order", ["compile, setup", "setup, compile", "backend.compile, setup", "explain, setup"])
def test_fabric_layers_are_named_in_the_model(order):
    """Layer names, and so routing keys, statistics and checkpoint keys, are the model's in
    either order: Fabric's ``_forward_module.`` is dropped, as DDP's ``module.`` is. With the
    module ``backend.compile`` returned kept alive, its per-forward watch, which Fabric's own
    compile leaves behind, took every backward for one that bypassed it (warned, exact). An
    ``explain`` of that module before ``setup`` left its own backend in the arguments Fabric
    compiles the model again with (Lightning keeps them on the model): no policy ran."""
    policy = fxgrad.chain(fxgrad.monitor(), fxgrad.by_name({"net.2": fxgrad.clip_by_norm(0.05)}))
    backend = fxgrad.backend(policy, compiler="aot_eager")
    fabric, model = _fabric(), _Net()
    reference = _Net()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    if order == "compile, setup":
        model, optimizer = fabric.setup(torch.compile(model, backend=backend), optimizer)
    elif order in ("backend.compile, setup", "explain, setup"):
        compiled = backend.compile(model)
        if order == "explain, setup":
            fxgrad.explain(compiled, torch.randn(4, 8), backend=backend)
        model, optimizer = fabric.setup(compiled, optimizer)
    else:
        model, optimizer = fabric.setup(model, optimizer)
        model = torch.compile(model, backend=backend)
    with warnings.catch_warnings():
        warnings.simplefilter("error", fxgrad.CoverageWarning)
        _fabric_steps(fabric, model, optimizer)
    assert sorted(k for k in backend.stats() if k.startswith("grad_norm/net")) == [
        "grad_norm/net.0",
        "grad_norm/net.2",
        "grad_norm/net.4",
    ]
    eager = torch.optim.SGD(reference.parameters(), lr=0.1)
    gen = torch.Generator().manual_seed(1)
    for _ in range(4):
        (reference(torch.randn(4, 8, generator=gen)) - 1).square().mean().backward()
        torch.nn.utils.clip_grad_norm_(reference.net[2].parameters(), 0.05)
        eager.step()
        eager.zero_grad()
    for ours, theirs in zip(model.parameters(), reference.parameters()):
        torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-7)


def test_folding_the_callbacks_backend_is_refused_at_fit():
    """The callback runs the policy before the optimizer's step, where no fold can take the factor:
    folding its backend used to leave the gradients unclipped (with a warning at the first step)."""
    callback = FxgradCallback(fxgrad.clip_by_global_norm(0.2), compiler="aot_eager")

    def folded(module):
        optimizer = torch.optim.AdamW(module.parameters(), lr=1e-2, fused=True)
        callback.backend.fold(optimizer)
        return optimizer

    with pytest.raises(ValueError, match=r"callback.backend.fold\(optimizer\): FxgradCallback runs its policy"):
        _fit(optimizer=folded, callbacks=[callback])


def test_fold_names_the_optimizer_fabric_wraps():
    backend = fxgrad.backend(fxgrad.clip_by_global_norm(1.0), compiler="aot_eager")
    fabric, model = _fabric(), _Net()
    model, optimizer = fabric.setup(model, torch.optim.AdamW(model.parameters(), fused=True))
    with pytest.raises(ValueError, match=r"it wraps torch.optim.AdamW: fold that one, fold\(optimizer.optimizer\)"):
        backend.fold(optimizer)
    backend.fold(optimizer.optimizer)
