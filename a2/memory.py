"""GPU memory of a training step: an estimate of its peak, and the `--memory auto` rule built on it.

The step's peak, on one rank, is the larger of the forward's end and the recomputed blocks' backward:
    weights    what never leaves the GPU (weights outside the blocks, trainable weights, encoders left loaded,
               the allocator's share), plus each block's frozen weights: all n blocks in their dtype, or, with
               `fp8`, their linear weights as float8 with one fp32 scale per row (a2/fp8.py), or, with
               `swap_blocks` s, n - s blocks resident and up to three (at most s) swapped blocks on the device at
               once (the one in use, the one being fetched, the one just released; a2/offload.py)
  + state      AdamW's two moments of the trainable weights (8 bytes each), and in the backward their fp32
               gradients (4 more; set to None after each step, so none in the forward); for full fine-tuning
               without FSDP, in the forward, autocast's bf16 copies of the weights (they live through it);
  + saved      what the forward keeps for backward, per block, with L tokens, model dim d, FFN dim f, h heads:
                 recomputed block:            its input, 2·L·d bytes (bf16)
                 + with save_attention:       the self-attention output and log-sum-exp, 2·L·d + 4·L·h
                 block not recomputed:        all its activations, L·(A·d + B·f) bytes (eager: 1.8x); in the
                                              backward of the recomputed blocks, freed already
               with `offload`, recomputed blocks' saved tensors go to pinned host memory as soon as they are made
               and come back one block ahead of their backward: two blocks' worth stays on the GPU;
  + transient  forward: the working set beyond what blocks keep, 4·L·f (an FFN hidden before and after GELU);
               backward: one block's activations and their gradients while it is recomputed and back-propagated,
               2·L·(A·d + B·f) (eager LoRA: + 2·L·(12d + 0.4f), peft's fp32 LoRA inputs); plus (FSDP) two
               unsharded bf16 blocks (the current one and the prefetched one).
A and B are per-token byte counts of a Wan block under bf16 autocast, measured on an H100 (bench.py, see the
README's speed section): the FFN keeps its input and two f-wide tensors, the attention its projections, norms
and RoPE'd queries/keys. Host (pinned) memory: the swapped blocks' weights and the offloaded activations.

The rule (`plan_memory`) walks a ladder of plans, cheapest first, and takes the first that fits the budget:
  1. recompute the fewest blocks that fit, each keeping its self-attention (`save_attention`: half a block's
     forward FLOPs at 32k tokens for 2·L·d bytes); 0 blocks when everything fits. Exact; costs recomputation.
  2. recompute every block keeping attention, and offload what they keep to host memory (`offload`). Exact;
     costs PCIe copies (A2-14B at 720p: 1.5 GB per block each way, ~0.1 s at 25 GB/s against ~0.6 s of block
     compute), overlapped with compute on a side stream.
  3. (if the host cannot hold the offloaded activations) recompute every block without saving attention, then
     also offloaded.
  4. LoRA: frozen linear weights in fp8 (`fp8`): half the weight bytes; costs an upcast per linear per use
     (memory-bound, a few % of the step) and the weights' rounding (e4m3: <= 2^-4 relative, tests/test_fp8.py).
  5. LoRA: fp8 and the fewest swapped blocks that fit (`swap_blocks`): their weights are fetched from host
     memory before each use in forward and backward, overlapped with compute. Exact relative to rung 4. (Rungs 4-5
     again without saved attention when the host cannot hold the attention outputs.)
  fp8 comes before swapping because it costs no transfer and makes each swapped block half the bytes; a user
  who wants bf16 weights with swapping sets the flags with `--memory manual`. If nothing fits: "DOES NOT FIT",
  before the first step (the estimate, the budget, what to change). The budget is the free GPU memory (or
  `--max-memory-gb`, to plan for a smaller card) less a margin for the allocator's fragmentation and
  cuBLAS/cuDNN workspaces; the host budget is the host's available memory less a margin.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, replace

from a2.fp8 import quantize_base_weights
from a2.offload import apply_offload
from a2.transformer import configure_blocks

ACT_PER_TOKEN_D = 24.0  # A: bytes per token per model dim of a block's activations (bf16 autocast)
ACT_PER_TOKEN_F = 4.0  # B: bytes per token per FFN dim
# eager LoRA blocks' transient is larger than a compiled block's (whose graph plans its buffers, what A and B were
# measured on): peft casts each LoRA input to fp32 and keeps it for the LoRA weights' gradients, 2·L·(12d + 0.4f)
# more, fitted to dry-run traces (a2/trace.py) of A2-14B (14.94 GiB) and Wan 1.3B (5.76 GiB) at 81x480x832, every
# block recomputed keeping attention; eager full fine-tuning's traced transient is the compiled term's (4.48 GiB vs
# 4.44 for Wan 1.3B)
EAGER_LORA_PER_TOKEN_D = 12.0
EAGER_LORA_PER_TOKEN_F = 0.4
# the forward's working set beyond what blocks keep: about one FFN hidden before and after its GELU (bf16, 2·L·f
# each); the peak of a step whose blocks are not all recomputed falls at the forward's end (1.3B full fine-tuning's
# trace: 0.95 GiB at 32,760 tokens, 4·L·f = 1.09)
FORWARD_PER_TOKEN_F = 4.0
EAGER_FULL_KEPT = 1.8
HEAD_PER_TOKEN_D = 4.0  # the output norm's fp32 input, kept for backward once per step (not per block)
MARGIN = 0.08  # of the budget, for fragmentation and workspaces (with expandable segments)
MARGIN_GB = 1.0
HOST_MARGIN = 0.8  # of the host's available memory that pinned buffers may take
GB = 2**30


def use_expandable_segments() -> None:
    """The CUDA allocator setting long video sequences need: without it the 14B step at 81x480x832 fails with
    10 GB reserved but unused (fragmentation). Only the environment variable, read when CUDA initialises, sets it;
    call this before anything touches CUDA. A user's own PYTORCH_CUDA_ALLOC_CONF is kept."""
    os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")


@dataclass(frozen=True)
class ModelBytes:
    """What the rule needs of the transformer on one rank (`model_bytes` reads it from a model)."""

    fixed: float  # bytes that stay on the GPU whatever the plan: weights outside the blocks, trainable weights,
    #               and what else is allocated (encoders)
    block: float  # one block's frozen weights in their dtypes (the mean over blocks)
    block_fp8: float  # the same with its frozen linear weights in float8 + fp32 row scales
    trainable: int  # trainable weights (fp32 gradients and AdamW moments: 12 bytes each)
    full_weights: int = 0  # weights autocast copies to bf16 (full fine-tuning without FSDP), else 0
    fsdp_block: float = 0.0  # one block's unsharded bf16 weights under FSDP, else 0
    lora: bool = True  # frozen base weights: fp8 and block swapping are allowed

    @property
    def frozen_blocks(self) -> bool:
        return self.block > 0


@dataclass(frozen=True)
class MemoryPlan:
    checkpoint_fraction: float  # of the blocks, recomputed in backward (the first ones)
    save_attention: bool  # recomputed blocks keep their self-attention outputs
    estimate_gb: float | None  # the step's estimated GPU peak (None: set by the flags, not planned)
    budget_gb: float | None
    why: str
    offload: bool = False  # recomputed blocks' saved tensors live in pinned host memory between forward and backward
    swap_blocks: int = 0  # blocks whose frozen weights live in pinned host memory
    fp8: bool = False  # frozen linear weights stored as float8
    host_gb: float = 0.0  # pinned host memory the plan takes

    def __str__(self) -> str:
        extra = [s for s, on in (("fp8 frozen weights", self.fp8), (f"{self.swap_blocks} blocks swapped to host",
                                 self.swap_blocks), ("activations offloaded to host", self.offload)) if on]
        return (f"recompute {self.checkpoint_fraction:.0%} of the blocks"
                + (" keeping self-attention" if self.save_attention and self.checkpoint_fraction else "")
                + "".join(", " + s for s in extra)
                + (f": ~{self.estimate_gb:.1f} GB of {self.budget_gb:.1f} GB" if self.budget_gb else "")
                + (f", {self.host_gb:.1f} GB pinned host memory" if self.host_gb else "") + f" ({self.why})")


def block_bytes(config: dict, tokens: int) -> dict[str, float]:
    """Bytes one block keeps for backward with `tokens` tokens (all samples of a micro-batch): recomputed
    (`ckpt`), recomputed keeping self-attention (`save`), not recomputed (`full`)."""
    d = config["num_attention_heads"] * config["attention_head_dim"]
    ckpt = 2.0 * tokens * d
    return dict(ckpt=ckpt, save=ckpt + 2.0 * tokens * d + 4.0 * tokens * config["num_attention_heads"],
                full=tokens * (ACT_PER_TOKEN_D * d + ACT_PER_TOKEN_F * config["ffn_dim"]))


def pinned_bytes(config: dict, tokens: int, save_attention: bool) -> float:
    """Pinned host bytes one offloaded block takes: its input (and attention output, log-sum-exp), each rounded up
    to a power of two by torch's pinned allocator (a2/offload.py)."""
    d, h = config["num_attention_heads"] * config["attention_head_dim"], config["num_attention_heads"]
    sizes = [2.0 * tokens * d] + ([2.0 * tokens * d, 4.0 * tokens * h] if save_attention else [])
    return sum(2.0 ** math.ceil(math.log2(s)) for s in sizes)


def step_estimate(config: dict, tokens: int, m: ModelBytes, checkpointed: int, save_attention: bool,
                  offload: bool = False, fp8: bool = False, swap_blocks: int = 0,
                  compile: bool = False) -> tuple[float, float]:
    """(GPU peak, pinned host bytes) of the step under a plan (module docstring); compile: the blocks are compiled
    (their transient is smaller than eager LoRA blocks', and what a block not recomputed keeps is less). The peak
    is the larger of two: the forward's end (everything the blocks keep, the optimizer's moments but no gradients
    yet, autocast's weight copies, the forward's working set) and the recomputed blocks' backward (what they keep,
    the gradients, one block's recomputation and backward). In between, the backward through blocks not
    recomputed frees what they kept as it makes their gradients (the dry-run traces)."""
    b = block_bytes(config, tokens)
    n = config["num_layers"]
    per_block = m.block_fp8 if fp8 else m.block
    weights = m.fixed + (n - swap_blocks + min(3, swap_blocks)) * per_block
    kept = (min(2, checkpointed) if offload else checkpointed) * b["save" if save_attention else "ckpt"]
    full = (n - checkpointed) * b["full"] * (1.0 if compile else EAGER_FULL_KEPT)
    d = config["num_attention_heads"] * config["attention_head_dim"]
    transient = 2 * b["full"]
    if not compile and m.lora:
        transient += 2.0 * tokens * (EAGER_LORA_PER_TOKEN_D * d + EAGER_LORA_PER_TOKEN_F * config["ffn_dim"])
    head = HEAD_PER_TOKEN_D * tokens * d
    forward = (weights + 8.0 * m.trainable + 2.0 * m.full_weights + kept + full + head
               + FORWARD_PER_TOKEN_F * tokens * config["ffn_dim"])
    backward = weights + 12.0 * m.trainable + kept + head + transient if checkpointed else 0.0
    forward, backward = forward + 2 * m.fsdp_block, backward + 2 * m.fsdp_block  # FSDP: this block, the next one
    # offloaded tensors take torch's pinned caching allocator's blocks: each rounded up to a power of two
    host = swap_blocks * per_block + (checkpointed * pinned_bytes(config, tokens, save_attention) if offload else 0)
    return max(forward, backward), host


def ladder(n: int, lora: bool, offload: bool = True):
    """The plans of the rule, cheapest first: (checkpointed, save_attention, offload, fp8, swap_blocks). offload:
    activation offload may be used (not under FSDP, where it is not tried). The plans without saved attention come
    after those with it: they cost an attention core more per block, but take half the host memory offloaded."""
    yield from ((k, True, False, False, 0) for k in range(n + 1))
    if offload:
        yield n, True, True, False, 0
    yield n, False, False, False, 0
    if offload:
        yield n, False, True, False, 0
    if lora and offload:
        for save in (True, False):
            yield from ((n, save, True, True, s) for s in range(n + 1))


def plan_memory(config: dict, tokens: int, budget: float, m: ModelBytes, host_budget: float = float("inf"),
                fp8: bool = False, offload: bool = False, swap_blocks: int = 0, compile: bool = False) -> MemoryPlan:
    """The `--memory auto` rule (module docstring). budget: bytes the step may use on this GPU (resident
    included); host_budget: pinned host bytes it may take; fp8, offload, swap_blocks: pieces the user forces on
    (flags), which every plan then has."""
    n = config["num_layers"]
    usable = budget * (1 - MARGIN) - MARGIN_GB * GB
    host_usable = host_budget * HOST_MARGIN
    lean = None  # the plan with the smallest estimate, said when none fits
    for k, save, off, f8, swap in ladder(n, m.lora and m.frozen_blocks, offload=not m.fsdp_block):
        off, f8, swap = off or offload, f8 or fp8, max(swap, swap_blocks)
        k = n if off else k  # offload applies to recomputed blocks
        gpu, host = step_estimate(config, tokens, m, k, save, off, f8, swap, compile)
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
                c = plan_memory(config, tokens, budget, m, host_budget, fp8, offload, swap_blocks, compile=True)
                if "DOES NOT FIT" not in c.why and (c.offload, c.fp8, c.swap_blocks, c.checkpoint_fraction) < (
                        off, f8, swap, k / n):
                    why += f"; with --compile: {str(c).split(':')[0]}"
            return MemoryPlan(k / n, save and k > 0, gpu / GB, budget / GB, why, off, swap, f8, host / GB)
    if lean is None:
        return MemoryPlan(1.0, False, float("inf"), budget / GB, "DOES NOT FIT: not enough host memory for any plan")
    k, save, off, f8, swap, gpu, host = lean
    return MemoryPlan(k / n, save, gpu / GB, budget / GB,
                      "DOES NOT FIT: the leanest plan; lower the resolution or frames, train a LoRA, or shard with "
                      "--fsdp over more GPUs", off, swap, f8, host / GB)


def cut_plan(plan: MemoryPlan, n: int, layers: int) -> MemoryPlan:
    """A plan for n blocks carried to the same model cut to `layers` blocks (a dry run traced per block): the
    recomputed fraction kept (configure_blocks rounds it), swapped blocks in proportion, at least one when the
    plan swaps any and one resident when it keeps any."""
    s = plan.swap_blocks
    swap = 0 if not s else layers if s == n else max(1, min(layers - 1, round(s * layers / n)))
    return replace(plan, swap_blocks=swap)


def fp8_bytes(weight) -> float:
    """Bytes of a frozen linear weight stored as float8 with one fp32 scale per output row (a2/fp8.py)."""
    return weight.numel() + 4.0 * weight.shape[0]


def model_bytes(model, full: bool, fsdp: bool, other: float = 0.0, layers: int | None = None,
                ema: bool = False) -> ModelBytes:
    """ModelBytes of a transformer, wherever it is now (host or GPU, sharded or not). other: bytes allocated on
    the GPU besides the transformer (encoders); layers: the bytes of the same model with this many blocks, each
    like the mean of its own (a dry run's model cut to a few blocks, planned as the whole); ema: --ema-decay keeps a
    copy of the trainable weights in their dtype (a2/ema.py), resident like them."""
    import torch

    def local(p):  # a rank's shard of an FSDP2 parameter (DTensor), else the tensor
        return p.to_local() if hasattr(p, "to_local") else p

    def nbytes(t):
        t = local(t)
        return t.numel() * t.element_size()

    n = len(model.blocks)
    scale = (layers or n) / n  # of what is in the blocks
    in_blocks = {id(t) for b in model.blocks for t in [*b.parameters(), *b.buffers()]}

    def count(tensors, size):  # size of `tensors`, those in the blocks scaled to `layers` blocks
        return sum(size(t) * (scale if id(t) in in_blocks else 1.0) for t in tensors)

    trainable = [p for p in model.parameters() if p.requires_grad]
    fixed = other + count(trainable, nbytes) * (2 if ema else 1)
    fixed += sum(nbytes(t) for t in [*model.parameters(), *model.buffers()] if id(t) not in in_blocks
                 and not t.requires_grad)
    block = block_fp8 = 0.0
    for b in model.blocks:
        frozen = {id(t): t for t in [*b.parameters(), *b.buffers()] if not t.requires_grad}
        block += sum(nbytes(t) for t in frozen.values())
        linear = {id(mod.weight): mod.weight for mod in b.modules() if isinstance(mod, torch.nn.Linear)
                  and id(mod.weight) in frozen and mod.weight.dtype != torch.float8_e4m3fn}
        block_fp8 += sum(nbytes(t) for i, t in frozen.items() if i not in linear)
        block_fp8 += sum(fp8_bytes(local(t)) for t in linear.values())
    return ModelBytes(fixed=fixed, block=block / n, block_fp8=block_fp8 / n,
                      trainable=round(count(trainable, lambda p: local(p).numel())),
                      full_weights=round(count(model.parameters(), torch.Tensor.numel)) if full and not fsdp else 0,
                      fsdp_block=2.0 * sum(p.numel() for p in model.blocks[0].parameters()) if fsdp else 0.0,
                      lora=not full)


def host_available() -> float:
    """The host's available memory (Linux /proc/meminfo MemAvailable), infinite where unknown."""
    try:
        with open("/proc/meminfo") as f:
            return next(float(line.split()[1]) * 1024 for line in f if line.startswith("MemAvailable:"))
    except (OSError, StopIteration, ValueError):
        return float("inf")


def plan_for_model(model, tokens: int, max_memory_gb: float | None, full: bool, fsdp: bool, device,
                   ema: bool = False, **forced) -> MemoryPlan:  # forced: plan_memory's fp8, offload, swap_blocks,
    #                                                              compile
    """plan_memory for a transformer before its weights move to the GPU (or already there, or sharded): the
    transformer's bytes are counted from its tensors, everything else allocated on the device is resident; the
    budget is what this process holds plus the device's free memory, or max_memory_gb. forced: plan_memory's."""
    import torch

    torch.cuda.synchronize(device)
    free, _ = torch.cuda.mem_get_info(device)
    local = [t.to_local() if hasattr(t, "to_local") else t for t in [*model.parameters(), *model.buffers()]]
    on_gpu = sum(t.numel() * t.element_size() for t in local if t.device.type == "cuda")
    other = max(0.0, torch.cuda.memory_allocated(device) - on_gpu)
    budget = max_memory_gb * GB if max_memory_gb else free + torch.cuda.memory_reserved(device)
    return plan_memory(dict(model.config), tokens, budget, model_bytes(model, full, fsdp, other, ema=ema),
                       host_available(), **forced)


def apply_plan(model, plan: MemoryPlan, device, compile: bool = False, fp8_matmul: bool = False) -> list[str]:
    """Put a model in place as `plan` says, in the order that never needs the whole bf16 model on the GPU: fp8
    frozen weights (a2/fp8.py) and swapped blocks' weights to pinned host memory (a2/offload.py) while the model is
    still on the host, then the rest to `device`, then the blocks' recomputation / compilation (configure_blocks)
    with the recomputed blocks' saved tensors offloaded. Returns what to log."""

    lines = []
    if plan.fp8:
        saved = quantize_base_weights(model, scaled_mm=fp8_matmul)
        lines.append(f"fp8 base weights: the blocks' frozen linears stored as float8 e4m3, {saved / GB:.2f} GB saved")
    swapped = apply_offload(model, plan.offload, plan.swap_blocks, device)
    if swapped:
        lines.append(f"block swap: the last {plan.swap_blocks} blocks' frozen weights in pinned host memory "
                     f"({swapped / GB:.2f} GB), fetched one block ahead in forward and backward")
    model.to(device)
    configure_blocks(model, plan.checkpoint_fraction, plan.save_attention, compile)
    lines.append(f"blocks: {plan.checkpoint_fraction:.0%} recomputed"
                 + (", keeping self-attention" if plan.save_attention and plan.checkpoint_fraction else "")
                 + (", their saved tensors offloaded to host memory" if plan.offload and plan.checkpoint_fraction
                    else "") + (", compiled" if compile else ""))
    return lines
