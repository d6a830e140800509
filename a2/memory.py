"""GPU memory of a training step: an estimate of its peak, and the `--memory auto` rule built on it.

The step's peak, on one rank, is taken as
    resident   what is on the GPU when the plan is made: weights (frozen bf16 or fp32 masters, a rank's shards
               under FSDP), the encoders that stay loaded, the CUDA context's share of the allocator;
  + state      fp32 gradients and AdamW's two moments of the trainable weights (12 bytes each), and for full
               fine-tuning without FSDP autocast's bf16 copies of the weights, which live through the forward;
  + saved      what the forward keeps for backward, per block, with L tokens, model dim d, FFN dim f, h heads:
                 recomputed block:            its input, 2·L·d bytes (bf16)
                 + with save_attention:       the self-attention output and log-sum-exp, 2·L·d + 4·L·h
                 block not recomputed:        all its activations, L·(A·d + B·f) bytes
  + transient  one block's activations and their gradients while it is recomputed and back-propagated,
               2·L·(A·d + B·f), plus (FSDP) two unsharded bf16 blocks (the current one and the prefetched one).
A and B are per-token byte counts of a Wan block under bf16 autocast, measured on an H100 (bench.py, see the
README's speed section): the FFN keeps its input and two f-wide tensors, the attention its projections, norms
and RoPE'd queries/keys.

The rule (`plan_memory`): recomputation only costs time, so take the fewest recomputed blocks that fit the budget,
each keeping its self-attention (`save_attention`, which saves half a block's forward FLOPs at 32k tokens for
2·L·d bytes); if even all blocks recomputed with saved attention do not fit, recompute everything; if that does
not fit either, say so before the first step (the estimate, the budget, what to change). The budget is the free
GPU memory (or `--max-memory-gb` minus what is already allocated, to plan for a smaller card) less a margin for
the allocator's fragmentation and cuBLAS/cuDNN workspaces.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

ACT_PER_TOKEN_D = 24.0  # A: bytes per token per model dim of a block's activations (bf16 autocast)
ACT_PER_TOKEN_F = 4.0  # B: bytes per token per FFN dim
MARGIN = 0.08  # of the budget, for fragmentation and workspaces (with expandable segments)
MARGIN_GB = 1.0
GB = 2**30


def use_expandable_segments() -> None:
    """The CUDA allocator setting long video sequences need: without it the 14B step at 81x480x832 fails with
    10 GB reserved but unused (fragmentation). Only the environment variable, read when CUDA initialises, sets it;
    call this before anything touches CUDA. A user's own PYTORCH_CUDA_ALLOC_CONF is kept."""
    os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")


@dataclass(frozen=True)
class MemoryPlan:
    checkpoint_fraction: float  # of the blocks, recomputed in backward (the first ones)
    save_attention: bool  # recomputed blocks keep their self-attention outputs
    estimate_gb: float  # the step's estimated peak
    budget_gb: float
    why: str

    def __str__(self) -> str:
        return (f"recompute {self.checkpoint_fraction:.0%} of the blocks"
                + (" keeping self-attention" if self.save_attention and self.checkpoint_fraction else "")
                + f": ~{self.estimate_gb:.1f} GB of {self.budget_gb:.1f} GB ({self.why})")


def block_bytes(config: dict, tokens: int) -> dict[str, float]:
    """Bytes one block keeps for backward with `tokens` tokens (all samples of a micro-batch): recomputed
    (`ckpt`), recomputed keeping self-attention (`save`), not recomputed (`full`)."""
    d = config["num_attention_heads"] * config["attention_head_dim"]
    ckpt = 2.0 * tokens * d
    return dict(ckpt=ckpt, save=ckpt + 2.0 * tokens * d + 4.0 * tokens * config["num_attention_heads"],
                full=tokens * (ACT_PER_TOKEN_D * d + ACT_PER_TOKEN_F * config["ffn_dim"]))


def step_estimate(config: dict, tokens: int, resident: float, trainable: int, full_weights: int, checkpointed: int,
                  save_attention: bool, fsdp_block_bytes: float = 0.0) -> float:
    """The step's peak in bytes (module docstring). trainable: number of trainable weights on this rank;
    full_weights: weights autocast copies to bf16 (full fine-tuning without FSDP), else 0; fsdp_block_bytes: one
    block's unsharded bf16 weights under FSDP, else 0."""
    b = block_bytes(config, tokens)
    n = config["num_layers"]
    saved = checkpointed * b["save" if save_attention else "ckpt"] + (n - checkpointed) * b["full"]
    return resident + 12.0 * trainable + 2.0 * full_weights + saved + 2 * b["full"] + 2 * fsdp_block_bytes


def plan_memory(config: dict, tokens: int, budget: float, **weights) -> MemoryPlan:
    """The `--memory auto` rule (module docstring). budget: bytes the step may use on this GPU (resident
    included); weights: step_estimate's resident / trainable / full_weights / fsdp_block_bytes."""
    n = config["num_layers"]
    usable = budget * (1 - MARGIN) - MARGIN_GB * GB
    for k in range(n + 1):
        est = step_estimate(config, tokens, checkpointed=k, save_attention=True, **weights)
        if est <= usable:
            why = "no recomputation needed" if k == 0 else f"the fewest recomputed blocks that fit ({k}/{n})"
            return MemoryPlan(k / n, k > 0, est / GB, budget / GB, why)
    est = step_estimate(config, tokens, checkpointed=n, save_attention=False, **weights)
    if est <= usable:
        return MemoryPlan(1.0, False, est / GB, budget / GB, "saving attention outputs would not fit")
    return MemoryPlan(1.0, False, est / GB, budget / GB,
                      "DOES NOT FIT: the leanest plan; lower the resolution or frames, train a LoRA, or shard with "
                      "--fsdp over more GPUs")


def plan_for_model(model, tokens: int, max_memory_gb: float | None, full: bool, fsdp: bool, device) -> MemoryPlan:
    """plan_memory for a transformer already on its GPU (sharded, with --fsdp): what is allocated now is resident;
    the budget is what this process holds plus the device's free memory, or max_memory_gb."""
    import torch

    def local(p):  # a rank's shard of an FSDP2 parameter (DTensor), else the parameter
        return p.to_local().numel() if hasattr(p, "to_local") else p.numel()

    torch.cuda.synchronize(device)
    free, _ = torch.cuda.mem_get_info(device)
    budget = max_memory_gb * GB if max_memory_gb else free + torch.cuda.memory_reserved(device)
    return plan_memory(dict(model.config), tokens, budget, resident=torch.cuda.memory_allocated(device),
                       trainable=sum(local(p) for p in model.parameters() if p.requires_grad),
                       full_weights=sum(p.numel() for p in model.parameters()) if full and not fsdp else 0,
                       fsdp_block_bytes=2.0 * sum(p.numel() for p in model.blocks[0].parameters()) if fsdp else 0.0)
