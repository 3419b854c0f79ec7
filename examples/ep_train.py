"""Expert-parallel training of a tiny Qwen3.5-MoE (Hugging Face, random init) with moe-gmm.

Run (CPU, gloo; any N that divides the 8 experts)::

    torchrun --nproc-per-node 2 examples/ep_train.py
    torchrun --nproc-per-node 4 examples/ep_train.py --dispatcher alltoall_overlap --steps 5
    torchrun --nproc-per-node 4 examples/ep_train.py --ep 2      # 2 data-parallel replicas of EP 2

What it shows, in order: join a process group with a timeout; build the same model on every
rank; shard its routed experts with ``apply_expert_parallel`` (each rank keeps E/N experts, the
router, shared expert and attention stay replicated); train, each rank on its slice of every
global batch, with ``sync_gradients`` after each backward; save an EP-sharded checkpoint in the
Hugging Face layout. With ``--check`` (default) rank 0 also trains a single-process replica on the
whole batches and reports how far the EP run is from it, then loads the checkpoint into a plain
(unsharded) model and confirms it equals the EP model's weights.
"""

from __future__ import annotations

import argparse
import os
import tempfile
from datetime import timedelta

import torch
import torch.distributed as dist
from transformers import Qwen3_5MoeForCausalLM, Qwen3_5MoeTextConfig

from moe_gmm.integrations.transformers import register_moe_gmm_experts
from moe_gmm.parallel import EPPlan, apply_expert_parallel, expert_parallel_groups, sync_gradients
from moe_gmm.parallel.checkpoint import load_ep_checkpoint, save_ep_checkpoint


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
    parser.add_argument(
        "--ep",
        type=int,
        default=None,
        help="EP size (default: all processes); fewer makes world/ep data-parallel replicas of each EP group",
    )
    parser.add_argument("--no-check", dest="check", action="store_false")
    parser.add_argument("--out", default=None, help="checkpoint directory (default: a temporary one)")
    args = parser.parse_args()

    # torchrun sets RANK / WORLD_SIZE / MASTER_ADDR; the timeout turns a dead peer into an error.
    dist.init_process_group("gloo", timeout=timedelta(seconds=60))
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.set_num_threads(1)

    ep = args.ep or world
    if ep == world:
        ep_group, sync = dist.group.WORLD, {}
    else:  # consecutive ranks form an EP group; ranks holding the same shard form an expert-DP group
        ep_group, expert_dp_group = expert_parallel_groups(ep)
        sync = {"dense_group": dist.group.WORLD, "expert_dp_group": expert_dp_group}

    model = build_model(seed=0)
    plan = EPPlan(expert_parallel_size=ep, apply_modules=["model.layers.{*}.mlp.experts"], dispatcher=args.dispatcher)
    sharded = apply_expert_parallel(model, ep_group, plan)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)  # built after sharding
    replica = build_model(seed=0) if (args.check and rank == 0) else None
    replica_opt = torch.optim.AdamW(replica.parameters(), lr=1e-3) if replica is not None else None
    if rank == 0:
        local = model.model.layers[0].mlp.experts.gate_up_proj.shape[0]
        print(
            f"EP={ep} x DP={world // ep} dispatcher={args.dispatcher}: sharded {sharded}, {local} of 8 experts per rank"
        )

    batch = args.per_rank_batch * world
    for step in range(args.steps):
        ids = global_batch(step, batch, args.seq_len)
        mine = ids[rank * args.per_rank_batch : (rank + 1) * args.per_rank_batch]
        optimizer.zero_grad()
        loss = model(input_ids=mine, labels=mine).loss  # mean over this rank's tokens
        loss.backward()
        sync_gradients(model, ep_group, **sync)  # average replicated grads; experts / world
        optimizer.step()
        mean_loss = loss.detach().clone()
        dist.all_reduce(mean_loss)
        mean_loss /= world
        if replica is not None:
            replica_opt.zero_grad()
            ref_loss = replica(input_ids=ids, labels=ids).loss
            ref_loss.backward()
            replica_opt.step()
            print(
                f"step {step}: loss {mean_loss.item():.6f} (single process {ref_loss.item():.6f}, "
                f"|diff| {abs(mean_loss.item() - ref_loss.item()):.2e})"
            )
        elif rank == 0:
            print(f"step {step}: loss {mean_loss.item():.6f}")

    out = args.out or (tempfile.mkdtemp(prefix="ep_ckpt_") if rank == 0 else None)
    box = [out]
    dist.broadcast_object_list(box)  # every rank writes into rank 0's directory
    if rank < ep:  # one EP group holds the whole model; the one with rank 0 saves it
        save_ep_checkpoint(model, box[0], ep_group)
    dist.barrier()
    if rank == 0:
        print(f"checkpoint: {sorted(os.listdir(box[0]))}")
        if args.check:
            plain = build_model(seed=1)
            load_ep_checkpoint(plain, box[0])  # EP=1: the whole experts tensors
            shard = model.model.layers[0].mlp.experts.gate_up_proj
            same = torch.equal(plain.model.layers[0].mlp.experts.gate_up_proj[: shard.shape[0]], shard)
            max_diff = max((p - q).abs().max().item() for p, q in zip(plain.parameters(), replica.parameters()))
            print(
                f"reloaded at EP=1: rank 0's experts bitwise equal: {same}; "
                f"max |param - single-process param|: {max_diff:.2e}"
            )
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
