"""EMA of the trained weights (--ema-decay), kept in the optimizer's state.

    ema <- decay_t * ema + (1 - decay_t) * weights,   decay_t = min(decay, (1 + t) / (10 + t))   after optimizer step t

The warm-up (1 + t) / (10 + t) is diffusers' EMAModel rule (the one SimpleTuner and most diffusion trainers use): early
on, when the weights move fast and an EMA of decay 0.9999 would stay at the initialisation for thousands of steps, it
follows them closely (t = 0: 0.1, t = 90: 0.91, t = 990: 0.991) and reaches `decay` after about 10 / (1 - decay)
steps. Each weight's EMA is one more entry, "ema", of its optimizer state, beside AdamW's moments, so it lives where
they live (the device; with --fsdp a DTensor sharded exactly like its weight), and every checkpoint and resume that
restores the optimizer restores it (DDP: optimizer.pt; --fsdp: the sharded optimizer state, reshardable), bit for bit.
It starts at the weights after the weight's first update (AdamW creates a weight's state there): before it a weight
has not moved, and after it the 0.1 of the first decay would have weighted the initial value, a difference that the
warm-up forgets within a few steps. A weight that never gets a gradient never moves: it is its own EMA.
"""

from __future__ import annotations

from contextlib import contextmanager

import torch


def ema_decay(decay: float, step: int) -> float:
    """The decay of the update after optimizer step `step` (0-based): the warm-up of the module docstring."""
    return min(decay, (1 + step) / (10 + step))


def _local(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's own shard (the same storage), a tensor itself: the EMA is elementwise, so shards update alone."""
    return t.to_local() if hasattr(t, "to_local") else t


def _tracked(opt: torch.optim.Optimizer, params) -> list[torch.Tensor]:
    """The weights that have optimizer state (have been updated)."""
    return [p for p in params if "step" in opt.state.get(p, {})]


@torch.no_grad()
def update_ema(opt: torch.optim.Optimizer, params, decay: float) -> None:
    """After opt.step(): every updated weight's EMA moves towards it by 1 - decay (one fused foreach kernel)."""
    tracked = _tracked(opt, params)
    for p in tracked:
        if "ema" not in opt.state[p]:
            opt.state[p]["ema"] = p.detach().clone()
    if tracked:
        torch._foreach_lerp_([_local(opt.state[p]["ema"]) for p in tracked], [_local(p.detach()) for p in tracked],
                             1.0 - decay)


@contextmanager
def ema_weights(opt: torch.optim.Optimizer, params, enabled: bool = True):
    """Inside: the weights hold their EMA (validation, export); after: the trained weights again, bit for bit.
    Costs one copy of the updated weights (of this rank's shards) while inside."""
    tracked = [p for p in _tracked(opt, params) if "ema" in opt.state[p]] if enabled else []
    weights = [_local(p.detach()) for p in tracked]
    saved = [w.clone() for w in weights]
    with torch.no_grad():
        if weights:
            torch._foreach_copy_(weights, [_local(opt.state[p]["ema"]) for p in tracked])
    try:
        yield
    finally:
        with torch.no_grad():
            if weights:
                torch._foreach_copy_(weights, saved)
