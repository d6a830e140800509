"""Every conditioning layout of a2 in one place. Training (train_a2.py) and sampling (A2Pipeline) build the
transformer's input with these functions and nothing else decides how a model family is conditioned.

A run's layout has one `kind` (its row of data: a2/kinds/kinds.py, KIND_DEFS):

  t2v        text only: hidden_states = x_t.
  prefix     SkyReels-A2: the element references are the first L_ref latent frames, marked by a mask, on the
             channel axis of a 36-channel model (A2, Wan I2V, an expanded T2V base):
             hidden_states = cat([x_t, mask (4) | condition latents (16)], dim=1), x0 = cat([references, VAE(clip)]).
  inplace    Wan I2V / FLF2V frame conditioning: frames of the clip itself (first, first_and_last, index, prefix,
             random) as mask | condition on the channel axis, x0 = VAE(clip).
  incontext  Phantom-Wan / SkyReels-V3 R2V style on a model that takes the latents alone (Wan T2V, TI2V-5B): the
             clean element latents appended after x_t on the time axis; loss and sampler see the video latents only.
  clean      Wan 2.2 TI2V-5B image-to-video: the clean latents of the clip's leading 4k+1 frames replace x_t's first
             latent frames, their tokens at timestep 0; the loss leaves them out.
  phantom    Phantom-Wan as released (its weights, ModelInfo.native_kind): each reference its own 1-frame clip, its
             posterior mean, appended after x_t on the time axis at the sample's timestep; the sampler's noise is
             drawn for T + L_ref frames (initial_latents) and the reference slots are the references in every input.
  v3         SkyReels-V3 R2V as released: the references' posterior samples (drawn after the noise, from its
             generator) zero-padded to exactly 4 slots, cat([x_t, slots], dim=2), one timestep for all tokens.
  magref     MAGREF (Wan 2.1 I2V): every element image as read (aspect kept, no element preprocess) pasted on one
             white canvas of the video's size by MAGREF's rule (reference_pixels, at load time), the canvas the I2V
             first frame on the channel axis: mask (4) = the region mask (where the images' pixels are) on latent
             frame 0, condition = VAE(canvas, zeros); CLIP tokens of the squashed canvas; x0 = VAE(cat([canvas,
             clip])), so latent frame 0 holds the canvas (the sampler's first 4 frames are dropped, as MAGREF's).
  kaleido    Kaleido as released (its SAT weights: a2/kaleido.py): each reference alone as a 1-frame clip, its posterior
             mean, cat([references, x_t], dim=2) at the sample's timestep, reference i at RoPE (i, 80 + y, 80 + x)
             (kaleido.prepare, through prepare_model); the prediction's first L_ref frames dropped.
  standin    Stand-In (Wan T2V + its reference LoRA): one element, framed as Stand-In's 512x512 face crop whatever
             the video's size (layout.reference_size, the face framing of a2/images.py reference_pixels), its clean
             latent (64x64) packed after x_t on the time axis, in whole latent frames of the video's grid (standin.py:
             pack_reference); a2/kinds/standin.py's forward (prepare_model installs it, with layout.reference_grid to
             unpack it) takes it as 32x32 reference tokens at RoPE time -1 past the video grid, t = 0, attending only
             to themselves, with the reference-only LoRA, and returns the video's prediction; when sampling their K/V
             are computed once and reused.
  vace       Wan VACE as released (its weights: Wan2.1-VACE, Wan2.2-VACE-Fun): each reference alone as a 1-frame clip,
             framed by VACE's own arithmetic, its posterior mean; the N reference latents before the clip's T frames
             (on top of --num-frames), in the noised sequence (x0 = cat([references, VAE(clip)])) and in VACE's
             context (a2/kinds/vace.py: encode; a control video or masked clip with its mask, or R2V's zeros), which
             rides beside x_t on the channel axis for the forward prepare_model installs (the context blocks' hints at
             the layout's context_scale); guidance keeps it in both branches; the sampler drops the references.

The pieces, each branching on the kind inside this file (as DiT's training_losses branches on its enums):

  make_layout          -> Layout: frames, latents and tokens of a kind; which kind a model takes from which flags,
                       and the one message when it cannot, is a2/plan.py's (plan_layout, sampling_plan); the
                       pipeline samples what it is given.
  encode(vae, ...)     the training encode: x0 and the Conditioning, the VAE calls in the order a cache replays.
  prepare_latents      the conditioning encoder shared by training and sampling.
  drop(cond, keep)     reference dropout (training) and guidance's reference-free branch (sampling).
  model_input          the transformer's (hidden_states, timestep).
  video_prediction     the part of the prediction that is the video.
  loss_start           the first latent frame the loss covers.
  restore              what the sampler puts back after its last step.
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace
from types import SimpleNamespace

import torch
from diffusers.models.autoencoders.vae import DiagonalGaussianDistribution
from diffusers.utils.torch_utils import randn_tensor

from a2 import kaleido
from a2.cli import ConfigError
from a2.config.dataset_config import kind_of
from a2.kinds import align, standin, vace
from a2.kinds.kinds import KIND_DEFS, KINDS, Kind

VAE_T = 4  # Wan VAE temporal compression: latent t>0 holds pixel frames 4t-3 .. 4t
VAE_S = 8  # and spatial (Wan 2.1's VAE; Wan 2.2's is 16: vae_scale)


# ---------------------------------------------------------------- VAE latents


def num_latent_frames(num_frames: int) -> int:
    return (num_frames - 1) // VAE_T + 1


def num_ref_latents(repeats, combine: str = "before") -> int:
    """Latent frames the elements occupy: the R = sum(repeats) frames encoded together (before), or
    1 + (r-1)//4 latents per element encoded alone (after). A2's 1/4/4 gives 3 either way."""
    if combine == "before":
        return num_latent_frames(sum(repeats))
    return sum(num_latent_frames(r) for r in repeats)


def vae_scale(vae) -> int:
    """The VAE's spatial compression: 8 (Wan 2.1), 16 (Wan 2.2's patchified VAE, `scale_factor_spatial`)."""
    return getattr(vae.config, "scale_factor_spatial", None) or VAE_S


def latent_stats(vae, device, dtype):
    mean = torch.tensor(vae.config.latents_mean, device=device, dtype=dtype).view(1, -1, 1, 1, 1)
    std = torch.tensor(vae.config.latents_std, device=device, dtype=dtype).view(1, -1, 1, 1, 1)
    return mean, std


def encode_vae(vae, pixels: torch.Tensor, sample_mode: str = "argmax", generator=None) -> torch.Tensor:
    """(B, 3, F, H, W) in [-1, 1] -> normalised latents (B, C, (F-1)//4+1, H/s, W/s), float32 (C 16, s 8 for Wan 2.1's
    VAE; 48 and 16 for Wan 2.2's).

    sample_mode "sample" draws from the posterior with `generator` (SkyReels-A2), "argmax" takes
    its mode (diffusers' Wan I2V)."""
    if sample_mode not in ("sample", "argmax"):
        raise ValueError(f"sample_mode must be 'sample' or 'argmax', got {sample_mode!r}")
    vae_param = next(vae.parameters())
    dist = vae.encode(pixels.to(vae_param.device, vae_param.dtype)).latent_dist
    z = dist.sample(generator) if sample_mode == "sample" else dist.mode()
    z = z.float()
    mean, std = latent_stats(vae, z.device, z.dtype)
    return (z - mean) * (1.0 / std)  # not `/ std`: SkyReels-A2 and diffusers multiply by the reciprocal (1 ulp)


class PosteriorCache:
    """Stands in for the VAE in encode_vae, so that prepare_latents runs unchanged on precomputed latents.

    Recording (`vae` given): encodes as the VAE does and keeps each call's posterior parameters (mean | logvar).
    Replaying (`posteriors` given): hands them out in call order; the pixels are not looked at (they may be
    meta tensors), only their shape is checked against the posterior. Sampling then happens in encode_vae as
    for a live VAE, with the same generators, so training from the cache equals training from pixels."""

    def __init__(self, latents_config: dict, posteriors: list[torch.Tensor] | None = None, vae=None):
        self.config = SimpleNamespace(**latents_config)  # latents_mean, latents_std
        self.vae, self.posteriors, self.calls = vae, list(posteriors or []), 0

    def parameters(self):
        if self.vae is not None:
            return self.vae.parameters()
        return iter([torch.empty(0, device="meta")])  # pixels.to(meta) in encode_vae: a no-op

    def encode(self, pixels: torch.Tensor):
        if self.vae is not None:
            dist = self.vae.encode(pixels).latent_dist
            self.posteriors.append(dist.parameters)
            return SimpleNamespace(latent_dist=dist)
        if self.calls >= len(self.posteriors):
            raise RuntimeError(f"the cache holds {len(self.posteriors)} VAE encodes for this batch; asked for more")
        params = self.posteriors[self.calls]  # (B, 2·C, T, h, w)
        self.calls += 1
        b, _, f, h, w = pixels.shape
        s = vae_scale(self)
        if params.shape[0] != b or params.shape[2:] != (num_latent_frames(f), h // s, w // s):
            raise RuntimeError(f"cached posterior {tuple(params.shape)} does not fit pixels {tuple(pixels.shape)}: "
                               "the cache was built for another layout; rebuild it with --precompute")
        return SimpleNamespace(latent_dist=DiagonalGaussianDistribution(params))


def frame_mask(cond_frames: torch.Tensor, latent_hw: tuple[int, int]) -> torch.Tensor:
    """Per-pixel-frame conditioning flags (B, F) -> the 4-channel latent mask (B, 4, T, h, w).

    Wan's rule: the first frame's flag is repeated 4 times (the causal VAE's first latent holds one
    frame), then the F+3 flags are read as (T, 4): channel c of latent t is pixel frame 4t+c-3."""
    b, f = cond_frames.shape
    flags = torch.cat([cond_frames[:, :1].repeat(1, VAE_T - 1), cond_frames], dim=1).float()  # (B, F+3)
    mask = flags.view(b, -1, VAE_T).transpose(1, 2)  # (B, 4, T)
    return mask[..., None, None].expand(-1, -1, -1, *latent_hw).contiguous()


def conditioning_frame_indices(mode: str, num_frames: int, index: int = 0, prefix: int = 1,
                               generator: torch.Generator | None = None) -> tuple[int, ...]:
    """Frames conditioned on in the inplace kind: first | first_and_last | index | prefix | random."""
    if mode == "first":
        return (0,)
    if mode == "first_and_last":
        return (0, num_frames - 1)
    if mode == "index":
        if not -num_frames <= index < num_frames:
            raise ValueError(f"frame index {index} outside a {num_frames}-frame clip")
        return (index % num_frames,)
    if mode == "prefix":
        if not 1 <= prefix < num_frames:
            raise ValueError(f"prefix of {prefix} frames needs 1 <= prefix < num_frames={num_frames}")
        return tuple(range(prefix))
    if mode == "random":  # one random frame; a generator keeps it a function of the sample's seed
        return (int(torch.randint(num_frames, (1,), generator=generator)),)
    raise ValueError(f"unknown frame conditioning {mode!r}")


# ---------------------------------------------------------------- the plan


@dataclass(frozen=True)
class Layout:
    """What the kind means for one run or one sampling call (a2/plan.py: plan_layout, sampling_plan), computed once."""

    kind: str  # a KIND_DEFS name (module docstring)
    num_frames: int  # pixel frames of the latent sequence (leading kinds: references + clip, 4·(L_ref + T) - 3;
    # else the clip)
    clip_frames: int  # pixel frames of the video clip: prefix 4·(T - L_ref - 1) + 1 (A2 at 81 frames: 69)
    ref_latents: int = 0  # latent frames of the references: before the clip (prefix, magref, vace), appended after it
    # (incontext, phantom, v3, refalign)
    repeats: tuple[int, ...] = ()  # pixel frames each element fills, in position order
    combine: str = "before"  # prefix: the element frames VAE-encoded at once (A2) or each alone (after)
    frame_conditioning: str = "full"  # inplace: which frames of the clip condition (clean: first | prefix)
    frame_index: int = 0  # inplace, frame_conditioning index: the frame
    prefix_frames: int = 1  # inplace / clean, frame_conditioning prefix: how many leading frames
    clean_frames: int = 0  # clean (and TI2V-5B sampling with a first frame): leading frames given clean
    reference_timestep: str = "shared"  # incontext: the references' timestep, the sample's (shared) or 0 (zero)
    e2v_type: str = "none"  # dual | vae | clip: the reference paths (clip: the VAE condition is zeros) | none
    image_branch: bool = False  # the trained transformer has CLIP image attention (its own, or from the expansion)
    use_clip: bool = False  # the step feeds CLIP image tokens (prefix, e2v_type dual | clip)
    expand: bool = False  # a T2V base widened to the 36 E2V input channels (a2/model/transformer.py: expand_to_e2v)
    per_token: bool = False  # one timestep per token, as the model was trained (TI2V-5B's expand_timesteps)
    placement_seed: int | None = None  # magref: random.Random(seed) shuffles the canvas as MAGREF; None: in order
    reference_size: tuple[int, int] | None = None  # standin: (height, width) px of the reference image, Stand-In's
    # 512x512 whatever the video's (make_layout sets it); None: the element images take the video's size
    context_scale: float = 1.0  # vace: the conditioning scale of the context blocks' hints (--vace-scale)
    reference_multiple: int | None = None  # vace, diffusers' framing: Sampling.reference_multiple (sampling_plan)
    reversed_references: bool = False  # vace, diffusers' order: Sampling.reversed_references (sampling_plan)

    @property
    def definition(self) -> Kind:
        """The kind's definition (KIND_DEFS): what every property below reads."""
        return KIND_DEFS[self.kind]

    @property
    def video_frames(self) -> int:
        """Pixel frames of the video the sampler writes (A2Pipeline's decode drop_refs): the sequence less 4 per
        leading reference latent (prefix: its clip; magref: 4 fewer than its clip, the canvas's latent frame decoded
        to 4 frames and dropped, as MAGREF's sampler drops them)."""
        return self.num_frames - VAE_T * (self.ref_latents if self.definition.leading else 0)

    @property
    def appended(self) -> bool:
        """The reference latents follow the video's on the time axis (their guidance has a reference-free branch)."""
        return self.definition.appended

    @property
    def cacheable(self) -> bool:
        """A precompute cache (VAE posteriors, magref's latent region mask) holds all the kind builds: not random
        conditioning frames, drawn per step."""
        return self.frame_conditioning != "random"

    @property
    def channel(self) -> bool:
        """The condition enters on the channel axis (mask | condition latents: a 36-channel model's input)."""
        return self.definition.channel

    @property
    def reference_tokens(self) -> bool:
        """The references are tokens of the transformer's sequence (Kind.reference_tokens)."""
        return self.definition.reference_tokens

    @property
    def original_export(self) -> str:
        """The file a full fine-tune of the kind's original-key weights is also exported as (Kind.original_export)."""
        return self.definition.original_export

    @property
    def takes_region(self) -> bool:
        """Beside its references the kind takes where the element images are on them (magref's canvas region)."""
        return self.definition.framing == "canvas"

    @property
    def context_blocks(self) -> bool:
        """The kind conditions through the model's context blocks (VACE): beside its references it takes a video to
        condition on and its mask, and a LoRA may adapt those blocks (lora_target)."""
        return self.definition.context

    @property
    def takes_references(self) -> bool:
        """The kind is given element references (training reads them from the data, sampling from the call)."""
        return self.definition.references[1] > 0

    @property
    def reference_images(self) -> int:
        """Images in the kind's references (B, N, 3, H, W) (reference_pixels): magref's one canvas, else one per
        element."""
        return 1 if self.takes_region else len(self.repeats)

    @property
    def reference_frames(self) -> list[int]:
        """Latent frames of each reference encoded alone (its repeats' 1 + (r-1)//4), in position order."""
        return [num_latent_frames(r) for r in self.repeats]

    @property
    def latent_frames(self) -> int:
        """Latent frames of hidden_states: the sequence's, plus the appended references (incontext, phantom, v3)."""
        return num_latent_frames(self.num_frames) + (self.ref_latents if self.appended else 0)

    @property
    def model_frames(self) -> int:
        """Pixel frames the transformer's input stands for (ModelInfo.latent_tokens counts its tokens from them)."""
        return VAE_T * (self.latent_frames - 1) + 1

    def tokens(self, info, height: int, width: int) -> int:
        """Transformer tokens of one sample at height x width (info: the ModelInfo): the input's frames, and
        standin's reference tokens beside them (its reference_grid over the patch, not the frames it is packed in)."""
        n = info.latent_tokens(self.model_frames, height, width)
        if self.reference_grid is not None:
            n += self.reference_grid[0] // info.patch_size[1] * (self.reference_grid[1] // info.patch_size[2])
        return n

    @property
    def reference_grid(self) -> tuple[int, int] | None:
        """standin: the reference latent's (height, width), reference_size over Wan 2.1's VAE stride (the VAE of
        Stand-In's bases, Wan 2.1 T2V and Wan 2.2 T2V-A14B; prepare_latents checks it); None for the other kinds."""
        return None if self.reference_size is None else (self.reference_size[0] // VAE_S,
                                                         self.reference_size[1] // VAE_S)

    @property
    def images(self) -> str:
        """What a sampling call of this run is given as images: "elements" (references, or for inplace the frames it
        conditions on, given as leading references), "first_frame" (TI2V-5B's image-to-video) or "none" (text)."""
        return {"none": "none", "frames": "first_frame"}.get(self.definition.axis, "elements")

    def describe(self) -> str:
        seq = self.definition.sequence.format(
            ref_latents=self.ref_latents, references=len(self.repeats), reference_timestep=self.reference_timestep,
            frame_conditioning=self.frame_conditioning, clean_frames=self.clean_frames,
            size="x".join(map(str, self.reference_size or ())), context_scale=self.context_scale)
        return (f"kind {self.kind}" + (f", E2V type {self.e2v_type}{', CLIP tokens' if self.use_clip else ''}"
                                       if self.definition.conditioned else "")
                + (", expanded to the E2V inputs" if self.expand else "")
                + f" | sequence: {seq}a {self.clip_frames}-frame clip")


def make_layout(kind: str, num_frames: int, repeats=(), **settings) -> Layout:
    """A Layout from its settings, with the frames and latents its kind derives (plan checks them against a model
    first). Raises ValueError when the references leave no frame to generate or more than the kind's slots."""
    if kind not in KINDS:
        raise ValueError(f"unknown conditioning kind {kind!r}; choose one of {KINDS}")
    d, repeats = KIND_DEFS[kind], tuple(repeats)
    if min(repeats, default=1) < 1:
        raise ValueError(f"element repeats must be >= 1, got {repeats}")
    if d.references[1] and not repeats:
        raise ValueError(f"the {kind} kind takes element references; none given")
    if d.slots and len(repeats) > d.slots:
        raise ValueError(f"the {kind} kind holds at most {d.slots} reference(s) (its slots), got {len(repeats)}: "
                         f"keep at most {d.slots}")
    if d.reference_size:
        settings.setdefault("reference_size", d.reference_size)
    clip, l_ref = num_frames, 0
    if d.one_frame:  # each reference one frame, as the labs encode it: element repeats do not apply
        repeats = (1,) * len(repeats)
        l_ref = d.slots or len(repeats)
    elif d.appended:  # each element alone, one latent per 1-4 frames, after the clip
        l_ref = num_ref_latents(repeats, "after")
    if kind == "prefix":  # A2's elements are a mini-video of repeated frames at the start of the sequence
        l_ref = num_ref_latents(repeats, settings.get("combine", "before"))
        clip = VAE_T * (num_latent_frames(num_frames) - l_ref - 1) + 1
        if clip < 1 or sum(repeats) >= num_frames:
            raise ValueError(f"{len(repeats)} elements fill {sum(repeats)} frames ({l_ref} latents, repeats "
                             f"{repeats}); num_frames={num_frames} leaves no frame to generate")
    if d.extends:  # the references' latent frames before the clip's, which is all of num_frames (VACE)
        num_frames = VAE_T * (l_ref + num_latent_frames(clip) - 1) + 1
    if kind == "magref":  # the canvas is pixel frame 0 (latent 0), the clip the frames after it
        clip, l_ref = num_frames - 1, 1
        if clip < VAE_T:
            raise ValueError(f"the magref canvas is frame 0 of the sequence: num_frames={num_frames} leaves no "
                             "latent frame to generate (use 4k+1 >= 5)")
    if d.clean and not settings.get("clean_frames"):
        raise ValueError(f"the {kind} kind takes clean_frames >= 1 (4k+1 leading frames)")
    return Layout(kind, num_frames, clip, l_ref, repeats, **settings)


def element_layout(layout: Layout, repeats, sampled: bool = False) -> Layout:
    """The run's layout for one element set (a bucket's: its elements' repeats, in position order), from the same
    plan: the same clip and settings, the references, their latents and the tokens of the set. A prefix sequence
    keeps its clip and holds the set's reference latents before it (fewer elements: a shorter sequence), as a bucket
    trains it. sampled: as a video is sampled instead (validation, a2/plan.py sampling_plan): --num-frames stays the
    whole sequence, so fewer references leave more video frames (SkyReels-A2's infer.py renders its 81 frames
    whatever the references). Raises ValueError when the kind cannot take the set (element_refusal)."""
    repeats = tuple(repeats)
    if not layout.takes_references or repeats == layout.repeats:
        return layout
    why = element_refusal(layout, len(repeats))
    if why:
        raise ValueError(why)
    num_frames = layout.clip_frames if layout.definition.extends else layout.num_frames
    if layout.kind == "prefix" and not sampled:
        num_frames = VAE_T * (num_latent_frames(layout.clip_frames) + num_ref_latents(repeats, layout.combine) - 1) + 1
    derived = ("kind", "num_frames", "clip_frames", "ref_latents", "repeats")
    return make_layout(layout.kind, num_frames, repeats,
                       **{f.name: getattr(layout, f.name) for f in fields(Layout) if f.name not in derived})


def element_refusal(layout: Layout, n: int) -> str | None:
    """Why one sample of `layout`'s kind cannot hold n element images (its definition's count range), else None."""
    d = KIND_DEFS[layout.kind]
    if not layout.takes_references or d.takes(n):
        return None
    lo, hi = d.references
    return f"the {layout.kind} kind takes {lo} to {hi} element image(s) a sample, this one has {n}"


def clip_frames(num_frames: int, elements, vae) -> int:
    """Pixel frames of the training clip for --num-frames (the whole sequence, reference frames included): what the
    reference latents leave of it in the prefix kind (A2 at 81 frames: 69), all of it otherwise. train_a2.py and
    `data.py validate` both read clips of this length."""
    kind = kind_of(vae, elements)
    if not KIND_DEFS[kind].leading:
        return num_frames
    try:
        return make_layout(kind, num_frames, [e.repeat for e in elements], combine=vae.combine).clip_frames
    except ValueError as e:
        raise ConfigError(f"--num-frames {num_frames}: {e}") from None


# ---------------------------------------------------------------- the encoded conditioning


@dataclass
class Conditioning:
    """The encoded condition of a batch, as prepare_latents builds it and model_input reads it."""

    kind: str
    condition: torch.Tensor | None = None  # prefix / inplace: (B, 4 + C, T, h, w) mask | condition latents; vace:
    # (B, 96, L_ref + T, h, w) its context
    ref_latents: torch.Tensor | None = None  # prefix: (B, C, L_ref, h, w), the start of x0; incontext, phantom, v3:
    # the clean latents appended after the video latents (v3: 4 slots, zeros after the references)
    clean: torch.Tensor | None = None  # clean: (B, C, T_c, h, w) the leading frames' latents
    image: torch.Tensor | None = None  # (B, 257·N, D) CLIP tokens of the elements (use_clip), else None
    canvas: torch.Tensor | None = None  # magref: (B, 3, H, W) the references' canvas in [-1, 1], x0's frame 0 and
    # the CLIP input (a2.pipeline.image_tokens)
    region: torch.Tensor | None = None  # magref: (B, h, w) bool, the canvas' region mask on the latent grid (what a
    # precompute cache keeps of the canvas beside its VAE posteriors and CLIP tokens)
    keep: torch.Tensor | None = None  # (B,) 1: conditioned, 0: dropped (drop); None: all conditioned
    reference_timestep: str = "shared"  # incontext: shared (the sample's timestep, Phantom) | zero
    per_token: bool = False  # the model takes one timestep per token (TI2V-5B)

    @property
    def definition(self) -> Kind:
        return KIND_DEFS[self.kind]

    @property
    def num_ref_latents(self) -> int:
        """Leading latent frames of the sequence that hold references (prefix, magref), else 0."""
        return self.ref_latents.shape[2] if self.definition.leading else 0

    @property
    def tensor(self) -> torch.Tensor | None:
        """The condition as a tensor to save beside sampled latents (infer.py --save-latents)."""
        if self.definition.reference_tokens:
            return self.ref_latents
        return {"channel": self.condition, "context": self.condition, "frames": self.clean}.get(self.definition.axis)


def prepare_latents(vae, layout: Layout, *, references: torch.Tensor | None = None, video: torch.Tensor | None = None,
                    cond_frame_indices: tuple[int, ...] = (), image: torch.Tensor | None = None,
                    sample_mode: str = "argmax", generator=None, region: torch.Tensor | None = None) -> Conditioning:
    """THE conditioning of the transformer, shared by training and inference. With sample_mode="sample" each
    posterior is sampled with `generator` (A2 draws its noise first, then this).

    prefix: `references` (B, N, 3, H, W) in [-1, 1], in position order; element i fills `repeats[i]` pixel frames
      of a mini-video of layout.num_frames frames, zeros after them. combine="before": the whole mini-video is
      VAE-encoded at once (A2's default); combine="after": each element's frames alone, the latents concatenated and
      zero-padded (in normalised latent space) to T latent frames. The mask marks the reference frames (frame_mask).
    inplace: `video` (B, 3, F, H, W) holds the conditioning frames at `cond_frame_indices` (the others are zeroed
      here) and is encoded in place; the mask marks them.
    incontext: each element VAE-encoded alone as a clip of `repeats[i]` frames, in position order (one latent per
      1-4 frames, as Phantom and V3 encode one frame per reference): `ref_latents` (B, C, L_ref, h, w), clean;
      model_input appends them after the video latents at every step. layout.num_frames is the video's alone.
    phantom: each reference alone as a 1-frame clip, its posterior mean (whatever sample_mode: Phantom-Wan's encode),
      in position order: `ref_latents` (B, C, N, h, w).
    v3: each reference alone as a 1-frame clip, sampled with `generator` (sample_mode "sample": SkyReels-V3 draws
      these after the noise), then zero latents up to 4 slots: `ref_latents` (B, C, 4, h, w).
    clean: the leading layout.clean_frames (4k+1) frames of `video`, encoded alone as diffusers' 5B I2V encodes its
      image: `clean` (B, C, T_c, h, w) (the causal VAE makes them the first T_c latents of the whole video's). In
      sampling a TI2V-5B first frame comes this way beside in-context references (encoded first).
    magref: `references` (B, 1, 3, H, W) in [-1, 1], MAGREF's canvas of the elements, and `region` (B, H, W) bool,
      where their pixels are on it (reference_pixels: what load_references and the dataset give); the canvas then
      layout.num_frames - 1 zero frames VAE-encoded; the mask's 4 channels of latent frame 0 are the region mask
      max-pooled to the latent grid (a latent cell is 1 if any of its pixels is a reference's), later frames 0.
      From a precompute cache the canvas is a meta tensor (the VAE encodes replay its posteriors, the CLIP tokens
      are cached) and `region` the cached one.
    vace: each reference (B, N, 3, H, W) alone as a 1-frame clip, in position order (reversed where the layout says:
      diffusers'), `ref_latents` (B, C, N, h, w), and VACE's context (a2/kinds/vace.py: encode) as `condition` (B, 96, N
      + T, h, w): with `video` (B, 3, F, H, W) and its mask `region` (B, F, H, W), 1 where VACE generates (a control
      video, a masked clip), else R2V's (video zeros, mask ones). Posterior means whatever sample_mode (Wan's encode).
    standin: the one reference (B, 1, 3, *layout.reference_size), Stand-In's 512x512 whatever the video's size
      (a2/images.py reference_pixels), as a 1-frame clip, its posterior mean whatever sample_mode (Stand-In's
      encode_ip_image): `ref_latents` (B, C, 1, *layout.reference_grid).
    e2v_type clip: the VAE condition is zeros (the CLIP tokens carry the references). `image`: the elements' CLIP
    tokens (B, 257·N, D), carried for model_input and drop."""
    kind, d = layout.kind, layout.definition
    cond = Conditioning(kind, image=image, reference_timestep=layout.reference_timestep, per_token=layout.per_token)
    if layout.clean_frames:
        n = layout.clean_frames
        if video is None or (n - 1) % VAE_T or n > video.shape[2]:
            raise ValueError(f"clean leading frames are 4k+1 frames of the video: {n} of "
                             f"{None if video is None else video.shape[2]}")
        cond.clean = encode_vae(vae, video[:, :, :n], sample_mode, generator)
    if not d.conditioned or d.clean:
        return cond
    if layout.takes_references:
        if references is None:
            raise ValueError(f"the {kind} kind takes references (element images), not video frames")
        b, n, _, h, w = references.shape
        if layout.reference_images != n:  # magref: the one canvas reference_pixels makes of all the elements
            raise ValueError(f"the {kind} kind takes {layout.reference_images} reference image(s) for the element "
                             f"repeats {layout.repeats}, got {n}")
        if not layout.takes_region:
            frames = [references[:, i, :, None].expand(-1, -1, k, -1, -1) for i, k in enumerate(layout.repeats)]
    if layout.reference_size and (h, w) != layout.reference_size:
        raise ValueError(f"the {kind} kind's reference is a {layout.reference_size[0]}x{layout.reference_size[1]} "
                         f"image (Stand-In's face crop) whatever the video's size, got {h}x{w}: frame it with "
                         f"reference_pixels (load_references(..., layout) of the {kind} layout)")
    mode = "argmax" if d.encode_mean else sample_mode  # the mode of a Gaussian is its mean
    if d.context:  # VACE: its context of the references and the video (a2/kinds/vace.py), all posterior means
        refs = references.flip(1) if layout.reversed_references else references  # diffusers' order
        cond.condition, cond.ref_latents = vace.encode(lambda x: encode_vae(vae, x, mode), refs, layout.clip_frames,
                                                       video, region)
        return cond
    if d.reference_tokens:  # each reference encoded alone
        latents = [encode_vae(vae, x, mode, generator) for x in frames]  # (B, C, 1 per 1-4 frames, h, w) each
        latents += [latents[0].new_zeros(latents[0].shape)] * (d.slots - n if d.slots else 0)  # V3's empty slots
        cond.ref_latents = torch.cat(latents, dim=2)
        if layout.reference_grid and cond.ref_latents.shape[-2:] != layout.reference_grid:
            raise ValueError(f"the {kind} kind's {h}x{w} reference encodes to {tuple(cond.ref_latents.shape[-2:])} "
                             f"latents, not {layout.reference_grid}: a VAE of another stride than Wan 2.1's")
        return cond
    if layout.takes_region:  # MAGREF's canvas
        if region is None or region.shape != (b, h, w):
            raise ValueError(f"the magref kind takes its canvas' pixel region mask (B, H, W) = {(b, h, w)} beside the "
                             f"canvas (reference_pixels), got {None if region is None else tuple(region.shape)}")
        cond.canvas = references[:, 0]  # (B, 3, H, W)
        pixels = torch.cat([cond.canvas[:, :, None], cond.canvas.new_zeros(b, 3, layout.num_frames - 1, h, w)], 2)
        latents = encode_vae(vae, pixels, sample_mode, generator)
        s = h // latents.shape[-2]
        region = region.to(latents.device, torch.float32)[:, None]  # (B, 1, H, W)
        cond.region = torch.nn.functional.max_pool2d(region, s)[:, 0] > 0  # (B, h, w)
        mask = torch.zeros(b, VAE_T, latents.shape[2], *latents.shape[-2:], device=latents.device)
        mask[:, :, 0] = cond.region[:, None].float()
        cond.ref_latents = latents[:, :, :1]
        cond.condition = torch.cat([mask, latents], dim=1)
        if layout.e2v_type == "clip":
            cond.condition = torch.zeros_like(cond.condition)
        return cond
    t = num_latent_frames(layout.num_frames)
    flags = torch.zeros((video if references is None else references).shape[0], layout.num_frames)
    if kind == "prefix":
        r = sum(layout.repeats)
        if layout.combine == "before":
            zeros = references.new_zeros(b, 3, layout.num_frames - r, h, w)
            latents = encode_vae(vae, torch.cat(frames + [zeros], dim=2), sample_mode, generator)
        elif layout.combine == "after":
            latents = torch.cat([encode_vae(vae, x, sample_mode, generator) for x in frames], dim=2)
            latents = torch.cat([latents, latents.new_zeros(*latents.shape[:2], t - layout.ref_latents,
                                                            *latents.shape[3:])], dim=2)
            r = VAE_T * (layout.ref_latents - 1) + 1  # the mask then marks exactly the reference latent frames
        else:
            raise ValueError(f"combine must be 'before' or 'after', got {layout.combine!r}")
        flags[:, :r] = 1
        cond.ref_latents = latents[:, :, :layout.ref_latents]
    else:  # inplace
        if video is None or video.shape[2] != layout.num_frames:
            raise ValueError(f"the inplace kind takes the {layout.num_frames}-frame video, got "
                             f"{None if video is None else tuple(video.shape)}")
        flags[:, list(cond_frame_indices)] = 1
        pixels = video * flags[:, None, :, None, None].to(video.device, video.dtype)
        latents = encode_vae(vae, pixels, sample_mode, generator)
    mask = frame_mask(flags.to(latents.device), latents.shape[-2:])
    cond.condition = torch.cat([mask, latents], dim=1)
    if layout.e2v_type == "clip":  # the VAE path is off: the model sees no reference latents, no mask
        cond.condition = torch.zeros_like(cond.condition)
    return cond


def encode(vae, layout: Layout, video: torch.Tensor, references: torch.Tensor | None, generator, sample_mode: str,
           region: torch.Tensor | None = None):
    """Training's encode step: x0 (B, C, T, h, w) and the Conditioning of a batch, the VAE calls in one fixed order
    (a recording PosteriorCache, --precompute, and a replaying one, training from the cache, see the same calls as
    the live VAE): the references first, then the clip (prefix, incontext; vace: its context, then the clip); the clip
    first, then its conditioning frames (inplace, clean). region: magref's pixel region mask (B, H, W) beside its
    canvas (prepare_latents); vace's mask (B, F, H, W) of a masked clip, 1 where VACE generates: the context holds the
    clip outside it (None: R2V, the references alone)."""
    if layout.takes_references:
        control = None
        if layout.context_blocks and region is not None:  # VACE's masked clip: the clip outside its
            control = video * (region[:, None] <= 0.5).to(video)  # mask (B, F, H, W), zeros inside, as VideoX-Fun's
        cond = prepare_latents(vae, layout, references=references, video=control, sample_mode=sample_mode,
                               generator=generator, region=region)
        if layout.takes_region:  # MAGREF's canvas is the sequence's frame 0, as the sampler makes it
            video = torch.cat([cond.canvas[:, :, None].to(video.device, video.dtype), video], dim=2)
        x0 = encode_vae(vae, video, sample_mode, generator)
        leading = layout.definition.leading and not layout.takes_region  # encoded apart from the clip (not magref's)
        return (torch.cat([cond.ref_latents, x0], dim=2) if leading else x0), cond
    x0 = encode_vae(vae, video, sample_mode, generator)
    idx = ()
    if layout.frame_conditioning != "full":  # the clip's own frames (clean: its leading ones, encoded above)
        idx = conditioning_frame_indices(layout.frame_conditioning, layout.clip_frames, layout.frame_index,
                                         layout.prefix_frames, generator[0] if generator else None)
    return x0, prepare_latents(vae, layout, video=video, cond_frame_indices=idx, sample_mode=sample_mode,
                               generator=generator)


# ---------------------------------------------------------------- what the transformer sees


def prepare_model(transformer, layout: Layout, rank: int | None = None) -> None:
    """What a kind changes in the transformer before it runs (training and sampling alike), each in its kind's module:
    refalign: the reference tokens skip the text cross-attention (a2/kinds/align.py video_only_cross_attention); vace:
    the forward that reads VACE's context packed beside x_t and adds its blocks' hints at the layout's context_scale
    (a2/kinds/vace.py install); standin: Stand-In's processors (reference LoRA at `rank`) and the forward that reads the
    packed reference of the layout's reference_grid (a2/kinds/standin.py prepare). Others: nothing."""
    if layout.definition.text_to_video_only:
        align.video_only_cross_attention(transformer, layout.ref_latents)
    if layout.context_blocks:
        vace.install(transformer, layout.context_scale)
    if layout.reference_grid is not None:
        standin.prepare(transformer, layout.reference_grid, rank)
    if layout.definition.prepended:  # Kaleido's RoPE positions of this call's references (a2/kaleido.py)
        kaleido.prepare(transformer, layout.ref_latents)


def lora_target(layout: Layout, target: str, blocks: str | None = None) -> str:
    """The modules a run's LoRA adapts: `target` (--lora-target), on VACE's model narrowed to its context blocks, its
    transformer blocks or both (`blocks`: --vace-lora-target, None: the context blocks; a2/kinds/vace.py:
    lora_target)."""
    return vace.lora_target(target, blocks or "vace") if layout.context_blocks else target


def kind_weights(transformer, layout: Layout) -> list:
    """The weights a kind adds to the transformer, which a LoRA run trains instead of a peft adapter: Stand-In's
    reference-only LoRA (a2/kinds/standin.py weights); none for the other kinds."""
    return standin.weights(transformer) if layout.reference_grid is not None else []


def drop(cond: Conditioning, keep: torch.Tensor) -> Conditioning:
    """The condition with the samples where keep (B,) is 0 unconditioned: the channel condition and the CLIP tokens
    zeroed (A2), the appended references zeroed (Phantom's and V3's unconditional: every slot zero), the clean frames
    of the clean kind left noisy (a TI2V-5B sample then trains as text-to-video; model_input reads keep; a first
    frame given beside in-context references stays, it is not a reference). A prefix run's reference latents stay in
    x0. VACE's context stays: its guidance drops the text alone (both branches see the references)."""
    k = keep.view(-1, 1, 1, 1, 1)
    return replace(cond, keep=keep if cond.definition.clean else cond.keep,
                   condition=cond.condition * k.to(cond.condition.dtype) if cond.definition.channel
                   else cond.condition,
                   ref_latents=cond.ref_latents * k.to(cond.ref_latents.dtype)
                   if cond.definition.reference_tokens else cond.ref_latents,
                   image=None if cond.image is None else cond.image * keep[:, None, None].to(cond.image.dtype))


def model_input(x_t: torch.Tensor, cond: Conditioning, timestep: torch.Tensor,
                patch_size=(1, 2, 2)) -> tuple[torch.Tensor, torch.Tensor]:
    """The transformer's (hidden_states, timestep) for the video latents x_t (B, C, T, h, w) at timestep (B,).

    Clean frames or a per-token model (TI2V-5B, diffusers' expand_timesteps): x_t's first T_c latent frames replaced
    by the clean ones where keep is 1, and one timestep per token (B, T·h·w / (p_t·p_h·p_w)), frame-major as the patch
    grid: 0 on the clean frames' tokens, else the sample's.
    prefix / inplace: cat([x_t, mask | condition], dim=1). vace: cat([x_t, VACE's context], dim=1), the context over
    the reference and video frames (a2/kinds/vace.py: pack). standin: the reference latent packed after x_t in whole
    frames of its grid (a2/kinds/standin.py: pack_reference). incontext: cat([x_t, references], dim=2), the reference
    tokens at the sample's timestep (shared; from a per-token timestep its largest value, the noisy tokens') or at 0
    (zero); a (B,) timestep stays (B,) when shared, else the result is per token over (T + L_ref) frames."""
    x = x_t
    if cond.clean is not None or cond.per_token:
        b, _, t, h, w = x_t.shape
        p_t, p_h, p_w = patch_size
        n = 0 if cond.clean is None else cond.clean.shape[2]
        keep = torch.ones(b, device=x_t.device) if cond.keep is None else cond.keep.to(x_t.device, torch.float32)
        if n:
            first = torch.where(keep.view(-1, 1, 1, 1, 1) > 0, cond.clean.to(x_t.dtype), x_t[:, :, :n])
            x = torch.cat([first, x_t[:, :, n:]], dim=2)
        clean_tokens = torch.zeros(t // p_t, h // p_h, w // p_w, device=x_t.device)
        clean_tokens[: n // p_t] = 1
        noisy = 1 - keep[:, None] * clean_tokens.flatten()[None]  # diffusers' mask[0][0][:, ::2, ::2], per sample
        timestep = noisy * timestep.reshape(-1, 1)
    d = cond.definition
    if d.channel:
        return torch.cat([x, cond.condition.to(x.dtype)], dim=1), timestep
    if d.packed:  # the forward prepare_model installs unpacks it (a2/kinds/standin.py: packed_forward)
        return standin.pack_reference(x, cond.ref_latents), timestep
    if d.context:  # and VACE's (a2/kinds/vace.py: install)
        return vace.pack(x, cond.condition), timestep
    if not d.appended:
        return x, timestep
    refs = cond.ref_latents.to(x.dtype)  # phantom / v3: the reference slots, the same in every step's input
    x = torch.cat([refs, x] if d.prepended else [x, refs], dim=2)  # kaleido: before the video
    if cond.reference_timestep == "shared" and timestep.dim() < 2:
        return x, timestep
    p_t, p_h, p_w = patch_size
    per_frame = (x_t.shape[3] // p_h) * (x_t.shape[4] // p_w)
    video, ref = x_t.shape[2] // p_t * per_frame, refs.shape[2] // p_t * per_frame
    if timestep.dim() < 2:
        timestep = timestep.reshape(-1).expand(x_t.shape[0])[:, None].expand(-1, video)
    if timestep.shape[1] != video:
        raise ValueError(f"per-token timestep of {timestep.shape[1]} tokens for {video} video tokens")
    sample = timestep.amax(dim=1, keepdim=True) if cond.reference_timestep == "shared" else timestep.new_zeros(())
    parts = [timestep, sample.expand(x_t.shape[0], ref)]
    return x, torch.cat(parts[::-1] if d.prepended else parts, dim=1)


def video_prediction(pred: torch.Tensor, cond: Conditioning) -> torch.Tensor:
    """The model output for the video latents: in the appended kinds the last L_ref (reference) frames dropped, the
    first where they come first (kaleido; Stand-In's forward returns the video's alone)."""
    if not cond.definition.appended:
        return pred
    n = cond.ref_latents.shape[2]
    return pred[:, :, n:] if cond.definition.prepended else pred[:, :, : pred.shape[2] - n]


def loss_start(cond: Conditioning, on_references: bool = False) -> int:
    """The first latent frame of the prediction the loss covers: after the leading references (with
    --loss-on-references False; by default the loss covers them, as VideoX-Fun trains VACE), after the clean leading
    frames (they are given), else 0."""
    if not on_references and cond.num_ref_latents:
        return cond.num_ref_latents
    return 0 if cond.clean is None else cond.clean.shape[2]


def initial_latents(layout: Layout, shape: tuple[int, ...], generator=None, device=None) -> torch.Tensor:
    """The sampler's starting noise for the video latents, shape (B, C, T, h, w), float32. Phantom-Wan draws it for
    T + L_ref frames (the reference slots last) and its solver steps the slots too, but replaces them in every input:
    the solver is elementwise, so sampling the first T frames alone gives the same video latents bit for bit."""
    extra = layout.ref_latents if layout.definition.noise_with_references else 0
    b, c, t, h, w = shape
    if layout.definition.noise_frames_first:  # Kaleido's torch.randn(B, T, C, h, w)
        return randn_tensor((b, t, c, h, w), generator=generator, device=device,
                            dtype=torch.float32).transpose(1, 2).contiguous()
    return randn_tensor((b, c, t + extra, h, w), generator=generator, device=device, dtype=torch.float32)[:, :, :t]


def restore(latents: torch.Tensor, cond: Conditioning) -> torch.Tensor:
    """The sampled latents with what the condition fixes put back: the clean leading frames (the solver moved them
    along with the rest)."""
    if cond.clean is None:
        return latents
    return torch.cat([cond.clean, latents[:, :, cond.clean.shape[2]:]], dim=2)
