"""Test-wide settings: quiet hubs, the Triton interpreter on CPU, deterministic seeds, memory poisoning,
and a guard that fails any test leaving a process-wide setting changed."""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

# Without CUDA, Triton kernels run in its CPU interpreter. Triton fixes the mode when it is first
# imported, so this must precede every test module (some import triton at collection). With a
# CUDA device the kernels compile for real and the same tests run on the GPU.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture(autouse=True)
def _no_leaks():
    """Fail a test that leaves a process-wide setting changed (``tests/helpers/global_state.py``).

    Every later test would otherwise run under it: a thread count left at 1 changes reduction
    orders, a dtype or tuning changes what runs. The settings are put back before failing, so one
    leak fails one test. Requested first by every test, so it checks after every other fixture's
    teardown (monkeypatch's undo included).
    """
    from tests.helpers.global_state import no_leaks

    with no_leaks():
        yield


@pytest.fixture(autouse=True)
def _seed(_no_leaks) -> None:
    torch.manual_seed(0)


@pytest.fixture
def poisoned_memory():
    """Every uninitialised tensor (torch.empty, also inside ATen kernels) starts as NaN.

    A backend that leaves any output element unwritten then fails the comparison.
    """
    from torch.utils import deterministic

    was_deterministic = torch.are_deterministic_algorithms_enabled()
    was_warn_only = torch.is_deterministic_algorithms_warn_only_enabled()
    was_fill = deterministic.fill_uninitialized_memory
    torch.use_deterministic_algorithms(True, warn_only=True)
    deterministic.fill_uninitialized_memory = True
    try:
        assert torch.isnan(torch.empty(4)).all(), "poisoning is not active"
        yield
    finally:
        deterministic.fill_uninitialized_memory = was_fill
        torch.use_deterministic_algorithms(was_deterministic, warn_only=was_warn_only)


@pytest.fixture(params=["native", "composed"])
def glue_path(request):
    """Run a test on the native CPU kernels and again on the composed torch ops they replace.

    ``native`` is skipped only where no C++ compiler exists; a compiler whose build fails is an error.
    """
    from moe_gmm.ops import native

    if request.param == "composed":
        with native.disabled():
            yield request.param
        return
    if not native.enabled():
        pytest.skip("native kernels turned off by MOE_GMM_NATIVE")
    if native.compiler() is None:
        pytest.skip("no C++ compiler here: the native kernels cannot be built")
    assert native.available(), native.unavailable_reason()
    yield request.param
