"""The ``cpu`` backend as registered (its thin spec): registration, and results that do not depend
on the thread count across its kernels."""

from __future__ import annotations

import pytest
import torch

from moe_gmm.ops.backends import get_backend
from moe_gmm.testing import gmm_inputs


def test_registered_and_first_for_cpu():
    from moe_gmm.ops.backends import AUTO_PRIORITY, select_backend

    assert get_backend("cpu").devices == frozenset({"cpu"})
    assert AUTO_PRIORITY["cpu"][0] == "cpu"
    assert select_backend(torch.zeros(4, 8), torch.zeros(2, 8, 8)).name == "cpu"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kernels_with_more_threads_than_cores_give_the_one_thread_results(dtype):
    # Hundreds of (expert, columns) tasks on 4 threads: on a machine of fewer cores the threads are
    # preempted mid-range and the others take their remaining tasks from the back.
    g = torch.Generator().manual_seed(11)
    counts = torch.randint(0, 13, (48,), generator=g).tolist()
    x, w, _ = gmm_inputs(counts, 64, 1024, dtype)
    dy = torch.randn(x.shape[0], 1024, generator=g).to(dtype)
    ends = torch.tensor(counts).cumsum(0)
    impl = get_backend("cpu")

    def passes():
        return impl.forward(x, w, ends), impl.grad_input(dy, w, ends), impl.grad_weight(x, dy, ends)

    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        expected = passes()
        torch.set_num_threads(4)
        for _ in range(3):
            for got, want in zip(passes(), expected):
                assert torch.equal(got, want)
    finally:
        torch.set_num_threads(threads)
