"""The Hugging Face Trainer training a model with an fxgrad policy, through ``fxgrad.integrations.transformers``.

The policy is declarative, in ``examples/hf_policy.json`` (monitor, a rescale of
the ``*.c_attn`` layers, a global clip). ``prepare`` compiles the model in
place with fxgrad's backend (it stays a ``GPT2LMHeadModel``: its checkpoints load
with ``from_pretrained``), sets ``max_grad_norm=0`` (the policy clips, inside the
backward), and returns a callback that adds fxgrad's
statistics to the Trainer's log entries, with no host sync in the step (the
copy happens at logging time).

``TrainingArguments(torch_compile_backend="fxgrad")`` does not work: the
Trainer hands the name to accelerate, whose ``DynamoBackend`` enum accepts
only its own list (``ValueError: 'FXGRAD' is not a valid DynamoBackend``,
accelerate 1.15); hence ``prepare``. Trains a small GPT-2 (random weights) on a
synthetic next-token task and saves ``examples/hf_trainer.png``.

    make examples   # or: python examples/hf_trainer.py
"""

import os

import torch
from common import HERE, gpt2, plt, save, sequences
from transformers import Trainer, TrainingArguments

from fxgrad import from_config
from fxgrad.frontend.config import load
from fxgrad.integrations.transformers import prepare

POLICY = os.path.join(HERE, "hf_policy.json")


class Sequences(torch.utils.data.Dataset):
    """Arithmetic sequences mod 128 (learnable next-token prediction)."""

    def __len__(self) -> int:
        return 4096

    def __getitem__(self, index: int) -> dict:
        ids = sequences(index, size=1)[0]
        return {"input_ids": ids, "labels": ids}


def main() -> None:
    torch.manual_seed(0)
    model = gpt2(layers=2)
    args = TrainingArguments(
        output_dir=os.path.join(HERE, ".hf_trainer_out"),
        max_steps=150,
        per_device_train_batch_size=16,
        learning_rate=3e-3,
        logging_steps=10,
        report_to=[],
        use_cpu=True,
        save_strategy="no",
    )
    spec = from_config(load(POLICY))  # the policy and skip list of hf_policy.json
    compiled, callback = prepare(model, spec.transform, args, skip=spec.skip, stats=["grad_norm/total*"])
    trainer = Trainer(model=compiled, args=args, train_dataset=Sequences(), callbacks=[callback])
    trainer.train()

    rows = [entry for entry in trainer.state.log_history if "loss" in entry]
    steps = [row["step"] for row in rows]
    before, after = "fxgrad/grad_norm/total", "fxgrad/grad_norm/total_clipped"
    print(f"policy: {callback.backend.transform!r}")
    last = rows[-1]
    print(f"step {last['step']}: loss {last['loss']:.3f}, grad norm {last[before]:.3f} -> {last[after]:.3f}")
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(8, 6), sharex=True)
    top.plot(steps, [row["loss"] for row in rows])
    top.set_ylabel("training loss")
    top.set_title("HF Trainer with fxgrad.integrations.transformers.prepare, policy from hf_policy.json")
    bottom.plot(steps, [row[before] for row in rows], label="grad norm before the policy")
    bottom.plot(steps, [row[after] for row in rows], label="after")
    bottom.set_xlabel("step")
    bottom.set_yscale("log")
    save(fig, "hf_trainer.png")


if __name__ == "__main__":
    main()
