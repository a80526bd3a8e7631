"""DDP on 2 CPU processes (gloo): exact vs local fxgrad semantics vs eager code, side by side.

* ``none``:  DDP(torch.compile(model)), no policy; ``none again``, a second copy of it (its
  ratio to ``none`` is the run's noise floor);
* ``eager``: the same, with the policy written after ``backward()`` the usual way
  (``clip_grad_norm_(foreach=True)``, per-layer loops; ``bench/policies.py``);
* ``local``: ``scope="graph"``: each process transforms its own gradient inside the
  backward, before DDP averages (the parameter server sees raw averages of
  locally transformed gradients); ``strict=False``: Dynamo's DDP optimizer compiles
  one graph per gradient bucket, and a global norm is then each bucket's;
* ``exact``: ``scope="step"``: DDP averages first; at ``optimizer.step()`` the policy
  runs on the averaged gradient as one compiled program (equal to one process on
  the whole batch);
* ``fold`` (with ``--optimizer adamw-fused``, for policies of one global factor): exact,
  with ``backend.fold(optimizer)``: the step program runs the update with the factor (under
  FSDP2's DTensors the factor rides in the fused update's ``grad_scale``).

With ``--fsdp2`` each block and the model are ``fully_shard``-ed instead (FSDP2,
gradients sharded on dim 0) and compiled whole; there is no ``local``, and
``exact eager`` is ``exact`` with the rules run on the DTensors one op at a time
(what step scope did before its program took FSDP2's local shards).

Prints step-time ratios (median over repeats of per-repeat ratios, rank 0).

    python bench/ddp.py [--policy rescale] [--optimizer sgd] [--repeats 10] [--steps 5] [--fsdp2]
                        [--compiler aot_eager]  # a dry run: the ratios then mean nothing
"""

from __future__ import annotations

import argparse
import copy
import os
import socket
import statistics
import sys
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn

sys.path.insert(0, os.path.dirname(__file__))

from models import MODELS, loss_of  # noqa: E402
from policies import OPTIMIZERS, POLICIES, fold_scopes, layers_of  # noqa: E402

import fxgrad  # noqa: E402


def worker(rank: int, world: int, port: int, options: argparse.Namespace) -> None:
    os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = "127.0.0.1", str(port)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    torch.set_num_threads(1)
    torch.manual_seed(0)
    base, args, kwargs = MODELS[options.model](options.scale)
    transform, make_eager = POLICIES[options.policy]
    names = ["none", "none again", "eager"] + (["exact eager", "exact"] if options.fsdp2 else ["local", "exact"])
    names += ["fold"] if "step" in fold_scopes(transform, options.optimizer) and not options.fsdp2 else []
    variants = {}
    for name in names:
        model = copy.deepcopy(base)
        if options.fsdp2:
            shard(model)
        backend, after_backward = None, lambda: None
        if name in ("none", "none again", "eager"):
            compiled = torch.compile(model, backend=options.compiler)
            if name == "eager":
                eager, layers = make_eager(), layers_of(model)
                after_backward = lambda eager=eager, model=model, layers=layers: eager(model, layers)  # noqa: E731
        else:
            local = name == "local"
            scope = "graph" if local else "step"
            backend = fxgrad.backend(transform, compiler=options.compiler, scope=scope, strict=not local)
            compiled = backend.compile(model)
            if name == "exact eager":
                backend._programs.run = lambda *args: False  # the rules on the DTensors, one op at a time
        ddp = compiled if options.fsdp2 else nn.parallel.DistributedDataParallel(compiled)
        optimizer = OPTIMIZERS[options.optimizer](model.parameters())
        if name == "fold":
            backend.fold(optimizer)

        def step(ddp=ddp, optimizer=optimizer, after_backward=after_backward):
            loss_of(ddp(*args, **kwargs)).backward()
            after_backward()
            optimizer.step()  # scope="step" runs the policy in its pre-hook
            optimizer.zero_grad(set_to_none=True)

        step()  # compile
        step()
        variants[name] = (step, [])
    for r in range(options.repeats):
        order = names[r % len(names) :] + names[: r % len(names)]
        for name in order:
            dist.barrier()
            start = time.perf_counter()
            for _ in range(options.steps):
                variants[name][0]()
            variants[name][1].append((time.perf_counter() - start) / options.steps)
    if rank == 0:
        setup = f"model {options.model}, policy {options.policy}, optimizer {options.optimizer}, {world} processes"
        print(f"{'FSDP2' if options.fsdp2 else 'DDP'}, {setup}")
        print("\n".join(ratio_lines({name: times for name, (_, times) in variants.items()})))
    dist.destroy_process_group()


def ratio_lines(times: dict[str, list[float]]) -> list[str]:
    """The step without a policy, then ``a / b: ratio`` (median of per-repeat ratios) for each
    variant over ``none`` and for the pairs compared, of the variants that ran (DDP has no
    ``exact eager``, FSDP2 no ``local``)."""

    def ratio(a: str, b: str) -> float:
        return statistics.median(x / y for x, y in zip(times[a], times[b]))

    pairs = [(name, "none") for name in times if name != "none"]
    pairs += [("local", "exact"), ("exact", "eager"), ("fold", "eager"), ("exact", "exact eager")]
    lines = [f"step without a policy: {statistics.median(times['none']) * 1e3:.1f} ms"]
    return lines + [f"{a} / {b}: {ratio(a, b):.3f}" for a, b in pairs if a in times and b in times]


def shard(model: nn.Module) -> None:
    """FSDP2 over ``model``: each block with parameters of its inner ``ModuleList``s and
    ``Sequential``s (GPT-2's transformer blocks), then the model."""
    from torch.distributed.fsdp import fully_shard

    for module in model.modules():
        if module is not model and isinstance(module, (nn.ModuleList, nn.Sequential)):
            for block in module:
                if any(True for _ in block.parameters()):
                    fully_shard(block)
    fully_shard(model)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="gpt2", choices=list(MODELS))
    parser.add_argument("--policy", default="rescale", choices=list(POLICIES))
    parser.add_argument("--optimizer", default="sgd", choices=list(OPTIMIZERS))
    parser.add_argument("--scale", type=float, default=1.0)
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--fsdp2", action="store_true", help="FSDP2 instead of DDP")
    parser.add_argument(
        "--compiler", default="inductor", choices=["inductor", "aot_eager"], help="aot_eager: a quick dry run"
    )
    options = parser.parse_args()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(worker, args=(2, port, options), nprocs=2, join=True)


if __name__ == "__main__":
    main()
