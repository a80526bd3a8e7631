"""fxgrad.integrations.transformers in a real Hugging Face Trainer: parity with max_grad_norm, logging, conflicts."""

import copy
import warnings

import models
import pytest
import torch
from parity import coverage_silent
from transformers import Trainer, TrainingArguments

import fxgrad
from fxgrad.integrations.transformers import FxgradTrainerCallback, prepare

STEPS = 10


def _gpt2():
    model = models.gpt2()[0]
    model.loss_type = "ForCausalLM"  # else transformers warns inside forward: a graph break before the loss
    return model


def _data() -> list[dict]:
    ids = torch.randint(0, 64, (STEPS * 8, 12), generator=torch.Generator().manual_seed(1))
    return [{"input_ids": row, "labels": row} for row in ids]


def _args(tmp_path, **kwargs) -> TrainingArguments:
    defaults = dict(
        output_dir=str(tmp_path),
        max_steps=STEPS,
        per_device_train_batch_size=4,
        optim="sgd",  # AdamW would amplify the float noise in the key bias's gradient, zero in exact arithmetic
        learning_rate=0.1,
        logging_steps=5,
        report_to=[],
        use_cpu=True,
        save_strategy="no",
        seed=0,
        disable_tqdm=True,
    )
    return TrainingArguments(**{**defaults, **kwargs})


@pytest.mark.parametrize("accumulate", [1, 2], ids=["graph_scope", "accumulate2_step_scope"])
def test_global_clip_matches_max_grad_norm(tmp_path, accumulate):
    max_norm = 0.5
    eager = _gpt2()
    reference = copy.deepcopy(eager)
    args = _args(tmp_path, max_grad_norm=max_norm, remove_unused_columns=False, gradient_accumulation_steps=accumulate)
    compiled = torch.compile(reference, backend="aot_eager")
    Trainer(model=compiled, args=args, train_dataset=_data()).train()

    args = _args(tmp_path, gradient_accumulation_steps=accumulate)
    model, callback = prepare(eager, fxgrad.clip_by_global_norm(max_norm), args, compiler="aot_eager")
    assert model is eager  # compiled in place: its class, state_dict keys and signature, as the Trainer reads them
    assert (args.max_grad_norm, args.remove_unused_columns) == (0.0, True)
    assert callback.backend.current_scope() == ("graph" if accumulate == 1 else "step")
    trainer = Trainer(model=model, args=args, train_dataset=_data(), callbacks=[callback])
    trainer.train()

    for name, weight in reference.state_dict().items():
        torch.testing.assert_close(eager.state_dict()[name], weight, rtol=1e-6, atol=1e-8, msg=name)
    trainer.save_model(str(tmp_path / "final"))  # loads with from_pretrained: no _orig_mod. prefix
    loaded = type(eager).from_pretrained(str(tmp_path / "final"))
    for name, weight in loaded.state_dict().items():
        torch.testing.assert_close(weight, eager.state_dict()[name], msg=name)
    assert "eval_loss" in trainer.evaluate(_data()[:8])  # the Trainer found the label column
    logged = [entry for entry in trainer.state.log_history if "loss" in entry]
    assert [entry["step"] for entry in logged] == [5, 10]  # logging_steps=5
    for entry in logged:
        assert entry["fxgrad/grad_norm/total"] > max_norm  # the clip was active
        assert entry["fxgrad/grad_norm/total_clipped"] == pytest.approx(max_norm, rel=1e-5)


def test_a_stats_pattern_no_logging_step_matched_is_told_at_the_end(tmp_path):
    args = _args(tmp_path)
    model, callback = prepare(_gpt2(), fxgrad.clip_by_global_norm(0.5), args, compiler="aot_eager", stats=["zclip/*"])
    trainer = Trainer(model=model, args=args, train_dataset=_data(), callbacks=[callback])
    with pytest.warns(UserWarning, match=r"stats 'zclip/\*' matched no statistic of the policy at any logging step"):
        trainer.train()
    assert not any(key.startswith("fxgrad/") for entry in trainer.state.log_history for key in entry)


@pytest.mark.parametrize("scope", ["graph", "step"])
def test_a_trainer_that_clips_a_plainly_compiled_model_is_reported(tmp_path, scope):
    """Handed a model compiled with fxgrad.backend, without prepare(), the Trainer clips with its
    default max_grad_norm=1.0 besides the policy: a 5.0 clip trained as a 1.0 clip, silently."""
    backend = fxgrad.backend(fxgrad.clip_by_global_norm(5.0), compiler="aot_eager", scope=scope)
    args = _args(tmp_path, max_steps=2, remove_unused_columns=False)
    trainer = Trainer(model=torch.compile(_gpt2(), backend=backend), args=args, train_dataset=_data())
    when = "before" if scope == "step" else "after"
    with pytest.warns(
        fxgrad.CoverageWarning, match=rf"clips the gradients itself, max_grad_norm=1.0 .*, {when} the"
    ) as told:
        trainer.train()
    assert len([w for w in told if "fxgrad" in str(w.message)]) == 1  # not again as a change after the backward
    monitored = fxgrad.backend(fxgrad.monitor(), compiler="aot_eager", scope=scope)  # it changes no gradient
    trainer = Trainer(model=torch.compile(_gpt2(), backend=monitored), args=args, train_dataset=_data())
    with coverage_silent():
        trainer.train()


@pytest.mark.parametrize(
    ("policy", "settings", "told"),
    [
        (fxgrad.monitor(), {}, True),
        (fxgrad.chain(fxgrad.rescale(alpha=0.5), fxgrad.monitor()), {}, True),
        (fxgrad.monitor(), {"max_grad_norm": 0.0}, False),  # no clip meant
        (fxgrad.clip_by_norm(1.0), {}, False),
        (fxgrad.by_name({"transformer.h.*": fxgrad.adagc()}, default=fxgrad.monitor()), {}, False),
    ],
    ids=["monitor", "rescale", "explicit_zero", "per_layer_clip", "routed_adagc"],
)
def test_turning_the_default_clip_off_for_a_policy_that_clips_nothing_is_told(tmp_path, policy, settings, told):
    """The Trainer's default max_grad_norm=1.0 is a clip; prepare() turns it off for the policy's
    clipping, so a policy that clips nothing would leave the gradients unclipped, silently."""
    args = _args(tmp_path, **settings)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        prepare(_gpt2(), policy, args, compiler="aot_eager")
    messages = [str(w.message) for w in caught if "prepare() turned the Trainer's clipping off" in str(w.message)]
    assert args.max_grad_norm == 0.0
    assert len(messages) == told
    if told:
        assert "clips nothing" in messages[0] and "fxgrad.clip_by_global_norm(1.0)" in messages[0]


def test_conflicting_arguments_raise(tmp_path):
    policy = fxgrad.clip_by_global_norm(1.0)
    with pytest.raises(ValueError, match=r"TrainingArguments\(max_grad_norm=0.5\) clips the gradients again"):
        prepare(_gpt2(), policy, _args(tmp_path, max_grad_norm=0.5), compiler="aot_eager")
    with pytest.raises(ValueError, match=r"TrainingArguments\(gradient_accumulation_steps=2\)"):
        prepare(_gpt2(), policy, _args(tmp_path, gradient_accumulation_steps=2), scope="graph", compiler="aot_eager")
    with pytest.raises(ValueError, match=r"TrainingArguments\(gradient_checkpointing=True\) breaks the graph"):
        prepare(_gpt2(), policy, _args(tmp_path, gradient_checkpointing=True), scope="graph", compiler="aot_eager")
    _, picked = prepare(_gpt2(), policy, _args(tmp_path, gradient_checkpointing=True), compiler="aot_eager")
    assert picked.backend.current_scope() == "step"
    with pytest.raises(ValueError, match=r"TrainingArguments\(torch_compile=True\) compiles the model a second"):
        prepare(_gpt2(), policy, _args(tmp_path, torch_compile_backend="aot_eager"), compiler="aot_eager")
    with pytest.raises(ValueError, match=r"TrainingArguments\(fsdp=.*\) shards the parameters"):
        prepare(_gpt2(), policy, _args(tmp_path, fsdp=True), compiler="aot_eager")
    zero = _args(tmp_path)
    zero.deepspeed = "ds_config.json"  # TrainingArguments(deepspeed=...) needs DeepSpeed installed
    with pytest.raises(ValueError, match=r"TrainingArguments\(deepspeed='ds_config.json'\) partitions"):
        prepare(_gpt2(), policy, zero, compiler="aot_eager")
    with pytest.raises(TypeError, match="policy must be an fxgrad transform"):
        prepare(_gpt2(), "clip_by_global_norm")
    refused = [(_gpt2(), "bogus", {}), ("not a model", "aot_eager", {}), (_gpt2(), "aot_eager", {"fsdp": True})]
    for model, compiler, settings in refused:  # a refused call leaves args as they were
        untouched = _args(tmp_path, **settings)
        with pytest.raises((TypeError, ValueError)):
            prepare(model, policy, untouched, compiler=compiler)
        assert (untouched.max_grad_norm, untouched.remove_unused_columns) == (1.0, True)
        assert not isinstance(model, torch.nn.Module) or model._compiled_call_impl is None  # not compiled
    # without args, the callback checks the Trainer's when the Trainer is built
    model, callback = prepare(_gpt2(), policy, compiler="aot_eager")
    args = _args(tmp_path)  # max_grad_norm keeps its default, 1.0
    with pytest.raises(ValueError, match=r"TrainingArguments\(max_grad_norm=1.0\)"):
        Trainer(model=model, args=args, train_dataset=_data(), callbacks=[callback])
    # a torch.compile wrapper hides the forward's signature: the Trainer would drop every column
    backend = fxgrad.backend(policy, compiler="aot_eager")
    wrapper, callback = backend.compile(_gpt2()), FxgradTrainerCallback(backend)
    with pytest.raises(ValueError, match=r"TrainingArguments\(remove_unused_columns=True\) drops every input"):
        Trainer(model=wrapper, args=_args(tmp_path, max_grad_norm=0.0), train_dataset=_data(), callbacks=[callback])
    with pytest.raises(TypeError, match="backend must be an fxgrad.backend"):
        FxgradTrainerCallback(policy)


def test_checkpointing_turned_on_on_the_model_picks_step_scope(tmp_path):
    """LoRA recipes call ``model.gradient_checkpointing_enable()`` and leave ``args`` alone: graph
    scope then failed at the first step (Llama) with a message about eager frames."""
    policy = fxgrad.clip_by_global_norm(1.0)
    model = _gpt2()
    model.gradient_checkpointing_enable()
    _, callback = prepare(model, policy, _args(tmp_path), compiler="aot_eager")
    assert callback.backend.current_scope() == "step"
    model = _gpt2()
    model.gradient_checkpointing_enable()
    with pytest.raises(ValueError, match=r"^model.gradient_checkpointing_enable\(\) breaks the graph"):
        prepare(model, policy, _args(tmp_path), scope="graph", compiler="aot_eager")


class PeftModel(torch.nn.Module):
    """A stand-in for ``peft.PeftModel`` (fxgrad does not import peft): its forward takes
    ``*args, **kwargs``, and the Trainer reads the base model's for the dataset's columns."""

    __module__ = "peft.peft_model"

    def __init__(self, base):
        super().__init__()
        self.base_model = base

    def get_base_model(self):
        return self.base_model

    def forward(self, *args, **kwargs):
        return self.base_model(*args, **kwargs)


def test_a_peft_models_hidden_signature_is_not_refused(tmp_path):
    """``get_peft_model`` without a ``task_type`` gives a plain ``PeftModel``: the Trainer keeps the
    columns its base model takes, so ``remove_unused_columns=True`` is fine (it was refused)."""
    model, _ = prepare(PeftModel(_gpt2()), fxgrad.clip_by_global_norm(1.0), _args(tmp_path), compiler="aot_eager")
    assert isinstance(model, PeftModel)


def test_update_level_factor_acts_through_the_trainer(tmp_path):
    """apply_to="update" from the Trainer's optimizer step: under SGD it equals the same multiplier
    on the gradient (and so differs from no policy)."""
    base, weights = _gpt2(), []
    for apply_to in ("grad", "update"):
        model = copy.deepcopy(base)
        policy = fxgrad.rescale(alpha=0, multipliers={"transformer.h.0.attn.c_attn": 3.0}, apply_to=apply_to)
        args = _args(tmp_path)
        compiled, callback = prepare(model, policy, args, compiler="aot_eager")
        Trainer(model=compiled, args=args, train_dataset=_data(), callbacks=[callback]).train()
        weights.append(model.state_dict())
    plain = copy.deepcopy(base)
    Trainer(model=plain, args=_args(tmp_path, max_grad_norm=0.0), train_dataset=_data()).train()
    name = "transformer.h.0.attn.c_attn.weight"
    torch.testing.assert_close(weights[1][name], weights[0][name], rtol=1e-5, atol=1e-7)
    assert (weights[1][name] - plain.state_dict()[name]).abs().max() > 1e-3


RESUMED_POLICY = fxgrad.chain(fxgrad.autoclip(percentile=50.0, history=8), fxgrad.zclip(warmup=2, max_norm=None))


def _train_for_resume(model, out, resume_from=None, **arguments):
    args = _args(out, max_steps=4, save_strategy="steps", save_steps=2, **arguments)
    compiled, callback = prepare(model, RESUMED_POLICY, args, compiler="aot_eager")
    Trainer(model=compiled, args=args, train_dataset=_data(), callbacks=[callback]).train(
        resume_from_checkpoint=resume_from
    )
    return callback.backend.state_dict()


def test_resuming_from_a_checkpoint_restores_the_policys_state(tmp_path):
    """The Trainer saves and restores only what it knows; the callback adds the backend's."""
    base = _gpt2()
    straight = _train_for_resume(copy.deepcopy(base), tmp_path / "straight")
    _train_for_resume(copy.deepcopy(base), tmp_path / "first")
    checkpoint = str(tmp_path / "first/checkpoint-2")
    for out, arguments in [("first", {}), ("elsewhere", {"resume_from_checkpoint": checkpoint})]:
        resumed = _train_for_resume(copy.deepcopy(base), tmp_path / out, resume_from=checkpoint, **arguments)
        assert straight.keys() == resumed.keys()
        for key, value in straight.items():
            torch.testing.assert_close(resumed[key], value, msg=key)
        assert resumed["0.autoclip/count"].item() == 4


def test_a_resume_that_finds_no_state_of_its_own_says_it_starts_over(tmp_path):
    """Resumed into another output_dir: no state there (warned after the first step, once the policy
    shows it keeps state), or another run's checkpoint at the same step (warned, not loaded)."""
    base = _gpt2()
    _train_for_resume(copy.deepcopy(base), tmp_path / "first")
    other = copy.deepcopy(base)
    with torch.no_grad():
        other.lm_head.weight.add_(0.01)  # another run: other weights at the same step
    _train_for_resume(other, tmp_path / "other")
    checkpoint = str(tmp_path / "first/checkpoint-2")
    with pytest.warns(RuntimeWarning, match="started over"):
        _train_for_resume(copy.deepcopy(base), tmp_path / "fresh", resume_from=checkpoint)
    with pytest.warns(RuntimeWarning, match="saved with other weights"):
        _train_for_resume(copy.deepcopy(base), tmp_path / "other", resume_from=checkpoint)
