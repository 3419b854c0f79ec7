"""Hostile calls to the ops' public API each raise the classified error naming the argument.

The table lives in :mod:`tests.helpers.hostile_cases`; every call runs in one child process
(:mod:`tests.helpers.op_worker`), so a call that crashed the interpreter (a segfault, an abort on
heap corruption) fails its own case with the signal instead of ending the test run.
"""

from __future__ import annotations

from collections import Counter

import pytest

from moe_gmm.ops import native
from tests.helpers.hostile_cases import CASES
from tests.helpers.op_worker import OpWorker


@pytest.fixture(scope="module")
def worker():
    native.available()  # build the native kernels here once, not inside the child's first case
    w = OpWorker("tests.helpers.hostile_cases:run_case")
    yield w
    w.close()


def test_the_table_covers_every_op():
    per_op = Counter(name.split("/")[0] for name in CASES)
    assert len(CASES) >= 100, len(CASES)
    assert set(per_op) == {"gmm", "permute", "unpermute", "swiglu", "expert_mlp", "gather_gmm"}, per_op
    assert all(case.exc in (TypeError, ValueError, IndexError) for case in CASES.values())


@pytest.mark.parametrize("name", sorted(CASES))
def test_hostile_call_raises_the_classified_error(worker, name):
    case = CASES[name]
    outcome = worker.run(name)
    assert outcome.raised(case.exc), f"{name}: expected {case.exc.__name__}, but the call {outcome.describe()}"
    assert case.names in outcome.message, f"{name}: the message does not name {case.names!r}: {outcome.message}"
