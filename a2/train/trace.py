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
- a2/memory/offload.py's copies take their CPU path (no streams): host copies are fake CPU tensors, counted as host
  memory, pinned: offloaded activations at torch's pinned allocator's size (the next power of two), swapped
  weights at their size (one registered buffer per block).

Status: the forward of the real step runs this way (A2-14B LoRA, recomputed blocks, 480p: seconds on a 2-core CPU),
the backward does not yet on a CUDA build of torch without a GPU driver: FakeTensorMode swaps in a no-op CUDA device
guard that reports one device, and autograd's engine, seeing nodes on a CUDA stream, asks the CUDA hooks whether
device 0 has a primary context, which fails its device-count check (GraphTask::stash_current_streams). The count
itself (LiveBytes) is checked on fake CPU tensors (tests/test_trace.py).

What the count cannot see: the allocator's fragmentation and rounding beyond 512 bytes (expandable segments keep it
small; without them the 14B step lost 10 GiB to it), cuBLAS/cuDNN workspaces (tens to hundreds of MB), torch.compile's
buffers (a compiled block's graph plans its own buffers: measured smaller than eager, see a2/memory/memory.py), NCCL
buffers, the CUDA context (~0.5 GiB, outside memory_allocated). a2/memory/memory.py's margin (8% + 1 GiB) is for these.

Categories of the device bytes at the peak: weights (frozen weights resident on the device, and casts of weights),
state (trainable weights, their gradients, the optimizer's moments), kept (what the forward keeps for backward:
made in the forward and alive when it ends, or brought back from host memory), transient (the rest: a block's
working tensors, the recomputation and the gradients flowing back), swapped (swapped blocks' weights fetched from
host memory). The peak is kept per phase (forward, backward through the head and the blocks not recomputed,
recompute: the recomputed blocks' backward, context: VACE's context blocks' backward, step) and at the forward's end,
the phases of a2/memory/memory.py's rule.

FSDP2 runs as on a GPU of N ranks in this one process, on torch's fake process group (collectives make tensors of
their shapes, nothing is sent): a DTensor counts as its local shard, what FSDP gathers is of category weights, and
its in-place storage resizes (a gathered weight freed after use, allocated again before the next) are counted.
"""

from __future__ import annotations

import contextlib
import math
import weakref
from dataclasses import dataclass, field, replace
from functools import partial
from types import SimpleNamespace
from unittest import mock

import torch
from diffusers.models.autoencoders.vae import DiagonalGaussianDistribution
from torch._subclasses.fake_tensor import FakeTensorConverter, FakeTensorMode, unset_fake_temporarily
from torch.utils._python_dispatch import TorchDispatchMode, is_traceable_wrapper_subclass
from torch.utils._pytree import tree_flatten
from torch.utils.weak import WeakIdKeyDictionary

from a2.cli import ConfigError
from a2.config.sections import (
    LoraSection,
    MemoryConfig,
    ObjectiveConfig,
    OptimConfig,
    ParallelConfig,
    ReferencesConfig,
    resolve_compile,
)
from a2.fake import _HOST
from a2.kinds import align
from a2.kinds.conditioning import encode, num_latent_frames
from a2.memory.memory import (
    CATEGORIES,
    GB,
    HOST_MARGIN,
    MARGIN,
    MARGIN_GB,
    PHASES,
    StepShape,
    apply_plan,
    compiled_full_keep,
    cut_config,
    cut_plan,
    full_keep,
    memory_plan,
    model_bytes,
    recompute_transient,
    step_estimate,
    step_memory,
    step_shape,
)
from a2.model.parallel import context_parallel, emulated_ranks, shard, step_costs
from a2.model.transformer import CLIP_TOKENS, TEXT_TOKENS
from a2.plan import Run
from a2.train.step import Encoders, forward_loss, make_optimizer, model_inputs, optimizer_step

CUDA_BLOCK = 512  # the CUDA caching allocator rounds every allocation up to a multiple of this


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
    with mock.patch.object(FakeTensorConverter, "set_tensor_memo", lambda *args: None), \
            FakeTensorMode(allow_non_fake_inputs=True) as mode:
        yield mode


@contextlib.contextmanager
def fsdp_gathers(tracer):
    """FSDP2's weight gathers as the tracer counts them: what its unshard allocates (the all-gather buffer, the
    gathered weights) is of category `weights`, and its in-place storage resizes (a gathered weight freed after use,
    allocated again before the next) are counted (LiveBytes.resized)."""
    from torch.distributed.fsdp._fully_shard import _fsdp_param, _fsdp_param_group

    group = _fsdp_param_group.FSDPParamGroup

    def resize(fn):
        def run(t):
            fn(t)
            tracer.resized(t)
        return run

    def gathering(fn):
        def run(*args, **kwargs):
            outer, tracer.gathering = tracer.gathering, "weights"
            try:
                return fn(*args, **kwargs)
            finally:
                tracer.gathering = outer
        return run

    with contextlib.ExitStack() as stack:
        for module in (_fsdp_param, _fsdp_param_group):
            for name in ("alloc_storage", "free_storage"):
                if hasattr(module, name):
                    stack.enter_context(mock.patch.object(module, name, resize(getattr(module, name))))
        for name in ("unshard", "wait_for_unshard"):
            stack.enter_context(mock.patch.object(group, name, gathering(getattr(group, name))))
        yield


@dataclass(eq=False)
class _Storage:
    nbytes: int
    where: str  # device | host
    phase: str  # setup | forward | backward | step: when it was made
    tag: str | None = None  # weights | state | swapped | kept | host (the copies of a2/memory/offload.py)
    alive: bool = True
    full_block: str = ""  # made in the forward of a block that is not recomputed: "blocks" | "context" (VACE's)


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

    def kept_by_full_blocks(self, group: str = "blocks") -> int:
        """The bytes at the peak that blocks not recomputed keep for backward (group "context": VACE's context
        blocks)."""
        return sum(s.nbytes for s in self.dynamic if s.full_block == group and _category(s) == "kept")


def _category(s: _Storage) -> str:
    if s.tag in CATEGORIES:
        return s.tag
    return "transient"


class LiveBytes(TorchDispatchMode):
    """Counts the live bytes of every storage made under it, on the device (tensors of type `device`) and in
    pinned host memory (what a2/memory/offload.py copies there), and the device peak during the step with its
    categories. Use inside a FakeTensorMode (or on real tensors: the count is the same). emulate_cuda: device storages
    are rounded up as CUDA's caching allocator rounds them (a dry run emulates the GPU on the CPU). The driver says
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
        self.peaks: dict[str, Peak] = {}  # the device peak of each phase (forward, backward, recompute, step)
        self.forward_end = Peak()  # the device bytes when the forward has returned the loss
        self.host_peak = 0  # pinned host bytes, the most at once
        self.in_full_block = ""  # the group of the block not recomputed whose forward runs (the driver's hooks)
        self.gathering: str | None = None  # FSDP2 gathers weights: what it allocates is of this category

    # ------------------------------------------------------------------ counting
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        source = None
        if func in (torch.ops.aten._to_copy.default, torch.ops.aten.copy_.default) and args:
            source = args[-1] if func is torch.ops.aten.copy_.default else args[0]
        for t in tree_flatten(out)[0]:
            t = getattr(t, "_local_tensor", t)  # a DTensor's memory is its local tensor's (FSDP2's shard)
            if isinstance(t, torch.Tensor) and not is_traceable_wrapper_subclass(t):
                self.track(t, source)
        return out

    def track(self, t: torch.Tensor, source: torch.Tensor | None = None) -> _Storage | None:
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
            # a2/memory/offload.py: a copy back
            if origin is not None and origin.where == "host" and origin.tag == "host":
                tag = "swapped" if origin.phase == "setup" else "kept"
            elif origin is not None and origin.phase == "setup":  # a cast of a weight (autocast's, fp8's) is of
                tag = origin.tag  # its category
            tag = "weights" if self.phase == "setup" else self.gathering or tag
        info = _Storage(nbytes, where, self.phase, tag,
                        full_block=self.in_full_block if self.phase == "forward" else "")
        self._add(st, info)
        return info

    def _add(self, st, info: _Storage) -> None:
        """Counts a storage from now until its last reference goes: on the device, made before the step (static)
        or in it (dynamic: the peaks follow), or in host memory."""
        self.storages[st] = info
        weakref.finalize(st, self._free, info)
        self.live[info.where] += info.nbytes
        if info.where == "host":
            self.host_peak = max(self.host_peak, self.live["host"])
        elif info.phase == "setup":
            self.static[info.tag] += info.nbytes
        else:
            self.dynamic.add(info)
            self._grown()

    def _grown(self) -> None:
        if self.live["device"] > self.peaks.get(self.phase, self.peak).total or self.phase not in self.peaks:
            self.peaks[self.phase] = Peak(self.live["device"], self.phase, dict(self.static), list(self.dynamic))
            if self.live["device"] > self.peak.total:
                self.peak = self.peaks[self.phase]

    def keep_only(self, tensors) -> None:
        """Of the device storages made so far, only these tensors' count from now on (what fully_shard leaves
        referenced of the weights it sharded, on fake tensors: a real run shards a meta-device replica)."""
        keep = {id(info) for t in tensors if (info := self.storages.get(t.untyped_storage())) is not None}
        for info in list(self.storages.values()):
            if info.where == "device" and info.phase == "setup" and id(info) not in keep:
                self._free(info)

    def resized(self, t: torch.Tensor) -> None:
        """t's storage was resized in place (FSDP2 frees a gathered weight's storage after use and allocates it
        again before the next; no op is dispatched for it): it counts as a storage of its new size from now on (the
        old record stays as it was in the peaks taken before)."""
        old = self.track(t)
        if old is None or not old.alive:
            return
        st = t.untyped_storage()
        nbytes = -(-st.nbytes() // self.round) * self.round
        if nbytes == old.nbytes:
            return
        self._free(old)
        self._add(st, replace(old, nbytes=nbytes, alive=True))  # (the old record was just freed: not its state)

    def _free(self, info: _Storage) -> None:
        if not info.alive:
            return
        info.alive = False
        self.live[info.where] -= info.nbytes
        if info.where == "device":
            if info.phase == "setup":
                self.static[info.tag] -= info.nbytes
            else:
                self.dynamic.discard(info)

    # ------------------------------------------------------------------ what the driver tells
    def mark(self, tensors, tag: str) -> None:
        """These tensors' storages are of category `tag` (the trainable weights, gradients, optimizer state; FSDP2's
        DTensors: this rank's shards)."""
        for t in tensors:
            t = getattr(t, "_local_tensor", t)
            if isinstance(t, torch.Tensor) and t.device.type == self.device:
                info = self.storages.get(t.untyped_storage())
                if info is None or info.tag == tag or info.where != "device":
                    continue
                if info.phase == "setup":
                    self.static[info.tag] -= info.nbytes
                    self.static[tag] += info.nbytes
                info.tag = tag

    def enter_block(self, full: str) -> None:
        """A block's forward starts, full: its group ("blocks", "context") if it is not recomputed, else "" (also
        when it ends)."""
        self.in_full_block = full

    def phases(self) -> dict[str, Peak]:
        """The device peak of each phase of the step and the bytes at the forward's end (a2/memory/memory.py's
        PHASES)."""
        return {p: self.forward_end if p == "forward end" else self.peaks[p] for p in PHASES
                if p in self.peaks or p == "forward end"}

    def forward_done(self) -> None:
        """The forward has returned the loss: what it made and still holds is kept for backward."""
        for s in self.dynamic:
            if s.phase == "forward" and s.tag is None:
                s.tag = "kept"
        self.forward_end = Peak(self.live["device"], "forward end", dict(self.static), list(self.dynamic))
        self.phase = "backward"


def step_state(model: torch.nn.Module, opt: torch.optim.Optimizer) -> list[torch.Tensor]:
    """The tensors of category `state`: trainable weights, their gradients, the optimizer's state (EMA included)."""
    params = [p for p in model.parameters() if p.requires_grad]
    return params + [p.grad for p in params if p.grad is not None] + [
        t for s in opt.state.values() for t in s.values() if isinstance(t, torch.Tensor)]


def trace_steps(tracer: LiveBytes, model: torch.nn.Module, forward, optim: OptimConfig, steps: int = 2) -> None:
    """`steps` training steps as train_a2.py's loop runs them, under `tracer`: forward() returns the loss, then
    backward and the trainer's optimizer_step (clipping, the non-finite guard, AdamW, the EMA with --ema-decay),
    gradients set to None. Two steps: the optimizer's state exists from the first step's end, so the second step is
    the steady state."""
    params = [p for p in model.parameters() if p.requires_grad]
    opt, guard = make_optimizer(optim, params, torch.device("cpu"))
    tracer.mark(params, "state")
    for step in range(steps):
        tracer.phase = "forward"
        loss = forward()
        tracer.forward_done()
        loss.backward()
        tracer.mark([p.grad for p in params], "state")
        tracer.phase = "step"
        optimizer_step(opt, params, guard, loss.detach(), step, optim, 1)
        del loss
        opt.zero_grad(set_to_none=True)
        tracer.mark(step_state(model, opt), "state")


# ---------------------------------------------------------------- a synthetic batch: what a precompute cache holds


class PosteriorShapes:
    """A VAE stand-in that hands out a posterior of the right shape for each encode, on the meta device (no data):
    what a precompute cache of the run would hold, for a synthetic batch."""

    def __init__(self, info):
        self.config = SimpleNamespace(latents_mean=[0.0] * info.z_dim, latents_std=[1.0] * info.z_dim,
                                      scale_factor_spatial=info.vae_scale)
        self.z_dim, self.shapes = info.z_dim, []

    def parameters(self):
        return iter([torch.empty(0, device="meta")])

    def encode(self, pixels: torch.Tensor):
        b, _, f, h, w = pixels.shape
        s = self.config.scale_factor_spatial
        params = torch.zeros(b, 2 * self.z_dim, num_latent_frames(f), h // s, w // s, device="meta")
        self.shapes.append(tuple(params.shape))
        return SimpleNamespace(latent_dist=DiagonalGaussianDistribution(params))


def synthetic_batch(run: Run, b: int, h: int, w: int) -> tuple[dict, Encoders]:
    """A cached batch of the run's layout (its largest element set) as model_inputs reads it, and the Encoders of a
    run trained from the cache: the posteriors' shapes (the kind's VAE calls, traced on meta tensors), no data. The
    dry run and bench.py fill them with zeros (zero_batch)."""
    layout = run.layout
    vae = PosteriorShapes(run.info)
    video = torch.empty(b, 3, layout.clip_frames, h, w, device="meta")
    size = layout.reference_size or (h, w)
    refs = torch.empty(b, layout.reference_images, 3, *size, device="meta") if layout.takes_references else None
    region = torch.ones(b, h, w, dtype=torch.bool) if layout.takes_region else None
    encode(vae, layout, video, refs, None, "argmax", region)
    batch = dict(indices=list(range(b)), posteriors=vae.shapes, video_shape=tuple(video.shape),
                 ref_shape=None if refs is None else tuple(refs.shape), region=region, repeats=layout.repeats,
                 element_names=tuple(e.name for e in run.elements) if layout.takes_references else ())
    return batch, Encoders(latents_config=vars(vae.config))


def zero_batch(batch: dict, enc: Encoders, run: Run, config, align_targets: torch.Tensor | None = None,
               device="cpu") -> tuple[dict, Encoders]:
    """synthetic_batch's shapes as zero tensors (the dry run's and bench.py's step): the posteriors, the text and
    CLIP tokens a precompute cache would hold for a transformer of `config`, `align_targets` as its DINOv3 targets
    (--align-loss), and the empty prompt of text dropout on `device`."""
    b = len(batch["indices"])
    zeros = dict(batch, posteriors=[torch.zeros(shape) for shape in batch["posteriors"]], align=align_targets,
                 text=torch.zeros(b, TEXT_TOKENS, config.text_dim),  # (B, 512, D)
                 clip=torch.zeros(b, CLIP_TOKENS * run.layout.reference_images, config.image_dim or 1)
                 if run.layout.use_clip else None)  # (B, 257·N, D)
    return zeros, replace(enc, empty_text=torch.zeros(1, TEXT_TOKENS, config.text_dim, device=device))


def align_zeros(run: Run, b: int, h: int, w: int, dim: int) -> torch.Tensor:
    """--align-loss: zero DINOv3 targets (B, N, L, dim) of the run's references, as its precompute cache holds them."""
    patch, s = run.info.patch_size, run.info.vae_scale
    starts, tokens, _ = align.reference_spans(run.layout, (h // s // patch[1], w // s // patch[2]), patch)
    return torch.zeros(b, len(starts), tokens, dim)


# ---------------------------------------------------------------- the dry run


def dry_run(memory: MemoryConfig, parallel: ParallelConfig, lora: LoraSection, optim: OptimConfig,
            objective: ObjectiveConfig, references: ReferencesConfig, size: tuple[int, int], run: Run, build,
            config: dict | None = None, align_dim: int | None = None, log=print, trace: bool = True) -> dict:
    """--dry-run of train_a2.py and bench.py: one rank's training step at real size without a GPU, weights or data.
    build(run) makes the transformer to train (its trainable weights set) on fake tensors, for `run` as on CUDA
    (bf16 frozen weights); config: the whole model's config when build cuts it to fewer blocks (bench.py's tests:
    the plan is the whole model's, traced on the cut model with its per-block choices, a2/memory/memory.py cut_plan),
    else the model's own. As on CUDA with the run's flags:
    bf16, the blocks compiled unless --compile False; --context-parallel N emulates one rank of its group (its share
    of the tokens, a2/model/parallel.py); --fsdp shards over --dry-run-ranks ranks on a fake process group. The plan
    (a2/memory/memory.py memory_plan, for a --max-memory-gb card, default 80) is applied as a real run applies it (fp8,
    swap, offload, recomputation; eager, the device emulated on the CPU), then two training steps (model_inputs +
    forward_loss on a synthetic batch of zero posteriors, backward, optimizer_step) run under LiveBytes. Prints the
    traced peak by category beside the rule's terms, the compiled accounting (compiled_peak) with compiled blocks,
    and whether it fits. Returns the plan, the traced plan, the tracer, the estimates (GiB) and `fits`; trace False:
    the plan alone (built, split and sharded as for the trace, nothing run: bench.py --memory-table)."""
    run = replace(run, compute_dtype=torch.bfloat16, compile=resolve_compile(memory.compile, "cuda"))
    cp, ranks = parallel.context_parallel, memory.dry_run_ranks or parallel.context_parallel
    if ranks % cp:
        raise ConfigError(f"--dry-run-ranks {ranks}: a multiple of --context-parallel {cp}")
    if not parallel.fsdp and ranks != cp:
        raise ConfigError(f"--dry-run-ranks {ranks}: without --fsdp a rank's step does not depend on the ranks beside "
                          "its context-parallel group; drop it")
    shape, (h, w) = step_shape(run.layout, run.info, size, optim.micro_batch, cp), size
    full, cpu = lora.training_type == "full", torch.device("cpu")
    log(f"dry run: the step of the run's largest element set, {len(run.layout.repeats)} element(s), "
        f"{shape.tokens:,} tokens per rank" + (f" (of {shape.whole:,}: context parallel {cp})" if cp > 1 else "")
        + (f", FSDP over {ranks} ranks" if parallel.fsdp else ""))
    batch, enc = synthetic_batch(run, optim.micro_batch, h, w)
    targets = None
    if references.align_loss:
        targets = align_zeros(run, optim.micro_batch, h, w, align_dim or align.target_dim(references.align_model))
    tracer = LiveBytes("cpu", emulate_cuda=True)
    with (emulated_ranks(ranks) if parallel.fsdp else contextlib.nullcontext()) as mesh, fake_tensors(), \
            emulated_cuda("cpu"), fsdp_gathers(tracer), tracer:
        model = build(run)
        whole = dict(config or model.config)
        n, cut = whole["num_layers"], len(model.blocks)
        if cp > 1:  # one rank of the group, emulated in this process (a2/model/parallel.py)
            context_parallel(model, None, cp)
        if parallel.fsdp:
            shard(model, mesh, torch.bfloat16)
            tracer.keep_only([getattr(t, "_local_tensor", t) for t in [*model.parameters(), *model.buffers()]])
        plan = memory_plan(memory, model, shape, full, parallel.fsdp, cpu, run.compile, ema=optim.ema_decay > 0,
                           dry_run=True, whole=whole if cut != n else None)
        if not trace:
            return dict(plan=plan, shape=shape)
        traced = cut_plan(plan, n, cut)
        m = model_bytes(model, full, parallel.fsdp, ema=optim.ema_decay > 0)  # the traced (cut) model's, before fp8
        apply_plan(model, traced, cpu)
        k = round(traced.checkpoint_fraction * cut)
        kc = round(traced.checkpoint_fraction * len(getattr(model, "vace_blocks", ())))  # (as configure_blocks)
        watch_blocks(tracer, model, k, kc)
        forward = partial(_step_loss, model, batch, enc, optim, objective, references, run, targets)
        trace_steps(tracer, model, forward, optim)
    config_cut = cut_config(whole, cut)
    save = traced.save_attention
    rule = {c: step_memory(config_cut, shape, m, k, save, traced.offload, traced.fp8, traced.swap_blocks, c, kc)
            for c in {False, run.compile}}
    estimate = {c: max(sum(v.values()) for v in r.values()) / GB for c, r in rule.items()}  # the largest phase
    compiled = (compiled_peak(tracer, config_cut, shape, m.precisions, save, kc == len(config_cut.get("vace_layers")
                                                                                      or ())) / GB
                if run.compile else None)
    if cp > 1:
        costs = step_costs(whole, shape.whole // optim.micro_batch, shape.context, cp)
        log(f"context parallel {cp}: {shape.tokens:,} tokens per rank; per rank forward attention cores "
            f"{optim.micro_batch * (costs['self_core'] + costs['cross_core']) / 1e12:.1f} TFLOP, all-to-all per block "
            f"{optim.micro_batch * costs['all_to_all_forward'] / 2**20:.0f} MiB forward + "
            f"{optim.micro_batch * costs['all_to_all_backward'] / 2**20:.0f} MiB backward (+ the forward's again per "
            "recomputed block)")
    log(f"memory: {plan}" + (f"\n  traced with {cut} of its {n} blocks: {traced}" if cut != n else ""))
    lines, fits = report(tracer, rule, estimate, traced, memory.max_memory_gb or 80.0, compiled)
    log("\n".join(lines))
    host = step_estimate(config_cut, shape, m, k, save, traced.offload, traced.fp8, traced.swap_blocks)[1]
    return dict(plan=plan, traced_plan=traced, tracer=tracer, rule=rule[False], peak_gb=tracer.peak.total / GB,
                estimate_gb=estimate[run.compile], eager_estimate_gb=estimate[False], compiled_gb=compiled,
                host_gb=host / GB, fits=fits, shape=shape)


def _step_loss(model, batch, enc, optim: OptimConfig, objective: ObjectiveConfig, references: ReferencesConfig,
               run: Run, targets):
    """The training step's loss (model_inputs + forward_loss) on synthetic_batch's shapes filled with zeros."""
    with unset_fake_temporarily():  # the inputs are real (small, latent-sized): the step's draws read values
        zeros, zeros_enc = zero_batch(batch, enc, run, model.config, targets)
        inputs = model_inputs(zeros, 0, 0, optim, objective, references, run, zeros_enc, 0, torch.device("cpu"))
    return forward_loss(model, inputs, objective, references, run, torch.autocast("cpu", dtype=torch.bfloat16),
                        torch.bfloat16)[0]


def watch_blocks(tracer: LiveBytes, model, recomputed: int, recomputed_context: int = 0) -> None:
    """Hooks that tell the tracer which block's forward runs (what blocks not recomputed keep is what the compiled
    accounting replaces; VACE's context blocks are a group of their own), when the backward reaches the recomputed
    blocks (the phase "recompute": the gradient of the last recomputed block's output is made) and, on VACE, when it
    has left the blocks for the context blocks (the phase "context": the gradient of the input of the first block
    after the first that takes one is made; the first block's backward, where it has one, falls in it)."""
    vace = list(getattr(model, "vace_blocks", ()))
    for group, blocks, k in (("blocks", model.blocks, recomputed), ("context", vace, recomputed_context)):
        for i, block in enumerate(blocks):
            full = group if i >= k else ""
            block.register_forward_pre_hook(lambda *_, full=full: tracer.enter_block(full))
            block.register_forward_hook(lambda *_: tracer.enter_block(""))
    if recomputed:
        def to_recompute(module, args, out):
            if out.requires_grad:
                out.register_hook(lambda grad: setattr(tracer, "phase", "recompute"))
        model.blocks[recomputed - 1].register_forward_hook(to_recompute)
    if vace:
        hooked = []  # (this forward's)

        def to_context(module, args):  # (not the first block's input: the context blocks read it too)
            if args[0].requires_grad and not hooked:
                hooked.append(args[0].register_hook(lambda grad: setattr(tracer, "phase", "context")))
        model.blocks[0].register_forward_pre_hook(lambda *_: hooked.clear())
        for block in model.blocks[1:]:
            block.register_forward_pre_hook(to_context)


def compiled_peak(tracer: LiveBytes, config: dict, shape: StepShape, precisions: tuple[str, str],
                  save_attention: bool, context_recomputed: bool = False) -> int:
    """The compiled accounting of an eager trace (a compiled block's graph cannot be traced on fake tensors here):
    each phase's traced peak with what compiled blocks hold differently from eager ones replaced by
    a2/memory/memory.py's compiled terms, the rule's own: what blocks not recomputed keep, scaled to a compiled block's
    keep (compiled_full_keep over full_keep), and in the recomputed blocks' backward an eager block's recomputation
    and backward replaced by a compiled block's (recompute_transient, both), as the rule substitutes them; VACE's
    context blocks likewise (their backward: "context"). precisions: the blocks' and the context blocks'
    (ModelBytes.precisions); context_recomputed: the last context block is recomputed. Those compiled terms are the
    H100 measurement (bench.py), not a trace; the forward's working set and the backward through blocks not
    recomputed stay the eager trace's (not measured compiled). The largest phase."""
    def scale(precision):
        return compiled_full_keep(config, shape.tokens) / full_keep(config, shape, precision, compile=False)

    def swap(precision):  # a compiled block's recomputation and backward for an eager one's
        return (recompute_transient(config, shape, precision, save_attention, True)
                - recompute_transient(config, shape, precision, save_attention, False))

    peaks = []
    for phase, peak in tracer.phases().items():
        total = peak.total - sum((1 - scale(p)) * peak.kept_by_full_blocks(g)
                                 for g, p in zip(("blocks", "context"), precisions))
        if phase == "recompute":
            total += swap(precisions[0])
        if phase == "context" and context_recomputed:
            total += swap(precisions[1])
        peaks.append(total)
    return round(max(peaks))


def report(tracer: LiveBytes, rule: dict, estimate: dict, plan, budget_gb: float, compiled_gb: float | None = None
           ) -> tuple[list[str], bool]:
    """What a dry run prints, GiB: the traced device peak by category beside the rule's terms at the same phase
    (rule: {compile: step_memory}; estimate: {compile: its largest phase, GiB}), the compiled accounting where blocks
    are compiled, the pinned host memory, and whether the step fits `budget_gb` with a2/memory/memory.py's margin for
    what the trace cannot see (module docstring): the traced peak, or with compiled blocks the compiled accounting.
    Returns (lines, fits)."""
    usable = budget_gb * (1 - MARGIN) - MARGIN_GB
    peak, phase = tracer.peak.total / GB, tracer.peak.phase
    eager = rule[False].get(phase, max(rule[False].values(), key=lambda c: sum(c.values())))
    traced = tracer.peak.by_category()
    lines = [f"dry run: peak device memory {peak:.2f} GiB in the {phase}, eager; the rule's estimate "
             f"{estimate[False]:.2f} GiB",
             "  traced: " + ", ".join(f"{c} {traced[c] / GB:.2f}" for c in CATEGORIES),
             "  rule:   " + ", ".join(f"{c} {eager[c] / GB:.2f}" for c in CATEGORIES)]
    fits = (peak if compiled_gb is None else compiled_gb) <= usable
    if compiled_gb is not None:
        lines.append(f"  compiled blocks: {compiled_gb:.2f} GiB, the rule's estimate {estimate[True]:.2f} GiB (the "
                     "trace with what compiled blocks keep and hold in their backward replaced by the H100 "
                     "measurement, a2/memory/memory.py)")
    lines += [f"  pinned host memory {tracer.host_peak / GB:.2f} GiB (plan: {plan.host_gb:.2f}): the GPU machine "
              f"needs {tracer.host_peak / GB / HOST_MARGIN:.1f} GiB of available RAM for it",
              f"  {'fits' if fits else 'DOES NOT FIT'}: {budget_gb:.1f} GiB card less {MARGIN:.0%} + {MARGIN_GB:.0f} "
              f"GiB for fragmentation, cuBLAS/cuDNN workspaces, compile's buffers and the CUDA context (not traced) "
              f"= {usable:.2f} GiB usable"]
    return lines, fits
