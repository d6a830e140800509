"""Context parallel (Ulysses): one sample's tokens split across the ranks of a CP group.

The sequence (video tokens and the in-sequence reference tokens: Phantom's / SkyReels-V3's frames on the time axis,
Stand-In's reference tokens after the video) is split across the group at the first block's input and gathered at
the output projection. Everything per token (norms, modulation, FFN, the q/k/v projections, Wan's RMSNorm across
heads, RoPE) runs on the local tokens; self-attention exchanges the split (all-to-all) so that each rank attends the
whole sequence for 1/N of the heads, then exchanges back. Cross-attention stays local against the whole text (and
CLIP) context, which every rank holds.

diffusers 0.42 ships this for WanTransformer3DModel (ContextParallelConfig, enable_parallelism, the model's
_cp_plan); a2 uses its pieces (the all-to-all with its backward, SeqAllToAllDim; the attention dispatch) and writes
what it lacks:
- a token count that does not divide by N: diffusers' even split asserts, and its "anything" variant has no backward.
  Here the sequence is padded to a multiple of N and the padding is cut off before attention, so it is never a key.
- Stand-In: its forward concatenates the reference's RoPE after the model's rope call (diffusers splits the rope
  output) and its attention restricts the reference queries to the reference keys; here the split is at the first
  block's inputs (hidden states, per-token modulation, RoPE) and the restriction runs on the gathered sequence.
- the CPU: diffusers builds its device as `rank % torch.accelerator.device_count()` (0 devices on a CPU host); here
  the mesh comes from the run (gloo on the CPU, NCCL on GPUs).

Gradients: every rank of a group computes the same loss on the gathered output; each parameter's gradient on a rank
holds its local tokens' part, and the group's sum is the one-process gradient. DDP and FSDP2 average over all ranks
(data-parallel x CP), so the loss a rank backpropagates is multiplied by the CP size (grad_scale).

Also here: the process group of a run, and FSDP2 (train_a2.py --fsdp). fully_shard wraps each block, then the root; a
rank keeps 1/N of every weight, frozen or trained, and gathers a block's in the compute dtype when it runs it. Full
fine-tuning shards the gradients and AdamW's moments with it; a LoRA's frozen base is sharded the same way, its
adapter trains as DTensor shards (reduce-scattered gradients), and its checkpoints and export hold the adapter alone.
Only rank 0 reads the weights: the other ranks build the model on the meta device and receive their shards.
"""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from diffusers.models.attention_dispatch import SeqAllToAllDim, dispatch_attention_fn
from diffusers.models.transformers.transformer_wan import WanAttnProcessor, _get_qkv_projections
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, set_model_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

from a2.cli import ConfigError
from a2.model.transformer import rotate, transformer_class


@dataclass
class SequenceSplit:
    """The split of the current forward's sequence over a CP group; `length` (tokens, reference tokens included) is
    set by the first block's input hook each forward and read by the attention processors. group None: one rank of
    a group of `size`, emulated in one process (the dry run, a2/train/trace.py): the exchanges make tensors of the
    shapes and dtypes the collectives make (their memory), from this rank's data alone."""

    group: dist.ProcessGroup | None
    size: int
    rank: int
    length: int = 0

    @property
    def chunk(self) -> int:
        """Tokens per rank: ceil(length / size) (the last ranks hold the padding)."""
        return -(-self.length // self.size)

    @property
    def padded(self) -> int:
        return self.chunk * self.size

    @property
    def start(self) -> int:
        """Global index of this rank's first token."""
        return self.rank * self.chunk

    def shard(self, x: torch.Tensor, dim: int = 1) -> torch.Tensor:
        """This rank's part of x along dim (its length `length`; the last ranks' zero padded), a tensor of its own:
        a view would keep the whole sequence alive as long as the blocks keep their inputs."""
        n = max(0, min(self.chunk, x.shape[dim] - self.start))
        part = x.narrow(dim, min(self.start, x.shape[dim]), n)
        return F.pad(part, [0, 0] * (x.dim() - 1 - dim) + [0, self.chunk - n]) if n < self.chunk else part.clone()

    def gather(self, x: torch.Tensor, dim: int = 1) -> torch.Tensor:
        """The whole sequence from every rank's part, the padding cut off."""
        if self.group is None:
            return torch.cat([x] * self.size, dim).narrow(dim, 0, self.length)
        return _Gather.apply(x.contiguous(), dim, self.group, self.rank).narrow(dim, 0, self.length)

    def to_heads(self, x: torch.Tensor) -> torch.Tensor:
        """(B, chunk, heads, D) local tokens -> (B, length, heads / size, D): the whole sequence, this rank's heads."""
        if self.group is None:
            return x[:, :, :x.shape[2] // self.size].repeat(1, self.size, 1, 1)[:, :self.length]
        return SeqAllToAllDim.apply(self.group, x.contiguous(), 2, 1)[:, :self.length]

    def to_tokens(self, x: torch.Tensor) -> torch.Tensor:
        """to_heads' inverse: (B, length, heads / size, D) -> (B, chunk, heads, D)."""
        x = F.pad(x, (0, 0, 0, 0, 0, self.padded - x.shape[1]))
        if self.group is None:
            b, _, h, d = x.shape
            return x.reshape(b, self.size, self.chunk, h, d).transpose(1, 2).reshape(b, self.chunk, h * self.size, d)
        return SeqAllToAllDim.apply(self.group, x.contiguous(), 1, 2)


class _Gather(torch.autograd.Function):
    """All-gather along dim; backward keeps this rank's part of the gradient: every rank computes the same loss from
    the gathered tensor, so the gradients arriving here are equal on all ranks (diffusers' AllGatherFunction does
    the same; a2 gathers with dist.all_gather, which gloo runs)."""

    @staticmethod
    def forward(ctx, x, dim, group, rank):
        ctx.dim, ctx.rank, ctx.chunk = dim, rank, x.shape[dim]
        parts = [torch.empty_like(x) for _ in range(dist.get_world_size(group))]
        dist.all_gather(parts, x, group=group)
        return torch.cat(parts, dim)

    @staticmethod
    def backward(ctx, grad):
        return grad.narrow(ctx.dim, ctx.rank * ctx.chunk, ctx.chunk), None, None, None


class UlyssesAttnProcessor(WanAttnProcessor):
    """Wan's self-attention (attn1) on this rank's tokens: the arithmetic of diffusers' WanAttnProcessor (q/k/v,
    RMSNorm across all heads, RoPE on the local tokens), attention over the whole sequence for this rank's heads."""

    split: SequenceSplit

    def __call__(self, attn, hidden_states, encoder_hidden_states=None, attention_mask=None, rotary_emb=None):
        if encoder_hidden_states is not None or attention_mask is not None:
            raise ValueError("context parallel runs self-attention (attn1) only, without a mask")
        q, k, v = _get_qkv_projections(attn, hidden_states, None)
        q, k = attn.norm_q(q), attn.norm_k(k)
        q, k, v = (t.unflatten(2, (attn.heads, -1)) for t in (q, k, v))  # (B, chunk, heads, head_dim)
        cos, sin = rotary_emb
        q, k = rotate(q, cos, sin), rotate(k, cos, sin)
        q, k, v = (self.split.to_heads(t) for t in (q, k, v))  # (B, length, heads / N, head_dim)
        out = dispatch_attention_fn(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False,
                                    backend=self._attention_backend)
        out = self.split.to_tokens(out).flatten(2, 3).type_as(q)  # (B, chunk, dim)
        return attn.to_out[1](attn.to_out[0](out))


def _split_timestep(split: SequenceSplit):
    """A per-token timestep (B, length) (TI2V-5B, in-context references at timestep 0) is split before the time
    embedding, as diffusers' plan does: the modulation and the output's shift/scale are then the local tokens'."""
    def hook(model, args, kwargs):
        args = list(args)
        t = args[1] if len(args) > 1 else kwargs.get("timestep")
        if t is not None and t.dim() == 2:
            split.length = t.shape[1]
            if len(args) > 1:
                args[1] = split.shard(t)  # (B, chunk)
            else:
                kwargs["timestep"] = split.shard(t)
        return tuple(args), kwargs
    return hook


def _split_inputs(split: SequenceSplit, first: bool):
    """The first block splits the hidden states; every block takes its part of the per-token inputs the model
    passes to all blocks whole (RoPE, Stand-In's per-token modulation)."""
    def hook(block, args, kwargs):
        names = ("hidden_states", "encoder_hidden_states", "temb", "rotary_emb")
        values = dict(zip(names, args), **kwargs)
        x, temb, (cos, sin) = values["hidden_states"], values["temb"], values["rotary_emb"]
        if first:
            split.length = x.shape[1]
            values["hidden_states"] = split.shard(x)  # (B, chunk, D)
        if temb.dim() == 4 and temb.shape[1] == split.length:  # per-token modulation of the whole sequence
            # (Stand-In's reference rows): (B, length, 6, D); a split per-token timestep made it local already
            values["temb"] = split.shard(temb)
        if cos.shape[1] == split.length:
            values["rotary_emb"] = (split.shard(cos), split.shard(sin))  # (1, chunk, 1, head_dim)
        # the hidden states stay positional: non-reentrant checkpointing saves positional inputs through the
        # saved-tensor hooks (activation offload moves them to host memory, a2/memory/offload.py), keyword inputs not
        return (values.pop("hidden_states"),), values
    return hook


def context_parallel(transformer, group: dist.ProcessGroup | None, size: int | None = None) -> SequenceSplit:
    """Split `transformer`'s sequence over `group` (its ranks run the same sample): hooks on the first block's inputs
    and the output projection, and Ulysses processors on every attention (Stand-In's too: call after standin.install
    and before configuring recomputation or compilation, which wrap the blocks' forward, not their hooks).
    group None: one rank of `size`, emulated (SequenceSplit). Returns the split (its `length` is the last
    forward's)."""
    size = dist.get_world_size(group) if group is not None else size
    heads = transformer.config.num_attention_heads
    if heads % size:
        raise ConfigError(f"--context-parallel {size}: the model's {heads} attention heads do not divide by it "
                         "(Ulysses gives each rank heads / N)")
    split = SequenceSplit(group, size, dist.get_rank(group) if group is not None else 0)
    if hasattr(transformer, "standin_cache"):  # Stand-In's kept reference K/V would be one rank's part
        transformer.standin_cache = False
    for block in transformer.blocks:
        for attn in (block.attn1, block.attn2):
            p = attn.processor
            if hasattr(p, "split_class"):  # a kind's own processor (Stand-In's) names its split form
                p.__class__ = p.split_class  # the same module and LoRA weights, split attention
            elif attn is block.attn1:
                backend = p._attention_backend
                p = UlyssesAttnProcessor()
                p._attention_backend = backend
                attn.set_processor(p)
            else:
                continue  # cross-attention: local rows against the whole context
            p.split = split
    transformer.register_forward_pre_hook(_split_timestep(split), with_kwargs=True)
    for i, block in enumerate(transformer.blocks):
        block.register_forward_pre_hook(_split_inputs(split, i == 0), with_kwargs=True)
    transformer.proj_out.register_forward_hook(lambda module, args, out: split.gather(out))
    transformer.context_parallel = split
    return split


def grad_scale(transformer) -> int:
    """What a rank's loss is multiplied by before backward: the CP size (DDP's / FSDP2's average over all ranks
    counts each CP group's partial gradients as separate samples), 1 without context parallel."""
    split = getattr(transformer, "context_parallel", None)
    return split.size if split else 1


def data_parallel(world: int, rank: int, cp: int, device_type: str) -> tuple[int, int, dist.ProcessGroup | None]:
    """(data-parallel rank, data-parallel world, this rank's CP group or None) of a run with `cp` ranks per sample.
    The mesh ("dp", "cp"): rank = dp_rank * cp + cp_rank, so a CP group is consecutive ranks (one node, where the
    all-to-all is fast). DDP and FSDP2 keep the whole world (FSDP2 shards over the flattened dp x cp ranks, as
    torchtitan)."""
    if cp < 1 or world % cp:
        raise ConfigError(f"--context-parallel {cp}: torchrun's world size {world} must be a multiple of it")
    if cp == 1:
        return rank, world, None
    mesh = init_device_mesh(device_type, (world // cp, cp), mesh_dim_names=("dp", "cp"))
    return rank // cp, world // cp, mesh["cp"].get_group()


def step_costs(config: dict, tokens: int, context: int, cp: int) -> dict:
    """Per rank of a CP group of `cp`, one sample of `tokens` sequence tokens against `context` text + image tokens:
    its tokens (padded split), the forward's attention-core FLOPs (self: the whole sequence for heads / cp; cross:
    its tokens against the context) and the all-to-all bytes per block (bf16): q, k, v and the output in the
    forward, their gradients in the backward, each rank sending (cp - 1) / cp of its chunk x model dim."""
    d = config["num_attention_heads"] * config["attention_head_dim"]
    chunk = -(-tokens // cp)
    per = 2.0 * chunk * d * (cp - 1) / cp  # bytes one exchange of one tensor sends from a rank
    return dict(tokens=chunk, self_core=4.0 * tokens * tokens * d / cp * config["num_layers"],
                cross_core=4.0 * chunk * context * d * config["num_layers"],
                all_to_all_forward=4 * per, all_to_all_backward=4 * per)


def sampling_group(device: str) -> int:
    """infer.py under torchrun (WORLD_SIZE > 1): the process group every rank samples in, one sample split over
    all of them (NCCL on GPUs, each rank on its LOCAL_RANK GPU; gloo on the CPU). Returns this rank (0: the one
    that writes); 0 without torchrun."""
    if int(os.environ.get("WORLD_SIZE", 1)) == 1:
        return 0
    cuda = device.startswith("cuda")
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))  # "cuda" is then this rank's GPU
    dist.init_process_group("nccl" if cuda else "gloo")
    return dist.get_rank()


def setup_distributed(device: str, fsdp: bool):
    """(world, rank, local_rank, device, ctrl) of a training run: the process group (NCCL on CUDA, gloo on the CPU;
    a one-rank group for --fsdp in one process) and ctrl, the CPU group the stop flag is agreed through each step, so
    that it never waits for the GPU. device: auto | cuda | cpu."""
    world = int(os.environ.get("WORLD_SIZE", 1))
    rank, local_rank = int(os.environ.get("RANK", 0)), int(os.environ.get("LOCAL_RANK", 0))
    use_cuda = device == "cuda" or device == "auto" and torch.cuda.is_available()
    if use_cuda and not torch.cuda.is_available():
        raise ConfigError("--device cuda: PyTorch sees no CUDA GPU here (--device cpu, or auto)")
    where = torch.device("cuda", local_rank) if use_cuda else torch.device("cpu")
    if world > 1:
        dist.init_process_group("nccl" if use_cuda else "gloo")
    elif fsdp:  # one process: FSDP still needs a (one-rank) process group
        dist.init_process_group("nccl" if use_cuda else "gloo", store=dist.HashStore(), rank=0, world_size=1)
    ctrl = dist.new_group(backend="gloo") if world > 1 and use_cuda else None
    if use_cuda:
        torch.cuda.set_device(where)
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
    return world, rank, local_rank, where, ctrl


def meta_replica(transformer, prepare):
    """--fsdp: the same architecture on the meta device on every rank, from rank 0's loaded transformer (the other
    ranks pass None and read no weights: host RAM holds one full copy, not one per rank: 14B = 57 GB in fp32), made
    trainable by prepare(model) as rank 0's was (its LoRA, the kind's modules). Returns (meta model, what
    shard_from_rank0 broadcasts: rank 0's weights and buffers, None elsewhere)."""
    rank0 = dist.get_rank() == 0
    config = [dict(transformer.config) if rank0 else None]
    dist.broadcast_object_list(config, src=0)
    with torch.device("meta"):
        replica = transformer_class(config[0]).from_config(config[0])  # VACE's: its context blocks too
    prepare(replica)
    source = None
    if rank0:  # the state dict (persistent) and the buffers it omits (RoPE tables), both rank 0's tensors
        source = transformer.state_dict(), dict(transformer.named_buffers())
    return replica, source


def shard(model, mesh, param_dtype: torch.dtype) -> None:
    """FSDP2 over `mesh`: each block, then the root (embeddings, head; `model` becomes the sharded module itself);
    compute in param_dtype, gradients reduced in fp32, each block's gather prefetching the next block's (two blocks
    gathered at a time, what a2/memory/memory.py plans, CUDA streams or not). Inputs are not cast
    (cast_forward_inputs=False): bf16 autocast does the casting as under DDP, and the timestep and RoPE tables, which
    FSDP would cast to bf16 (a timestep of 937.5 becomes 936), stay fp32 as under DDP."""
    mp = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32, cast_forward_inputs=False)
    blocks = [*model.blocks, *getattr(model, "vace_blocks", ())]  # VACE's context blocks are blocks too
    for block in blocks:
        fully_shard(block, mesh=mesh, mp_policy=mp)
    fully_shard(model, mesh=mesh, mp_policy=mp)
    for i, block in enumerate(blocks):  # each block gathers the next one's weights: two at a time, as planned
        block.set_modules_to_forward_prefetch(blocks[i + 1:i + 2])
        block.set_modules_to_backward_prefetch(blocks[max(0, i - 1):i])


def shard_from_rank0(model, source, device, param_dtype: torch.dtype) -> None:
    """FSDP2: shard meta_replica's model, materialise it on `device` and fill it from rank 0's `source`: each weight
    is broadcast once and every rank keeps its own shard; unsharded buffers are copied whole."""
    shard(model, init_device_mesh(device.type, (dist.get_world_size(),)), param_dtype)
    model.to_empty(device=device)
    rank0 = dist.get_rank() == 0
    set_model_state_dict(model, source[0] if rank0 else {},
                         options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True))
    with torch.no_grad():
        for name, buf in model.named_buffers():  # to_empty left them uninitialised (not in a state dict)
            if rank0:
                buf.copy_(source[1][name])
            dist.broadcast(buf, src=0)


def gathered(model, prepare, lora: bool):
    """--fsdp at export: on rank 0 a plain (unsharded) model holding the trained weights gathered to its host, on the
    other ranks None (a collective: every rank calls it). A LoRA gathers its adapter alone (and what else trains),
    into a meta-device shell made trainable by prepare(model) as the run's was; full fine-tuning every weight."""
    state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True,
                                                                 ignore_frozen_params=lora))
    if dist.get_rank() != 0:
        return None
    with torch.device("meta"):
        shell = transformer_class(model.config).from_config(model.config)
    prepare(shell)
    shell.load_state_dict(state, assign=True, strict=not lora)
    return shell


@contextlib.contextmanager
def emulated_ranks(ranks: int):
    """A dry run's process group of `ranks` in this one process (torch's fake backend: collectives return tensors
    of the right shapes, nothing is sent) and its device mesh, so that FSDP2 shards a model as on `ranks` GPUs and
    one rank's step is traced (a2/train/trace.py). Yields the mesh; the group is destroyed after."""
    from torch.testing._internal.distributed.fake_pg import FakeStore  # (registers the "fake" backend)

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=ranks)
    try:
        yield init_device_mesh("cpu", (ranks,))
    finally:
        dist.destroy_process_group()
