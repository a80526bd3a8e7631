"""The Hugging Face Trainer training a model compiled with fxgrad's named backend.

The policy is declarative, in ``examples/hf_policy.json``; fxgrad's backend
name ``"fxgrad"`` reads the file named by ``FXGRAD_CONFIG``. The Trainer's own
clipping is turned off (``max_grad_norm=0``): fxgrad clips inside the backward.

``TrainingArguments(torch_compile_backend="fxgrad")`` does not work: the
Trainer hands the name to accelerate, whose ``DynamoBackend`` enum accepts
only its own list (``ValueError: 'FXGRAD' is not a valid DynamoBackend``,
accelerate 1.15). So the model is compiled with the named backend before it
is given to the Trainer, with ``torch_compile=False``.

A callback logs fxgrad's statistics next to the Trainer's loss, with no host
sync in the step (the copy happens at logging time). Trains a small GPT-2
(random weights) on a synthetic next-token task and saves
``examples/hf_trainer.png``.

    make examples   # or: python examples/hf_trainer.py
"""

import os

import torch
from common import HERE, gpt2, plt, save, sequences
from transformers import Trainer, TrainerCallback, TrainingArguments

from fxgrad import backend_for
from fxgrad.frontend.config import CONFIG_ENV, load

POLICY = os.path.join(HERE, "hf_policy.json")


class Sequences(torch.utils.data.Dataset):
    """Arithmetic sequences mod 128 (learnable next-token prediction)."""

    def __len__(self) -> int:
        return 4096

    def __getitem__(self, index: int) -> dict:
        ids = sequences(index, size=1)[0]
        return {"input_ids": ids, "labels": ids}


class FxgradStats(TrainerCallback):
    """Adds fxgrad's device-side statistics to each Trainer log entry."""

    def __init__(self) -> None:
        self.rows = []

    def on_log(self, args, state, control, logs=None, **kwargs):
        backend = backend_for(load(POLICY))
        if backend is None or logs is None or "loss" not in logs:
            return
        stats = {k: v.item() for k, v in backend.stats().items() if not k.startswith("grad_norm/transformer")}
        logs.update({f"fxgrad/{k}": v for k, v in stats.items()})
        self.rows.append((state.global_step, logs["loss"], stats))


def main() -> None:
    os.environ[CONFIG_ENV] = POLICY
    torch.manual_seed(0)
    model = gpt2(layers=2)
    args = TrainingArguments(
        output_dir=os.path.join(HERE, ".hf_trainer_out"),
        max_steps=150,
        per_device_train_batch_size=16,
        learning_rate=3e-3,
        logging_steps=10,
        max_grad_norm=0.0,  # fxgrad clips inside the backward
        report_to=[],
        use_cpu=True,
        save_strategy="no",
        remove_unused_columns=False,  # the compiled module's forward takes *args, **kwargs
    )
    stats = FxgradStats()
    compiled = torch.compile(model, backend="fxgrad")  # policy from $FXGRAD_CONFIG
    Trainer(model=compiled, args=args, train_dataset=Sequences(), callbacks=[stats]).train()

    steps = [step for step, _, _ in stats.rows]
    print(f"policy: {backend_for(load(POLICY)).transform!r}")
    last = stats.rows[-1]
    print(
        f"step {last[0]}: loss {last[1]:.3f}, grad norm {last[2]['grad_norm/total']:.3f} -> "
        f"{last[2]['grad_norm/total_clipped']:.3f}"
    )
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(8, 6), sharex=True)
    top.plot(steps, [loss for _, loss, _ in stats.rows])
    top.set_ylabel("training loss")
    top.set_title("HF Trainer, torch_compile_backend='fxgrad', policy from hf_policy.json")
    bottom.plot(steps, [s["grad_norm/total"] for _, _, s in stats.rows], label="grad norm before the policy")
    bottom.plot(steps, [s["grad_norm/total_clipped"] for _, _, s in stats.rows], label="after")
    bottom.set_xlabel("step")
    bottom.set_yscale("log")
    save(fig, "hf_trainer.png")


if __name__ == "__main__":
    main()
