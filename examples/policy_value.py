"""Different rescaling per sub-network, routed by layer name.

An actor-critic-shaped network: a ``policy`` MLP (4 action logits) and a
``value`` MLP (one scalar), trained jointly on a synthetic supervised proxy
(the actions and values of a fixed random teacher). Both arms are compiled
with Inductor, same seed and data:

* baseline: no gradient policy;
* ``by_name({"policy.*": rescale(alpha=0.3), "value.*": rescale(alpha=0.7)})``.

The rescaling article suggests alpha 0.3 for a policy network and 0.7 for a
value network; this shows how to express that, not that it helps: the
result is printed as measured. Saves ``examples/policy_value.png``.

    make examples   # or: python examples/policy_value.py
"""

import copy

import torch
import torch.nn as nn
from common import plt, save, tail, train

import fxgrad

STEPS, LR = 300, 3e-3


def mlp(out: int) -> nn.Sequential:
    return nn.Sequential(nn.Linear(16, 64), nn.Tanh(), nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, out))


class ActorCritic(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.policy = mlp(4)
        self.value = mlp(1)

    def forward(self, state: torch.Tensor):
        return self.policy(state), self.value(state).squeeze(-1)


TEACHER = torch.Generator().manual_seed(7)
W_ACTION = torch.randn(16, 4, generator=TEACHER)
W_VALUE = torch.randn(16, generator=TEACHER)


def batch(step: int, size: int = 128):
    state = torch.randn(size, 16, generator=torch.Generator().manual_seed(step))
    return state, (state @ W_ACTION).argmax(-1), torch.sin(state @ W_VALUE) * 3


def losses(compiled, step):
    state, action, value = batch(step)
    logits, predicted = compiled(state)
    return {"policy": nn.functional.cross_entropy(logits, action), "value": nn.functional.mse_loss(predicted, value)}


def run(name, model, compiled):
    return train(name, compiled, torch.optim.Adam(model.parameters(), lr=LR), losses, STEPS)


def main() -> None:
    torch.manual_seed(0)
    base = ActorCritic()
    plain = copy.deepcopy(base)
    baseline = run("baseline", plain, torch.compile(plain))
    policy = fxgrad.by_name({"policy.*": fxgrad.rescale(alpha=0.3), "value.*": fxgrad.rescale(alpha=0.7)})
    routed_model = copy.deepcopy(base)
    print(
        fxgrad.explain(copy.deepcopy(base), batch(0)[0], backend=fxgrad.backend(policy, compiler="aot_eager")).table()
    )
    routed = run("routed rescale", routed_model, fxgrad.backend(policy).compile(routed_model))

    for head in ("policy", "value"):
        print(
            f"{head} loss (mean of the last 20 steps): baseline {tail(baseline[head]):.3f}, "
            f"routed rescale {tail(routed[head]):.3f}"
        )

    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for ax, head in zip(axes, ("policy", "value")):
        ax.plot(baseline[head], label="baseline")
        ax.plot(routed[head], label=f"rescale alpha={'0.3' if head == 'policy' else '0.7'} on {head}.*")
        ax.set_yscale("log")
        ax.set_xlabel("step")
        ax.set_title(f"{head} head loss")
    fig.suptitle("by_name routing: different rescale alphas per sub-network (same seed and data)")
    save(fig, "policy_value.png")


if __name__ == "__main__":
    main()
