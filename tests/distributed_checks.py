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
    barrier and teardown its peer may never reach. A rank that passes exits at
    once after the teardown: in interpreter finalization, gloo's C++ threads
    sometimes abort the process ("terminate called without an active
    exception", SIGABRT) after the check has passed. A rank stuck for
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
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)  # skip interpreter teardown, where gloo's threads now and then abort the process

    return run


def model_and_data(outputs: int = 4):
    model = nn.Sequential(
        nn.Linear(16, 32), nn.LayerNorm(32), nn.GELU(), nn.Linear(32, 32), nn.GELU(), nn.Linear(32, outputs)
    )
    x = torch.randn(BATCH, 16, generator=torch.Generator().manual_seed(1))
    return model, x


def shard_layers(model: nn.Sequential) -> None:
    """FSDP2: ``fully_shard`` each layer with parameters, then the model."""
    from torch.distributed.fsdp import fully_shard

    for layer in model:
        if any(True for _ in layer.parameters()):
            fully_shard(layer)
    fully_shard(model)


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
def fold_under(rank: int, world: int, wrapper: str, policy: str) -> None:
    """The default scope with backend.fold under DDP (``wrapper="ddp"``) or FSDP2 (``"fsdp2"``,
    the step program on local shards): 5 fused AdamW steps equal one process on the whole batch
    with the eager reference and the same optimizer. A global clip folds into ``grad_scale``; a
    per-layer clip folds into the step program under DDP, and under FSDP2 (DTensor parameters)
    runs the policy, then the optimizer's own step, after a warning."""
    make, reference = POLICIES[policy]
    model, x = model_and_data()
    whole = copy.deepcopy(model)
    backend = fxgrad.backend(make(), compiler="aot_eager")
    if wrapper == "fsdp2":
        shard_layers(model)
        forward = backend.compile(model)
    else:
        forward = nn.parallel.DistributedDataParallel(backend.compile(model))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True)
    backend.fold(optimizer)
    expected = torch.optim.AdamW(whole.parameters(), lr=1e-2, fused=True)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(5):
            loss(forward(half(x, rank, world))).backward()
            optimizer.step()
            optimizer.zero_grad()
            loss(whole(x)).backward()
            reference(whole)
            expected.step()
            expected.zero_grad()
    told = [w for w in caught if "the parameters are DTensors" in str(w.message)]
    assert len(told) == (wrapper == "fsdp2" and policy != "global_clip"), [str(w.message) for w in caught]
    if policy == "global_clip":
        assert backend.stats()["folded_factor"].item() < 1.0  # the clip acted
    for (name, a), b in zip(model.named_parameters(), whole.parameters()):
        a = a.full_tensor() if wrapper == "fsdp2" else a
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7, msg=name)


@on_each_rank
def fold_in_graph_scope(rank: int, world: int) -> None:
    """backend.fold() with scope="graph" under DDP: each rank's backward has a factor of its own,
    which the fused update would apply to the averaged gradients (the replicas drift apart).
    fold() says so and leaves the factor to the backward: the replicas stay equal."""
    model, x = model_and_data()
    backend = fxgrad.backend(fxgrad.clip_by_global_norm(1e-2), compiler="aot_eager", scope="graph")
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        backend.fold(optimizer)
    assert any("each rank would have a factor of its own" in str(w.message) for w in caught)
    ddp = nn.parallel.DistributedDataParallel(backend.compile(model))
    for _ in range(3):
        loss(ddp(half(x, rank, world))).backward()
        optimizer.step()
        optimizer.zero_grad()
    for name, p in model.named_parameters():
        copies = [torch.zeros_like(p) for _ in range(world)]
        dist.all_gather(copies, p.detach().clone())
        torch.testing.assert_close(copies[0], copies[1], rtol=0, atol=0, msg=name)


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
def ddp_local_buckets(rank: int, world: int, wrapper: str) -> None:
    """scope="graph" under DDP with several gradient buckets: Dynamo's DDP optimizer compiles one
    graph per bucket on fake copies of the parameters. Layers keep their names and types (the
    LayerNorm is skipped), per-layer rules apply per rank, and a global clip, which would see
    one bucket, is refused with the reason."""
    torch.manual_seed(0)  # 1 MB buckets (the smallest Dynamo takes), and a 1 MB layer: two buckets
    model = nn.Sequential(
        nn.Linear(16, 512), nn.LayerNorm(512), nn.GELU(), nn.Linear(512, 512), nn.GELU(), nn.Linear(512, 4)
    )
    x = model_and_data()[1]
    parts = []
    for r in range(world):
        local = copy.deepcopy(model)
        loss(local(half(x, r, world))).backward()
        ref.clip_per_layer(local, 1e-3)
        parts.append(local)
    averaged = copy.deepcopy(model)
    for p, *qs in zip(averaged.parameters(), *[m.parameters() for m in parts]):
        p.grad = sum(q.grad for q in qs) / world
    global_clip = copy.deepcopy(model)
    backend = fxgrad.backend(fxgrad.clip_by_norm(1e-3), compiler="aot_eager", scope="graph")
    ddp = nn.parallel.DistributedDataParallel(compiled(model, backend, wrapper), bucket_cap_mb=1)
    loss(ddp(half(x, rank, world))).backward()
    torch.optim.SGD(model.parameters(), lr=0.0).step()
    assert sum(1 for graph in backend.graphs if graph.params) > 1  # the buckets made several graphs
    assert {p.layer for graph in backend.graphs for p in graph.params} == {"0", "1", "3", "5"}
    assert_grads_close(model, averaged, rtol=1e-5)

    backend = fxgrad.backend(fxgrad.clip_by_global_norm(1e-3), compiler="aot_eager", scope="graph")
    ddp = nn.parallel.DistributedDataParallel(compiled(global_clip, backend, wrapper), bucket_cap_mb=1)
    try:
        loss(ddp(half(x, rank, world))).backward()
    except Exception as error:  # Dynamo may wrap it
        assert "one graph per gradient bucket" in str(error), error
    else:
        raise AssertionError("a global clip over one bucket's graph was not refused")


@on_each_rank
def auto_scope_is_exact(rank: int, world: int, wrapper: str) -> None:
    """The default scope in a data-parallel job is exact, applied at optimizer.step(),
    here after 2 accumulated micro-batches (no_sync on the first). ``torch.compile(DDP(model))``
    of an ``nn.Sequential`` compiles no graph at all (Dynamo leaves torch.nn's own forward
    eager): the policy runs all the same."""
    model, x = model_and_data()
    whole = copy.deepcopy(model)
    backend = fxgrad.backend(fxgrad.clip_by_global_norm(1e-3), compiler="aot_eager")
    if wrapper == "torch.compile(DDP)":
        ddp = torch.compile(nn.parallel.DistributedDataParallel(model), backend=backend)
    else:
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
def fsdp2(
    rank: int, world: int, policy: str, wrapper: str | None = None, compiler: str = "aot_eager", outputs: int = 4
) -> None:
    """scope="step" on FSDP2's sharded DTensor gradients: norms over whole layers.

    The compiled step program runs the local shards, all-reducing the layer norms; a
    policy with a rule that reads whole rows runs eagerly on the DTensors, and says so.
    With ``wrapper``, the sharded model is compiled with the backend and
    ``optimizer.step()`` applies the policy; without, ``backend.step(model)``.
    ``outputs=1``: the head's one row leaves rank 1 with empty shards."""
    make, reference = POLICIES[policy]
    model, x = model_and_data(outputs)
    whole = copy.deepcopy(model)
    shard_layers(model)
    backend = fxgrad.backend(make(), compiler=compiler, scope="step")
    forward = model if wrapper is None else compiled(model, backend, wrapper)
    loss(forward(half(x, rank, world))).backward()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        if wrapper is None:
            backend.step(model)
        torch.optim.SGD(model.parameters(), lr=0.0).step()  # applies the policy, unless already applied
    eager = [str(w.message) for w in caught if "runs the policy eagerly" in str(w.message)]
    local = policy not in ("agc", "sinkhorn")  # they read whole rows and columns
    assert len(backend._programs._programs) == int(local), "the compiled program runs the local shards"
    assert len(eager) == int(not local), eager  # the fallback is said, once
    loss(whole(x)).backward()
    reference(whole)
    for (name, p), q in zip(model.named_parameters(), whole.parameters()):
        torch.testing.assert_close(
            p.grad.full_tensor(), q.grad, rtol=1e-5, atol=1e-5 * q.grad.abs().max().item(), msg=name
        )


@on_each_rank
def fsdp2_balance_norms(rank: int, world: int) -> None:
    """``balance_norms`` reads whole weights, on uneven and empty shards too (the head's one row):
    equal to one process, pushes included."""
    model, x = model_and_data(outputs=1)
    whole = copy.deepcopy(model)
    shard_layers(model)
    settings = dict(k=1, lam=0.5, every=1, entropy_drop=0.0)
    backend = fxgrad.backend(fxgrad.balance_norms(**settings), compiler="aot_eager", scope="step")
    reference = ref.Balance(**settings)
    applied = []
    for _ in range(2):
        for net in (model, whole):
            net.zero_grad()
            with torch.no_grad():  # the weight norm moves into the first layer: the entropy drops
                net[0].weight.mul_(3.0)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # it runs eagerly on the DTensors, and says so
            loss(model(half(x, rank, world))).backward()
            backend.step(model)
        loss(whole(x)).backward()
        applied.append(reference.step(whole))
    assert applied == [False, True], applied
    for (name, p), q in zip(model.named_parameters(), whole.parameters()):
        torch.testing.assert_close(
            p.grad.full_tensor(), q.grad, rtol=1e-5, atol=1e-5 * q.grad.abs().max().item(), msg=name
        )


@on_each_rank
def fsdp2_in_graph_scope(rank: int, world: int, wrapper: str) -> None:
    """scope="graph" on an FSDP2 model: its forward gathers the parameters outside the compiled
    graphs, so the policy would do nothing; refused, naming step scope."""
    model, x = model_and_data()
    shard_layers(model)
    backend = fxgrad.backend(fxgrad.clip_by_global_norm(1e-3), compiler="aot_eager", scope="graph")
    try:
        forward = compiled(model, backend, wrapper)
        loss(forward(half(x, rank, world))).backward()
        torch.optim.SGD(model.parameters(), lr=0.0).step()
    except ValueError as error:
        assert "FSDP2's fully_shard" in str(error) and "scope='step'" in str(error), error
    else:
        raise AssertionError("graph scope on an FSDP2 model was not refused")


@on_each_rank
def fsdp2_program_steps(rank: int, world: int, compiler: str) -> None:
    """The compiled step program on FSDP2's local shards equals the same policy in one process
    on the whole gradients, step by step, state and statistics included: a skipped
    non-finite step (a NaN in rank 0's shard only), ZClip's warm-up and EMAs, and a layer
    whose one output row leaves rank 1 with empty shards."""

    def policy():
        return fxgrad.chain(
            fxgrad.skip_nonfinite(), fxgrad.monitor(), fxgrad.rescale(alpha=0.5), fxgrad.zclip(warmup=2)
        )

    model = nn.Sequential(nn.Linear(16, 32), nn.LayerNorm(32), nn.GELU(), nn.Linear(32, 3), nn.GELU(), nn.Linear(3, 1))
    whole = copy.deepcopy(model)
    shard_layers(model)
    sharded = fxgrad.backend(policy(), compiler=compiler, scope="step")
    single = fxgrad.backend(policy(), compiler="aot_eager", scope="step")
    for step in range(5):
        x = torch.randn(BATCH, 16, generator=torch.Generator().manual_seed(step)) * (1 + 9 * (step == 3))
        for m in (model, whole):
            m.zero_grad()
        loss(model(half(x, rank, world))).backward()
        loss(whole(x)).backward()
        if step == 2:
            whole[0].weight.grad[0, 0] = float("nan")
            if rank == 0:
                model[0].weight.grad.to_local()[0, 0] = float("nan")
        sharded.step(model)
        single.step(whole)
        for (name, p), q in zip(model.named_parameters(), whole.parameters()):
            atol = 1e-5 * q.grad.abs().max().item() + 1e-12
            torch.testing.assert_close(p.grad.full_tensor(), q.grad, rtol=1e-5, atol=atol, msg=f"step {step}: {name}")
        got, want = sharded.stats(), single.stats()
        assert got.keys() == want.keys()
        for key, value in want.items():
            torch.testing.assert_close(got[key], value, rtol=1e-5, atol=1e-7, msg=f"step {step}: {key}")
    assert len(sharded._programs._programs) == 1
    assert sharded.stats()["nonfinite_steps"].item() == 1.0


class LlamaBlock(nn.Module):
    """An embedding, an RMSNorm, a SwiGLU MLP with a residual, and a head: a Llama block's shapes."""

    def __init__(self, vocab: int = 16, dim: int = 16, hidden: int = 32) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.norm = nn.RMSNorm(dim)
        self.w1 = nn.Linear(dim, hidden)
        self.w3 = nn.Linear(dim, hidden, bias=False)
        self.w2 = nn.Linear(hidden, dim)
        self.head = nn.Linear(dim, vocab, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.embed(tokens)
        y = self.norm(h)
        h = h + self.w2(nn.functional.silu(self.w1(y)) * self.w3(y))
        return self.head(h)


def zero_nonfinite(model: nn.Module) -> None:
    for p in model.parameters():
        p.grad.copy_(torch.where(torch.isfinite(p.grad), p.grad, 0.0))


def zero_all(model: nn.Module) -> None:
    for p in model.parameters():
        p.grad.zero_()


NONFINITE = {  # with a NaN in w2.weight's gradient, on rank 0's shard only
    "zero_nonfinite": (fxgrad.zero_nonfinite, zero_nonfinite),
    "skip_nonfinite": (fxgrad.skip_nonfinite, zero_all),
}


class SequenceParallelNorm(nn.Module):
    """torchtitan's plan for a norm: under ``SequenceParallel`` its weight's gradient is a DTensor
    partial over the ranks (each holds its sequence shard's sum)."""

    def __init__(self) -> None:
        super().__init__()
        self.norm, self.proj = nn.RMSNorm(8), nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(self.norm(x))


@on_each_rank
def tensor_parallel_partial_gradients(rank: int, world: int) -> None:
    """Element-wise rules on a partial gradient: DTensor computes them on the all-reduced sum and
    returns it replicated, which step scope writes back as each rank's share of the sum. A NaN
    in rank 0's share is a NaN of the sum (``NONFINITE``); ``clip_by_value`` runs without one."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Partial, Replicate, Shard
    from torch.distributed.tensor.parallel import ColwiseParallel, SequenceParallel, parallelize_module

    mesh = init_device_mesh("cpu", (world,))
    x = torch.randn(2, 4, 8, generator=torch.Generator().manual_seed(1))
    clip = lambda m: torch.nn.utils.clip_grad_value_(m.parameters(), 1e-3)  # noqa: E731  the norm too: skip=()
    policies = {**NONFINITE, "clip_by_value": (lambda: fxgrad.clip_by_value(1e-3), clip)}
    for policy, (make, reference) in policies.items():
        model = SequenceParallelNorm()
        whole = copy.deepcopy(model)
        nan = policy in NONFINITE
        loss(whole(x)).backward()
        if nan:
            whole.norm.weight.grad[0] = float("nan")
        reference(whole)
        plan = {"norm": SequenceParallel(), "proj": ColwiseParallel(input_layouts=Shard(1), output_layouts=Replicate())}
        parallelize_module(model, mesh, plan)
        loss(model(x)).backward()
        assert model.norm.weight.grad.placements == (Partial(),)
        if nan and rank == 0:
            model.norm.weight.grad.to_local()[0] = float("nan")
        fxgrad.backend(make(), compiler="aot_eager", scope="step", skip=()).step(model)
        assert model.norm.weight.grad.placements == (Partial(),)  # in place
        for (name, p), q in zip(model.named_parameters(), whole.parameters()):
            grad = p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad
            torch.testing.assert_close(grad, q.grad, rtol=1e-5, atol=1e-6, msg=f"{policy}: {name}")


@on_each_rank
def tensor_parallel(rank: int, world: int, dp: int) -> None:
    """scope="step" on a tensor-parallel Llama block equals one process on the whole batch, for
    every policy of ``POLICIES``: 1-D TP over all ranks when ``dp == 1``, else FSDP2 x TP on a
    ``(dp, world // dp)`` mesh (each data-parallel group takes its share of the batch).

    w1 and w3 are column-wise (weights and w1's bias Shard(0)), w2 row-wise (weight Shard(1): its
    rows are split across ranks; bias a Replicate DTensor); embed, norm and head stay plain
    tensors, the same on every tensor-parallel rank. Each policy runs two steps: the first
    through ``backend.step(model)``, the second through ``optimizer.step()`` alone; a
    ``monitor(check_ranks=True)`` before it finds the ranks' layer norms equal. Then the
    ``NONFINITE`` policies must see a NaN that only rank 0's shard holds."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    mesh = init_device_mesh("cpu", (dp, world // dp), mesh_dim_names=("dp", "tp"))
    tokens = torch.randint(0, 16, (BATCH, 6), generator=torch.Generator().manual_seed(1))
    for policy, (make, reference) in {**POLICIES, **NONFINITE}.items():
        nan = policy in NONFINITE
        model = LlamaBlock()
        whole = copy.deepcopy(model)
        loss(whole(tokens)).backward()
        if nan:
            whole.w2.weight.grad[0, 0] = float("nan")  # on rank 0 in both meshes: dp and tp ranks 0
        reference(whole)
        plan = {"w1": ColwiseParallel(), "w3": ColwiseParallel(), "w2": RowwiseParallel()}
        parallelize_module(model, mesh["tp"], plan)
        if dp > 1:
            for layer in model.children():
                fully_shard(layer, mesh=mesh["dp"])
            fully_shard(model, mesh=mesh["dp"])
        transform = fxgrad.chain(fxgrad.monitor(check_ranks=True), make())
        backend = fxgrad.backend(transform, compiler="aot_eager", scope="step")
        optimizer = torch.optim.SGD(model.parameters(), lr=0.0)  # lr 0: the gradients stay visible
        for step in range(2):
            optimizer.zero_grad()
            loss(model(half(tokens, mesh.get_local_rank("dp"), dp))).backward()
            if nan and rank == 0:
                model.w2.weight.grad.to_local()[0, 0] = float("nan")
            if step == 0:
                backend.step(model)
            optimizer.step()  # applies the policy on the second step only
            for (name, p), q in zip(model.named_parameters(), whole.parameters()):
                grad = p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad
                atol = 1e-5 * q.grad.abs().max().item()
                torch.testing.assert_close(grad, q.grad, rtol=1e-5, atol=atol, msg=f"{policy}, step {step}: {name}")
            assert backend.stats()["rank_mismatch"].item() == 0.0
    if dp == 1:  # the model compiled with the backend: "auto" is step scope, the backward is left alone
        model = LlamaBlock()
        whole = copy.deepcopy(model)
        loss(whole(tokens)).backward()
        ref.clip_global(whole, 1e-3)
        parallelize_module(
            model, mesh["tp"], {"w1": ColwiseParallel(), "w3": ColwiseParallel(), "w2": RowwiseParallel()}
        )
        backend = fxgrad.backend(fxgrad.clip_by_global_norm(1e-3), compiler="aot_eager")
        loss(torch.compile(model, backend=backend)(tokens)).backward()
        torch.optim.SGD(model.parameters(), lr=0.0).step()
        for (name, p), q in zip(model.named_parameters(), whole.parameters()):
            grad = p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad
            atol = 1e-5 * q.grad.abs().max().item()
            torch.testing.assert_close(grad, q.grad, rtol=1e-5, atol=atol, msg=f"compiled: {name}")


@on_each_rank
def ranks_out_of_sync(rank: int, world: int) -> None:
    """monitor(check_ranks=True) under DDP exact: 0.0 while the ranks' gradients agree, 1.0 on
    every rank once one rank changes its gradients after DDP's all-reduce."""
    model, x = model_and_data()
    policy = fxgrad.chain(fxgrad.monitor(check_ranks=True), fxgrad.clip_by_global_norm(1e-3))
    backend = fxgrad.backend(policy, compiler="aot_eager", scope="step")
    ddp = nn.parallel.DistributedDataParallel(backend.compile(model))
    for desync in (False, True):
        model.zero_grad()
        loss(ddp(half(x, rank, world))).backward()
        if desync and rank == 1:
            model[3].weight.grad[0, 0] += 1e-3
        backend.step()
        assert backend.stats()["rank_mismatch"].item() == float(desync), (desync, backend.stats()["rank_mismatch"])
    local = fxgrad.backend(fxgrad.monitor(check_ranks=True), compiler="aot_eager", scope="graph")
    try:
        loss(local.compile(copy.deepcopy(model))(x)).backward()
    except Exception as error:  # noqa: BLE001  Dynamo wraps what the backend raises
        assert "check_ranks compares" in str(error), error
    else:
        raise AssertionError("check_ranks in graph scope did not raise")
