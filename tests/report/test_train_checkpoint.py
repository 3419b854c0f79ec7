"""``moe-gmm train``'s checked files: round trip, and every kind of damage names the file and the tensor."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from moe_gmm.checksum import CheckpointError
from moe_gmm.report.train_checkpoint import check_state, load_checked, save_checked


def _payload() -> tuple[nn.Module, dict]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 3), nn.Linear(3, 2))
    opt = torch.optim.AdamW(model.parameters())
    model(torch.randn(2, 4)).sum().backward()
    opt.step()
    return model, {"model": model.state_dict(), "optimizer": opt.state_dict(), "step": 1, "losses": [1.0]}


def test_round_trip_keeps_every_tensor_bitwise(tmp_path):
    model, payload = _payload()
    save_checked(tmp_path / "c.pt", payload)
    state = load_checked(tmp_path / "c.pt", ("model", "optimizer"))
    assert set(state) == {"model", "optimizer", "step", "losses"}
    for key, value in payload["model"].items():
        assert torch.equal(state["model"][key], value)
    assert torch.equal(state["optimizer"]["state"][0]["exp_avg"], payload["optimizer"]["state"][0]["exp_avg"])
    check_state(state["model"], model.state_dict(), tmp_path / "c.pt")
    assert not list(tmp_path.glob("*.tmp"))


def _damaged(tmp_path, edit):
    _, payload = _payload()
    save_checked(tmp_path / "c.pt", payload)
    raw = torch.load(tmp_path / "c.pt", weights_only=True)
    edit(raw)
    torch.save(raw, tmp_path / "c.pt")
    return tmp_path / "c.pt"


@pytest.mark.parametrize(
    ("edit", "match"),
    [
        (lambda s: s["model"]["0.weight"].add_(1e-6), r"tensor 'model/0\.weight' does not match its checksum"),
        (lambda s: s["optimizer"]["state"][1]["exp_avg_sq"].fill_(float("nan")), r"'optimizer/state/1/exp_avg_sq'"),
        (lambda s: s["model"].pop("1.bias"), r"tensor 'model/1\.bias' is missing"),
        (lambda s: s["model"].update(extra=torch.zeros(1)), r"tensor 'model/extra' has no checksum"),
        (lambda s: s.pop("checksums"), r"no \['checksums'\]"),
        (lambda s: s.pop("optimizer"), r"no \['optimizer'\]"),
        (lambda s: s.update(checksums=[1]), r"checksums is a list"),
    ],
)
def test_damage_names_the_file_and_the_tensor(tmp_path, edit, match):
    path = _damaged(tmp_path, edit)
    with pytest.raises(CheckpointError, match=match) as info:
        load_checked(path, ("model", "optimizer"))
    assert str(path) in str(info.value)


@pytest.mark.parametrize("content", [b"", b"\x00" * 100, b"PK\x03\x04 not a zip"])
def test_unreadable_files_are_checkpoint_errors(tmp_path, content):
    (tmp_path / "c.pt").write_bytes(content)
    with pytest.raises(CheckpointError, match=r"c\.pt.*cannot be read"):
        load_checked(tmp_path / "c.pt", ("model",))
    with pytest.raises(CheckpointError, match="no such file"):
        load_checked(tmp_path / "missing.pt", ("model",))


def test_a_state_that_does_not_fit_the_model_is_refused_before_any_copy(tmp_path):
    model, payload = _payload()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    state = dict(payload["model"])
    state["1.weight"] = torch.zeros(2, 4)
    with pytest.raises(
        CheckpointError, match=r"tensor '1\.weight' is \(2, 4\) torch\.float32, the model's is \(2, 3\)"
    ):
        check_state(state, model.state_dict(), tmp_path / "c.pt")
    state["1.weight"] = payload["model"]["1.weight"].double()
    with pytest.raises(CheckpointError, match=r"torch\.float64, the model's is \(2, 3\) torch\.float32"):
        check_state(state, model.state_dict(), tmp_path / "c.pt")
    with pytest.raises(CheckpointError, match=r"tensor '0\.bias' of the model is missing"):
        check_state({k: v for k, v in payload["model"].items() if k != "0.bias"}, model.state_dict(), tmp_path / "c.pt")
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())
