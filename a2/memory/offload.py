"""Memory reach: what a training step keeps on the GPU between uses, parked in host memory and brought
back one block ahead of its use, overlapped with compute.

Activation offload (recomputed blocks): what a checkpointed block keeps for backward, its input (and with
save_attention the self-attention output and log-sum-exp), is copied to pinned host memory as the forward saves it,
and copied back when the backward of the block after it starts, so the copy overlaps that block's backward. It is
done with saved-tensor hooks around the block call: eager non-reentrant checkpointing saves the block inputs through
them (and, with `respect_saved_tensors_hooks`, what selective checkpointing keeps); a compiled block is one autograd
function whose saved tensors (inputs, weights, kept attention) go through them too. Weights, tensors shared by all
blocks (text states, time embedding, RoPE) and tensors under MIN_BYTES stay where they are.

Block swap (frozen weights, LoRA runs): the non-trainable tensors (frozen parameters and buffers) of the last n
blocks live in pinned host memory; a block's are copied to the GPU while the block before it computes, in the
forward (block i+1 during block i) and in the backward (block i-1 during block i, where a recomputed block re-runs
its forward and every block multiplies by its weights for the input gradient), and released right after the block.
LoRA weights, their gradients and the optimizer state never move. The last n blocks, not the first: the forward
then reaches the first swapped block after n_resident blocks that hide its copy, the turn from forward to backward
happens on the last block, which stays on the GPU across it, and the backward ends on resident blocks, so every
copy of the step has a block's compute to hide behind.

Both follow the order of `blocks`; VACE's context blocks (a2/kinds/vace.py), which run before them on hooks of their
own, are not reached, so a2/memory/memory.py refuses both on VACE (check_context_blocks) and never plans them there.

Both work on any device: on the CPU (tests) "host" copies are separate storages and a released block's tensors
are empty, so a wrong or missing restore changes results or fails; on CUDA the copies run on two side streams (one
per direction), ordered against the compute stream by events, with record_stream telling the allocator which
stream still reads a tensor, so no copy waits for the host. Swapped weights take exactly their bytes of host RAM
(one buffer per block, registered with the driver); offloaded activations go through torch's pinned allocator,
which caches them across steps and rounds each up to a power of two.
"""

from __future__ import annotations

import weakref

import torch
from torch import nn

from a2.fake import fake_mode_active, host_memory

MIN_BYTES = 1 << 20  # smaller saved tensors stay on the GPU: a copy's fixed cost outweighs the memory


class Copier:
    """Host <-> device copies on side streams (CUDA), or plain separate-storage copies (CPU). One stream per
    direction: the link is full duplex, and a block's activations going out need not wait for weights coming in."""

    def __init__(self, device: torch.device):
        self.device = device
        # a dry run's fake CUDA tensors take the CPU path: no streams or pinned memory to ask a GPU for
        # (a2/train/trace.py)
        self.cuda = device.type == "cuda" and not fake_mode_active()
        self.down = torch.cuda.Stream(device) if self.cuda else None  # device -> host
        self.up = torch.cuda.Stream(device) if self.cuda else None  # host -> device

    def to_host(self, t: torch.Tensor):
        """(host copy, event when done). The copy starts once the compute queued so far (which produced t) is
        done, and t's memory is not reused before the copy has read it."""
        with host_memory(pow2=True):  # (a dry run counts it: a2/train/trace.py)
            if not self.cuda:
                return t.detach().to("cpu", copy=True), None  # (same strides: offloaded tensors are dense)
            host = torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device="cpu", pin_memory=True)
        main = torch.cuda.current_stream(self.device)
        with torch.cuda.stream(self.down):
            self.down.wait_stream(main)
            host.copy_(t.detach(), non_blocking=True)
            done = torch.cuda.Event()
            done.record(self.down)
        t.record_stream(self.down)
        return host, done

    def to_device(self, host: torch.Tensor, after=None):
        """(device copy, event when done), queued on the side stream behind `after` (an event or None)."""
        if not self.cuda:
            return host.to(self.device, copy=True), None
        with torch.cuda.stream(self.up):
            if after is not None:  # the host copy is complete
                self.up.wait_event(after)
            t = torch.empty_strided(host.shape, host.stride(), dtype=host.dtype, device=self.device)
            t.copy_(host, non_blocking=True)
            done = torch.cuda.Event()
            done.record(self.up)
        return t, done

    def use(self, t: torch.Tensor, done) -> torch.Tensor:
        """t, made safe to use on the compute stream: it waits for t's copy, and the allocator learns that the
        compute stream reads t (it was allocated on the side stream)."""
        if self.cuda:
            main = torch.cuda.current_stream(self.device)
            main.wait_event(done)
            t.record_stream(main)
        return t


class Offloaded:
    """One saved tensor parked in host memory; `get` brings it back (prefetched or on demand)."""

    __slots__ = ("copier", "host", "stored", "back", "arrived", "__weakref__")

    def __init__(self, copier: Copier, t: torch.Tensor):
        self.copier = copier
        self.host, self.stored = copier.to_host(t)
        self.back = self.arrived = None

    def prefetch(self) -> None:
        if self.back is None:
            self.back, self.arrived = self.copier.to_device(self.host, self.stored)
            self.host = None  # the pinned block is reused only after the copy read it (the host allocator's events)

    def get(self) -> torch.Tensor:
        self.prefetch()
        if self.arrived is not None:
            self.copier.use(self.back, self.arrived)
            self.arrived = None
        return self.back


def dense(t: torch.Tensor) -> bool:
    """Its elements fill a span of its storage exactly, in some order of the dims: a copy with the same strides
    (what the backward, compiled or not, expects) holds exactly its elements."""
    expected = 1
    for stride, size in sorted((st, s) for s, st in zip(t.shape, t.stride()) if s != 1):
        if stride != expected:
            return False
        expected *= size
    return True


def frozen_tensors(block: nn.Module) -> list[torch.Tensor]:
    """Every non-trainable tensor of the block (frozen parameters; buffers, e.g. fp8 weights and their scales,
    whatever their dtype), each once."""
    return list({id(t): t for t in [*block.parameters(), *block.buffers()] if not t.requires_grad}.values())


def _storages(tensors) -> set[int]:
    # the storage itself, not its data pointer: a dry run's fake tensors have none (a2/train/trace.py)
    return {t.untyped_storage()._cdata for t in tensors if isinstance(t, torch.Tensor)}


class BlockOffload:
    """The hooks of activation offload and block swap on a model's `blocks`: one per model (`model.a2_offload`),
    set up by apply_offload."""

    def __init__(self, model: nn.Module, device):
        self.blocks = list(model.blocks)
        self.index = {id(b): i for i, b in enumerate(self.blocks)}
        self.device = torch.device(device)
        if self.device.type == "cuda" and self.device.index is None:  # compared with tensors' devices, which have one
            self.device = torch.device("cuda", torch.cuda.current_device())
        self.copier = Copier(self.device)
        self.min_bytes = MIN_BYTES
        self.saved: dict[int, list] = {}  # offloaded block -> weak refs to its Offloaded tensors of the latest forward
        self.skip: set[int] = set()  # storages the running block's pack hook leaves alone
        self.swap: list[int] = []  # blocks whose frozen tensors live in host memory
        self.frozen: dict[int, list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]] = {}  # (tensor, host, empty)
        self.buffers: list[torch.Tensor] = []  # the swapped blocks' host memory
        self.state: dict[int, object] = {}  # swapped block -> "host" | (device copies, event) | "device"
        self.in_backward = False
        self.activations = False  # offload what the recomputed blocks (configure_blocks marks them) save
        self.running = None  # (block, its saved-tensor hooks) while an offloading block's forward runs
        for block in self.blocks:  # every block: block i's backward start prefetches block i-1, swapped or not
            block.register_forward_pre_hook(self._pre_forward, with_kwargs=True)
            block.register_forward_hook(self._post_forward, always_call=True)  # also closes the hooks on errors

    # ------------------------------------------------------------------ block swap
    def add_swap(self, blocks: list[int]) -> None:
        """Blocks' frozen tensors, wherever they are (host memory before the model moves to the device, or the
        device), to host memory (pinned on CUDA); on the device each becomes an empty tensor until loaded."""
        for i in blocks:
            if i in self.frozen:
                continue
            tensors = frozen_tensors(self.blocks[i])
            hosts = self.host_buffer(tensors)
            self.frozen[i] = []
            for t, host in zip(tensors, hosts):
                host.copy_(t.detach())
                self.frozen[i].append((t, host, torch.empty(0, dtype=t.dtype, device=self.device)))
            self.swap.append(i)
            self.state[i] = "device"
            self._release(i)

    def host_buffer(self, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
        """Host tensors shaped as `tensors`, contiguous, views of one buffer of exactly their size, page-locked on
        CUDA (registered with the driver: torch's pinned allocator rounds every allocation up to a power of two,
        up to twice the host RAM for a block's weights). The buffer lives as long as this object."""
        align = 256
        sizes = [-(-t.numel() * t.element_size() // align) * align for t in tensors]
        with host_memory(pow2=False):  # (a dry run counts it: a2/train/trace.py)
            flat = torch.empty(sum(sizes), dtype=torch.uint8)
        if self.copier.cuda and flat.numel():
            if int(torch.cuda.cudart().cudaHostRegister(flat.data_ptr(), flat.numel(), 0)) == 0:
                weakref.finalize(self, torch.cuda.cudart().cudaHostUnregister, flat.data_ptr()).atexit = False
            else:  # (e.g. a locked-memory limit) torch's pinned allocator instead
                flat = flat.pin_memory()
        self.buffers.append(flat)
        out, offset = [], 0
        for t, size in zip(tensors, sizes):
            out.append(flat[offset: offset + t.numel() * t.element_size()].view(t.dtype).view(t.shape))
            offset += size
        return out

    def _load(self, i: int) -> None:
        """Start copying block i's frozen tensors to the device (side stream), if they are not there."""
        if self.state.get(i) == "host":
            copies = [self.copier.to_device(host) for _, host, _ in self.frozen[i]]
            self.state[i] = ([c for c, _ in copies], copies[-1][1] if copies else None)

    def _ensure(self, i: int) -> None:
        """Block i's frozen tensors are on the device and usable by the compute stream."""
        if i not in self.state:
            return
        self._load(i)
        if self.state[i] != "device":
            copies, done = self.state[i]
            for (t, _, _), c in zip(self.frozen[i], copies):
                # .data keeps the tensor object, which autograd's saved weights and compiled graphs refer to
                t.data = self.copier.use(c, done) if done is not None else c
            self.state[i] = "device"

    def _release(self, i: int) -> None:
        """Block i's device copies are dropped (the allocator reuses them once the queued compute read them)."""
        if self.state.get(i, "host") != "host":
            self._ensure(i)  # a copy still in flight is waited for before its memory can be given back
            for t, _, empty in self.frozen[i]:
                t.data = empty
            self.state[i] = "host"

    def resident(self) -> list[int]:
        """The swapped blocks whose frozen tensors are on the device (or on their way) now."""
        return [i for i in self.swap if self.state[i] != "host"]

    # ------------------------------------------------------------------ hooks
    def _pre_forward(self, block, args, kwargs):
        i = self.index[id(block)]
        self._ensure(i)
        self._load(i + 1)  # the next block's weights copy while this block computes
        if self.activations and getattr(block, "recomputed", False) and torch.is_grad_enabled():
            # what all blocks share (text states, time embedding, RoPE) and the weights are not this block's to move
            self.skip = _storages([*args[1:], *kwargs.values(), *block.parameters(), *block.buffers()])
            self.saved[i] = []
            hooks = torch.autograd.graph.saved_tensors_hooks(lambda t: self._pack(i, t), unpack)
            hooks.__enter__()
            self.running = (block, hooks)

    def _post_forward(self, block, args, out):
        if self.running is not None and self.running[0] is block:
            self.running[1].__exit__(None, None, None)
            self.running = None
        i = self.index[id(block)]
        grad = isinstance(out, torch.Tensor) and out.requires_grad
        if not (grad and i == len(self.blocks) - 1):  # the last block is the first of the backward: it stays
            self._release(i)
        if grad:
            out.register_hook(lambda _, i=i: self._backward_starts(i))

    def _backward_starts(self, i: int) -> None:
        """The gradient of block i's output is complete: block i+1's backward is done, block i's begins."""
        if not self.in_backward:
            self.in_backward = True
            torch.autograd.Variable._execution_engine.queue_callback(self._backward_done)
        self._release(i + 1)
        self._ensure(i)
        self._load(i - 1)
        for ref in self.saved.get(i - 1, ()):
            saved = ref()
            if saved is not None:
                saved.prefetch()

    def _backward_done(self) -> None:
        self.in_backward = False
        for i in self.swap:
            self._release(i)

    # ------------------------------------------------------------------ activation offload
    def _pack(self, i: int, t: torch.Tensor):
        if (isinstance(t, nn.Parameter) or t.device != self.device or t.numel() * t.element_size() < self.min_bytes
                or t.untyped_storage()._cdata in self.skip or not dense(t)):
            return t
        saved = Offloaded(self.copier, t)
        self.saved[i].append(weakref.ref(saved))
        return saved


def unpack(saved):
    return saved.get() if isinstance(saved, Offloaded) else saved


def swapped_blocks(model: nn.Module, n: int) -> list[int]:
    """The blocks apply_offload(model, swap=n) keeps in host memory: the last n (see the module docstring)."""
    blocks = len(model.blocks)
    if not 0 <= n <= blocks:
        raise ValueError(f"--swap-blocks {n}: the model has {blocks} blocks")
    return list(range(blocks - n, blocks))


def swap_bytes(model: nn.Module, n: int) -> int:
    """(Of a model not swapped yet.) Host RAM (pinned) that swapping n blocks takes, and the device memory it frees,
    less the (at most) two swapped blocks on the device at a time. Each swapped block's bytes cross host -> device
    twice a step (forward, backward)."""
    return sum(t.numel() * t.element_size() for i in swapped_blocks(model, n)
               for t in frozen_tensors(model.blocks[i]))


def apply_offload(model: nn.Module, activations: bool, swap: int, device, min_bytes: int | None = None) -> int:
    """Activation offload of the recomputed blocks (those configure_blocks marks, before or after this call) and
    block swap of the last `swap` blocks' frozen tensors, on `device`. Call it before the model is moved to the
    device (the swapped weights then never go there whole) or after. Returns the bytes swapped (host RAM).

    Costs per step: swap, each swapped block's frozen bytes host -> device twice (forward, backward; see swap_bytes);
    activation offload, each offloaded tensor device -> host in the forward and back in the backward, its bytes
    taken in pinned host RAM instead of the device (a2/memory/memory.py's saved bytes of the recomputed blocks)."""
    size = swap_bytes(model, swap)
    if activations or swap:
        if getattr(model, "a2_offload", None) is None:
            model.a2_offload = BlockOffload(model, device)
        model.a2_offload.activations = model.a2_offload.activations or activations
        model.a2_offload.min_bytes = MIN_BYTES if min_bytes is None else min_bytes
        model.a2_offload.add_swap(swapped_blocks(model, swap))
    return size
