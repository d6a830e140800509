"""Stand-In (WeChatCV/Stand-In): a reference image's tokens beside the video tokens in Wan's self-attention.

The reference (one frame: its VAE latent, posterior mean, normalised) goes through the model's own patch
embedding and its tokens are appended after the video tokens. They
- sit at RoPE position time -1, rows h.., columns w.. (h, w: the video's token grid): before the first frame,
  below and right of the video;
- are modulated with the time embedding of t = 0 (clean), pass every block's self-attention and FFN, skip the
  cross-attention (no text), and are dropped before the head;
- attend only to themselves, while video tokens attend to video + reference;
- have a LoRA (Stand-In's: rank 128, no scale) on their own q/k/v projections, not on the video tokens'.
Their keys and values depend on nothing that changes while sampling (not the timestep, the text or the video), so
a sampler computes them at its first step and reuses them (`forward(cache="fill")`, then `cache="use"`).

diffusers' WanTransformerBlock runs unchanged: reference tokens take a per-token time embedding (its 4-dim `temb`
path, made for TI2V), attn1 gets StandInAttnProcessor and attn2 VideoOnlyCrossAttnProcessor. The processors hold
the per-call state (`num_reference`, the kept K/V) that `forward` sets, as diffusers' block passes them nothing.

The reference image is Stand-In's 512x512 face crop (its Kind row's reference_size) whatever the video's size: 64x64
latents, 32x32 = 1024 tokens, as their model was trained. a2 frames the user's (or data.py's) face crop to it with
fit_pad_white (the face framing of a2/images.py reference_pixels: Lanczos fit, white pad), where Stand-In's
FaceProcessor pads its crop to a square with white, then resizes with cv2 INTER_AREA; the crop itself (insightface
antelopev2's largest face, a 1.5x square crop, BiSeNet parsing with the background painted white) is not an a2
dependency: give a2 the cropped face. The standin kind keeps the transformer's (hidden_states, timestep) interface:
the reference latent rides in hidden_states after x_t, flattened into whole latent frames of the video's size
(pack_reference), and the forward packed_forward installs reads it back (unpack_reference) from the reference's
latent grid, which prepare_model gives it.
"""

from __future__ import annotations

import re
from pathlib import Path

import torch
from diffusers.models.attention_dispatch import dispatch_attention_fn
from diffusers.models.embeddings import get_1d_rotary_pos_embed
from torch import nn

from a2.model.transformer import VideoOnlyCrossAttnProcessor, embed, rotate, unpatchify, weights_in

RANK = 128  # Stand-In's released LoRAs
ROPE_THETA = 10000.0  # Wan's (diffusers' WanRotaryPosEmbed default)
CACHE_MODES = (None, "fill", "use")
HUB_ID = "BowenXue/Stand-In"  # Stand-In_wan2.1_T2V_14B.ckpt, Stand-In_wan2.2_T2V_A14B_{high,low}.ckpt


class ReferenceLoRA(nn.Module):
    """Stand-In's low-rank delta up(down(x)), unscaled, computed in its own weights' dtype (Stand-In keeps them fp32
    beside a bf16 model). A plain module, not peft: peft's LoRA acts on every token of a projection."""

    def __init__(self, dim: int, rank: int = RANK):
        super().__init__()
        self.down = nn.Linear(dim, rank, bias=False)
        self.up = nn.Linear(rank, dim, bias=False)
        nn.init.normal_(self.down.weight, std=1 / rank)  # Stand-In's init: the delta starts at zero
        nn.init.zeros_(self.up.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.up(self.down(x.to(self.down.weight.dtype))).to(x.dtype)


class StandInAttnProcessor(nn.Module):
    """Self-attention (attn1) over video tokens followed by `num_reference` reference tokens: video queries attend
    to video + reference keys, reference queries to reference keys only; the reference LoRA adds to the reference
    tokens' q/k/v. With no reference tokens in the sequence and kept K/V (`kv`), video queries attend to video +
    kept reference keys. A module, so the LoRA's weights are the transformer's
    (`blocks.<i>.attn1.processor.<q|k|v>_lora.<down|up>.weight`)."""

    _attention_backend = None  # set by diffusers' set_attention_backend, as on its own processors
    _parallel_config = None
    lora_enabled = True  # off (enable_lora): the reference tokens as with a zero LoRA (infer.py's base rows)

    def __init__(self, dim: int, rank: int = RANK):
        super().__init__()
        self.q_lora, self.k_lora, self.v_lora = ReferenceLoRA(dim, rank), ReferenceLoRA(dim, rank), ReferenceLoRA(
            dim, rank)
        self.num_reference = 0
        self.keep = False
        self.kv: tuple[torch.Tensor, torch.Tensor] | None = None

    def qkv(self, attn, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, reference: bool):
        q, k, v = attn.to_q(x), attn.to_k(x), attn.to_v(x)
        if reference and self.lora_enabled:
            q, k, v = q + self.q_lora(x), k + self.k_lora(x), v + self.v_lora(x)
        q, k = attn.norm_q(q), attn.norm_k(k)
        q, k, v = (t.unflatten(2, (attn.heads, -1)) for t in (q, k, v))  # (B, L, heads, head_dim)
        return rotate(q, cos, sin), rotate(k, cos, sin), v

    @property
    def split_class(self):
        """Its form under context parallel (a2/model/parallel.py context_parallel)."""
        return UlyssesStandInAttnProcessor

    def attend(self, q, k, v):
        return dispatch_attention_fn(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False,
                                     backend=self._attention_backend)

    def __call__(self, attn, hidden_states, encoder_hidden_states=None, attention_mask=None, rotary_emb=None):
        n = self.num_reference
        length = hidden_states.shape[1] - n
        cos, sin = rotary_emb  # (1, length + n, 1, head_dim): video positions, then the reference's
        q, k, v = self.qkv(attn, hidden_states[:, :length], cos[:, :length], sin[:, :length], reference=False)
        reference_out = None
        if n:
            qr, kr, vr = self.qkv(attn, hidden_states[:, length:], cos[:, length:], sin[:, length:], reference=True)
            if self.keep:
                self.kv = (kr.detach(), vr.detach())
            reference_out = self.attend(qr, kr, vr)
        elif self.kv is not None:  # kept from a batch-1 call; CFG may run 2 (the same reference for both)
            kr, vr = (t.expand(q.shape[0], -1, -1, -1) for t in self.kv)
        if n or self.kv is not None:
            k, v = torch.cat([k, kr], 1), torch.cat([v, vr], 1)
        out = self.attend(q, k, v)  # (B, length, heads, head_dim)
        if reference_out is not None:
            out = torch.cat([out, reference_out], 1)
        out = out.flatten(2, 3).type_as(q)
        return attn.to_out[1](attn.to_out[0](out))


class UlyssesStandInAttnProcessor(StandInAttnProcessor):
    """Stand-In's self-attention under the split: the reference LoRA on the local tokens that are reference tokens
    (global index >= length - num_reference), then on the gathered sequence video queries attend to all keys and
    reference queries to the reference keys only (StandInAttnProcessor's rule)."""

    split = None  # a2/model/parallel.py SequenceSplit, set by context_parallel

    def __call__(self, attn, hidden_states, encoder_hidden_states=None, attention_mask=None, rotary_emb=None):
        if self.keep or self.kv is not None:
            raise ValueError("Stand-In's kept reference K/V are not split: sample with standin_cache off under "
                             "context parallel")
        s, n = self.split, self.num_reference
        video = s.length - n
        cut = min(max(video - s.start, 0), hidden_states.shape[1])  # local tokens before the first reference token
        cos, sin = rotary_emb
        parts = [self.qkv(attn, hidden_states[:, :cut], cos[:, :cut], sin[:, :cut], reference=False),
                 self.qkv(attn, hidden_states[:, cut:], cos[:, cut:], sin[:, cut:], reference=True)]
        q, k, v = (s.to_heads(torch.cat(t, 1)) for t in zip(*parts))  # (B, length, heads / N, head_dim)
        out = self.attend(q[:, :video], k, v)
        if n:
            out = torch.cat([out, self.attend(q[:, video:], k[:, video:], v[:, video:])], 1)
        out = s.to_tokens(out).flatten(2, 3).type_as(q)
        return attn.to_out[1](attn.to_out[0](out))


def install(transformer, rank: int = RANK, dtype: torch.dtype = torch.float32) -> None:
    """Stand-In's processors on every block; the reference LoRA in `dtype` (fp32 as Stand-In's) at its zero init."""
    dim = transformer.config.num_attention_heads * transformer.config.attention_head_dim
    device = transformer.patch_embedding.weight.device
    for block in transformer.blocks:
        block.attn1.set_processor(StandInAttnProcessor(dim, rank).to(device, dtype))
        block.attn2.set_processor(VideoOnlyCrossAttnProcessor())


def installed(transformer) -> bool:
    return all(isinstance(b.attn1.processor, StandInAttnProcessor) for b in transformer.blocks)


def prepare(transformer, reference_grid: tuple[int, int], rank: int | None = None) -> None:
    """The standin kind's transformer, training and sampling alike: Stand-In's processors (reference LoRA at `rank`,
    Stand-In's 128 by default; kept when already there, e.g. loaded from a Stand-In file) and the forward that reads
    the packed reference of this reference_grid (packed_forward)."""
    if not installed(transformer):
        install(transformer, rank or RANK)
    packed_forward(transformer, reference_grid)


def weights(transformer) -> list:
    """Stand-In's reference-only LoRA (its q/k/v on the reference tokens), which a LoRA run trains instead of a peft
    adapter."""
    return [p for n, p in transformer.named_parameters() if ".attn1.processor." in n]


def reference_rotary(rope, video_grid: tuple[int, int, int], reference_grid: tuple[int, int, int]):
    """(cos, sin), each (1, Lr, 1, head_dim), of the reference tokens at Stand-In's positions: time -1, rows
    h .. h+hr-1, columns w .. w+wr-1 for a video of (f, h, w) tokens; the frequencies of diffusers' WanRotaryPosEmbed
    (`rope`), at those positions."""
    _, h, w = video_grid
    fr, hr, wr = reference_grid
    device = rope.freqs_cos.device
    positions = (torch.full((fr,), -1, device=device), torch.arange(h, h + hr, device=device),
                 torch.arange(w, w + wr, device=device))
    cos, sin = [], []
    for i, (dim, pos) in enumerate(zip((rope.t_dim, rope.h_dim, rope.w_dim), positions)):
        c, s = get_1d_rotary_pos_embed(dim, pos, ROPE_THETA, use_real=True, repeat_interleave_real=True,
                                       freqs_dtype=torch.float64)
        shape = [1, 1, 1, dim]
        shape[i] = -1
        cos.append(c.view(shape).expand(fr, hr, wr, dim))
        sin.append(s.view(shape).expand(fr, hr, wr, dim))
    return tuple(torch.cat(t, -1).reshape(1, fr * hr * wr, 1, -1) for t in (cos, sin))


def clear_cache(transformer) -> None:
    for block in transformer.blocks:
        block.attn1.processor.kv = None


def enable_lora(transformer, on: bool) -> None:
    """Switch the reference LoRA on or off (as peft's enable_lora / disable_lora for an ordinary one): off, the
    reference tokens go through the base weights alone, as without the file (its zero init). The kept K/V are
    forgotten, as they were made with the other setting and no parameter changed."""
    for block in transformer.blocks:
        block.attn1.processor.lora_enabled = on
        block.attn1.processor.kv = None
    transformer.standin_kept = None


def forward(transformer, hidden_states: torch.Tensor, timestep: torch.Tensor, encoder_hidden_states: torch.Tensor,
            encoder_hidden_states_image: torch.Tensor | None = None, reference_latents: torch.Tensor | None = None,
            cache: str | None = None) -> torch.Tensor:
    """diffusers' WanTransformer3DModel.forward with Stand-In's reference tokens; returns the video prediction.

    reference_latents: (B, C, 1, hr, wr), the reference's latent (None: no reference, or the kept one with
    cache="use"). cache: None (nothing kept: each call computes the reference), "fill" (compute it and keep each
    layer's reference K/V), "use" (no reference tokens; each layer's kept K/V)."""
    if cache not in CACHE_MODES:
        raise ValueError(f"Stand-In cache {cache!r}: choose one of {CACHE_MODES}")
    if not installed(transformer):
        raise ValueError("the transformer has no Stand-In processors: call a2.kinds.standin.install (or load_lora) "
                         "first")
    blocks = transformer.blocks
    if cache == "fill" and reference_latents is None:
        raise ValueError("Stand-In cache='fill' needs reference_latents (the reference whose K/V it keeps)")
    if cache == "use" and (reference_latents is not None or any(b.attn1.processor.kv is None for b in blocks)):
        raise ValueError("Stand-In cache='use' takes no reference_latents and needs the K/V of a cache='fill' call")
    x, rotary, temb, proj, text, grid = embed(transformer, hidden_states, timestep, encoder_hidden_states,
                                              encoder_hidden_states_image)  # proj (B, 6, D)
    length = x.shape[1]
    n = 0
    if reference_latents is not None:
        if reference_latents.shape[1] != hidden_states.shape[1] or reference_latents.shape[2] != 1:
            raise ValueError(f"Stand-In reference latents {tuple(reference_latents.shape)}: one frame of "
                             f"{hidden_states.shape[1]} channels (this model's patch embedding input) expected")
        r = transformer.patch_embedding(reference_latents)
        reference_grid = tuple(r.shape[2:])
        r = r.flatten(2).transpose(1, 2)
        n = r.shape[1]
        # the clean time embedding of the reference: t = 0 (only the time path of the embedder is needed)
        _, proj_ref, _, _ = transformer.condition_embedder(torch.zeros_like(timestep),
                                                           encoder_hidden_states[:, :0])
        proj_ref = proj_ref.unflatten(1, (6, -1))
        x = torch.cat([x, r], 1)
        proj = torch.cat([proj[:, None].expand(-1, length, -1, -1), proj_ref[:, None].expand(-1, n, -1, -1)], 1)
        rotary = tuple(torch.cat([a, b.to(a.dtype)], 1)
                       for a, b in zip(rotary, reference_rotary(transformer.rope, grid, reference_grid)))
    for block in blocks:
        block.attn1.processor.num_reference = block.attn2.processor.num_reference = n
        block.attn1.processor.keep = cache == "fill"
        if cache is None:
            block.attn1.processor.kv = None
    for block in blocks:  # recomputed and compiled as configure_blocks set each block's forward
        x = block(x, text, proj, rotary)
    if getattr(transformer, "context_parallel", None) is None:  # else each rank holds part of the sequence
        x = x[:, :length]  # the reference tokens have no output
    return unpatchify(transformer, x, temb, grid, length)  # a split is gathered before `length` cuts it


def pack_reference(x: torch.Tensor, reference: torch.Tensor) -> torch.Tensor:
    """cat([x, packed reference], dim=2): the reference latent (B, C, 1, hr, wr), of any size, flattened row-major
    into k = ceil(hr·wr / (h·w)) latent frames of x's (B, C, T, h, w) grid, zero padded (unpack_reference)."""
    b, c, _, h, w = x.shape
    n = reference.shape[3] * reference.shape[4]
    k = -(-n // (h * w))
    flat = torch.nn.functional.pad(reference.flatten(2), (0, k * h * w - n))  # (B, C, k·h·w)
    return torch.cat([x, flat.view(b, c, k, h, w).to(x.dtype)], dim=2)


def unpack_reference(hidden_states: torch.Tensor, reference_grid: tuple[int, int]):
    """pack_reference's inverse: (x (B, C, T, h, w), reference (B, C, 1, hr, wr)) for reference_grid (hr, wr)."""
    b, c, _, h, w = hidden_states.shape
    hr, wr = reference_grid
    k = -(-hr * wr // (h * w))
    if hidden_states.shape[2] <= k:
        raise ValueError(f"Stand-In input {tuple(hidden_states.shape)}: no video frames before the {k} frames of a "
                         f"{hr}x{wr} reference latent")
    packed = hidden_states[:, :, -k:].flatten(2)[:, :, :hr * wr]  # (B, C, hr·wr)
    return hidden_states[:, :, :-k], packed.unflatten(2, (1, hr, wr))


def packed_forward(transformer, reference_grid: tuple[int, int]) -> None:
    """Make `transformer(hidden_states=pack_reference(x_t, reference latent), ...)` Stand-In's forward (a2/
    conditioning.py's standin kind packs the reference after x_t; reference_grid: its latent (hr, wr)): returns the
    video's prediction. Without gradients (sampling) the reference K/V are kept and reused while the reference and
    every weight are unchanged (torch.equal on the reference, the parameters' in-place versions), so a sampler's later
    passes, CFG's included, skip the reference tokens as Stand-In's loop does; `transformer.standin_cache = False`
    recomputes them always."""
    from diffusers.models.modeling_outputs import Transformer2DModelOutput

    transformer.standin_reference_grid = tuple(reference_grid)
    if "forward" in vars(transformer):  # already Stand-In's (its cache switch as it was set)
        return
    transformer.standin_cache = True
    transformer.standin_kept = None  # (reference, parameter versions) of the kept K/V

    def stand_in(hidden_states, timestep, encoder_hidden_states, encoder_hidden_states_image=None,
                 return_dict=True, attention_kwargs=None):
        x, reference = unpack_reference(hidden_states, transformer.standin_reference_grid)
        cache = None
        if transformer.standin_cache and not torch.is_grad_enabled() and reference.shape[0] == 1:
            versions = tuple(p._version for p in transformer.parameters())
            kept = transformer.standin_kept
            if kept is not None and kept[1] == versions and torch.equal(kept[0], reference):
                cache, reference = "use", None
            else:
                cache, transformer.standin_kept = "fill", (reference.clone(), versions)
        else:
            transformer.standin_kept = None
        out = forward(transformer, x, timestep, encoder_hidden_states, encoder_hidden_states_image, reference, cache)
        return Transformer2DModelOutput(sample=out) if return_dict else (out,)

    transformer.forward = stand_in


# ---------------------------------------------------------------- Stand-In's LoRA file

# Stand-In's keys (models/set_condition_branch.py: blocks.<i>.self_attn.<q|k|v>_loras.<down|up>.weight) and a2's
THEIR_FORMAT, A2_FORMAT = "blocks.{}.self_attn.{}_loras.{}.weight", "blocks.{}.attn1.processor.{}_lora.{}.weight"
THEIR_KEY = re.compile(r"blocks\.(\d+)\.self_attn\.([qkv])_loras\.(down|up)\.weight")
A2_KEY = re.compile(r"blocks\.(\d+)\.attn1\.processor\.([qkv])_lora\.(down|up)\.weight")
BASES = ("Stand-In_wan2.1_T2V_14B.ckpt on Wan2.1-T2V-14B; Stand-In_wan2.2_T2V_A14B_high/_low.ckpt on "
         "Wan2.2-T2V-A14B's high-/low-noise expert")


def read_lora(path, shapes_only: bool = False) -> dict[str, torch.Tensor]:
    """A Stand-In LoRA file (.ckpt as released: a torch pickle, maybe under "state_dict"; or .safetensors), tensors
    only (weights_only: a pickle cannot run code here)."""
    try:
        return weights_in(Path(path), shapes_only)
    except Exception as e:  # missing, truncated, or a pickle holding more than tensors
        raise ValueError(f"{path}: not a readable Stand-In LoRA ({type(e).__name__}: {e})") from e


def load_lora(transformer, path) -> int:
    """Stand-In's LoRA file onto a2's modules (installing the processors at the file's rank); returns the rank.
    One-line errors name the file: a key that is not Stand-In's, a missing one, or shapes of another base."""
    path = Path(path)
    state = read_lora(path)
    bad = next((k for k in state if not THEIR_KEY.fullmatch(k)), None)
    if bad is not None or not state:
        raise ValueError(f"{path}: {bad!r} is not a Stand-In LoRA key (blocks.<i>.self_attn.<q|k|v>_loras."
                         f"<down|up>.weight): not a Stand-In LoRA file" if bad else f"{path}: empty Stand-In LoRA")
    layers = 1 + max(int(THEIR_KEY.fullmatch(k).group(1)) for k in state)
    first = next(k for k in state if k.endswith("down.weight"))
    rank, dim = state[first].shape
    for key, t in state.items():
        if t.shape != ((rank, dim) if key.endswith("down.weight") else (dim, rank)):
            raise ValueError(f"{path}: {key} is {tuple(t.shape)} where {first} is {(rank, dim)}: a damaged Stand-In "
                             "LoRA (download it again)")
    n = len(transformer.blocks)
    width = transformer.config.num_attention_heads * transformer.config.attention_head_dim
    if transformer.config.in_channels != 16 or transformer.config.image_dim is not None:
        raise ValueError(f"{path}: a Stand-In LoRA on a model of {transformer.config.in_channels} input channels"
                         f"{' with an image branch' if transformer.config.image_dim else ''} (I2V / E2V): Stand-In "
                         f"is a LoRA on Wan T2V; load it on its base ({BASES})")
    if (layers, dim) != (n, width):
        raise ValueError(f"{path}: a Stand-In LoRA for a {layers}-layer, {dim}-wide Wan on this {n}-layer, "
                         f"{width}-wide model: load it on its base ({BASES})")
    missing = next((k for k in (THEIR_FORMAT.format(i, p, part) for i in range(n) for p in "qkv"
                                for part in ("down", "up")) if k not in state), None)  # (no other key: checked above)
    if missing:
        raise ValueError(f"{path}: no {missing}: an incomplete Stand-In LoRA")
    mapped = {A2_FORMAT.format(*THEIR_KEY.fullmatch(k).groups()): v for k, v in state.items()}
    if not installed(transformer) or transformer.blocks[0].attn1.processor.q_lora.down.out_features != rank:
        install(transformer, rank)
    transformer.load_state_dict(mapped, strict=False)
    enable_lora(transformer, True)
    return rank


def export_lora(run_dir: Path, transformer, tag: str = "", metadata: dict[str, str] | None = None) -> Path:
    """The trained reference LoRA as a Stand-In file, run_dir/standin_lora<tag>.ckpt (a Wan 2.2 expert's tag starts
    _high | _low, as Stand-In names its pair): their keys under "state_dict", a torch pickle as their
    set_condition_branch loads it (load_lora and infer.py --lora, --lora-high / --lora-low read it back)."""
    path = Path(run_dir) / f"standin_lora{tag}.ckpt"
    # "a2_metadata": what it was trained on (a2.train.lora.base_metadata); their loader reads "state_dict" alone
    torch.save({"state_dict": {k: v.cpu() for k, v in lora_state_dict(transformer).items()},
                "a2_metadata": dict(metadata or {})}, path)
    return path


def is_lora_file(path) -> bool:
    """A Stand-In LoRA file (its keys), not an ordinary (peft / diffusers / Wan) LoRA."""
    path = Path(path)
    if not path.is_file() or path.suffix not in (".ckpt", ".pt", ".pth", ".safetensors"):
        return False
    return any(THEIR_KEY.fullmatch(k) for k in read_lora(path, shapes_only=True))


def lora_state_dict(transformer) -> dict[str, torch.Tensor]:
    """The reference LoRA in Stand-In's key format (what its set_condition_branch loads)."""
    return {THEIR_FORMAT.format(*m.groups()): value.detach().clone()
            for key, value in transformer.state_dict().items() if (m := A2_KEY.fullmatch(key))}
