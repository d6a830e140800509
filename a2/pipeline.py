"""A2Pipeline: Elements-to-Video inference on Wan: element images, prompt and image encoding, the denoising loop,
decoding, video files. The conditioning (what the transformer is given, per kind) is a2/kinds/conditioning.py's, shared
with training, and so is how element images become references (a2/images.py: reference_pixels, load_references).
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import numpy as np
import torch
from diffusers.loaders import WanLoraLoaderMixin
from PIL import Image
from tqdm import tqdm

from a2.config.dataset_config import ConditioningConfig, check_size
from a2.images import preprocess_image, tensor_to_uint8
from a2.kinds import standin
from a2.kinds.conditioning import (
    VAE_T,
    Layout,
    drop,
    initial_latents,
    latent_stats,
    model_input,
    num_latent_frames,
    prepare_latents,
    prepare_model,
    restore,
    vae_scale,
    video_prediction,
)
from a2.kinds.kinds import kind_sampling, model_flow_shift, schedule_sigmas
from a2.model.tiny import model_path
from a2.model.transformer import TEXT_TOKENS, detect_model, expert_for_timestep, load_transformer
from a2.plan import sampling_plan

# ---------------------------------------------------------------- text and image encoders


def encode_prompt(tokenizer, text_encoder, prompts: list[str], max_length: int = TEXT_TOKENS) -> torch.Tensor:
    """T5 embeddings (B, 512, D): real tokens then exact zeros, as Wan was trained.

    Always 512 tokens: diffusers' Wan attention takes the last 512 context tokens as text and the
    rest as image tokens, so a shorter text would silently be read as image tokens."""
    from diffusers.pipelines.wan.pipeline_wan import prompt_clean

    prompts = [prompt_clean(p) for p in prompts]
    inputs = tokenizer(prompts, padding="max_length", max_length=max_length, truncation=True,
                       add_special_tokens=True, return_attention_mask=True, return_tensors="pt")
    device = next(text_encoder.parameters()).device
    ids, mask = inputs.input_ids.to(device), inputs.attention_mask.to(device)
    seq_lens = mask.gt(0).sum(dim=1)
    emb = text_encoder(ids, mask).last_hidden_state  # (B, 512, D)
    keep = torch.arange(max_length, device=device)[None, :] < seq_lens[:, None]
    return emb * keep[..., None].to(emb.dtype)


def encode_image(image_encoder, image_processor, clip_pixels: torch.Tensor) -> torch.Tensor:
    """CLIP penultimate hidden states of each element, concatenated in position order.

    clip_pixels: (B, N, 3, h, w) in [-1, 1], already preprocessed to the CLIP resolution.
    Returns (B, N*257, C). The uint8 round trip is exact for images that came from uint8 files, and
    lets CLIPImageProcessor do the same resize/crop/normalise as for a PIL image."""
    b, n = clip_pixels.shape[:2]
    images = list(tensor_to_uint8(clip_pixels.flatten(0, 1)))
    device = next(image_encoder.parameters()).device
    pixel_values = image_processor(images=images, return_tensors="pt").pixel_values
    pixel_values = pixel_values.to(device, next(image_encoder.parameters()).dtype)
    hidden = image_encoder(pixel_values=pixel_values, output_hidden_states=True).hidden_states[-2]
    return hidden.reshape(b, n * hidden.shape[1], hidden.shape[2])  # (B, N*257, C)


def encode_canvas(image_encoder, image_processor, canvas: torch.Tensor) -> torch.Tensor:
    """MAGREF's CLIP tokens of its canvas (B, 3, H, W) in [-1, 1]: squashed to the CLIP size with torch bicubic (no
    crop, as Wan's clip.visual), to [0, 1], CLIP-normalised, penultimate hidden states (B, 257, C)."""
    size = (image_processor.crop_size["height"], image_processor.crop_size["width"])
    param = next(image_encoder.parameters())
    x = torch.nn.functional.interpolate(canvas.to(param.device, torch.float32), size=size, mode="bicubic",
                                        align_corners=False).mul(0.5).add(0.5)
    mean = torch.tensor(image_processor.image_mean, device=x.device).view(1, -1, 1, 1)
    std = torch.tensor(image_processor.image_std, device=x.device).view(1, -1, 1, 1)
    x = (x - mean) / std
    return image_encoder(pixel_values=x.to(param.dtype), output_hidden_states=True).hidden_states[-2]


def image_tokens(image_encoder, image_processor, cond, clip_pixels: torch.Tensor | None) -> torch.Tensor:
    """The CLIP image tokens of a Conditioning: its canvas' (magref), else the element images' (encode_image)."""
    if cond.canvas is not None:
        return encode_canvas(image_encoder, image_processor, cond.canvas)
    if clip_pixels is None:
        raise ValueError("this model has an image branch: pass CLIP element images (clip_references)")
    return encode_image(image_encoder, image_processor, clip_pixels)


# ---------------------------------------------------------------- VAE latents


def decode_vae(vae, latents: torch.Tensor) -> torch.Tensor:
    """Normalised latents (B, C, T, h, w) (C: 16, Wan 2.2's VAE 48) -> pixels (B, 3, 4(T-1)+1, H, W) in [-1, 1]."""
    vae_param = next(vae.parameters())
    mean, std = latent_stats(vae, latents.device, torch.float32)
    z = latents.float() / (1.0 / std) + mean  # diffusers' Wan pipelines: latents / (1 / std) + mean
    return vae.decode(z.to(vae_param.device, vae_param.dtype), return_dict=False)[0].float().clamp(-1, 1)


# ---------------------------------------------------------------- the pipeline

def make_scheduler(name: str, flow_shift: float, num_train_timesteps: int = 1000):
    """UniPC (A2 and Wan's default; A2 uses flow_shift 8) or FlowMatchEuler, both in flow-matching mode."""
    from diffusers import FlowMatchEulerDiscreteScheduler, UniPCMultistepScheduler

    if name == "unipc":
        return UniPCMultistepScheduler(prediction_type="flow_prediction", use_flow_sigmas=True,
                                       num_train_timesteps=num_train_timesteps, flow_shift=flow_shift)
    if name == "euler":
        return FlowMatchEulerDiscreteScheduler(num_train_timesteps=num_train_timesteps, shift=flow_shift)
    raise ValueError(f"unknown scheduler {name!r}; choose unipc or euler")


def load_encoders(model_dir: Path, image_encoder_dir: Path | None, dtype: torch.dtype):
    """The frozen encoders of a model dir: VAE (always fp32), tokenizer, T5, and CLIP + its processor from
    `image_encoder_dir` (None: no image branch). Returns (vae, tokenizer, text_encoder, image_encoder,
    image_processor), on the CPU, in eval mode, without gradients."""
    from diffusers import AutoencoderKLWan
    from transformers import AutoTokenizer, CLIPImageProcessor, CLIPVisionModel, UMT5EncoderModel

    # the vae/ dir itself: from_pretrained(dir, subfolder=) takes a diffusion_pytorch_model.safetensors in the dir
    # first, and Wan-AI's Wan2.1-VACE release keeps its DiT under that name, beside which its parts may be put
    vae = AutoencoderKLWan.from_pretrained(Path(model_dir) / "vae", torch_dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(Path(model_dir) / "tokenizer")
    text_encoder = UMT5EncoderModel.from_pretrained(model_dir, subfolder="text_encoder", torch_dtype=dtype)
    image_encoder = image_processor = None
    if image_encoder_dir is not None:
        image_encoder = CLIPVisionModel.from_pretrained(image_encoder_dir, subfolder="image_encoder", torch_dtype=dtype)
        image_processor = CLIPImageProcessor.from_pretrained(image_encoder_dir, subfolder="image_processor")
    for m in (vae, text_encoder, image_encoder):
        if m is not None:
            m.eval().requires_grad_(False)
    return vae, tokenizer, text_encoder, image_encoder, image_processor


class A2Pipeline(WanLoraLoaderMixin):
    """Prompt + element images -> video, on an E2V (A2 / Wan I2V) or T2V Wan transformer, or a Wan 2.2
    A14B expert pair (`transformer` for the high-noise steps, `transformer_2` below the boundary).

    A plain class (diffusers' WanImageToVideoPipeline takes one image); LoRA loading comes from
    diffusers' Wan loader mixin, so `load_lora_weights` reads diffusers, original-Wan and musubi keys
    (`load_into_transformer_2=True` puts a LoRA on the low-noise expert)."""

    _lora_loadable_modules = ["transformer", "transformer_2"]
    transformer_name = "transformer"
    hf_device_map = None  # read by the LoRA loader mixin (no accelerate device map here)

    def __init__(self, transformer, vae, tokenizer, text_encoder, image_encoder=None, image_processor=None,
                 transformer_2=None, boundary_ratio: float | None = None, flow_shift: float = 8.0,
                 expand_timesteps: bool = False, model: str | None = None, info=None):
        if (transformer_2 is None) != (boundary_ratio is None):
            raise ValueError("a Wan 2.2 expert pair needs both transformer_2 and boundary_ratio")
        self.transformer, self.vae = transformer, vae
        self.tokenizer, self.text_encoder = tokenizer, text_encoder
        self.image_encoder, self.image_processor = image_encoder, image_processor
        self.transformer_2, self.boundary_ratio = transformer_2, boundary_ratio
        self.flow_shift = flow_shift  # the sampler shift when a call gives none (from_pretrained: the model's)
        self.expand_timesteps = expand_timesteps  # Wan 2.2 TI2V-5B: per-token timesteps, first frame replaced
        self.model = model  # ModelInfo.name: whose sampler a kind's defaults are (a2.kinds.kinds.kind_sampling)
        self.info = info  # a2.model.transformer.ModelInfo (from_pretrained): what `plan` plans for

    @classmethod
    def from_pretrained(cls, model_dir, dtype: torch.dtype = torch.float32, device="cpu", transformer=None,
                        image_encoder_dir=None, transformer_2=None, components=None):
        """Load each component from a diffusers-format dir (`tiny`... = a built-in offline tiny model).

        The dir is checked by `detect_model` (clear error for unsupported ones); a Wan 2.2 A14B dir loads both
        experts. `transformer` / `transformer_2` replace the dir's own (a trained model in memory). A Phantom-Wan
        checkpoint takes its VAE and text encoder from its Wan parts dir (`components`, else ModelInfo's default)."""
        info = detect_model(model_path(model_dir), image_encoder_dir and model_path(image_encoder_dir), components)
        model_dir = info.path
        transformer = transformer if transformer is not None else load_transformer(model_dir, dtype)
        if info.two_experts and transformer_2 is None:
            transformer_2 = load_transformer(model_dir, dtype, subfolder="transformer_2")
        if transformer.config.image_dim is not None and info.image_encoder_dir is None:
            raise FileNotFoundError(f"{model_dir}: the transformer has an image branch but there is no "
                                    "image_encoder/; pass --image-encoder DIR")
        vae, tokenizer, text_encoder, image_encoder, image_processor = load_encoders(
            info.parts_dir, info.image_encoder_dir if transformer.config.image_dim is not None
            else None, dtype)
        pipe = cls(transformer, vae, tokenizer, text_encoder, image_encoder, image_processor,
                   transformer_2 if info.two_experts else None, info.boundary_ratio,
                   expand_timesteps=info.expand_timesteps, model=info.name,
                   flow_shift=model_flow_shift(info.parts_dir), info=info)
        return pipe.to(device)

    def to(self, device):
        for m in (self.transformer, self.transformer_2, self.vae, self.text_encoder, self.image_encoder):
            if m is not None:
                m.to(device).eval()
        return self

    @property
    def device(self):
        return next(self.transformer.parameters()).device

    @property
    def components(self) -> dict:  # read by the LoRA loader mixin
        return dict(transformer=self.transformer, transformer_2=self.transformer_2, vae=self.vae,
                    text_encoder=self.text_encoder, image_encoder=self.image_encoder)

    def plan(self, num_frames: int, elements=(), conditioning: ConditioningConfig | None = None, *,
             first_frame: bool = False, seed: int | None = None) -> Layout:
        """The layout a call samples in, for library callers: a2.plan.sampling_plan on this model, the plan
        infer.py and train_a2.py make. elements: Elements or their frame counts (A2's: (1, 4, 4)); first_frame:
        a TI2V-5B image-to-video call; seed: the call's, which MAGREF's canvas placement follows."""
        if self.info is None:
            raise ValueError("A2Pipeline.plan needs the model's ModelInfo: build it with from_pretrained, or pass "
                             "info=a2.model.transformer.detect_model(...)")
        return sampling_plan(self.info, elements, conditioning or ConditioningConfig(), num_frames,
                             first_frame=first_frame, image_branch=self.image_encoder is not None, seed=seed,
                             reference_lora=standin.installed(self.transformer))

    @torch.no_grad()
    def __call__(
        self,
        prompt: str,
        references: torch.Tensor | None = None,
        clip_references: torch.Tensor | None = None,
        *,
        layout: Layout,
        negative_prompt: str | None = None,
        height: int = 480,
        width: int = 832,
        num_frames: int | None = None,
        num_inference_steps: int | None = None,
        guidance_scale: float | None = None,
        guidance_scale_2: float | None = None,
        guidance_scale_img: float | None = None,
        scheduler: str | None = None,
        schedule: str | None = None,
        sigmas=None,
        flow_shift: float | None = None,
        sample_mode: str | None = None,
        seed: int | None = None,
        generator: torch.Generator | None = None,
        fps: int | None = None,
        preset: str | None = None,
        decode: str | None = None,
        progress: bool = True,
        first_frame: torch.Tensor | None = None,
        region: torch.Tensor | None = None,
        control_video: torch.Tensor | None = None,
        mask: torch.Tensor | None = None,
    ) -> dict:
        """Generate one video.

        references: (1, N, 3, H, W) VAE-path element images in [-1, 1] (standin: Stand-In's 512x512
        reference); clip_references (1, N, 3, h, w)
        the CLIP-path ones (None for models without an image branch), as load_references gives them for the kind
        (the magref kind: its one canvas, and `region` (1, H, W) where the element images are on it). Noise is drawn
        first, then the posterior is sampled with the same generator (A2's order, needed for bit-parity).
        layout: the conditioning kind and its shapes (a2/kinds/conditioning.py), planned once: infer.py's and training's
        plan, or `self.plan(...)` for a library caller. `first_frame` (1, 3, H, W) is a TI2V-5B image-to-video call's
        first frame (its clean latent replaces the first latent frame at timestep 0). VACE (layout kind vace):
        `control_video` (1, 3, F, H, W) in [-1, 1], F the layout's clip_frames, and its `mask` (1, F, H, W), 1 where
        VACE generates (none: all of it); neither: R2V, the references alone (a2/kinds/vace.py: encode).

        Every sampling setting left out (None) is the kind's own sampler's on this model (a2.kinds.kinds.Sampling,
        kind_sampling; `preset`: another of the lab's entry points, infer.py --preset): this is the one place they are
        filled, so infer.py, a run's validation and a library call sample alike. negative_prompt, num_inference_steps,
        guidance_scale, guidance_scale_img, scheduler (unipc | euler), schedule (the unshifted sigmas,
        a2.kinds.kinds.SCHEDULES; `sigmas`: an ndarray of num_inference_steps values instead), flow_shift (a kind
        without its own: the model dir's, `self.flow_shift`), sample_mode (the VAE encode: sample | argmax), seed (the
        noise generator's, on the CPU or the device as the kind draws it; `generator` instead: a library caller's own),
        fps (returned for the writer), decode. Returns them as `sampling`.
        decode: "drop_refs" decodes all latents and drops the 4·L_ref reference frames (A2, MAGREF);
        "video_only" decodes the video latents alone (VACE); "all" keeps everything; "none" skips the VAE.
        Wan 2.2 pair: each step runs `transformer` when its timestep >= boundary_ratio * num_train_timesteps,
        else `transformer_2` with guidance_scale_2 (default: guidance_scale), exactly as diffusers' Wan pipelines.
        guidance_scale_img (incontext, phantom, v3, refalign): reference guidance as Phantom-Wan and SkyReels-V3 R2V
        sample, three forwards a step: u + s_img·(r − u) + s·(c − r) with u = (no references, negative prompt),
        r = (references, negative prompt), c = (references, prompt), s = guidance_scale (Phantom: s 7.5, s_img 5).
        None (a kind without it): text CFG only, the references in both branches (the same as s_img = 1, one forward
        fewer). Returns dict(video (1, 3, F', H, W) in [-1, 1] or None, latents, condition (Conditioning.tensor: the
        channel condition, the in-context reference latents, or the clean leading latents), num_ref_latents, sampling
        (the Sampling it used))."""
        transformer = self.transformer  # the only one, or the high-noise expert of a Wan 2.2 pair
        s = vae_scale(self.vae)
        if num_frames not in (None, layout.num_frames):
            raise ValueError(f"num_frames {num_frames}: the layout was planned for {layout.num_frames}")
        num_frames = layout.num_frames
        check_size(height, width, num_frames, s * transformer.config.patch_size[1])
        device, dtype = self.device, transformer.dtype
        if (references is not None) != layout.takes_references or (first_frame is not None) != bool(
                layout.clean_frames):
            raise ValueError(f"the {layout.kind} layout takes " + ("reference images" if layout.takes_references
                             else "no reference images") + (" and a first frame" if layout.clean_frames else ""))
        if (control_video is not None or mask is not None) and not layout.context_blocks:
            raise ValueError(f"a control video and its mask are VACE's; the {layout.kind} layout takes none")
        for model in (transformer, self.transformer_2):
            if model is not None:
                prepare_model(model, layout)
        if guidance_scale_img is not None and not layout.appended:
            raise ValueError("guidance_scale_img (reference guidance) is for reference_layout incontext and the "
                             "Phantom-Wan / SkyReels-V3 R2V / RefAlign models")
        if self.boundary_ratio is None and guidance_scale_2 is not None:
            raise ValueError("guidance_scale_2 is for the low-noise expert of a Wan 2.2 A14B pair")
        given = dict(scheduler=scheduler, schedule=schedule, flow_shift=flow_shift, encode_mode=sample_mode,
                     steps=num_inference_steps, guidance_scale=guidance_scale, guidance_scale_img=guidance_scale_img,
                     negative_prompt=negative_prompt, seed=seed, fps=fps, decode=decode)
        own = replace(kind_sampling(layout.kind, self.model, preset), **{k: v for k, v in given.items()
                                                                         if v is not None})
        own = replace(own, flow_shift=self.flow_shift if own.flow_shift is None else own.flow_shift,
                      seed=None if generator is not None else own.seed)
        if generator is None:  # the noise on the CPU where the lab draws it there (DiffSynth's rand_device)
            generator = torch.Generator("cpu" if own.noise_on_cpu else device).manual_seed(own.seed)
        if own.seeded_placement and own.seed is not None and layout.placement_seed not in (None, own.seed):
            raise ValueError(f"the canvas was placed by seed {layout.placement_seed} (the layout's) and the noise "
                             f"would be drawn from seed {own.seed}: plan the layout with seed={own.seed}")
        sched = make_scheduler(own.scheduler, own.flow_shift)
        if sigmas is None:
            sigmas = schedule_sigmas(own.schedule, own.steps)
        if sigmas is None:
            sched.set_timesteps(own.steps, device=device)
        else:  # the released model's own schedule (shifted by the scheduler)
            sched.set_timesteps(sigmas=sigmas, device=device)
        sample_mode, guidance_scale, guidance_scale_img = own.encode_mode, own.guidance_scale, own.guidance_scale_img

        prompt_embeds = encode_prompt(self.tokenizer, self.text_encoder, [prompt]).to(dtype)
        negative_embeds = None
        if guidance_scale > 1.0 or guidance_scale_img is not None:
            negative_embeds = encode_prompt(self.tokenizer, self.text_encoder, [own.negative_prompt]).to(dtype)
        shape = (1, transformer.config.out_channels, num_latent_frames(num_frames), height // s, width // s)
        latents = initial_latents(layout, shape, generator, device)
        video = first_frame[:, :, None] if first_frame is not None else control_video
        region = mask if mask is not None else region  # VACE's mask, or MAGREF's canvas region
        cond = prepare_latents(  # after the noise, as A2 and diffusers draw
            self.vae, layout, references=None if references is None else references.to(device),
            video=None if video is None else video.to(device), sample_mode=sample_mode,
            generator=generator, region=None if region is None else region.to(device))
        if transformer.config.image_dim is not None:  # from the element images, or the canvas they make (magref)
            cond.image = image_tokens(self.image_encoder, self.image_processor, cond, clip_references).to(dtype)
        empty = drop(cond, torch.zeros(1, device=device)) if guidance_scale_img is not None else None

        def predict(model, x_t, t, c, text):
            x, timestep = model_input(x_t, c, t.expand(1), model.config.patch_size)
            if own.timestep_in_dtype:  # the lab's pipeline hands the DiT its timestep in the compute dtype
                timestep = timestep.to(dtype).to(timestep.dtype)
            image = None if c.image is None else c.image.to(dtype)
            return video_prediction(model(hidden_states=x.to(dtype), timestep=timestep, encoder_hidden_states=text,
                                          encoder_hidden_states_image=image, return_dict=False)[0], c)

        guidance_scale_2 = guidance_scale if guidance_scale_2 is None else guidance_scale_2
        for t in tqdm(sched.timesteps, disable=not progress, desc="denoising"):
            low = expert_for_timestep(t, self.boundary_ratio, sched.config.num_train_timesteps) == "low"
            model, scale = (self.transformer_2, guidance_scale_2) if low else (transformer, guidance_scale)
            noise_pred = predict(model, latents, t, cond, prompt_embeds)
            if negative_embeds is not None:  # CFG on text: the same image tokens and references in both (A2)
                noise_uncond = predict(model, latents, t, cond, negative_embeds)
                if empty is not None:  # Phantom / V3: the unconditional has no references
                    noise_none = predict(model, latents, t, empty, negative_embeds)
                    noise_pred = noise_none + guidance_scale_img * (noise_uncond - noise_none) \
                        + scale * (noise_pred - noise_uncond)
                else:
                    noise_pred = noise_uncond + scale * (noise_pred - noise_uncond)
            latents = sched.step(noise_pred.float(), t, latents, return_dict=False)[0]
        latents = restore(latents, cond)

        num_ref, decode = cond.num_ref_latents, own.decode
        video = None
        if decode == "drop_refs":
            video = decode_vae(self.vae, latents)[:, :, VAE_T * num_ref:]
        elif decode == "video_only":
            video = decode_vae(self.vae, latents[:, :, num_ref:])
        elif decode == "all":
            video = decode_vae(self.vae, latents)
        elif decode != "none":
            raise ValueError(f"unknown decode mode {decode!r}")
        return dict(video=video, latents=latents, condition=cond.tensor, num_ref_latents=num_ref, sampling=own)


def save_video(path, video: torch.Tensor, fps: int = 15, references: torch.Tensor | None = None) -> Path:
    """Write (3, F, H, W) in [-1, 1] as mp4; with references (N, 3, h, w), each frame gets the
    references to its left, as A2's infer.py does (brought to the video's height H where they are not at it:
    Stand-In's 512x512 reference)."""
    import imageio.v3 as iio

    frames = tensor_to_uint8(video.permute(1, 0, 2, 3))  # (F, H, W, 3)
    if references is not None and len(references):
        refs = tensor_to_uint8(references)  # (N, h, w, 3)
        h = frames.shape[1]
        if refs.shape[1] != h:
            size = (h, max(1, round(refs.shape[2] * h / refs.shape[1])))
            refs = np.stack([np.asarray(preprocess_image(Image.fromarray(r), "resize", size)) for r in refs])
        refs = np.concatenate(list(refs), axis=1)  # (H, N*w, 3)
        frames = np.stack([np.concatenate([refs, f], axis=1) for f in frames])
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    iio.imwrite(path, frames, fps=fps, codec="libx264", plugin="pyav")
    return path
