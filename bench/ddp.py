"""DDP on 2 CPU processes (gloo): exact vs local fxgrad semantics, side by side.

* ``none``:  DDP(torch.compile(model)), no policy;
* ``local``: ``scope="graph"``: each process rescales its own gradient inside the
  backward, before DDP averages (the parameter server sees raw averages of
  locally rescaled gradients);
* ``exact``: ``scope="step"``: DDP averages first, ``backend.step()`` rescales the
  averaged gradient (equal to one process on the whole batch).

Prints step-time ratios (median over repeats of per-repeat ratios, rank 0).

    python bench/ddp.py [--policy rescale] [--repeats 10] [--steps 5]
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
from policies import POLICIES  # noqa: E402

import fxgrad  # noqa: E402


def worker(rank: int, world: int, port: int, options: argparse.Namespace) -> None:
    os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = "127.0.0.1", str(port)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    torch.set_num_threads(1)
    torch.manual_seed(0)
    base, args, kwargs = MODELS[options.model](options.scale)
    transform = POLICIES[options.policy][0]
    variants = {}
    for name in ("none", "local", "exact"):
        model = copy.deepcopy(base)
        if name == "none":
            compiled, backend = torch.compile(model), None
        else:
            backend = fxgrad.backend(transform, scope="graph" if name == "local" else "step")
            compiled = backend.compile(model)
        ddp = nn.parallel.DistributedDataParallel(compiled)
        optimizer = torch.optim.SGD(model.parameters(), lr=1e-4)

        def step(ddp=ddp, backend=backend, optimizer=optimizer, name=name):
            loss_of(ddp(*args, **kwargs)).backward()
            if name == "exact":
                backend.step()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)

        step()  # compile
        step()
        variants[name] = (step, [])
    for r in range(options.repeats):
        names = list(variants)[r % 3 :] + list(variants)[: r % 3]
        for name in names:
            dist.barrier()
            start = time.perf_counter()
            for _ in range(options.steps):
                variants[name][0]()
            variants[name][1].append((time.perf_counter() - start) / options.steps)
    if rank == 0:
        base_times = variants["none"][1]
        print(f"model {options.model}, policy {options.policy}, {world} processes (gloo, 1 thread each)")
        print(f"step without a policy: {statistics.median(base_times) * 1e3:.1f} ms")
        for name in ("local", "exact"):
            ratio = statistics.median(t / b for t, b in zip(variants[name][1], base_times))
            print(f"{name:>5} / none: {ratio:.3f}")
        ratio = statistics.median(a / b for a, b in zip(variants["local"][1], variants["exact"][1]))
        print(f"local / exact: {ratio:.3f}")
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="gpt2", choices=list(MODELS))
    parser.add_argument("--policy", default="rescale", choices=list(POLICIES))
    parser.add_argument("--scale", type=float, default=1.0)
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--steps", type=int, default=5)
    options = parser.parse_args()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(worker, args=(2, port, options), nprocs=2, join=True)


if __name__ == "__main__":
    main()
