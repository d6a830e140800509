"""GPU memory of a training step on one rank: the estimate of its peak, and the `--memory auto` rule built on it.

The step's memory falls into the categories a dry run's trace counts (a2/train/trace.py), in five phases (six with
VACE's context blocks); the peak is the largest phase (`step_memory`). With n blocks of which the first k are
recomputed, L tokens on this rank (Lf in the whole sequence: context parallel splits it), model dim d, FFN dim f, h
heads of width e, Lc cross-attention keys (512 text + 257 per CLIP image), T trainable weights on this rank (fp32):
    weights    frozen weights on the GPU: those outside the blocks and what else is allocated (encoders), and each
               block's: all n in their dtype, or with `fp8` their linear weights as float8 + one fp32 scale per row
               (a2/memory/fp8.py), or with `swap_blocks` s, n - s resident (a2/memory/offload.py); under FSDP a rank's
               shards and the block gathered in use, a LoRA's forward also the weights outside the blocks and one more
               block (its frozen weights' gathers are freed late), the backward also the next block's prefetched gather
               and the weights outside the blocks (FSDP2 keeps the root's gathered from the forward on)
    swapped    swapped blocks fetched to the GPU: two (at most s) at once, the one in use and the next
    state      T·(4 weights + 8 AdamW moments [+ 4 EMA]) always; in the forward autocast's bf16 copies of the
               trainable weights (2·T: they live through it; not under FSDP, whose gathered weights are bf16 already);
               in the backward the fp32 gradients of the blocks done so far (4·T per block / n)
    kept       what the forward keeps for backward: per recomputed block its input, 2·L·d (with `save_attention`
               also the self-attention output and log-sum-exp, 2·L·d + 4·L·h; with `offload` two blocks' worth stay,
               the rest is in pinned host memory); per block not recomputed all its activations (`full_block`);
               outside the blocks RoPE's tables and the context (8·L·e + 2·Lc·d; full fine-tuning 8·Lc·d); at the
               forward's end the head's (norm_out's fp32 input, 4·L·d; full fine-tuning 10·L·d) and the gathered
               output
    transient  the working set: in the forward a block's (`FORWARD`, the FFN hidden and peft's fp32 LoRA inputs;
               context parallel: + Lf·d, its exchange), or the whole sequence before the first block splits it
               (Lf·(2.6·d + 8·e));
               in the backward through blocks not recomputed one block's backward (`BACKWARD`); in the backward of
               the recomputed blocks one block's recomputation and backward (`recompute_transient`); full fine-tuning
               under FSDP also a block's fp32 gradients as they are reduce-scattered
The phases: forward (at the last block; under context parallel also the first), forward's end, backward (through the
head and the blocks not recomputed: everything kept is still there), recompute (the recomputed blocks' backward, the
blocks not recomputed freed, at its first block or at its last where full fine-tuning's gradients outgrow what the
blocks keep), step (the optimizer's, with every gradient).
VACE (a2/kinds/vace.py) adds c context blocks, each a block (+ its hint's projection) run before the blocks on the same
L tokens, the first kc = round(k/n·c) recomputed as configure_blocks recomputes them; what they add:
    weights    c context blocks' frozen weights (fp8 as the blocks')
    kept       per context block what a block of its precision keeps (recomputed: its input; also the context's
               embedding, 2·L·d, which they all read); its blocks, where its LoRA is on the context blocks alone, keep
               as frozen blocks ("frozen": no weight gradient, no LoRA input), the first of them nothing
    transient  a hint (2·L·d) alive at the last block's forward where it hints it, its gradient at the backward's start
               there; in the recompute phase the gradients of the hints of the blocks behind it (2·L·d each)
and two phases: forward at the last context block (their keep, the c - 1 hints made before it, the context's input
and its embedding's casts: CONTEXT_INPUT·L) and "context", the context blocks' backward after the blocks' (what they
keep and the hints' gradients: at the last context block, or at the last recomputed one with its recomputation).

What a block keeps and holds depends on eager or compiled execution, and on how the trained weights compute
(ModelBytes.precision: peft's LoRA in fp32, a LoRA under FSDP in bf16, full fine-tuning). Eager, the per-token
coefficients below are fitted to dry-run traces (a2/train/trace.py) of A2-14B and Wan 1.3B, LoRA and full, with and
without CLIP, at 32,760 and 75,600 tokens and context parallel 2-8 (each fitted case within 2% of its trace; a LoRA
under FSDP on A2-14B alone). Compiled, a block not recomputed keeps L·(24d + 4f) and a recomputed block's backward holds
2·L·(24d + 4f) (H100, bench.py: a compiled block's graph plans its buffers); the forward's working set and the
backward through blocks not recomputed are taken as eager's (not measured compiled). A dry run traces eager and gives
the compiled accounting by the same substitution (`compiled_full_keep` and `recompute_transient`, a2/train/trace.py
compiled_peak): the rule and the trace compute the same terms. docs/memory.md's table holds both, at full size.

The rule (`plan_memory`) walks a ladder of plans, cheapest first, and takes the first that fits the budget:
  1. recompute the fewest blocks that fit, each keeping its self-attention (`save_attention`: half a block's
     forward FLOPs at 32k tokens for 2·L·d bytes); 0 blocks when everything fits. Exact; costs recomputation.
  2. recompute every block keeping attention, and offload what they keep to host memory (`offload`). Exact;
     costs PCIe copies (A2-14B at 720p: 1.4 GiB per block each way, ~0.1 s at 25 GB/s against ~0.6 s of block
     compute), overlapped with compute on a side stream.
  3. (if the host cannot hold the offloaded activations) recompute every block without saving attention, then
     also offloaded.
  4. LoRA: frozen linear weights in fp8 (`fp8`): half the weight bytes; costs an upcast per linear per use
     (memory-bound, a few % of the step) and the weights' rounding (e4m3: <= 2^-4 relative, tests/test_fp8.py).
  5. LoRA: fp8 and the fewest swapped blocks that fit (`swap_blocks`): their weights are fetched from host
     memory before each use in forward and backward, overlapped with compute. Exact relative to rung 4. (Rungs 4-5
     again without saved attention when the host cannot hold the attention outputs.)
  Under FSDP only rungs 1 and 3 without offload (offload, fp8 and swap are not combined with sharding); on VACE
  rungs 1, 3 and 4 without offload or swap (their hooks do not reach its context blocks: check_context_blocks).
  fp8 comes before swapping because it costs no transfer and makes each swapped block half the bytes; a user
  who wants bf16 weights with swapping sets the flags with `--memory manual`. If nothing fits: "DOES NOT FIT",
  before the first step (the estimate, the budget, what to change). The budget is the free GPU memory (or
  `--max-memory-gb`, to plan for a smaller card) less a margin for the allocator's fragmentation and
  cuBLAS/cuDNN workspaces (what a dry run's trace cannot see: 8% + 1 GiB), and 1% more for the rule's own error
  against the trace, so that the plan it picks passes its dry run; the host budget is the host's available memory
  less a margin. Figures are GiB (2^30).
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, replace

import torch

from a2.cli import ConfigError
from a2.config.sections import MemoryConfig
from a2.memory.fp8 import fp8_bytes, quantize_base_weights, scaled_mm_supported
from a2.memory.offload import apply_offload, frozen_tensors
from a2.model.transformer import CLIP_TOKENS, TEXT_TOKENS, configure_blocks

GB = 2**30  # a GiB: every figure the rule and the dry run print
COMPILED_D, COMPILED_F = 24.0, 4.0  # a compiled block not recomputed keeps L·(24d + 4f) bytes (H100, bench.py)
# eager, per token per model dim and per FFN dim (fitted to dry-run traces, module docstring):
# by how the trained weights compute (ModelBytes.precisions): "lora" peft's LoRA in fp32, "lora bf16" the same under
# FSDP (its weights gathered in bf16; fitted on A2-14B alone, what is not fitted taken as full fine-tuning's), "full",
# "frozen" blocks that train nothing (VACE's blocks under a LoRA of its context blocks: no weight gradient, no LoRA
# input; fitted on Wan2.1-VACE 1.3B and 14B, LoRA, 3 references, 81x480x832)
FULL_BLOCK = {"lora": (50.0, 4.08), "lora bf16": (47.2, 4.0), "full": (60.0, 4.0),  # what a block not recomputed
              "frozen": (36.0, 2.0)}  # keeps
RECOMPUTE = {"lora": (63.9, 10.08), "lora bf16": (63.7, 4.0), "full": (72.2, 4.0),  # a recomputed block's backward
             "frozen": (49.3, 3.7)}
FORWARD = {"lora": ((13.5, 6.4), (7.5, 8.4)), "lora bf16": ((19.6, 0.3), (11.5, 3.3)),  # the forward's working set at
           "full": ((19.6, 0.3), (11.5, 3.3)), "frozen": ((24.6, 1.0), (16.3, 3.36))}  # the last block (not
# recomputed, recomputed)
BACKWARD = {"lora": (0.0, 3.95), "lora bf16": (9.9, 0.0), "full": (9.9, 0.0),  # through a block not recomputed
            "frozen": (-2.0, 4.0)}  # (frozen: less the head's input, freed by then)
CLIP_D = 4.3  # eager, per token per model dim, with CLIP tokens: the image cross-attention's output and its LoRA
CONTEXT_D = 12.0  # per context key per model dim, each block not recomputed and recomputed: cross-attention's K/V
CONTEXT_INPUT = 4130.0  # VACE, per token: its 96-channel context and the casts of its patch embedding (eager)
UNSPLIT_D = 2.6  # per token of the whole sequence per model dim: what context parallel holds before the split
MARGIN = 0.08  # of the budget, for fragmentation and workspaces (with expandable segments)
MARGIN_GB = 1.0
SLACK = 0.01  # of the budget, that the rule leaves for its own error against the dry run's trace (within 1% there)
HOST_MARGIN = 0.8  # of the host's available memory that pinned buffers may take
OUT_CHANNELS = 64  # the output projection's width per token (16 latent channels x a 1x2x2 patch), fp32 gathered
CATEGORIES = ("weights", "state", "kept", "transient", "swapped")
PHASES = ("forward", "forward end", "backward", "recompute", "context", "step")


def use_expandable_segments() -> None:
    """The CUDA allocator setting long video sequences need: without it the 14B step at 81x480x832 fails with
    10 GiB reserved but unused (fragmentation). Only the environment variable, read when CUDA initialises, sets it;
    call this before anything touches CUDA. A user's own PYTORCH_CUDA_ALLOC_CONF is kept."""
    os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")


@dataclass(frozen=True)
class ModelBytes:
    """What the rule needs of the transformer on one rank (`model_bytes` reads it from a model)."""

    fixed: float  # frozen bytes that stay on the GPU whatever the plan: weights outside the blocks and what else is
    #               allocated (encoders); a rank's shards under FSDP
    block: float  # one block's frozen weights in their dtypes (the mean over blocks; a rank's shard under FSDP)
    block_fp8: float  # the same with its frozen linear weights in float8 + fp32 row scales
    trainable: int  # trainable weights on this rank (fp32: 4 bytes, their AdamW moments 8, gradients 4)
    ema: bool = False  # --ema-decay: a copy of the trainable weights (4 bytes each)
    lora: bool = True  # frozen base weights: fp8 and block swapping are allowed
    fsdp_block: float = 0.0  # one block's weights gathered in the compute dtype under FSDP, else 0
    fsdp_root: float = 0.0  # the weights outside the blocks gathered under FSDP (through the forward), else 0
    context_block: float = 0.0  # VACE: one context block's frozen weights in their dtypes (the mean), else 0
    context_block_fp8: float = 0.0  # the same with its frozen linear weights in float8 + fp32 row scales
    base_frozen: bool = False  # the blocks train nothing (VACE's LoRA on its context blocks): they compute "frozen"
    context_frozen: bool = False  # VACE's context blocks train nothing (its LoRA on the blocks)

    @property
    def frozen_blocks(self) -> bool:
        return self.block > 0

    @property
    def precision(self) -> str:
        """How the trained weights compute, which sets what an eager step holds: "lora", peft's LoRA in fp32 (each
        LoRA input cast to fp32 and kept); "lora bf16", under FSDP, its weights gathered in the compute dtype; or
        "full"."""
        return "full" if not self.lora else "lora bf16" if self.fsdp_block else "lora"

    @property
    def precisions(self) -> tuple[str, str]:
        """How the blocks and VACE's context blocks compute: `precision`, or "frozen" where they train nothing (no
        weight gradient, no LoRA input kept)."""
        return tuple("frozen" if frozen else self.precision for frozen in (self.base_frozen, self.context_frozen))


@dataclass(frozen=True)
class StepShape:
    """What the rule needs of one micro-batch's step besides the model."""

    tokens: int  # on this rank (context parallel: its share), all samples of the micro-batch
    sequence: int = 0  # of the whole sequence (context parallel: every rank's); 0: `tokens`
    context: int = 512  # cross-attention keys per sample: 512 text tokens and 257 per CLIP image
    clip: bool = False  # the step feeds CLIP image tokens (the image cross-attention runs)

    @property
    def whole(self) -> int:
        return self.sequence or self.tokens


def step_shape(layout, info, resolution: tuple[int, int], micro_batch: int, context_parallel: int) -> StepShape:
    """The step a rank runs: the micro-batch's tokens of a run's layout (its largest element set; in-context and
    Stand-In references counted), its share under context parallel (each sample split, the last rank padded), and
    the cross-attention context (512 text tokens and 257 CLIP tokens per image where the step feeds them)."""
    whole = layout.tokens(info, *resolution)
    context = TEXT_TOKENS + (CLIP_TOKENS * layout.reference_images if layout.use_clip else 0)
    return StepShape(micro_batch * -(-whole // context_parallel), micro_batch * whole, context, layout.use_clip)


@dataclass(frozen=True)
class MemoryPlan:
    checkpoint_fraction: float  # of the blocks, recomputed in backward (the first ones)
    save_attention: bool  # recomputed blocks keep their self-attention outputs
    estimate_gb: float | None  # the step's estimated GPU peak, GiB (None: set by the flags, not planned)
    budget_gb: float | None  # GiB
    why: str
    offload: bool = False  # recomputed blocks' saved tensors live in pinned host memory between forward and backward
    swap_blocks: int = 0  # blocks whose frozen weights live in pinned host memory
    fp8: bool = False  # frozen linear weights stored as float8
    host_gb: float = 0.0  # pinned host memory the plan takes, GiB

    @classmethod
    def manual(cls, c: MemoryConfig) -> MemoryPlan:
        """The plan the flags set (--memory manual, and the CPU)."""
        return cls(c.checkpoint_fraction if c.gradient_checkpointing else 0.0, c.save_attention, None, None,
                   "the flags", c.offload_activations, c.swap_blocks, c.fp8_base)

    def __str__(self) -> str:
        extra = [s for s, on in (("fp8 frozen weights", self.fp8), (f"{self.swap_blocks} blocks swapped to host",
                                 self.swap_blocks), ("activations offloaded to host", self.offload)) if on]
        return (f"recompute {self.checkpoint_fraction:.0%} of the blocks"
                + (" keeping self-attention" if self.save_attention and self.checkpoint_fraction else "")
                + "".join(", " + s for s in extra)
                + (f": ~{self.estimate_gb:.2f} GiB of {self.budget_gb:.2f} GiB" if self.budget_gb else "")
                + (f", {self.host_gb:.2f} GiB pinned host memory" if self.host_gb else "") + f" ({self.why})")


def _dims(config: dict) -> tuple[int, int, int, int]:
    """(model dim, FFN dim, heads, head dim)."""
    return (config["num_attention_heads"] * config["attention_head_dim"], config["ffn_dim"],
            config["num_attention_heads"], config["attention_head_dim"])


def recomputed_keep(config: dict, tokens: int, save_attention: bool) -> float:
    """Bytes one recomputed block keeps for backward: its input (bf16), with save_attention also the self-attention
    output (bf16) and log-sum-exp (fp32)."""
    d, _, h, _ = _dims(config)
    return 2.0 * tokens * d + (2.0 * tokens * d + 4.0 * tokens * h if save_attention else 0.0)


def compiled_full_keep(config: dict, tokens: int) -> float:
    """Bytes a compiled block that is not recomputed keeps for backward (H100)."""
    d, f, _, _ = _dims(config)
    return tokens * (COMPILED_D * d + COMPILED_F * f)


def full_keep(config: dict, s: StepShape, precision: str, compile: bool) -> float:
    """Bytes a block that is not recomputed keeps for backward, compiled or eager (module docstring); precision:
    ModelBytes.precision."""
    if compile:
        return compiled_full_keep(config, s.tokens)
    d, f, _, _ = _dims(config)
    a, b = FULL_BLOCK[precision]
    return s.tokens * (a * d + b * f + CLIP_D * d * s.clip) + CONTEXT_D * s.context * d


def recompute_transient(config: dict, s: StepShape, precision: str, save_attention: bool, compile: bool) -> float:
    """Bytes one recomputed block holds while it is recomputed and back-propagated (its recomputed activations and
    their gradients; without save_attention also the recomputed attention output), compiled or eager; precision:
    ModelBytes.precision."""
    d, f, _, _ = _dims(config)
    unsaved = 0.0 if save_attention else 2.0 * s.tokens * d
    if compile:
        return 2 * compiled_full_keep(config, s.tokens) + unsaved
    a, b = RECOMPUTE[precision]
    return s.tokens * (a * d + b * f + CLIP_D * d * s.clip) + CONTEXT_D * s.context * d + unsaved


def pinned_bytes(config: dict, tokens: int, save_attention: bool) -> float:
    """Pinned host bytes one offloaded block takes: its input (and attention output, log-sum-exp), each rounded up
    to a power of two by torch's pinned allocator (a2/memory/offload.py)."""
    d, _, h, _ = _dims(config)
    sizes = [2.0 * tokens * d] + ([2.0 * tokens * d, 4.0 * tokens * h] if save_attention else [])
    return sum(2.0 ** math.ceil(math.log2(s)) for s in sizes)


def step_memory(config: dict, s: StepShape, m: ModelBytes, checkpointed: int, save_attention: bool,
                offload: bool = False, fp8: bool = False, swap_blocks: int = 0, compile: bool = False,
                context_checkpointed: int | None = None) -> dict[str, dict[str, float]]:
    """The step's GPU bytes at each phase's peak, by category (module docstring): {phase: {category: bytes}}.
    context_checkpointed: VACE's recomputed context blocks (None: as configure_blocks rounds checkpointed / n)."""
    d, f, _, e = _dims(config)
    n, k, L, T = config["num_layers"], checkpointed, s.tokens, m.trainable
    hinted = config.get("vace_layers") or ()  # VACE: the blocks its c context blocks hint, kc of them recomputed
    c = len(hinted)
    kc = round(k / n * c) if context_checkpointed is None else context_checkpointed
    lora, p = m.lora, m.precision
    pb, pc = m.precisions
    per_block = m.block_fp8 if fp8 else m.block
    weights = m.fixed + (n - swap_blocks) * per_block + c * (m.context_block_fp8 if fp8 else m.context_block)
    swapped = min(2, swap_blocks) * per_block
    amp = 0.0 if m.fsdp_block else 2.0 * T  # autocast's bf16 copies of the trainable weights
    state = (12.0 + 4.0 * m.ema) * T
    rec = recomputed_keep(config, L, save_attention)
    hint = 2.0 * L * d  # VACE: a hint, its gradient, a context block's input (bf16)
    outside = 8.0 * L * e + (2.0 if lora else 8.0) * s.context * d
    blocks = (min(2, k) if offload else k) * rec + (n - k) * full_keep(config, s, pb, compile)
    if pb == "frozen":  # the first block's input needs no gradient: it keeps nothing
        blocks -= rec if k else full_keep(config, s, pb, compile)
    context = 0.0  # what the context blocks keep: the context's embedding and each block's (a frozen one nothing)
    if c and pc != "frozen":
        context = (hint if kc else 0.0) + kc * rec + (c - kc) * full_keep(config, s, pc, compile)
    kept = outside + blocks + context
    if (pc if c else p) == "lora" and not (kc if c else k) and not compile:  # an eager first block keeps no fp32
        kept -= 4.0 * L * d  # copy of its input
    # VACE: a hint alive at the last block's forward where it hints it, its gradient at the backward's start
    last_hint = hint if n - 1 in hinted else 0.0
    head = (4.0 if lora else 10.0) * L * d + 4.0 * s.whole * OUT_CHANNELS
    a, b = FORWARD[pb][k == n]
    forward = L * (a * d + b * f) + (s.whole * d if s.whole > L else 0.0) + last_hint  # (context parallel: what its
    unsplit = s.whole * (UNSPLIT_D * d + 8.0 * e) if s.whole > L else 0.0  # exchange holds)
    a, b = BACKWARD[pb]
    gathered = weights + m.fsdp_block + ((m.fsdp_root + m.fsdp_block) if lora else 0.0)  # (FSDP, frozen
    in_backward = weights + 2.0 * m.fsdp_block + m.fsdp_root  # weights: more gathers in the forward; in the backward
    phases = {  # the next block's prefetched gather and the root's, kept since the forward)
        "forward": dict(state=state + amp, kept=kept, transient=forward, weights=gathered),
        # autocast's cache is cleared as the forward returns; the copies the blocks not recomputed saved remain
        "forward end": dict(state=state + amp * (n - k) / n, kept=kept + head, transient=0.0),
        "backward": dict(state=state + amp * (n - k) / n, kept=kept + head, transient=L * (a * d + b * f) + last_hint,
                         weights=in_backward),
        "step": dict(state=state + 4.0 * T, kept=0.0, transient=0.0)}
    if unsplit > kept - outside:  # at the first block, the whole sequence not yet split, rather than the last
        phases["forward"] = dict(phases["forward"], kept=outside, transient=forward + unsplit)
    if c and pc != "frozen":  # at the last context block's forward: every hint made so far alive, and its input
        a, b = FORWARD[pc][kc == c]
        at = dict(phases["forward"], kept=outside + context,
                  transient=L * (a * d + b * f) + (c - 1) * hint + CONTEXT_INPUT * L)
        phases["forward"] = max(phases["forward"], at, key=lambda v: sum(v.values()))
    if k:  # at the last recomputed block's backward, or at the first's with the gradients of all the others
        skip = 1 if pb == "frozen" else 0  # (a frozen first block has no backward, nothing kept)
        first = (state + 4.0 * T * (n - k) / n, (min(2, k) if offload else k - skip) * rec, k - 1)
        last = (state + 4.0 * T * (n - 1) / n, min(2 if offload else 1, k) * rec, skip)
        grads, held, i = max(first, last, key=lambda v: v[0] + v[1] + hint * sum(j >= v[2] for j in hinted))
        phases["recompute"] = dict(state=grads + amp / n, kept=outside + held + context,
                                   transient=recompute_transient(config, s, pb, save_attention, compile)
                                   + hint * sum(j >= i for j in hinted)  # VACE: the gradients of the hints after
                                   + (0.0 if lora else 2 * m.fsdp_block),  # FSDP: fp32 gradients reduce-scattered
                                   weights=in_backward)
    if c and pc != "frozen":  # VACE: the context blocks' backward, the blocks' done: at the last one (everything
        # they keep there) or the last recomputed one (its recomputation), with the hints' gradients not yet used and
        # the gradient of the next one's input (none after the last)
        a, b = BACKWARD[pc]
        grads = state + 4.0 * T * (0.0 if pb == "frozen" else n / (n + c))
        last = dict(state=grads + amp, kept=outside + context, transient=L * (a * d + b * f) + (c - 2) * hint)
        recomputed = dict(state=grads + amp / n, kept=outside + (hint + kc * rec if kc else 0.0),
                          transient=recompute_transient(config, s, pc, save_attention, compile)
                          + (kc - 1 - (kc == c)) * hint)
        phases["context"] = dict(max(last, recomputed if kc else last, key=lambda v: sum(v.values())),
                                 weights=in_backward)
    return {p: dict(dict(weights=weights, swapped=swapped), **cats) for p, cats in phases.items()}


def step_estimate(config: dict, s: StepShape, m: ModelBytes, checkpointed: int, save_attention: bool,
                  offload: bool = False, fp8: bool = False, swap_blocks: int = 0,
                  compile: bool = False) -> tuple[float, float]:
    """(GPU peak, pinned host bytes) of the step under a plan: the largest phase of step_memory; offloaded tensors
    take torch's pinned caching allocator's blocks (each rounded up to a power of two), swapped weights their bytes."""
    phases = step_memory(config, s, m, checkpointed, save_attention, offload, fp8, swap_blocks, compile)
    host = (swap_blocks * (m.block_fp8 if fp8 else m.block)
            + (checkpointed * pinned_bytes(config, s.tokens, save_attention) if offload else 0))
    return max(sum(c.values()) for c in phases.values()), host


def ladder(n: int, lora: bool, offload: bool = True, fp8: bool = True):
    """The plans of the rule, cheapest first: (checkpointed, save_attention, offload, fp8, swap_blocks). offload:
    activation offload and block swapping may be used (not under FSDP, nor on VACE: their hooks are on the blocks
    alone); fp8: fp8 frozen weights may be (not under FSDP). The plans without saved attention come after those with
    it: they cost an attention core more per block, but take half the host memory offloaded."""
    yield from ((k, True, False, False, 0) for k in range(n + 1))
    if offload:
        yield n, True, True, False, 0
    yield n, False, False, False, 0
    if offload:
        yield n, False, True, False, 0
    if lora and fp8:
        for save in (True, False):
            yield from ((n, save, offload, True, s) for s in range(n + 1 if offload else 1))


def plan_memory(config: dict, s: StepShape, budget: float, m: ModelBytes, host_budget: float = float("inf"),
                fp8: bool = False, offload: bool = False, swap_blocks: int = 0, compile: bool = False) -> MemoryPlan:
    """The `--memory auto` rule (module docstring). budget: bytes the step may use on this GPU (resident
    included); host_budget: pinned host bytes it may take; fp8, offload, swap_blocks: pieces the user forces on
    (flags), which every plan then has."""
    n = config["num_layers"]
    usable = budget * (1 - MARGIN - SLACK) - MARGIN_GB * GB
    host_usable = host_budget * HOST_MARGIN
    lean = None  # the plan with the smallest estimate, said when none fits
    vace = bool(config.get("vace_layers"))
    for k, save, off, f8, swap in ladder(n, m.lora and m.frozen_blocks, not m.fsdp_block and not vace,
                                         not m.fsdp_block):
        off, f8, swap = off or offload, f8 or fp8, max(swap, swap_blocks)
        k = n if off else k  # offload applies to recomputed blocks
        gpu, host = step_estimate(config, s, m, k, save, off, f8, swap, compile)
        if host > host_usable:
            continue
        if lean is None or gpu < lean[5]:
            lean = (k, save, off, f8, swap, gpu, host)
        if gpu <= usable:
            why = ("no recomputation needed" if k == 0 else f"the fewest swapped blocks that fit ({swap}/{n})"
                   if swap else "bf16 frozen weights do not fit" if f8 else
                   "what recomputed blocks keep does not fit on the GPU" if off else
                   "saving attention outputs would not fit" if not save else
                   f"the fewest recomputed blocks that fit ({k}/{n})")
            if off and not save:
                why += "; attention outputs not kept: the host cannot hold them offloaded"
            if (fp8, offload, swap_blocks) != (False, False, 0):
                why += "; forced by the flags: " + ", ".join(
                    s for s, on in (("fp8", fp8), ("offload", offload), (f"{swap_blocks} swapped", swap_blocks)) if on)
            if not compile:  # compiled blocks need less: say when that plan would be cheaper (the user's choice)
                c = plan_memory(config, s, budget, m, host_budget, fp8, offload, swap_blocks, compile=True)
                if "DOES NOT FIT" not in c.why and (c.offload, c.fp8, c.swap_blocks, c.checkpoint_fraction) < (
                        off, f8, swap, k / n):
                    why += f"; with --compile: {str(c).split(':')[0]}"
            return MemoryPlan(k / n, save and k > 0, gpu / GB, budget / GB, why, off, swap, f8, host / GB)
    if lean is None:
        return MemoryPlan(1.0, False, float("inf"), budget / GB, "DOES NOT FIT: not enough host memory for any plan")
    k, save, off, f8, swap, gpu, host = lean
    return MemoryPlan(k / n, save, gpu / GB, budget / GB,
                      "DOES NOT FIT: the leanest plan; lower the resolution or frames, train a LoRA, or shard with "
                      "--fsdp (and --context-parallel) over more GPUs", off, swap, f8, host / GB)


def cut_plan(plan: MemoryPlan, n: int, layers: int) -> MemoryPlan:
    """A plan for n blocks carried to the same model cut to `layers` blocks (a dry run traced per block): the
    recomputed fraction kept (configure_blocks rounds it), swapped blocks in proportion, at least one when the
    plan swaps any and one resident when it keeps any."""
    s = plan.swap_blocks
    swap = 0 if not s else layers if s == n else max(1, min(layers - 1, round(s * layers / n)))
    return replace(plan, swap_blocks=swap)


def cut_config(config: dict, layers: int) -> dict:
    """A transformer config cut to its first `layers` blocks (a dry run's model, traced per block): VACE's context
    blocks those that hint one of them."""
    cut = dict(config, num_layers=layers)
    if "vace_layers" in config:
        cut["vace_layers"] = [i for i in config["vace_layers"] if i < layers]
    return cut


def local(t: torch.Tensor) -> torch.Tensor:
    """A rank's shard of an FSDP2 parameter (DTensor), else the tensor."""
    return t.to_local() if hasattr(t, "to_local") else t


def nbytes(t: torch.Tensor) -> int:
    """The bytes a tensor takes on this rank (local)."""
    t = local(t)
    return t.numel() * t.element_size()


def model_bytes(model, full: bool, fsdp: bool, other: float = 0.0, whole: dict | None = None,
                ema: bool = False, compute_dtype: torch.dtype = torch.bfloat16) -> ModelBytes:
    """ModelBytes of a transformer, wherever it is now (host or GPU, sharded or not: a rank's shards of FSDP2's
    DTensors). other: bytes allocated on the GPU besides the transformer (encoders); whole: the config of the same
    model uncut, whose blocks (and VACE's context blocks) are each like the mean of the model's own (a dry run's model
    cut to a few blocks, planned as the whole: cut_config); ema: --ema-decay keeps a copy of the trainable weights
    (a2/train/step.py); compute_dtype: what FSDP gathers each block in."""
    def frozen_bytes(blocks):  # (the mean block's frozen bytes, the same in fp8)
        block = block_fp8 = 0.0
        for b in blocks:
            frozen = {id(t): t for t in frozen_tensors(b)}
            block += sum(nbytes(t) for t in frozen.values())
            linear = {id(mod.weight): mod.weight for mod in b.modules() if isinstance(mod, torch.nn.Linear)
                      and id(mod.weight) in frozen and mod.weight.dtype != torch.float8_e4m3fn}
            block_fp8 += sum(nbytes(t) for i, t in frozen.items() if i not in linear)
            block_fp8 += sum(fp8_bytes(local(t)) for t in linear.values())
        return block / max(1, len(blocks)), block_fp8 / max(1, len(blocks))

    groups = (list(model.blocks), list(getattr(model, "vace_blocks", ())))  # (blocks, VACE's context blocks)
    whole = whole or dict(model.config)
    scales = (whole["num_layers"] / len(groups[0]),
              len(whole.get("vace_layers") or ()) / len(groups[1]) if groups[1] else 0.0)
    scale = {id(t): sc for g, sc in zip(groups, scales) for b in g for t in [*b.parameters(), *b.buffers()]}
    trainable = [p for p in model.parameters() if p.requires_grad]
    fixed = other + sum(nbytes(t) for t in [*model.parameters(), *model.buffers()] if id(t) not in scale
                        and not t.requires_grad)
    (block, block_fp8), (context, context_fp8) = (frozen_bytes(g) for g in groups)
    trains = [any(p.requires_grad for b in g for p in b.parameters()) for g in groups]
    size = compute_dtype.itemsize if fsdp else 0
    return ModelBytes(fixed=fixed, block=block, block_fp8=block_fp8,
                      trainable=round(sum(local(p).numel() * scale.get(id(p), 1.0) for p in trainable)),
                      ema=ema, lora=not full, fsdp_block=size * sum(p.numel() for p in model.blocks[0].parameters()),
                      fsdp_root=size * sum(p.numel() for p in model.parameters() if id(p) not in scale),
                      context_block=context, context_block_fp8=context_fp8, base_frozen=not trains[0],
                      context_frozen=bool(groups[1]) and not trains[1])


def proc_bytes(path: str, key: str) -> float:
    """A Linux memory figure in bytes: /proc/meminfo's MemAvailable (the host's available memory), /proc/self/status's
    VmRSS (this process's resident memory, pinned buffers included); infinite where unknown."""
    try:
        with open(path) as f:
            return next(float(line.split()[1]) * 1024 for line in f if line.startswith(key + ":"))
    except (OSError, StopIteration, ValueError):
        return float("inf")


def check_context_blocks(c: MemoryConfig) -> None:
    """VACE's context blocks against the flags: activation offload and block swap (a2/memory/offload.py) follow the
    blocks' order, which VACE's context blocks run apart from (a2/kinds/vace.py), so they are refused (fp8 and
    recomputation cover the context blocks)."""
    forced = [f for f, on in (("--offload-activations", c.offload_activations), ("--swap-blocks", c.swap_blocks)) if on]
    if forced:
        raise ConfigError(f"{' '.join(forced)} does not reach VACE's context blocks: drop it (--fp8-base and "
                          "recomputation cover them)")


def check_flags(c: MemoryConfig, training_type: str, fsdp: bool, device, context_blocks: bool = False) -> None:
    """The memory flags against the run (a ConfigError, one line, before anything loads); context_blocks: the model
    has VACE's context blocks (Layout.context_blocks), which activation offload and block swap do not reach."""
    lora = training_type == "lora"
    if context_blocks:
        check_context_blocks(c)
    if c.fp8_base and not lora:
        raise ConfigError("--fp8-base stores the frozen weights of a LoRA run in fp8; full fine-tuning trains them")
    if c.fp8_matmul and not c.fp8_base and (c.mode == "manual" or device.type != "cuda"):  # else: if planned
        raise ConfigError("--fp8-matmul multiplies by the fp8 base weights: add --fp8-base")
    if c.fp8_matmul and not scaled_mm_supported(device):
        raise ConfigError(f"--fp8-matmul needs a CUDA GPU of compute capability 9.0+ (H100), not {device}: drop it "
                          "(--fp8-base alone computes in bf16)")
    if c.swap_blocks and not lora:  # full fine-tuning trains every weight
        raise ConfigError(f"--swap-blocks swaps frozen weights: LoRA only, not --training-type {training_type}")
    if c.swap_blocks < 0:
        raise ConfigError(f"--swap-blocks {c.swap_blocks}: a number of blocks, >= 0")
    forced = [f for f, on in (("--offload-activations", c.offload_activations), ("--swap-blocks", c.swap_blocks),
                              ("--fp8-base", c.fp8_base)) if on]
    if fsdp and forced:  # their hooks and fp8 weights are set up on the unsharded model only
        raise ConfigError(f"{' '.join(forced)} is not combined with --fsdp: drop one of them")


def memory_plan(c: MemoryConfig, model, shape: StepShape, full: bool, fsdp: bool, device, compile: bool,
                ema: bool = False, dry_run: bool = False, whole: dict | None = None) -> MemoryPlan:
    """How the step fits (module docstring), decided before the transformer's weights move to the GPU (or once
    sharded): --memory auto on CUDA, and in a dry run, plans it from the model, the shape and the memory (the flags
    --fp8-base, --offload-activations, --swap-blocks force their piece on); --memory manual and the CPU take the
    flags. The budget: --max-memory-gb, else this process's reserved plus the device's free memory (a dry run: 80
    GiB); the host's available memory (a dry run: the GPU machine's, unknown, so unlimited: it prints what the plan
    pins). whole: the config of the model uncut, which a dry run's cut model is planned as (cut_config)."""
    if hasattr(model, "vace_blocks"):  # (train_a2.py checks it before loading, where the layout is known)
        check_context_blocks(c)
    if c.mode == "manual" or device.type != "cuda" and not dry_run:
        return MemoryPlan.manual(c)
    config = dict(whole or model.config)
    if dry_run:
        other, budget, host = 0.0, (c.max_memory_gb or 80.0) * GB, float("inf")
    else:
        torch.cuda.synchronize(device)
        free, _ = torch.cuda.mem_get_info(device)
        on_gpu = sum(nbytes(t) for t in [*model.parameters(), *model.buffers()] if local(t).device.type == "cuda")
        other = max(0.0, torch.cuda.memory_allocated(device) - on_gpu)
        budget = c.max_memory_gb * GB if c.max_memory_gb else free + torch.cuda.memory_reserved(device)
        host = proc_bytes("/proc/meminfo", "MemAvailable")
    m = model_bytes(model, full, fsdp, other, whole=whole, ema=ema)
    plan = plan_memory(config, shape, budget, m, host, fp8=c.fp8_base, offload=c.offload_activations,
                       swap_blocks=c.swap_blocks, compile=compile)
    return replace(plan, why=f"--memory auto: {plan.why}")


def apply_plan(model, plan: MemoryPlan, device, compile: bool = False, fp8_matmul: bool = False) -> list[str]:
    """Put a model in place as `plan` says, in the order that never needs the whole bf16 model on the GPU: fp8
    frozen weights (a2/memory/fp8.py) and swapped blocks' weights to pinned host memory (a2/memory/offload.py) while the
    model is still on the host, then the rest to `device`, then the blocks' recomputation / compilation
    (configure_blocks) with the recomputed blocks' saved tensors offloaded. Returns what to log besides the plan
    (str(plan))."""

    lines = []
    if plan.fp8:
        saved = quantize_base_weights(model, scaled_mm=fp8_matmul)
        lines.append(f"fp8 base weights: the blocks' frozen linears stored as float8 e4m3, {saved / GB:.2f} GiB saved")
    swapped = apply_offload(model, plan.offload, plan.swap_blocks, device)
    if swapped:
        lines.append(f"block swap: the last {plan.swap_blocks} blocks' frozen weights in pinned host memory "
                     f"({swapped / GB:.2f} GiB), fetched one block ahead in forward and backward")
    model.to(device)
    configure_blocks(model, plan.checkpoint_fraction, plan.save_attention, compile)
    if compile:  # (what the blocks recompute, keep and offload is the plan's own line, `memory: ...`)
        lines.append("blocks: compiled")
    return lines
