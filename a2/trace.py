"""The live bytes of a training step at real size, on any machine: the step runs on fake tensors (torch's
FakeTensorMode: shapes, dtypes and devices, no data, no compute), and a TorchDispatchMode counts every storage from
the op that made it to its last reference (a weakref finalizer on the storage), per device, as
torch.cuda.memory_allocated counts the CUDA caching allocator's blocks (each rounded up to 512 bytes).

The step must believe it runs on CUDA, since the memory is CUDA's (`emulated_cuda`):
- tensors are fake tensors on the `cuda` device (FakeTensorMode makes them without a GPU);
- CUDA autocast is on with its real per-op casts (bf16 matmuls, fp32 `rms_norm`/`layer_norm`/softmax...):
  torch.autocast refuses "cuda" where no GPU is, so its availability checks are answered as on a GPU;
- scaled_dot_product_attention picks its CUDA backend from the enabled ones in torch's priority order (flash,
  memory-efficient, then cuDNN: `sdpa_kernel(CUDNN_ATTENTION)`, diffusers' `_native_cudnn`, leaves only cuDNN) and
  runs that backend's op, whose meta kernel gives the outputs, log-sum-exp and backward buffers it allocates; its
  choice function needs a GPU to ask, so the shapes are taken as supported (bf16, head dim 128: all three are);
- a2/offload.py's copies take their CPU path (no streams): host copies are fake CPU tensors, counted as host
  memory, pinned: offloaded activations at torch's pinned allocator's size (the next power of two), swapped
  weights at their size (one registered buffer per block).

Status: the forward of the real step runs this way (A2-14B LoRA, recomputed blocks, 480p: seconds on a 2-core CPU),
the backward does not yet on a CUDA build of torch without a GPU driver: FakeTensorMode swaps in a no-op CUDA device
guard that reports one device, and autograd's engine, seeing nodes on a CUDA stream, asks the CUDA hooks whether
device 0 has a primary context, which fails its device-count check (GraphTask::stash_current_streams). The count
itself (LiveBytes) is checked on fake CPU tensors (tests/test_trace.py).

What the count cannot see: the allocator's fragmentation and rounding beyond 512 bytes (expandable segments keep it
small; without them the 14B step lost 10 GB to it), cuBLAS/cuDNN workspaces (tens to hundreds of MB), torch.compile's
buffers (a compiled block's graph plans its own buffers: measured smaller than eager, see a2/memory.py), NCCL
buffers, the CUDA context (~0.5 GB, outside memory_allocated). a2/memory.py's margin (8% + 1 GB) is for these.

Categories of the device bytes at the peak: weights (frozen weights resident on the device, and casts of weights),
state (trainable weights, their gradients, the optimizer's moments), kept (what the forward keeps for backward:
made in the forward and alive when it ends, or brought back from host memory), transient (the rest: a block's
working tensors, the recomputation and the gradients flowing back), swapped (swapped blocks' weights fetched from
host memory).
"""

from __future__ import annotations

import contextlib
import math
import weakref
from dataclasses import dataclass, field
from unittest import mock

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten
from torch.utils.weak import WeakIdKeyDictionary

from a2.fake import _HOST
from a2.memory import HOST_MARGIN, MARGIN, MARGIN_GB, apply_plan, block_bytes

CUDA_BLOCK = 512  # the CUDA caching allocator rounds every allocation up to a multiple of this
GB = 2**30
CATEGORIES = ("weights", "state", "kept", "transient", "swapped")


class _FusedRMSNorm(torch.autograd.Function):
    """CUDA's fused RMSNorm kernel as memory: the fp32 output and per-row rstd, the fp32 input (autocast's cast)
    and rstd kept for backward, input and weight gradients. Shapes only: for fake tensors, whose values nobody
    reads (on the CPU, rms_norm is a composite of pow/mean/rsqrt/mul that keeps other tensors)."""

    @staticmethod
    def forward(ctx, x, shape, weight, eps):
        rstd = x.new_empty(x.shape[: x.dim() - len(shape)] + (1,) * len(shape))
        ctx.save_for_backward(x, weight, rstd)
        return torch.empty_like(x)

    @staticmethod
    def backward(ctx, grad):
        x, weight, _ = ctx.saved_tensors
        return (torch.empty_like(x) if ctx.needs_input_grad[0] else None, None,
                torch.empty_like(weight) if weight is not None and ctx.needs_input_grad[2] else None, None)


def _sdpa_backend_op(args, kwargs):
    """F.scaled_dot_product_attention as the backend op CUDA would run (module docstring), on the inputs as CUDA
    autocast casts them; None when not emulated (GQA)."""
    a = {**dict(zip(("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale"), args)), **kwargs}
    q, k, v, mask = a["query"], a["key"], a["value"], a.get("attn_mask")
    if a.get("enable_gqa"):
        return None
    if torch.is_autocast_enabled(q.device.type):  # scaled_dot_product_attention is on CUDA autocast's bf16 list
        dtype = torch.get_autocast_dtype(q.device.type)
        q, k, v = (t.to(dtype) if t.is_floating_point() else t for t in (q, k, v))
    dropout, causal, scale = a.get("dropout_p", 0.0), a.get("is_causal", False), a.get("scale")
    lse = torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v))
    enabled = {1: torch.backends.cuda.flash_sdp_enabled() and mask is None,
               2: torch.backends.cuda.mem_efficient_sdp_enabled(), 3: torch.backends.cuda.cudnn_sdp_enabled()}
    backend = next((b for b in torch._C._get_sdp_priority_order() if enabled.get(b)), 0)
    with torch.autocast(q.device.type, enabled=False):
        if backend == 1:
            return torch.ops.aten._scaled_dot_product_flash_attention(q, k, v, dropout, causal, scale=scale)[0]
        if backend == 2:
            return torch.ops.aten._scaled_dot_product_efficient_attention(q, k, v, mask, lse, dropout, causal,
                                                                          scale=scale)[0]
        if backend == 3:
            return torch.ops.aten._scaled_dot_product_cudnn_attention(q, k, v, mask, lse, dropout, causal, False,
                                                                      scale=scale)[0]
        return torch.ops.aten._scaled_dot_product_attention_math(q, k, v, mask, dropout, causal, scale=scale)[0]


def _cuda_ops(device: str):
    """torch.nn.functional's functions whose CUDA form differs from the CPU's, run on tensors of `device` as on
    CUDA: attention's backend op and, where CUDA autocast's fp32 list differs from the CPU's, its cast (module
    docstring). Patched functions rather than a TorchFunctionMode: modes are off in the backward, where
    recomputed blocks run their forward again and must see the same ops."""
    sdpa, rms_norm = torch.nn.functional.scaled_dot_product_attention, torch.nn.functional.rms_norm

    def scaled_dot_product_attention(*args, **kwargs):
        q = args[0] if args else kwargs["query"]
        out = _sdpa_backend_op(args, kwargs) if q.device.type == device else None
        return sdpa(*args, **kwargs) if out is None else out

    def fused_rms_norm(input, normalized_shape, weight=None, eps=None):
        if input.device.type != device or not torch.is_autocast_enabled(device):
            return rms_norm(input, normalized_shape, weight, eps)
        with torch.autocast(device, enabled=False):  # on CUDA autocast's fp32 list
            return _FusedRMSNorm.apply(input.float(), tuple(normalized_shape),
                                       None if weight is None else weight.float(), eps)

    return [mock.patch.object(torch.nn.functional, "scaled_dot_product_attention", scaled_dot_product_attention),
            mock.patch.object(torch.nn.functional, "rms_norm", fused_rms_norm)]


@contextlib.contextmanager
def emulated_cuda(device: str = "cpu"):
    """The step's CUDA ops on fake tensors of `device` (module docstring): "cpu" (autograd runs; use with
    torch.autocast("cpu") and LiveBytes(emulate_cuda=True)), or "cuda" (the forward only, where no GPU is)."""
    with contextlib.ExitStack() as stack:
        if device == "cuda" and not torch.cuda.is_available():
            stack.enter_context(mock.patch("torch.cuda.amp.common.amp_definitely_not_available", return_value=False))
            stack.enter_context(mock.patch("torch.cuda.is_bf16_supported", return_value=True))
        for patch in _cuda_ops(device):
            stack.enter_context(patch)
        yield


@contextlib.contextmanager
def fake_tensors():
    """A FakeTensorMode in which modules can move (.to(), peft's adapters): nn.Module swaps fake parameters, and
    torch.utils.swap_tensors refuses tensors with weak references, which the fake converter's memo of every fresh
    op output holds (a memo keyed by meta tensors made for that output alone, never read again)."""
    from torch._subclasses.fake_tensor import FakeTensorConverter, FakeTensorMode

    with mock.patch.object(FakeTensorConverter, "set_tensor_memo", lambda *args: None), \
            FakeTensorMode(allow_non_fake_inputs=True) as mode:
        yield mode


@dataclass(eq=False)
class _Storage:
    nbytes: int
    where: str  # device | host
    phase: str  # setup | forward | backward | step: when it was made
    op: str  # the op that made it
    tag: str | None = None  # weights | state | swapped | kept | host (the copies of a2/offload.py)
    alive: bool = True
    full_block: bool = False  # made in the forward of a block that is not recomputed


@dataclass
class Peak:
    """The device bytes at the peak, by category, and where in the step it came."""

    total: int = 0
    phase: str = ""
    static: dict = field(default_factory=dict)  # category -> bytes of the storages that predate the step
    dynamic: list = field(default_factory=list)  # the step's storages alive then (their category is known later)

    def by_category(self) -> dict[str, int]:
        out = {c: self.static.get(c, 0) for c in CATEGORIES}
        for s in self.dynamic:
            out[_category(s)] += s.nbytes
        return out

    def by_op(self, category: str) -> dict[str, int]:
        """The bytes of one category of the step's storages at the peak, by the op that made them."""
        out: dict[str, int] = {}
        for s in self.dynamic:
            if _category(s) == category:
                out[s.op] = out.get(s.op, 0) + s.nbytes
        return dict(sorted(out.items(), key=lambda kv: -kv[1]))

    def kept_by_full_blocks(self) -> int:
        """The bytes at the peak that blocks not recomputed keep for backward."""
        return sum(s.nbytes for s in self.dynamic if s.full_block and _category(s) == "kept")


def _category(s: _Storage) -> str:
    if s.tag in CATEGORIES:
        return s.tag
    return "transient"


class LiveBytes(TorchDispatchMode):
    """Counts the live bytes of every storage made under it, on the device (tensors of type `device`) and in
    pinned host memory (what a2/offload.py copies there), and the device peak during the step with its categories.
    Use inside a FakeTensorMode (or on real tensors: the count is the same). emulate_cuda: device storages are
    rounded up as CUDA's caching allocator rounds them (a dry run emulates the GPU on the CPU). The driver says
    where the step is (`phase`; the peak is of the step, not of the setup) and which storages are state (`mark`)."""

    def __init__(self, device: str = "cuda", emulate_cuda: bool | None = None):
        super().__init__()
        self.device = device
        self.round = CUDA_BLOCK if (device == "cuda" if emulate_cuda is None else emulate_cuda) else 1
        self.storages: WeakIdKeyDictionary = WeakIdKeyDictionary()  # storage -> _Storage
        self.live: dict[str, int] = {"device": 0, "host": 0}
        self.static: dict[str, int] = dict.fromkeys(CATEGORIES, 0)  # device bytes made before the step, by category
        self.dynamic: set[_Storage] = set()  # device storages made in the step, alive
        self.phase = "setup"
        self.peak = Peak()
        self.host_peak = 0  # pinned host bytes, the most at once
        self.in_full_block = False  # the forward of a block that is not recomputed is running (the driver's hooks)

    # ------------------------------------------------------------------ counting
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        source = None
        if func in (torch.ops.aten._to_copy.default, torch.ops.aten.copy_.default) and args:
            source = args[-1] if func is torch.ops.aten.copy_.default else args[0]
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor):
                self.track(t, source, func.__name__)
        return out

    def track(self, t: torch.Tensor, source: torch.Tensor | None = None, op: str = "") -> _Storage | None:
        if t.device.type == "meta":  # shapes only (the training step's pixels from a cache): no memory anywhere
            return None
        st = t.untyped_storage()
        info = self.storages.get(st)
        if info is not None:
            return info
        nbytes = st.nbytes()
        tag = None
        if _HOST or t.device.type != self.device:
            where, tag = "host", "host"
            if _HOST and _HOST[-1] and nbytes:
                nbytes = 2 ** math.ceil(math.log2(nbytes))
        else:
            where = "device"
            nbytes = -(-nbytes // self.round) * self.round
            origin = self.storages.get(source.untyped_storage()) if source is not None else None
            if origin is not None and origin.where == "host" and origin.tag == "host":  # a2/offload.py: a copy back
                tag = "swapped" if origin.phase == "setup" else "kept"
            elif origin is not None and origin.phase == "setup":  # a cast of a weight (autocast's, fp8's) is of
                tag = origin.tag  # its category
        info = _Storage(nbytes, where, self.phase, op, tag, full_block=self.in_full_block and self.phase == "forward")
        self.storages[st] = info
        weakref.finalize(st, self._free, info)
        self.live[where] += nbytes
        if where == "host":
            if self.phase != "setup" or tag == "host":
                self.host_peak = max(self.host_peak, self.live["host"])
            return info
        if self.phase == "setup":
            info.tag = "weights"
            self.static["weights"] += nbytes
            return info
        self.dynamic.add(info)
        if self.live["device"] > self.peak.total:
            self.peak = Peak(self.live["device"], self.phase, dict(self.static), list(self.dynamic))
        return info

    def _free(self, info: _Storage) -> None:
        info.alive = False
        self.live[info.where] -= info.nbytes
        if info.where == "device":
            if info.phase == "setup":
                self.static[info.tag] -= info.nbytes
            else:
                self.dynamic.discard(info)

    # ------------------------------------------------------------------ what the driver tells
    def mark(self, tensors, tag: str) -> None:
        """These tensors' storages are of category `tag` (the trainable weights, gradients, optimizer state)."""
        for t in tensors:
            if isinstance(t, torch.Tensor) and t.device.type == self.device:
                info = self.storages.get(t.untyped_storage())
                if info is None or info.tag == tag or info.where != "device":
                    continue
                if info.phase == "setup":
                    self.static[info.tag] -= info.nbytes
                    self.static[tag] += info.nbytes
                info.tag = tag

    def forward_done(self) -> None:
        """The forward has returned the loss: what it made and still holds is kept for backward."""
        for s in self.dynamic:
            if s.phase == "forward" and s.tag is None:
                s.tag = "kept"
        self.phase = "backward"

    def host_bytes(self) -> int:
        """Pinned host bytes alive now (swapped blocks' buffers and offloaded copies)."""
        return self.live["host"]


def step_state(model: torch.nn.Module, opt: torch.optim.Optimizer) -> list[torch.Tensor]:
    """The tensors of category `state`: trainable weights, their gradients, the optimizer's state."""
    params = [p for p in model.parameters() if p.requires_grad]
    return params + [p.grad for p in params if p.grad is not None] + [
        t for s in opt.state.values() for t in s.values() if isinstance(t, torch.Tensor)]


def trace_steps(tracer: LiveBytes, model: torch.nn.Module, opt: torch.optim.Optimizer, forward, steps: int = 2,
                max_grad_norm: float = 1.0) -> None:
    """`steps` training steps as train_a2.py's loop runs them, under `tracer`: forward() returns the loss, then
    backward, gradient clipping, the optimizer step, gradients set to None. Two steps: the optimizer's state exists
    from the first step's end, so the second step is the steady state."""
    params = [p for p in model.parameters() if p.requires_grad]
    tracer.mark(params, "state")
    for _ in range(steps):
        tracer.phase = "forward"
        loss = forward()
        tracer.forward_done()
        loss.backward()
        del loss
        tracer.mark([p.grad for p in params], "state")
        tracer.phase = "step"
        torch.nn.utils.clip_grad_norm_(params, max_grad_norm)
        opt.step()
        opt.zero_grad(set_to_none=True)
        tracer.mark(step_state(model, opt), "state")


def dry_run(build, plan_for, forward, steps: int = 2) -> tuple[LiveBytes, object]:
    """A training step at real size without a GPU or weights: build() makes the transformer (its trainable weights
    set) on fake tensors, plan_for(model) decides its memory plan (a2/memory.py), which is applied as a real run
    applies it (fp8, swap, offload, recomputation; eager, the device emulated on the CPU), then `steps` training
    steps (trace_steps: AdamW, clipping) run under LiveBytes, forward(model) returning the loss under
    torch.autocast("cpu", bfloat16). Returns (the tracer, the plan)."""

    tracer = LiveBytes("cpu", emulate_cuda=True)
    with fake_tensors(), emulated_cuda("cpu"), tracer:
        model = build()
        plan = plan_for(model)
        apply_plan(model, plan, torch.device("cpu"))
        for block in model.blocks:  # what blocks not recomputed keep: the compiled accounting replaces it
            if not block.recomputed:
                block.register_forward_pre_hook(lambda *_: setattr(tracer, "in_full_block", True))
                block.register_forward_hook(lambda *_: setattr(tracer, "in_full_block", False))
        opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-5, fused=True)
        trace_steps(tracer, model, opt, lambda: forward(model), steps)
    return tracer, plan


def compiled_peak(tracer: LiveBytes, config: dict, tokens: int, full_blocks: int) -> int:
    """The compiled accounting of an eager trace (a compiled block's graph cannot be traced on fake tensors here):
    the traced peak with what the `full_blocks` blocks not recomputed keep replaced by a compiled block's keep,
    L·(24d + 4f) each, and, when the peak is in the backward, the eager transient at the peak replaced by a compiled
    block's recomputation and backward, 2·L·(24d + 4f) (a2/memory.py block_bytes). Those compiled terms are the H100
    measurement (bench.py), not a trace. A forward peak keeps its eager working set (a compiled forward's, fused,
    is taken to be no larger; not measured)."""

    full = block_bytes(config, tokens)["full"]
    peak = tracer.peak.total - tracer.peak.kept_by_full_blocks() + full_blocks * full
    if tracer.peak.phase == "backward":
        peak += 2 * full - tracer.peak.by_category()["transient"]
    return round(peak)


def report(tracer: LiveBytes, plan, budget_gb: float, estimate_gb: float | None = None,
           compiled_gb: float | None = None) -> tuple[list[str], bool]:
    """What a dry run prints: the traced device peak by category beside the plan's estimate (or `estimate_gb`), the
    pinned host memory, and whether it fits `budget_gb` with a2/memory.py's margin for what the trace cannot see
    (module docstring): the traced peak, or with compiled blocks (`compiled_gb`: compiled_peak) that accounting.
    Returns (lines, fits)."""

    cats = tracer.peak.by_category()
    usable = budget_gb * (1 - MARGIN) - MARGIN_GB
    peak = tracer.peak.total / GB
    fits = (peak if compiled_gb is None else compiled_gb) <= usable
    estimate_gb = plan.estimate_gb if estimate_gb is None else estimate_gb
    est = "" if estimate_gb is None else f" (plan's estimate {estimate_gb:.2f} GiB)"
    lines = [f"dry run: peak device memory {peak:.2f} GiB in the {tracer.peak.phase}{est}, eager",
             "  " + ", ".join(f"{c} {cats[c] / GB:.2f}" for c in CATEGORIES) + " GiB"]
    if compiled_gb is not None:
        lines.append(f"  compiled blocks: {compiled_gb:.2f} GiB (the eager transient and unrecomputed blocks' keep "
                     "replaced by a compiled block's, measured on an H100, not traced)")
    lines += [f"  pinned host memory {tracer.host_peak / GB:.2f} GiB (plan: {plan.host_gb:.2f}): the GPU machine "
              f"needs {tracer.host_peak / GB / HOST_MARGIN:.1f} GiB of available RAM for it",
              f"  {'fits' if fits else 'DOES NOT FIT'}: {budget_gb:.1f} GiB card less {MARGIN:.0%} + {MARGIN_GB:.0f} "
              f"GiB for fragmentation, cuBLAS/cuDNN workspaces, compile's buffers and the CUDA context (not traced) "
              f"= {usable:.2f} GiB usable"]
    return lines, fits
