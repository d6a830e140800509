"""The kind table: every conditioning kind of a2 as one `Kind` row (KIND_DEFS), with its lab's own sampling
(`Sampling`, each value beside the file it is read from) and the lookups that read a row (kind_sampling,
kind_elements, index_elements). The row is the whole generic definition of a kind; a2/kinds/conditioning.py holds the
functions that read it (the plan, the encode, the model input) and names a kind only where it is truly particular."""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np
import torch

from a2.elements import A2_ELEMENTS, RELEASED_ELEMENTS

STANDIN_SIZE = (512, 512)  # (height, width) px of Stand-In's reference: its FaceProcessor's crop, whatever the video's
V3_SLOTS = 4  # SkyReels-V3 R2V's reference slots (its MAX_ALLOWED_REF_IMG_LENGTH), zero latents where unused

A2_NEGATIVE_PROMPT = (
    "Bright tones, overexposed, static, blurred details, subtitles, style, works, paintings, images, static, "
    "overall gray, worst quality, low quality, JPEG compression residue, ugly, incomplete, extra fingers, poorly "
    "drawn hands, poorly drawn faces, deformed, disfigured, misshapen limbs, fused fingers, still picture, messy "
    "background, three legs, many people in the background, walking backwards"
)


def model_flow_shift(model_dir, default: float = 8.0) -> float:
    """The sampler shift a model dir ships (scheduler_config flow_shift / shift: A2 8, Wan2.1 T2V 3, ...)."""
    path = Path(model_dir) / "scheduler" / "scheduler_config.json"
    if not path.exists():
        return default
    c = json.loads(path.read_text())
    return float(c.get("flow_shift") or c.get("shift") or default)


# Wan's own negative prompt (the Chinese original of A2's), which Phantom-Wan always samples with
WAN_NEGATIVE_PROMPT = ("色调艳丽，过曝，静态，细节模糊不清，字幕，风格，作品，画作，画面，静止，整体发灰，"  # noqa: RUF001
                       "最差质量，低质量，JPEG压缩残留，丑陋的，残缺的，多余的手指，画得不好的手部，"  # noqa: RUF001
                       "画得不好的脸部，畸形的，毁容的，形态畸形的肢体，手指融合，静止不动的画面，"  # noqa: RUF001
                       "杂乱的背景，三条腿，背景人很多，倒着走")  # noqa: RUF001
MAGREF_NEGATIVE_PROMPT = "镜头晃动，" + WAN_NEGATIVE_PROMPT  # noqa: RUF001 (magref/configs/magref_14B.py: "camera shake, ")
# Kaleido's sampling yaml (configs/sampling/sample_wanvae_concat_14b.yaml:13): Wan's without "poorly drawn faces, "
KALEIDO_NEGATIVE_PROMPT = WAN_NEGATIVE_PROMPT.replace("画得不好的脸部，", "")  # noqa: RUF001
SCHEDULES = ("diffusers", "phantom", "diffusers034", "flowmatch", "kaleido")
def schedule_sigmas(schedule: str, steps: int) -> np.ndarray | None:
    """The unshifted sigmas of a schedule (None: diffusers' own default). diffusers 0.37 moved its UniPC default
    start to 1 - 1e-6 (timesteps differ by 1 in places): the released models sampled with the earlier ones.
    phantom: Phantom-Wan's FlowUniPC, from its float32 training sigma_max 0.999 to 0. diffusers034: diffusers 0.34's
    use_flow_sigmas default, which SkyReels-V3 pins. flowmatch: DiffSynth's FlowMatchScheduler(sigma_min=0,
    extra_one_step=True), Stand-In's Euler sampler: torch's float32 linspace(1, 0, steps + 1) without the 0 (diffusers'
    FlowMatchEuler default ends near 0.005 instead). kaleido: its RFSampler's hunyuan schedule, 1 - s for numpy's
    float64 s = linspace(0, 1, steps + 1) (sgm/modules/diffusionmodules/sampling.py:889-898), from 1 to exactly 0
    (the 0 is the scheduler's terminal). Fed to set_timesteps(sigmas=), which shifts them."""
    if schedule == "diffusers":
        return None
    if schedule == "phantom":
        return np.linspace(float(np.float32(1 - 1 / 1000)), 0, steps + 1)[:-1].copy()
    if schedule == "diffusers034":
        return np.flip(1.0 - np.linspace(1, 1 / 1000, steps + 1))[:-1].copy()
    if schedule == "flowmatch":  # torch's linspace, not numpy's: float32 values that can differ in the last bit
        return torch.linspace(1.0, 0.0, steps + 1)[:-1].numpy()
    if schedule == "kaleido":
        return 1.0 - np.linspace(0.0, 1.0, steps + 1)[:-1]
    raise ValueError(f"unknown schedule {schedule!r}; choose one of {SCHEDULES}")


@dataclass(frozen=True)
class Sampling:
    """How a kind's own code samples: what A2Pipeline uses for every setting its caller leaves out (None), the one
    place those are filled (infer.py, a run's validation and the OpenS2V renderer pass only what their user set). The
    values and the lab's file each is read from: README, "What each kind samples with"."""

    scheduler: str = "unipc"  # unipc | euler (make_scheduler)
    schedule: str = "diffusers"  # the unshifted sigmas (schedule_sigmas)
    flow_shift: float | None = None  # None: the shift the model dir ships (model_flow_shift), a diffusers Wan
    # pipeline's; a lab whose script fixes it, its own
    encode_mode: str = "sample"  # the references' / condition's VAE encode: a posterior sample or its mean (argmax),
    # in training too (its encode is its sampling's)
    steps: int = 50
    guidance_scale: float = 5.0
    guidance_scale_img: float | None = None  # the appended kinds' reference guidance (a third forward); None: off
    negative_prompt: str = A2_NEGATIVE_PROMPT
    num_frames: int | None = None  # the frames the lab's entry point renders when --num-frames is left out (V3's 121,
    # a real model's; a built-in tiny model keeps its own); None: the caller's (81 pixel frames)
    fps: int = 15
    seed: int = 42
    noise_on_cpu: bool = False  # the noise drawn with a CPU generator whatever the device (DiffSynth's rand_device)
    timestep_in_dtype: bool = False  # the DiT gets the timestep cast to the compute dtype and back, as DiffSynth's
    # pipelines cast it (bf16: 937.5 becomes 936; float32: unchanged)
    seeded_placement: bool = False  # MAGREF: the seed shuffles the canvas (Layout.placement_seed = the seed)
    decode: str = "drop_refs"  # leading references: decoded with the video and their frames dropped (A2, MAGREF),
    # or dropped before the decode (video_only: Wan's VACE and diffusers' decode the video latents alone)
    reference_multiple: int | None = None  # the references first resized to sides a multiple of this (Lanczos), as
    # diffusers' WanVACEPipeline frames them (a2/images.py vace_frame); None: the lab's framing alone
    reversed_references: bool = False  # the references placed in reverse order (diffusers' VACE puts each before the
    # ones before it)


@dataclass(frozen=True)
class Kind:
    """One conditioning kind: everything that differs between kinds as data, read by the functions below. What is
    truly particular (A2's reference mini-video, MAGREF's canvas, Stand-In's packing, the clean frames) stays an
    `if kind ==` in them."""

    name: str
    axis: str  # where the condition enters: none | channel (mask | condition, 36 channels) | time (after x_t) |
    # tokens (Stand-In's packed reference) | frames (clean leading latent frames) | context (VACE's context beside
    # x_t, read by its context blocks: a2/kinds/vace.py)
    references: tuple[int, int] = (0, 0)  # (fewest, most) element images one sample takes; (0, 0): none
    frame_conditioning: tuple[str, ...] = ("full",)  # the --frame-conditioning modes it takes (plan refuses others)
    native: bool = False  # a released model's own layout: its weights choose it (ModelInfo.native_kind), no flag
    leading: bool = False  # the references are the sequence's first latent frames (x0 starts with them; the sampler
    # drops them): A2's prefix, MAGREF's canvas, VACE's references
    extends: bool = False  # the leading references' latent frames come on top of the clip's: --num-frames counts the
    # clip alone (VACE); else they are frames of it (A2's 81 frames: 12 of references, a 69-frame clip)
    one_frame: bool = False  # each reference one 1-frame clip, whatever its element's repeat (the labs encode so)
    slots: int = 0  # the reference latents fill exactly this many slots, zeros after the references (V3); 0: one each
    encode_mean: bool = False  # the references' posterior mean whatever the sample mode (the lab's encode)
    noise_with_references: bool = False  # the sampler's noise is drawn for the video and reference frames (Phantom)
    clip: bool = False  # the step feeds CLIP image tokens where the model has the image branch
    text_to_video_only: bool = False  # the reference tokens skip the text cross-attention (RefAlign's blocks)
    reference_size: tuple[int, int] | None = None  # the reference image's (height, width) whatever the video's
    framing: str = "element"  # how its reference images are framed (a2/images.py reference_pixels, FRAMINGS): each
    # by its element's vae_preprocess at the video's size, or the lab's own arithmetic whatever the element's: face
    # (Stand-In's crop at reference_size), fit_white (VACE's bilinear fit on white), canvas (MAGREF's canvas)
    sequence: str = ""  # what the sequence holds besides the clip, for Layout.describe ({} fields: Layout.describe)
    sampling: Sampling = Sampling()  # its own sampler (the lab's code), infer.py's defaults
    modes: tuple[tuple[str, Sampling], ...] = ()  # the lab's other entry points, infer.py --preset NAME
    # the element specs it takes when none are given (--elements, --element-specs, a dataset config), in training and
    # sampling alike (kind_elements): SkyReels-A2's roles, or a released model's references framed as its lab's
    elements: tuple = A2_ELEMENTS
    # what its precompute cache's name hashes beside the data (a2.plan.cache_key): version 2, A2's pad/crop-then-resize
    # framing; magref 3, its canvas of the images as read and the region mask; standin its reference's size; vace 4,
    # VACE's framing and its context's encodes (a masked clip's mask file is hashed with the clip's files)
    cache_fields: tuple[tuple[str, object], ...] = (("version", 2),)
    # a full fine-tune of its original-key weights is also exported in them under this name (a2/train/lora.py
    # export_weights): a .pth as Phantom's code loads it (torch.load), a .safetensors as RefAlign's pipeline reads it
    original_export: str = "Phantom-Wan.pth"
    # its elements play roles (A2's subject / object / background, Stand-In's subject): a public index fills them by
    # role; a kind without roles takes a clip's kept masks as positional references ref0, ref1, ... (index_elements)
    roles: bool = False
    # a public index's background png is one of its references, in the last slot (the lab trained with backgrounds)
    background: bool = False
    # the references' latent frames come before the video's on the time axis (time axis), each at its own RoPE
    # position: Kaleido's (a2/kaleido.py: prepare); else after them
    prepended: bool = False
    # the sampler's noise is drawn frames first, (B, T, C, h, w), then laid out (B, C, T, h, w) (Kaleido's torch.randn)
    noise_frames_first: bool = False

    def takes(self, n: int) -> bool:
        """One sample of this kind can hold n element images."""
        return self.references[0] <= n <= self.references[1]

    # where the condition enters, each read once here (axis above)
    conditioned = property(lambda self: self.axis != "none")  # any condition beside the text
    channel = property(lambda self: self.axis == "channel")  # mask | condition latents: a 36-channel input
    appended = property(lambda self: self.axis == "time")  # reference latents after the video's on the time axis
    packed = property(lambda self: self.axis == "tokens")  # Stand-In's reference tokens packed after x_t
    context = property(lambda self: self.axis == "context")  # VACE's context, read by its context blocks
    clean = property(lambda self: self.axis == "frames")  # clean leading latent frames at timestep 0

    @property
    def reference_tokens(self) -> bool:
        """The references are tokens of the transformer's sequence after the video's (appended latent frames, or
        Stand-In's reference tokens): what --align-loss aligns (a2/kinds/align.py), what the reference-free guidance
        pass and reference dropout zero."""
        return self.appended or self.packed


INPLACE_MODES = ("first", "first_and_last", "index", "prefix", "random")
MOST_ELEMENTS = 8  # incontext: each element its own latents; a2 takes as many as MAGREF's canvas
# Each lab's entry point as a user runs it, its file named beside the value (README: "What each kind samples with").
# SkyReels-A2 infer.py: UniPC flow_shift 8, 50 steps, CFG 5, its English negative prompt, seed 42, the posterior sample
# after the noise (the generator on the device), 15 fps
_A2 = Sampling(flow_shift=8.0)
# Phantom-Wan generate.py (--sample_steps 50, --sample_shift 5, --sample_guide_scale_text 7.5 / _img 5) and
# configs/shared_config.py (Wan's negative prompt, 16 fps); its FlowUniPC from 0.999, the references' posterior mean
_PHANTOM = Sampling(schedule="phantom", flow_shift=5.0, encode_mode="argmax", guidance_scale=7.5,
                    guidance_scale_img=5.0, negative_prompt=WAN_NEGATIVE_PROMPT, fps=16)
# SkyReels-V3's entry point: generate_video.py (--seed 42 :171-175, --duration 5 :151-155, 24 fps :342) ->
# ReferenceToVideoPipeline.generate_video (reference_to_video_pipeline.py:768-790: 8 steps, guidance 1.0 / 1.0, an
# empty negative prompt, duration * 24 + 1 = 121 frames) -> WanSkyReelsA2WanT2VPipeline.__call__ (its UniPC shift 5
# on diffusers 0.34). Guidance 1 is one forward a step (do_classifier_free_guidance: guidance_scale > 1, :367-368),
# so the reference guidance is off. --preset v3-cfg: that class's own defaults (:399-402: 97 + 8 = 105 frames, 50
# steps, 7.5 / 5; three forwards a step)
_V3 = Sampling(schedule="diffusers034", flow_shift=5.0, encode_mode="sample", steps=8, guidance_scale=1.0,
               guidance_scale_img=None, negative_prompt="", num_frames=121, fps=24)
_V3_CFG = replace(_V3, steps=50, guidance_scale=7.5, guidance_scale_img=5.0, num_frames=105)
# Wan's VACE code: Wan2.1 generate.py (--sample_shift 16 :76-81, --sample_steps 50, --sample_guide_scale 5 :242) and
# wan/vace.py (its config's negative prompt :353, FlowUniPC from sigma 0.999, WanVAE.encode's mean, the reference
# latents dropped before the decode :280-293), shared_config.py (16 fps); ali-vilab/VACE vace_wan_inference.py
# --base_seed 2025 (:158-162; Wan's own -1 draws a random one). diffusers 0.42's WanVACEPipeline: its dir's
# scheduler (shift 3), UniPC from sigma 1 - 1e-6, no negative prompt, the references resized to multiples of 8
# (Lanczos) and placed reversed (:569-578), the video latents decoded (a random seed: a2 keeps VACE's 2025)
_VACE = Sampling(schedule="phantom", flow_shift=16.0, encode_mode="argmax", negative_prompt=WAN_NEGATIVE_PROMPT,
                 fps=16, seed=2025, decode="video_only")
_VACE_DIFFUSERS = replace(_VACE, schedule="diffusers", flow_shift=None, negative_prompt="", reference_multiple=8,
                          reversed_references=True)
KIND_DEFS = {k.name: k for k in (
    Kind("t2v", "none", elements=()),
    # SkyReels-A2: any non-empty set of its elements (roles kept: a `required` one must be there), posterior samples
    Kind("prefix", "channel", (1, MOST_ELEMENTS), leading=True, clip=True, sampling=_A2, roles=True, background=True,
         sequence="{ref_latents} reference latents + "),
    Kind("inplace", "channel", frame_conditioning=INPLACE_MODES, sampling=Sampling(encode_mode="argmax"),
         elements=(), sequence="(conditioned on frames: {frame_conditioning}) "),
    # a2's own: A2's elements (a background among them) as tokens after the clip; + TI2V's first frame
    Kind("incontext", "time", (1, MOST_ELEMENTS), frame_conditioning=("full", "first", "prefix"), background=True,
         sequence="(then {ref_latents} clean reference latents, timestep {reference_timestep}) "),
    Kind("clean", "frames", frame_conditioning=("first", "prefix"), sampling=Sampling(encode_mode="argmax"),
         elements=(), sequence="({clean_frames} clean leading frames at timestep 0) "),
    # Phantom-Data's references are the clip's subjects, no background (BindWeave's OpenS2V loader, of the same
    # family, loads the background png and never adds it); SkyReels-V3 R2V's and MAGREF's references include scenes
    Kind("phantom", "time", (1, 4), native=True, one_frame=True, encode_mean=True, noise_with_references=True,
         sampling=_PHANTOM, elements=RELEASED_ELEMENTS[:4],
         sequence="(then {ref_latents} reference latents, posterior means, Phantom-Wan's layout) "),
    Kind("v3", "time", (1, V3_SLOTS), native=True, one_frame=True, slots=V3_SLOTS, sampling=_V3, background=True,
         elements=RELEASED_ELEMENTS[:V3_SLOTS],
         modes=(("v3-cfg", _V3_CFG),),
         sequence=f"(then {{references}} reference latents in {V3_SLOTS} slots, SkyReels-V3's layout) "),
    # MAGREF generate.py (--sample_steps 40, --sample_shift 3, --sample_guide_scale 5, --base_seed 3407, --frame_num
    # 81) and configs (magref_14B.py: "镜头晃动，" + Wan's negative prompt; shared_config.py: 15 fps): Wan's FlowUniPC
    # from sigma 0.999, WanVAE.encode's mean, the canvas placed by the seed
    Kind("magref", "channel", (1, 8), leading=True, clip=True, background=True, framing="canvas",
         cache_fields=(("version", 3),),
         elements=RELEASED_ELEMENTS[:8], sampling=Sampling(
             schedule="phantom", flow_shift=3.0, encode_mode="argmax", steps=40,
             negative_prompt=MAGREF_NEGATIVE_PROMPT, fps=15, seed=3407, seeded_placement=True),
         sequence="a canvas of {references} references as frame 0, then "),
    # RefAlign's example script (examples/wanvideo/model_inference/Wan2.1-T2V-1.3B_subject.py: seed 0, cfg_scale 5,
    # Wan's negative prompt, 16 fps) and its pipeline (diffsynth/pipelines/wan_video_new3.py: 50 steps, shift 5, CPU
    # noise for the video frames, the 7.5 of U + 5 (I - U) + 7.5 (C - I) hard-coded): DiffSynth's Euler, linspace(1, 0)
    Kind("refalign", "time", (1, 3), native=True, one_frame=True, encode_mean=True, text_to_video_only=True,
         elements=RELEASED_ELEMENTS[:3], sampling=Sampling(
             scheduler="euler", schedule="flowmatch", flow_shift=5.0, encode_mode="argmax", guidance_scale=7.5,
             guidance_scale_img=5.0, negative_prompt=WAN_NEGATIVE_PROMPT, fps=16, seed=0, noise_on_cpu=True,
             timestep_in_dtype=True), original_export="refalign_model.safetensors",
         sequence="(then {ref_latents} clean reference latents, posterior means, no text cross-attention: "
                  "RefAlign's layout) "),
    # Stand-In infer.py (--num_inference_steps 20, --seed 0, Wan's negative prompt, --fps 25) and its DiffSynth
    # pipeline (pipelines/wan_video.py: FlowMatchScheduler shift 5 on linspace(1, 0), cfg_scale 5, rand_device cpu,
    # the timestep in the compute dtype)
    # Wan's VACE code (_VACE); diffusers' WanVACEPipeline as --preset diffusers. Up to 4 references, as VideoX-Fun
    # trains VACE-Fun (0-4 a clip; a2 takes 1-4: with none it is Wan's text-to-video)
    Kind("vace", "context", (1, 4), native=True, leading=True, extends=True, one_frame=True, encode_mean=True,
         framing="fit_white", sampling=_VACE, modes=(("diffusers", _VACE_DIFFUSERS),),
         elements=RELEASED_ELEMENTS[:4],
         original_export="diffusion_pytorch_model.safetensors",  # Wan-AI's Wan2.1-VACE file, beside its config.json
         cache_fields=(("version", 4),),
         sequence="{ref_latents} reference latents (VACE's context, scale {context_scale:g}) + "),
    Kind("standin", "tokens", (1, 1), one_frame=True, slots=1, encode_mean=True, reference_size=STANDIN_SIZE,
         elements=A2_ELEMENTS[:1], sampling=Sampling(
             scheduler="euler", schedule="flowmatch", flow_shift=5.0, encode_mode="argmax", steps=20,
             negative_prompt=WAN_NEGATIVE_PROMPT, fps=25, seed=0, noise_on_cpu=True, timestep_in_dtype=True),
         framing="face", roles=True, cache_fields=(("version", 2), ("reference_size", STANDIN_SIZE)),
         sequence="(then Stand-In's reference tokens of a {size} image: time -1, t 0, self-only attention) "),
    # Kaleido's sample_video.py with its sampling yaml and model yaml (zai-org/Kaleido @ 4c6c757): RFSampler (Euler)
    # on its float64 shifted linspace at shift_scale 7 (sampling.py:889-926: 1 - s / (7 + s - 7 s), to exactly 0), 50
    # steps, VanillaCFG 6 with the references in both branches (sample_video.py:293-294), its negative prompt, sat's
    # seed 1234 (sat/arguments.py:182; their draw follows the model's build, a2 seeds right before it), CPU float32
    # noise of (1, T, C, h, w) (diffusion_video.py:320), 16 fps, the whole video decoded (sample_video.py:322-330);
    # each reference alone, its posterior mean (wan_vae.py:516-542), Lanczos fit on white (sample_video.py:212-228)
    Kind("kaleido", "time", (1, 3), native=True, one_frame=True, encode_mean=True, prepended=True,
         noise_frames_first=True, elements=RELEASED_ELEMENTS[:3], sampling=Sampling(
             scheduler="euler", schedule="kaleido", flow_shift=7.0, encode_mode="argmax", guidance_scale=6.0,
             negative_prompt=KALEIDO_NEGATIVE_PROMPT, fps=16, seed=1234, noise_on_cpu=True, decode="video_only"),
         original_export="mp_rank_00_model_states.pt",  # in SAT's load dir, as the release (a2/kaleido.py save)
         sequence="({ref_latents} clean reference latents first, posterior means, each at RoPE time i, rows and "
                  "columns past 80: Kaleido's layout) "),
)}
KINDS = tuple(KIND_DEFS)
# the base model's own sampler where it differs from the kind's: diffusers' Wan I2V pipelines take the posterior mean
# and the shift the dir ships (A2, the prefix kind's own, samples the posterior at its hard-coded 8)
# VideoX-Fun's examples/wan2.2_vace_fun/predict_s2v.py samples Wan2.2-VACE-Fun A14B with FlowMatch Euler at shift 12
# (config/wan2.2/wan_civitai_t2v.yaml), 50 steps, guidance 5, Wan's negative prompt, seed 43, 16 fps
MODEL_SAMPLING = {"Wan2.2 VACE-Fun A14B": dict(scheduler="euler", schedule="diffusers", flow_shift=12.0, seed=43),
                  "Wan2.1 I2V": dict(encode_mode="argmax", flow_shift=None),
                  "Wan2.2 I2V A14B": dict(encode_mode="argmax", flow_shift=None),
                  "Wan2.2 TI2V 5B": dict(encode_mode="argmax")}


def kind_sampling(kind: str, model: str | None = None, mode: str | None = None) -> Sampling:
    """The sampling of a `kind` on a model named `model` (ModelInfo.name), or the lab's entry point `mode`
    (infer.py --preset); raises ValueError naming the modes the kind has."""
    d = KIND_DEFS[kind]
    if mode is not None:
        modes = dict(d.modes)
        if mode not in modes:
            raise ValueError(f"--preset {mode}: the {kind} kind samples in its own way"
                             + (f" or as {', '.join(modes)}" if modes else "") + "; drop --preset")
        return modes[mode]
    return replace(d.sampling, **MODEL_SAMPLING.get(model, {}))


def kind_elements(kind: str, public: bool = False) -> tuple:
    """The element specs a `kind` takes when none are given (--elements, --element-specs, a dataset config), read
    alike by train_a2.py, data.py validate, a run's validation and infer.py, so training and sampling frame the same
    images the same way: Kind.elements (SkyReels-A2's roles; a released model's references, each one frame framed as
    its lab frames one, A2's files read at the first three positions; Stand-In's one subject). On a public dataset's
    index a kind without roles reads a clip's kept masks as positional references (index_elements)."""
    d = KIND_DEFS[kind]
    return index_elements(kind) if public and not d.roles and d.references[1] else d.elements


def index_elements(kind: str) -> tuple:
    """The elements a kind without roles reads from a public-dataset index with default flags: ref0, ref1, ... (one
    frame each, framed as the labs frame them) up to its maximum, then `background` where the kind uses one. A clip
    fills at most the maximum (a2.data.public_read.clip_elements): with a background png the masks leave it the last
    slot, without one they fill every slot (a V3 clip of 4 masks and no png: 4 references)."""
    d = KIND_DEFS[kind]
    refs = RELEASED_ELEMENTS[:d.references[1]]
    if not d.background:
        return refs
    return refs + (replace(RELEASED_ELEMENTS[0], name="background", suffixes=("_background.png",),
                           position=len(refs)),)


def largest_element_set(kind: str, elements) -> tuple:
    """What a run plans (memory, dry run, validation's pairing) for index_elements(kind): the largest set one clip
    fills, the kind's maximum of references (the masks, or one mask fewer and the background png)."""
    return tuple(elements)[:KIND_DEFS[kind].references[1] or None]
