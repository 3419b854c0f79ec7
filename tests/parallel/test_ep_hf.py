"""EP on a real (tiny, random) Hugging Face Qwen3.5-MoE model running the ``moe_gmm`` experts.

One 2-rank spawn: the model under ``parallelize_moe`` at (dp 1, ep 2) gives logits and gradients
equal to the single-process model on the concatenated batch, and its Hugging Face export (DCP's
consolidating writer) loads with ``from_pretrained`` into a plain model, bitwise.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")

from moe_gmm.integrations.transformers import register_moe_gmm_experts
from moe_gmm.parallel import EPPlan, parallelize_moe
from moe_gmm.parallel.dcp import export_hf
from moe_gmm.parallel.launch import run_ranks
from moe_gmm.testing import relative_error
from tests.helpers.mesh_runs import mesh

pytestmark = pytest.mark.distributed

LIMIT = 1e-5
EP_PATTERN = "model.layers.{*}.mlp.experts"  # the text model's names; the 397B plan adds .language_model


def _config():
    return transformers.Qwen3_5MoeTextConfig(
        vocab_size=128, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        head_dim=8, moe_intermediate_size=16, num_experts=8, num_experts_per_tok=3,
        shared_expert_intermediate_size=24, linear_key_head_dim=8, linear_value_head_dim=8,
        linear_num_key_heads=2, linear_num_value_heads=4, layer_types=["linear_attention", "full_attention"],
        experts_implementation="moe_gmm",
    )  # fmt: skip


def _build(seed: int):
    register_moe_gmm_experts()
    torch.manual_seed(seed)
    return transformers.Qwen3_5MoeForCausalLM(_config()).float()


def _hf_worker(rank: int, ep: int, root: str) -> dict:
    ids = torch.randint(0, 128, (ep, 12), generator=torch.Generator().manual_seed(5))
    ref = _build(seed=0)
    ref_out = ref(input_ids=ids, labels=ids)  # mean loss over the concatenated batch
    ref_out.loss.backward()
    ref_grads = {n: p.grad for n, p in ref.named_parameters()}

    model = _build(seed=0)
    par = parallelize_moe(model, mesh(1, ep), EPPlan(ep, [EP_PATTERN]))
    out = model(input_ids=ids[rank : rank + 1], labels=ids[rank : rank + 1])
    par.average_loss(out.loss).backward()  # each rank's loss is a mean over its equally many tokens
    errs = {"logits": relative_error(out.logits, ref_out.logits[rank : rank + 1])}
    for name, p in model.named_parameters():
        errs[name] = relative_error(p.grad.full_tensor(), ref_grads[name])

    export_hf(model, Path(root) / "ckpt")  # writes config.json too
    loaded_ok = None
    if rank == 0:
        fresh = _build(seed=0)  # the parameters before the backward: what was saved
        plain = transformers.Qwen3_5MoeForCausalLM.from_pretrained(Path(root) / "ckpt").float()
        want = dict(fresh.named_parameters())
        loaded_ok = all(torch.equal(p.detach(), want[n].detach()) for n, p in plain.named_parameters())
    return {"matched": par.experts, "errs": errs, "loaded_ok": loaded_ok}


def test_hf_qwen3_5_moe_expert_parallel_equals_single_process(tmp_path):
    reports = run_ranks(_hf_worker, 2, str(tmp_path), timeout_s=150)
    assert reports[0]["matched"] == ["model.layers.0.mlp.experts", "model.layers.1.mlp.experts"]
    assert len(reports[0]["errs"]) > 20
    for rank, report in enumerate(reports):
        for name, err in report["errs"].items():
            assert err < LIMIT, f"rank {rank} {name}: relative error {err:.2e}"
        assert any("mlp.gate.weight" in n for n in report["errs"])  # router grads compared
        assert any("shared_expert." in n for n in report["errs"])
    assert reports[0]["loaded_ok"] is True
