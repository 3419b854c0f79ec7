"""Expert-parallel training of a tiny Qwen3.5-MoE (Hugging Face, random init) with moe-gmm on a DeviceMesh.

Run (CPU, gloo; N processes form a (N / ep, ep) mesh, ep dividing the 8 experts)::

    torchrun --nproc-per-node 2 examples/ep_train.py
    torchrun --nproc-per-node 4 examples/ep_train.py --dispatcher alltoall_overlap --steps 5
    torchrun --nproc-per-node 4 examples/ep_train.py --ep 2      # dp 2 x ep 2

What it shows, in order: join a process group with a timeout; build the same model on every
rank; ``parallelize_moe`` on a ``("dp", "ep")`` mesh (experts sharded over ``ep`` as DTensors,
FSDP2 over the rest); train, each rank on its slice of every global batch, backpropagating its
share of the global loss; save a DCP checkpoint (model and optimizer) whose layout does not depend
on the mesh. With ``--check`` (default) rank 0 also trains a single-process replica on the whole
batches and reports how far the parallel run is from it, then every rank loads the checkpoint
into a plain (unsharded) model and rank 0 compares it with the parallel model's weights.
"""

from __future__ import annotations

import argparse
import os
import tempfile
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from transformers import Qwen3_5MoeForCausalLM, Qwen3_5MoeTextConfig

from moe_gmm.integrations.transformers import register_moe_gmm_experts
from moe_gmm.optim import make_adamw
from moe_gmm.parallel import EPPlan, parallelize_moe
from moe_gmm.parallel.dcp import load_checkpoint, save_checkpoint


def build_model(seed: int) -> Qwen3_5MoeForCausalLM:
    config = Qwen3_5MoeTextConfig(
        vocab_size=128, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        head_dim=16, linear_key_head_dim=16, linear_value_head_dim=16, linear_num_key_heads=2,
        linear_num_value_heads=4, layer_types=["linear_attention", "full_attention"], num_experts=8,
        num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=32,
        tie_word_embeddings=False, experts_implementation=register_moe_gmm_experts(),
    )  # fmt: skip
    torch.manual_seed(seed)  # identical replicas on every rank before sharding
    return Qwen3_5MoeForCausalLM(config)


def global_batch(step: int, batch: int, seq_len: int) -> torch.Tensor:
    return torch.randint(0, 128, (batch, seq_len), generator=torch.Generator().manual_seed(step))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--per-rank-batch", type=int, default=2)
    parser.add_argument("--seq-len", type=int, default=32)
    parser.add_argument("--dispatcher", choices=["alltoall", "alltoall_overlap"], default="alltoall")
    parser.add_argument("--ep", type=int, default=None, help="EP size (default: all processes); dp = processes / ep")
    parser.add_argument("--no-check", dest="check", action="store_false")
    parser.add_argument("--out", default=None, help="checkpoint directory (default: a temporary one, removed at exit)")
    args = parser.parse_args()

    # torchrun sets RANK / WORLD_SIZE / MASTER_ADDR; the timeout turns a dead peer into an error.
    dist.init_process_group("gloo", timeout=timedelta(seconds=60))
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.set_num_threads(1)
    ep = args.ep or world
    mesh = init_device_mesh("cpu", (world // ep, ep), mesh_dim_names=("dp", "ep"))

    model = build_model(seed=0)
    plan = EPPlan(expert_parallel_size=ep, apply_modules=["model.layers.{*}.mlp.experts"], dispatcher=args.dispatcher)
    par = parallelize_moe(model, mesh, plan)
    optimizer = make_adamw(par.model.parameters(), lr=1e-3)  # built after parallelizing
    replica = build_model(seed=0) if (args.check and rank == 0) else None
    replica_opt = make_adamw(replica.parameters(), lr=1e-3) if replica is not None else None
    if rank == 0:
        local = model.model.layers[0].mlp.experts.ep_shard.num_local_experts  # FSDP splits their storage over dp
        print(f"mesh dp={world // ep} x ep={ep} dispatcher={args.dispatcher}: {local} of 8 experts per rank")

    batch = args.per_rank_batch * world
    for step in range(args.steps):
        ids = global_batch(step, batch, args.seq_len)
        mine = ids[rank * args.per_rank_batch : (rank + 1) * args.per_rank_batch]
        optimizer.zero_grad()
        loss = model(input_ids=mine, labels=mine).loss  # mean over this rank's tokens
        par.average_loss(loss).backward()  # every reduction sums: each rank backpropagates loss / world
        par.clip_grad_norm_(1.0)
        optimizer.step()
        mean_loss = loss.detach().clone()
        dist.all_reduce(mean_loss)
        mean_loss /= world
        if replica is not None:
            replica_opt.zero_grad()
            ref_loss = replica(input_ids=ids, labels=ids).loss
            ref_loss.backward()
            torch.nn.utils.clip_grad_norm_(replica.parameters(), 1.0)
            replica_opt.step()
            print(
                f"step {step}: loss {mean_loss.item():.6f} (single process {ref_loss.item():.6f}, "
                f"|diff| {abs(mean_loss.item() - ref_loss.item()):.2e})"
            )
        elif rank == 0:
            print(f"step {step}: loss {mean_loss.item():.6f}")

    with tempfile.TemporaryDirectory(prefix="ep_ckpt_") as scratch:
        box = [args.out or scratch]
        dist.broadcast_object_list(box)  # every rank writes its shards into rank 0's directory
        save_checkpoint(box[0], par, optimizer, extra={"step": args.steps})  # signed: manifest.json
        if rank == 0:
            print(f"checkpoint: {sorted(os.listdir(box[0]))}")
        if args.check:
            plain = build_model(seed=1)
            load_checkpoint(box[0], plain)  # every rank reads the whole tensors
            full = {n: p.full_tensor() for n, p in model.named_parameters()}
            if rank == 0:
                same = all(torch.equal(p, full[n]) for n, p in plain.named_parameters())
                max_diff = max((p - q).abs().max().item() for p, q in zip(plain.parameters(), replica.parameters()))
                print(
                    f"reloaded into a plain model: bitwise equal: {same}; "
                    f"max |param - single-process param|: {max_diff:.2e}"
                )
        dist.barrier()  # nobody removes the scratch directory while another rank still reads it
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
