"""Checks that run inside 2 CPU processes (gloo); launched by test_distributed.py.

Each rank trains on its half of a batch; the reference is one process on the
whole batch (DDP and FSDP2 average gradients, and the loss is a mean, so the
whole-batch gradient is what the ranks should agree on).
"""

from __future__ import annotations

import copy
import datetime
import faulthandler
import functools
import os
import sys
import traceback
import warnings

import reference as ref
import torch
import torch.distributed as dist
import torch.nn as nn
from parity import assert_grads_close

import fxgrad

BATCH = 8
STUCK_AFTER_S = 150  # a rank still running then prints every thread's stack and exits


def on_each_rank(check):
    """Run ``check(rank, world, ...)`` in a gloo process group; fail loudly, never hang.

    The ranks meet through a file, not a TCP port: a port picked free by the
    launcher can be taken (or self-connected) before rank 0 binds it.

    A rank that raises prints its traceback and exits at once, skipping the
    barrier and teardown its peer may never reach. A rank stuck for
    ``STUCK_AFTER_S`` prints every thread's stack and exits, and a collective
    waits at most 120 s: a hang shows where it was instead of a bare timeout.
    """

    @functools.wraps(check)
    def run(rank: int, world: int, rendezvous_file: str, *args) -> None:
        faulthandler.dump_traceback_later(STUCK_AFTER_S, exit=True)
        dist.init_process_group(
            "gloo",
            init_method=f"file://{rendezvous_file}",
            rank=rank,
            world_size=world,
            timeout=datetime.timedelta(seconds=120),
        )
        torch.manual_seed(0)
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("error", fxgrad.CoverageWarning)  # no false alarm in the documented orders
                check(rank, world, *args)
        except BaseException:
            traceback.print_exc()
            sys.stderr.flush()
            os._exit(1)
        dist.barrier()  # neither rank tears the group down while the other still uses it
        dist.destroy_process_group()
        faulthandler.cancel_dump_traceback_later()

    return run


def model_and_data():
    model = nn.Sequential(
        nn.Linear(16, 32), nn.LayerNorm(32), nn.GELU(), nn.Linear(32, 32), nn.GELU(), nn.Linear(32, 4)
    )
    x = torch.randn(BATCH, 16, generator=torch.Generator().manual_seed(1))
    return model, x


def half(x: torch.Tensor, rank: int, world: int) -> torch.Tensor:
    size = x.shape[0] // world
    return x[rank * size : (rank + 1) * size]


def loss(out: torch.Tensor) -> torch.Tensor:
    return (out.float() ** 2).mean()


def compiled(model: nn.Module, backend: fxgrad.Backend, wrapper: str) -> nn.Module:
    """The two ways users compile: ``backend.compile(model)``, ``torch.compile(model, backend=backend)``."""
    return backend.compile(model) if wrapper == "backend.compile" else torch.compile(model, backend=backend)


POLICIES = {
    "global_clip": (lambda: fxgrad.clip_by_global_norm(1e-3), lambda m: ref.clip_global(m, 1e-3)),
    "per_layer_clip": (lambda: fxgrad.clip_by_norm(1e-3), lambda m: ref.clip_per_layer(m, 1e-3)),
    "rescale": (lambda: fxgrad.rescale(alpha=0.5), lambda m: ref.rescale(m, 0.5)),
    "linf_normalize": (lambda: fxgrad.normalize("linf"), lambda m: ref.normalize(m, "linf")),
    "sinkhorn": (lambda: fxgrad.sinkhorn(iters=3), lambda m: ref.sinkhorn(m, 3)),
    "agc": (lambda: fxgrad.adaptive_grad_clip(1e-3), lambda m: ref.agc(m, 1e-3)),
    "trust_ratio": (lambda: fxgrad.scale_by_trust_ratio(), lambda m: ref.trust_ratio(m)),
}


@on_each_rank
def ddp_exact(rank: int, world: int, policy: str) -> None:
    """scope="step" after DDP's all-reduce equals one process on the whole batch."""
    make, reference = POLICIES[policy]
    model, x = model_and_data()
    whole = copy.deepcopy(model)
    backend = fxgrad.backend(make(), compiler="aot_eager", scope="step")
    ddp = nn.parallel.DistributedDataParallel(backend.compile(model))
    loss(ddp(half(x, rank, world))).backward()
    backend.step()
    loss(whole(x)).backward()
    reference(whole)
    assert_grads_close(model, whole, rtol=1e-5)


@on_each_rank
def ddp_local(rank: int, world: int, wrapper: str) -> None:
    """scope="graph" under DDP: each rank rescales its own gradient, then DDP averages."""
    model, x = model_and_data()
    parts = []
    for r in range(world):  # what each rank computes on its own half, then rescales
        local = copy.deepcopy(model)
        loss(local(half(x, r, world))).backward()
        ref.rescale(local, 0.5)
        parts.append(local)
    averaged = copy.deepcopy(model)
    for p, *qs in zip(averaged.parameters(), *[m.parameters() for m in parts]):
        p.grad = sum(q.grad for q in qs) / world
    backend = fxgrad.backend(fxgrad.rescale(alpha=0.5), compiler="aot_eager", scope="graph")
    ddp = nn.parallel.DistributedDataParallel(compiled(model, backend, wrapper))
    loss(ddp(half(x, rank, world))).backward()
    torch.optim.SGD(model.parameters(), lr=0.0).step()  # the plain path's check runs here
    assert_grads_close(model, averaged, rtol=1e-5)


@on_each_rank
def auto_scope_is_exact(rank: int, world: int, wrapper: str) -> None:
    """The default scope in a data-parallel job is exact, applied at optimizer.step(),
    here after 2 accumulated micro-batches (no_sync on the first)."""
    model, x = model_and_data()
    whole = copy.deepcopy(model)
    backend = fxgrad.backend(fxgrad.clip_by_global_norm(1e-3), compiler="aot_eager")
    ddp = nn.parallel.DistributedDataParallel(compiled(model, backend, wrapper))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)  # lr 0: the gradients stay visible
    micro_batches = half(x, rank, world).chunk(2)
    with ddp.no_sync():
        loss(ddp(micro_batches[0])).backward()
    loss(ddp(micro_batches[1])).backward()
    optimizer.step()
    assert backend.current_scope() == "step" and not any(graph.routes for graph in backend.graphs)
    for k in range(2):  # micro-batch k of every rank, as one batch
        loss(whole(torch.cat([half(x, r, world).chunk(2)[k] for r in range(world)]))).backward()
    ref.clip_global(whole, 1e-3)
    assert_grads_close(model, whole, rtol=1e-5)


@on_each_rank
def fsdp2(rank: int, world: int, policy: str, wrapper: str | None = None) -> None:
    """scope="step" on FSDP2's sharded DTensor gradients: norms over whole layers.

    With ``wrapper``, the sharded model is compiled with the backend and
    ``optimizer.step()`` applies the policy; without, ``backend.step(model)``."""
    from torch.distributed.fsdp import fully_shard

    make, reference = POLICIES[policy]
    model, x = model_and_data()
    whole = copy.deepcopy(model)
    for layer in model:
        if any(True for _ in layer.parameters()):
            fully_shard(layer)
    fully_shard(model)
    backend = fxgrad.backend(make(), compiler="aot_eager", scope="step")
    forward = model if wrapper is None else compiled(model, backend, wrapper)
    loss(forward(half(x, rank, world))).backward()
    if wrapper is None:
        backend.step(model)
    torch.optim.SGD(model.parameters(), lr=0.0).step()  # applies the policy, unless already applied
    loss(whole(x)).backward()
    reference(whole)
    for (name, p), q in zip(model.named_parameters(), whole.parameters()):
        torch.testing.assert_close(
            p.grad.full_tensor(), q.grad, rtol=1e-5, atol=1e-5 * q.grad.abs().max().item(), msg=name
        )
