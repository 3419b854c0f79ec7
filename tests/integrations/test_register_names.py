"""``register_moe_gmm_experts`` takes no name that transformers or another library already uses: the
experts registry is global, so taking one over would change every model that asks for it."""

from __future__ import annotations

import pytest

pytest.importorskip("transformers.integrations.moe")

from transformers.integrations.moe import ExpertsInterface  # noqa: E402

from moe_gmm.integrations.transformers import register_moe_gmm_experts  # noqa: E402


@pytest.mark.parametrize("name", ["eager", "grouped_mm", "batched_mm"])
def test_a_name_taken_by_transformers_is_refused_and_left_alone(name):
    before = ExpertsInterface._global_mapping.get(name)
    with pytest.raises(ValueError, match=f"name='{name}' is an experts implementation"):
        register_moe_gmm_experts(name)
    assert ExpertsInterface._global_mapping.get(name) is before


def test_our_own_name_can_be_registered_again():
    assert register_moe_gmm_experts("moe_gmm_register_test") == "moe_gmm_register_test"
    first = ExpertsInterface._global_mapping["moe_gmm_register_test"]
    try:
        register_moe_gmm_experts("moe_gmm_register_test", fused=False)
        assert ExpertsInterface._global_mapping["moe_gmm_register_test"] is not first
    finally:
        del ExpertsInterface._global_mapping["moe_gmm_register_test"]
