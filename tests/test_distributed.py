"""DDP (exact and local modes), FSDP2 and tensor parallelism with 2 CPU processes over gloo
(FSDP2 x TP with 4)."""

import os
import tempfile
import time

import distributed_checks as checks
import pytest
import torch.multiprocessing as mp

pytestmark = pytest.mark.slow


def launch(fn, *args, timeout: float = 240.0, world: int = 2) -> None:
    """Run ``fn(rank, world, rendezvous_file, *args)`` in ``world`` processes; a hang fails instead of blocking CI."""
    with tempfile.TemporaryDirectory() as folder:
        context = mp.spawn(fn, args=(world, os.path.join(folder, "rendezvous"), *args), nprocs=world, join=False)
        deadline = time.monotonic() + timeout
        while not context.join(timeout=5):
            if time.monotonic() > deadline:
                for process in context.processes:
                    process.kill()
                pytest.fail(f"{fn.__name__}{args} did not finish in {timeout:.0f} s")


@pytest.mark.parametrize("policy", ["global_clip", "per_layer_clip", "rescale"])
def test_ddp_exact_equals_one_process_on_the_whole_batch(policy):
    launch(checks.ddp_exact, policy)


WRAPPERS = ["backend.compile", "torch.compile"]


@pytest.mark.parametrize("policy", ["global_clip", "per_layer_clip"])
@pytest.mark.parametrize("wrapper", ["ddp", "fsdp2"])
def test_fold_equals_one_process_with_the_eager_reference(wrapper, policy):
    launch(checks.fold_under, wrapper, policy)


def test_fold_in_graph_scope_under_ddp_leaves_the_factor_to_each_ranks_backward():
    launch(checks.fold_in_graph_scope)


@pytest.mark.parametrize("wrapper", WRAPPERS)
def test_ddp_local_rescales_before_the_all_reduce(wrapper):
    launch(checks.ddp_local, wrapper)


@pytest.mark.parametrize("wrapper", WRAPPERS)
def test_ddp_local_with_several_buckets_keeps_the_layer_names(wrapper):
    launch(checks.ddp_local_buckets, wrapper)


@pytest.mark.parametrize("wrapper", [*WRAPPERS, "torch.compile(DDP)"])
def test_default_scope_is_exact_under_ddp(wrapper):
    launch(checks.auto_scope_is_exact, wrapper)


@pytest.mark.parametrize("policy", list(checks.POLICIES))
def test_fsdp2_norms_span_the_shards(policy):
    launch(checks.fsdp2, policy)


@pytest.mark.parametrize("wrapper", WRAPPERS)
def test_fsdp2_in_graph_scope_is_refused(wrapper):
    launch(checks.fsdp2_in_graph_scope, wrapper)


@pytest.mark.parametrize("policy", ["agc", "sinkhorn"])
def test_fsdp2_row_rules_with_a_rank_of_empty_shards(policy):
    launch(checks.fsdp2, policy, None, "aot_eager", 1)


def test_fsdp2_balance_norms_on_uneven_shards_equals_one_process():
    launch(checks.fsdp2_balance_norms)


@pytest.mark.parametrize("compiler", ["aot_eager", pytest.param("inductor", marks=pytest.mark.inductor)])
def test_fsdp2_step_program_on_local_shards_equals_one_process(compiler):
    launch(checks.fsdp2_program_steps, compiler)


@pytest.mark.parametrize("wrapper", WRAPPERS)
def test_fsdp2_compiled_model_needs_no_backend_step(wrapper):
    launch(checks.fsdp2, "global_clip", wrapper)


def test_tensor_parallel_equals_one_process_on_the_whole_batch():
    launch(checks.tensor_parallel, 1)


def test_tensor_parallel_partial_gradients_under_element_wise_rules():
    launch(checks.tensor_parallel_partial_gradients)


def test_fsdp2_by_tensor_parallel_equals_one_process_on_the_whole_batch():
    launch(checks.tensor_parallel, 2, world=4)  # a (dp=2, tp=2) mesh: ~70 s on 2 cores


def test_check_ranks_flags_a_rank_out_of_sync():
    launch(checks.ranks_out_of_sync)
