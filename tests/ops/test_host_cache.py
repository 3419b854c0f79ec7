"""``host_cache``: reuse only memory nothing refers to, never alias live data, stay within the limit."""

from __future__ import annotations

import io

import pytest
import torch

from moe_gmm import grouped_matmul
from moe_gmm.ops import host_cache
from moe_gmm.testing import gmm_inputs, reference_grouped_matmul_grads

MIB = 1 << 20
SHAPE = (512, 1024)  # 2 MiB in float32: above MIN_BYTES


@pytest.fixture(autouse=True)
def fresh_cache():
    saved = host_cache.limit_bytes()
    host_cache.clear()
    host_cache.set_limit_bytes(64 * MIB)
    yield
    host_cache.clear()
    host_cache.set_limit_bytes(saved)


def _new():
    return host_cache.empty(SHAPE, dtype=torch.float32)


def test_reuses_memory_once_the_last_reference_is_gone():
    t = _new()
    assert t.shape == SHAPE and t.is_contiguous() and t.dtype == torch.float32
    ptr = t.data_ptr()
    del t
    again = _new()
    assert again.data_ptr() == ptr
    s = host_cache.stats()
    assert (s.hits, s.misses, s.storages, s.bytes_held) == (1, 1, 1, 2 * MIB)


def test_same_bytes_other_shape_and_dtype_reuse_too():
    ptr = _new().data_ptr()
    other = host_cache.empty((1024, 1024), dtype=torch.bfloat16)
    assert other.data_ptr() == ptr and other.shape == (1024, 1024)


@pytest.mark.parametrize(
    "holder",
    [
        lambda t: t,  # the tensor itself
        lambda t: t[3:],  # a view
        lambda t: t.t(),  # a transposed view
        lambda t: t.numpy(),  # a NumPy array on the same memory
        lambda t: t.untyped_storage(),  # the storage object
    ],
    ids=["tensor", "view", "transpose", "numpy", "storage"],
)
def test_never_hands_out_memory_that_is_still_referenced(holder):
    t = _new()
    t.fill_(7.0)
    base = t.untyped_storage().data_ptr()
    kept = holder(t)
    del t
    other = _new()
    other.fill_(-1.0)
    assert other.untyped_storage().data_ptr() != base
    if not isinstance(kept, torch.UntypedStorage):
        assert bool((torch.as_tensor(kept) == 7.0).all())


def test_small_tensors_and_other_devices_bypass_the_cache():
    small = host_cache.empty((16, 16), dtype=torch.float32)
    assert small.shape == (16, 16)
    meta = host_cache.empty(SHAPE, dtype=torch.float32, device="meta")
    assert meta.device.type == "meta"
    assert host_cache.stats().storages == 0


def test_limit_drops_idle_storages_least_recently_used_first():
    host_cache.set_limit_bytes(5 * MIB)  # room for two 2 MiB storages
    a, b = _new(), _new()
    b_ptr = b.data_ptr()
    del a, b  # both idle; a was used first
    big = host_cache.empty((768, 1024), dtype=torch.float32)  # 3 MiB: one idle storage must go
    s = host_cache.stats()
    assert (s.storages, s.bytes_held) == (2, 5 * MIB)
    assert _new().data_ptr() == b_ptr  # a was dropped, b kept
    del big


def test_over_the_limit_allocates_without_caching():
    host_cache.set_limit_bytes(3 * MIB)
    kept = _new()  # 2 MiB held and in use
    extra = _new()  # would exceed the limit: served uncached
    assert extra.data_ptr() != kept.data_ptr()
    assert host_cache.stats().storages == 1


def test_zero_limit_turns_caching_off():
    host_cache.set_limit_bytes(0)
    _new()
    assert host_cache.stats().storages == 0


def test_bad_limit_is_rejected():
    with pytest.raises(TypeError, match="nbytes"):
        host_cache.set_limit_bytes(1.5)
    with pytest.raises(ValueError, match="nbytes"):
        host_cache.set_limit_bytes(-1)


def test_environment_limit(monkeypatch):
    monkeypatch.setenv(host_cache.CACHE_ENV_VAR, "12")
    assert host_cache._default_limit() == 12 * MIB
    monkeypatch.setenv(host_cache.CACHE_ENV_VAR, "lots")
    with pytest.raises(ValueError, match=host_cache.CACHE_ENV_VAR):
        host_cache._default_limit()


def test_saved_tensor_has_exactly_its_own_bytes():
    t = _new().fill_(3.0)
    buffer = io.BytesIO()
    torch.save(t, buffer)
    buffer.seek(0)
    loaded = torch.load(buffer)
    assert loaded.untyped_storage().nbytes() == t.numel() * 4 and torch.equal(loaded, t)


def test_gradients_accumulate_correctly_across_steps_that_reuse_memory():
    # Weight grads come from the cache; .backward() stores the first as .grad and adds later ones
    # into it. Reuse must neither alias .grad nor lose an accumulation.
    counts = [40, 0, 60, 30]
    x, w, group_list = gmm_inputs(counts, 64, 1024)  # grad_weight [4, 64, 1024] fp32 = 1 MiB
    w = w.detach().requires_grad_(True)
    dy = torch.randn(x.shape[0], 1024, generator=torch.Generator().manual_seed(3))
    _, dw_ref = reference_grouped_matmul_grads(x, w.detach(), counts, dy)
    for backend in ("cpu", "eager"):
        w.grad = None
        for _ in range(3):
            grouped_matmul(x, w, group_list, backend=backend).backward(dy)
        torch.testing.assert_close(w.grad, (3 * dw_ref).float(), rtol=1e-4, atol=1e-3)
        first = w.grad
        w.grad = None  # now idle: the next step may reuse it, and must fully overwrite it
        grouped_matmul(x, w, group_list, backend=backend).backward(dy)
        torch.testing.assert_close(w.grad, dw_ref.float(), rtol=1e-4, atol=1e-3)
        del first
