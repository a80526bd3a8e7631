"""Per-layer gradient norms from fxgrad, logged to TensorBoard every N steps.

Trains a small GPT-2 (transformers, random weights) on a synthetic next-token task,
compiled with plain ``torch.compile`` and fxgrad's backend:

    backend = fxgrad.backend(fxgrad.chain(fxgrad.monitor(), fxgrad.clip_by_global_norm(1.0)))
    compiled = torch.compile(model, backend=backend)

``monitor()`` computes each layer's gradient norm inside the compiled backward, on the
device; ``backend.stats()`` returns them as device tensors. Every ``LOG_EVERY`` steps the
loop copies them to the host in one ``.tolist()`` (the only host sync) and writes, with
``torch.utils.tensorboard.SummaryWriter``:

* scalars: ``grad_norm/<layer>`` per layer, ``grad_norm/total`` and
  ``grad_norm/total_clipped`` (before and after the policy), ``clip_coef`` and ``loss``;
* an image, ``grad_norm/heatmap``: log10 of each layer's norm (rows) over the logged
  steps (columns), drawn with matplotlib into an image tensor (``add_image``).

The other steps call neither ``backend.stats()`` nor ``.item()``: the loss stays on the
device until a logging step. At the end the script reads the event file back with
TensorBoard's ``EventAccumulator`` and checks that every scalar tag has one value per
logged step and that the heatmap image is there (it raises otherwise), then saves the
last heatmap as ``examples/tensorboard_norms.png``.

    pip install tensorboard
    python examples/tensorboard_norms.py [LOGDIR]   # default: a new temporary directory
    tensorboard --logdir LOGDIR
"""

import math
import sys
import tempfile

import numpy as np
import torch
from common import gpt2, plt, save, sequences
from torch.utils.tensorboard import SummaryWriter

import fxgrad

STEPS, LOG_EVERY = 150, 10


def heatmap(layers, steps, history):
    """log10 per-layer norms (rows) over the logged steps (columns), as a matplotlib figure."""
    heat = [[math.log10(max(column[i], 1e-12)) for column in history] for i in range(len(layers))]
    fig, ax = plt.subplots(figsize=(9, 5.5))
    half = LOG_EVERY / 2
    extent = (steps[0] - half, steps[-1] + half, len(layers) - 0.5, -0.5)
    image = ax.imshow(heat, aspect="auto", cmap="viridis", extent=extent, interpolation="nearest")
    ax.set_yticks(range(len(layers)), layers, fontsize=7)
    ax.set_xlabel("step")
    ax.set_title("per-layer gradient norm (log10) before the clip, from backend.stats()")
    fig.colorbar(image, ax=ax)
    fig.tight_layout()
    return fig


def figure_to_image(fig) -> torch.Tensor:
    """The rendered figure as a uint8 ``(3, H, W)`` tensor, what ``add_image`` takes."""
    fig.canvas.draw()
    rgba = np.asarray(fig.canvas.buffer_rgba())
    return torch.from_numpy(rgba[..., :3].copy()).permute(2, 0, 1)


def main(logdir: str) -> None:
    torch.manual_seed(0)
    model = gpt2(layers=2)
    backend = fxgrad.backend(fxgrad.chain(fxgrad.monitor(), fxgrad.clip_by_global_norm(1.0)))
    compiled = torch.compile(model, backend=backend)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    writer = SummaryWriter(logdir)

    layers, steps, history = None, [], []  # history: one list of per-layer norms per logged step
    for step in range(STEPS):
        ids = sequences(step)
        loss = compiled(ids, labels=ids).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if step % LOG_EVERY != 0:
            continue  # no backend.stats(), no .item(): nothing leaves the device on these steps

        # Logging step: a device snapshot of the statistics, then ONE device->host copy.
        stats = backend.stats()  # {name: 0-dim device tensor}, no sync
        names = [k for k in stats if k.startswith("grad_norm/") or k == "clip_coef"] + ["loss"]
        values = torch.stack([stats[k] for k in names[:-1]] + [loss.detach()]).tolist()  # the sync
        row = dict(zip(names, values))
        for name, value in row.items():
            writer.add_scalar(name, value, step)
        if layers is None:
            layers = [k[len("grad_norm/") :] for k in names if k.startswith("grad_norm/") and "total" not in k]
        steps.append(step)
        history.append([row[f"grad_norm/{layer}"] for layer in layers])
        fig = heatmap(layers, steps, history)
        writer.add_image("grad_norm/heatmap", figure_to_image(fig), step)
        plt.close(fig)
        print(
            f"step {step:3d}  loss {row['loss']:.3f}  grad norm {row['grad_norm/total']:.3f}"
            f" -> {row['grad_norm/total_clipped']:.3f}"
        )
    writer.close()

    check_event_file(logdir, [f"grad_norm/{layer}" for layer in layers], len(steps))
    save(heatmap(layers, steps, history), "tensorboard_norms.png")


def check_event_file(logdir: str, layer_tags: list[str], logged: int) -> None:
    """Reads the event file back and checks the scalars and the image TensorBoard will show."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(logdir, size_guidance={"scalars": 0, "images": 0})
    events.Reload()
    tags = events.Tags()
    expected = layer_tags + ["grad_norm/total", "grad_norm/total_clipped", "clip_coef", "loss"]
    missing = [tag for tag in expected if tag not in tags["scalars"]]
    short = [tag for tag in expected if tag in tags["scalars"] and len(events.Scalars(tag)) != logged]
    if missing or short or len(events.Images("grad_norm/heatmap")) != logged:
        raise RuntimeError(f"event file in {logdir}: missing {missing}, wrong length {short}")
    last = events.Scalars("grad_norm/total")[-1]
    print(
        f"event file checked: {len(expected)} scalar tags ({len(layer_tags)} layers) x {logged} logged steps "
        f"and {logged} heatmap images; grad_norm/total at step {last.step} = {last.value:.3f}"
    )
    print(f"tensorboard --logdir {logdir}")


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else tempfile.mkdtemp(prefix="fxgrad_tensorboard_"))
