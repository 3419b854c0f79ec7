"""``MoeMesh`` and the ``ParallelizedMoe`` handle: mesh roles and loss scaling arguments.

The loss scaling itself is what the training comparisons in test_fsdp / test_ddp measure
(uneven tokens per rank through ``normalize_loss``, equal ones through ``average_loss``).
"""

from __future__ import annotations

import pytest

from moe_gmm.parallel.mesh import MoeMesh


@pytest.mark.parametrize("mesh", [None, "dp,ep", [[0, 1]]])
def test_mesh_must_be_a_device_mesh(mesh):
    with pytest.raises(TypeError, match=r"mesh must be a torch.distributed.DeviceMesh, got "):
        MoeMesh(mesh)


@pytest.mark.distributed
@pytest.mark.parametrize(
    ("case", "expected"),
    [
        ("no_ep_dim", "ValueError: ep_dim must name a dim of the mesh ('dp',), got 'ep'"),
        ("no_data_dim", "ValueError: mesh must have a data dim besides 'ep' (size 1 is fine), got dims ('ep',)"),
        ("loss_type", "TypeError: loss_sum must be a torch.Tensor, got float"),
        ("count_shape", "ValueError: num_tokens must be a scalar, got shape (2,)"),
    ],
)
def test_mesh_and_loss_errors(mesh_reports_2, case, expected):
    for report in mesh_reports_2:
        assert report["usage_errors"][case].startswith(expected), report["usage_errors"][case]
