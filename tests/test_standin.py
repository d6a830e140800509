"""Stand-In's reference tokens (a2/kinds/standin.py) on a tiny T2V Wan: the split attention is the masked full
attention, cached K/V sampling is the uncached one, a2's forward is Stand-In's (tests/their_standin.py, written from
their code), the restriction costs less than the extra tokens, and Stand-In's LoRA file loads with clear errors."""


import numpy as np
import pytest
import torch
import torch.nn.functional as F
from diffusers import WanTransformer3DModel
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.flop_counter import FlopCounterMode

from a2.config.dataset_config import ConditioningConfig
from a2.elements import Element
from a2.kinds import standin
from a2.model.transformer import TEXT_TOKENS, preset_config
from tests.conftest import drawn_person
from tests.their_standin import TheirStandIn, their_sampling

RANK = 8
GRID = (3, 8, 12)  # latent frames, height, width of the video: 3 x 4 x 6 = 72 tokens
REF = (6, 6)  # the reference latent: 3 x 3 = 9 tokens
STANDIN = ConditioningConfig(reference_layout="standin")


def tiny_t2v(seed=0):
    torch.manual_seed(seed)
    model = WanTransformer3DModel(**preset_config("tiny", e2v=False)).eval()
    standin.install(model, rank=RANK)
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():  # a trained LoRA, not the zero init (which would hide its placement)
        for name, p in model.named_parameters():
            if "_lora." in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.05)
    return model


def their_loras(model):
    return {i: {p: (getattr(b.attn1.processor, f"{p}_lora").down.weight, getattr(b.attn1.processor, f"{p}_lora").up
                    .weight) for p in "qkv"} for i, b in enumerate(model.blocks)}


def inputs(seed=2):
    g = torch.Generator().manual_seed(seed)
    latents = torch.randn(1, 16, *GRID, generator=g)
    reference = torch.randn(1, 16, 1, *REF, generator=g)
    text = torch.randn(1, TEXT_TOKENS, 32, generator=g)
    negative = torch.randn(1, TEXT_TOKENS, 32, generator=g)
    return latents, reference, text, negative


class MaskedFullAttention(standin.StandInAttnProcessor):
    """attn1 as one attention over video + reference tokens with an explicit boolean mask (video rows: every key;
    reference rows: reference keys only), or no mask (mask=False: the unrestricted attention)."""

    def __init__(self, processor, mask=True):
        torch.nn.Module.__init__(self)
        self.q_lora, self.k_lora, self.v_lora = processor.q_lora, processor.k_lora, processor.v_lora
        self.num_reference, self.keep, self.kv, self.mask = processor.num_reference, False, None, mask

    def __call__(self, attn, hidden_states, encoder_hidden_states=None, attention_mask=None, rotary_emb=None):
        n, total = self.num_reference, hidden_states.shape[1]
        cos, sin = rotary_emb
        video = self.qkv(attn, hidden_states[:, :total - n], cos[:, :total - n], sin[:, :total - n], False)
        ref = self.qkv(attn, hidden_states[:, total - n:], cos[:, total - n:], sin[:, total - n:], True)
        q, k, v = (torch.cat([a, b], 1).transpose(1, 2) for a, b in zip(video, ref))
        allowed = torch.ones(total, total, dtype=torch.bool)
        allowed[total - n:, :total - n] = False
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=allowed if self.mask else None)
        return attn.to_out[0](out.transpose(1, 2).flatten(2))


def with_attn1(model, make):
    saved = [b.attn1.processor for b in model.blocks]
    for b, p in zip(model.blocks, saved):
        b.attn1.set_processor(make(p))
    return saved


@torch.no_grad()
def test_no_reference_is_plain_wan():
    """Installed, with no reference and nothing kept: diffusers' WanTransformer3DModel, bit for bit."""
    model = tiny_t2v()
    latents, _, text, _ = inputs()
    t = torch.tensor([700.0])
    assert torch.equal(standin.forward(model, latents, t, text), model(latents, t, text).sample)


@torch.no_grad()
def test_split_attention_equals_masked_attention():
    """Split attention (video queries on video + reference keys, reference queries on reference keys) == one
    attention with the explicit mask, in one layer and through the model. Not bit for bit: the masked softmax sums
    the reference rows' exponentials over 81 keys (72 exact zeros) where the split one sums 9, and float32 sums in
    another order round differently: a few float32 ulps of values ~1 (bound 1e-5). Without the mask the reference
    rows come out different."""
    model = tiny_t2v()
    latents, reference, text, _ = inputs()
    attn, processor = model.blocks[0].attn1, model.blocks[0].attn1.processor
    lv, lr = GRID[0] * GRID[1] * GRID[2] // 4, REF[0] * REF[1] // 4
    x = torch.randn(1, lv + lr, 128, generator=torch.Generator().manual_seed(5))
    rotary = tuple(torch.cat([a, b], 1) for a, b in zip(
        model.rope(latents), standin.reference_rotary(model.rope, (GRID[0], GRID[1] // 2, GRID[2] // 2), (1, 3, 3))))
    processor.num_reference = lr
    split = processor(attn, x, rotary_emb=rotary)
    masked = MaskedFullAttention(processor)(attn, x, rotary_emb=rotary)
    unrestricted = MaskedFullAttention(processor, mask=False)(attn, x, rotary_emb=rotary)
    assert (split - masked).abs().max() < 1e-5
    assert (split - unrestricted)[:, lv:].abs().max() > 1e-2  # the restriction matters

    t = torch.tensor([700.0])
    split = standin.forward(model, latents, t, text, reference_latents=reference)
    with_attn1(model, MaskedFullAttention)
    assert (split - standin.forward(model, latents, t, text, reference_latents=reference)).abs().max() < 1e-5


def a2_sampling(model, latents, reference, text, negative, sigmas, cache: bool, cfg=5.0):
    """The same loop as their_sampling through a2.kinds.standin.forward: with the cache ("fill" at the first positive
    pass, "use" after), or the reference recomputed in every pass."""
    standin.clear_cache(model)
    for k, sigma in enumerate(sigmas[:-1]):
        t = (sigma * 1000).expand(1)
        if cache:
            posi = standin.forward(model, latents, t, text, reference_latents=reference if k == 0 else None,
                                   cache="fill" if k == 0 else "use")
            nega = standin.forward(model, latents, t, negative, cache="use")
        else:
            posi = standin.forward(model, latents, t, text, reference_latents=reference)
            nega = standin.forward(model, latents, t, negative, reference_latents=reference)
        latents = latents + (nega + cfg * (posi - nega)) * (sigmas[k + 1] - sigma)
    return latents


def sigmas(steps=3, shift=5.0):  # Stand-In's FlowMatchScheduler(shift=5, sigma_min=0, extra_one_step=True) + 0
    s = torch.linspace(1.0, 0.0, steps + 1)[:-1]
    return torch.cat([shift * s / (1 + (shift - 1) * s), torch.zeros(1)])


# Bound of the float32 residuals below: values ~1 that differ by a few float32 ulps (1.2e-7 at 1) per operation where
# the two sides round differently, carried through 2 layers (and 3 sampling steps with CFG 5): 2e-5 (~170 ulps).
# Observed here: 0 (cache), 7e-7 (separate FFN), 3e-6 (Wan's float64 sinusoid and RoPE).
BOUND = 2e-5


@torch.no_grad()
def test_cached_sampling_equals_uncached():
    """The reference K/V kept from the first positive pass (and used by the negative passes, as Stand-In does) give
    the latents of recomputing the reference in every pass: the reference tokens' path depends on no timestep, text
    or video token. Bit for bit on this CPU; in general within BOUND, as a cached pass runs the video tokens' FFN
    in a matrix product of 72 rows and an uncached one in 81 (the reference rows appended), and CPU kernels may round
    a row differently with the row count. A cache of another reference is far off."""
    model = tiny_t2v()
    latents, reference, text, negative = inputs()
    cached = a2_sampling(model, latents, reference, text, negative, sigmas(), cache=True)
    uncached = a2_sampling(model, latents, reference, text, negative, sigmas(), cache=False)
    assert (cached - uncached).abs().max() <= BOUND
    other = a2_sampling(model, latents, reference * 0.5, text, negative, sigmas(), cache=True)
    assert (cached - other).abs().max() > 100 * BOUND
    with pytest.raises(ValueError, match="cache='use'"):
        standin.clear_cache(model)
        standin.forward(model, latents, torch.tensor([1.0]), text, cache="use")


@torch.no_grad()
def test_forward_is_stand_ins():
    """a2.kinds.standin.forward == Stand-In's forward written out (their_standin.py) on the same weights and LoRA, bit
    for bit, when the reference's FFN is one matrix product with the video's (diffusers' block, a2) and diffusers'
    rounding of the time embedding, RoPE and RMSNorm is used. Stand-In's FFN of the reference alone, and its own
    roundings (float64 sinusoid and complex128 RoPE cast to float32, x*rsqrt(mean+eps)), are the whole residual:
    within BOUND. Without the reference the output is far off."""
    model = tiny_t2v()
    latents, reference, text, _ = inputs()
    t = torch.tensor([700.0])
    ours = standin.forward(model, latents, t, text, reference_latents=reference)
    loras = their_loras(model)
    assert torch.equal(ours, TheirStandIn(model, loras, wan_numerics=False, joint_ffn=True)(latents, t, text,
                                                                                              reference))
    for wan in (False, True):  # the separate FFN may round alike or not, by the CPU's kernels and thread count
        theirs = TheirStandIn(model, loras, wan_numerics=wan)(latents, t, text, reference)
        assert (ours - theirs).abs().max() <= BOUND
    assert (ours - standin.forward(model, latents, t, text)).abs().max() > 100 * BOUND


@torch.no_grad()
def test_sampling_is_stand_ins():
    """Stand-In's loop with its own per-block cache (filled by the first positive pass, used by every later pass,
    the negative ones too) == a2's cached sampling: bit for bit with the joint FFN and diffusers' rounding, within
    BOUND as Stand-In computes."""
    model = tiny_t2v()
    latents, reference, text, negative = inputs()
    ours = a2_sampling(model, latents, reference, text, negative, sigmas(), cache=True)
    loras = their_loras(model)
    joint = TheirStandIn(model, loras, wan_numerics=False, joint_ffn=True)
    assert torch.equal(ours, their_sampling(joint, latents, reference, text, negative, sigmas()))
    theirs = their_sampling(TheirStandIn(model, loras, wan_numerics=True), latents, reference, text, negative,
                            sigmas())
    assert 0 < (ours - theirs).abs().max() <= BOUND


def count(model, fn):
    with sdpa_kernel(SDPBackend.MATH), FlopCounterMode(display=False) as fc:  # math SDPA: its bmm are counted
        fn()
    return fc.get_total_flops()


@torch.no_grad()
def test_restriction_costs_no_more_than_the_extra_tokens():
    """FLOPs counted (torch's FlopCounterMode) on the tiny model: the reference tokens with the restriction add
    less than the same tokens with unrestricted attention, by exactly the attention-core FLOPs of the reference
    queries on the video keys (4·Lr·Lv·d per layer); a cached step adds only the video queries on the reference keys
    (4·Lv·Lr·d per layer)."""
    model = tiny_t2v()
    latents, reference, text, _ = inputs()
    t = torch.tensor([700.0])
    d, layers = 128, len(model.blocks)
    lv, lr = GRID[0] * GRID[1] * GRID[2] // 4, REF[0] * REF[1] // 4
    video = count(model, lambda: standin.forward(model, latents, t, text))
    restricted = count(model, lambda: standin.forward(model, latents, t, text, reference_latents=reference,
                                                      cache="fill"))
    cached = count(model, lambda: standin.forward(model, latents, t, text, cache="use"))
    saved = with_attn1(model, lambda p: MaskedFullAttention(p, mask=False))
    unrestricted = count(model, lambda: standin.forward(model, latents, t, text, reference_latents=reference))
    for b, p in zip(model.blocks, saved):
        b.attn1.set_processor(p)
    assert restricted - video < unrestricted - video
    assert unrestricted - restricted == layers * 4 * lr * lv * d
    assert cached - video == layers * 4 * lv * lr * d
    print(f"\ntiny FLOPs: video {video}, +reference restricted {restricted - video}, unrestricted "
          f"{unrestricted - video}, cached step {cached - video}")


@torch.no_grad()
def test_reference_is_stand_ins_1024_tokens_at_any_video_size():
    """The standin layout of a 480x832 video (as of any other size) takes Stand-In's 512x512 reference: 64x64 latents,
    packed after the video's 60x104 ones in one latent frame (zero padded) and read back exactly, 32x32 = 1024
    reference tokens (at time -1, past the 30x52 token grid), as their model was trained.
    A reference latent that does not fit in whole frames of a small video takes several (4x6 latents: 171 frames)."""
    from a2.kinds.conditioning import Conditioning, make_layout, model_input, prepare_model
    from a2.model.tiny import model_path
    from a2.model.transformer import detect_model
    from a2.plan import sampling_plan

    layout = sampling_plan(detect_model(model_path("tiny-t2v")), (1,), STANDIN, 1)  # a 480x832 Wan T2V video's
    assert layout == make_layout("standin", 1, (1,), e2v_type="vae")
    assert layout.reference_size == (512, 512)  # Stand-In's FaceProcessor crop
    assert layout.reference_grid == (64, 64) and "512x512" in layout.describe()
    g = torch.Generator().manual_seed(0)
    x_t, reference = torch.randn(1, 16, 1, 60, 104, generator=g), torch.randn(1, 16, 1, 64, 64, generator=g)
    hidden, _ = model_input(x_t, Conditioning("standin", ref_latents=reference), torch.tensor([500.0]))
    assert hidden.shape == (1, 16, 2, 60, 104)
    x, unpacked = standin.unpack_reference(hidden, layout.reference_grid)
    assert torch.equal(x, x_t) and torch.equal(unpacked, reference)
    assert hidden[:, :, 1].flatten(2)[:, :, 4096:].abs().max() == 0  # 60·104 - 4096 zeros
    small = standin.pack_reference(x_t[..., :4, :6], reference)
    assert small.shape[2] == 1 + 171 and torch.equal(standin.unpack_reference(small, (64, 64))[1], reference)

    model = tiny_t2v()
    prepare_model(model, layout)
    lengths = []
    model.blocks[0].attn1.register_forward_pre_hook(lambda m, a, kw: lengths.append(a[0].shape[1]), with_kwargs=True)
    model(hidden_states=hidden, timestep=torch.tensor([500.0]), encoder_hidden_states=torch.zeros(1, TEXT_TOKENS, 32))
    assert lengths == [30 * 52 + 32 * 32]
    # what the memory plan and the throughput count: the same tokens (a 5-frame 480x832 clip: 2 latent frames)
    info = detect_model(model_path("tiny-t2v"))
    assert make_layout("standin", 5, (1,), e2v_type="vae").tokens(info, 480, 832) == 2 * 30 * 52 + 32 * 32


# ---------------------------------------------------------------- Stand-In's LoRA file


def their_file(model, path, wrap=True, drop=None, **edit):
    """A Stand-In LoRA file as set_condition_branch reads it: blocks.<i>.self_attn.<q|k|v>_loras.<down|up>.weight
    (a torch pickle, under "state_dict" when wrap)."""
    state = {f"blocks.{i}.self_attn.{p}_loras.{part}.weight": w.clone()
             for i, lora in their_loras(model).items() for p, pair in lora.items() for part, w in zip(("down", "up"),
                                                                                                     pair)}
    state.pop(drop, None)
    state.update(edit)
    torch.save({"state_dict": state} if wrap else state, path)
    return state


@torch.no_grad()
def test_lora_file_loads(tmp_path):
    """Their file onto a fresh model: the same forward as the model it came from, and exported back to their keys."""
    source = tiny_t2v()
    state = their_file(source, tmp_path / "standin.ckpt")
    torch.manual_seed(0)
    model = WanTransformer3DModel(**preset_config("tiny", e2v=False)).eval()
    assert standin.load_lora(model, tmp_path / "standin.ckpt") == RANK
    latents, reference, text, _ = inputs()
    t = torch.tensor([300.0])
    assert torch.equal(standin.forward(model, latents, t, text, reference_latents=reference),
                       standin.forward(source, latents, t, text, reference_latents=reference))
    exported = standin.lora_state_dict(model)
    assert exported.keys() == state.keys() and all(torch.equal(exported[k], state[k]) for k in state)
    their_file(source, tmp_path / "plain.ckpt", wrap=False)
    standin.load_lora(model, tmp_path / "plain.ckpt")


def test_lora_file_errors(tmp_path):
    source = tiny_t2v()
    model = WanTransformer3DModel(**preset_config("tiny", e2v=False)).eval()
    other = WanTransformer3DModel(**{**preset_config("tiny", e2v=False), "num_layers": 3}).eval()
    their_file(source, tmp_path / "two.ckpt")
    with pytest.raises(ValueError, match=r"two\.ckpt: a Stand-In LoRA for a 2-layer, 128-wide Wan on this 3-layer, "
                                         r"128-wide model: load it on its base \(Stand-In_wan2.1_T2V_14B.ckpt on "):
        standin.load_lora(other, tmp_path / "two.ckpt")
    narrow = WanTransformer3DModel(**{**preset_config("tiny", e2v=False), "num_attention_heads": 2})
    standin.install(narrow, rank=RANK)
    their_file(narrow, tmp_path / "narrow.ckpt")
    with pytest.raises(ValueError, match=r"narrow\.ckpt: a Stand-In LoRA for a 2-layer, 64-wide Wan on this 2-layer, "
                                         r"128-wide model: load it on its base"):
        standin.load_lora(model, tmp_path / "narrow.ckpt")
    bent = torch.zeros(128, RANK + 1)
    their_file(source, tmp_path / "bent.ckpt", **{"blocks.1.self_attn.k_loras.up.weight": bent})
    with pytest.raises(ValueError, match=r"bent\.ckpt: blocks\.1\.self_attn\.k_loras\.up\.weight is \(128, 9\) where "
                                         r"blocks\.0\.self_attn\.q_loras\.down\.weight is \(8, 128\): a damaged"):
        standin.load_lora(model, tmp_path / "bent.ckpt")
    their_file(source, tmp_path / "extra.ckpt", **{"blocks.0.attn1.to_q.lora_A.weight": bent})
    with pytest.raises(ValueError, match=r"extra\.ckpt: 'blocks\.0\.attn1\.to_q\.lora_A\.weight' is not a Stand-In"):
        standin.load_lora(model, tmp_path / "extra.ckpt")
    their_file(source, tmp_path / "cut.ckpt", drop="blocks.1.self_attn.v_loras.up.weight")
    with pytest.raises(ValueError, match=r"cut\.ckpt: no blocks\.1\.self_attn\.v_loras\.up\.weight: an incomplete"):
        standin.load_lora(model, tmp_path / "cut.ckpt")
    (tmp_path / "junk.ckpt").write_bytes(b"not a pickle")
    with pytest.raises(ValueError, match=r"junk\.ckpt: not a readable Stand-In LoRA"):
        standin.load_lora(model, tmp_path / "junk.ckpt")


# ---------------------------------------------------------------- the standin kind through A2Pipeline


@torch.no_grad()
def test_pipeline_samples_stand_in_with_the_kv_cache(tmp_path):
    """A2Pipeline with reference_layout standin on tiny-t2v carrying a Stand-In LoRA file: the first positive pass
    computes the reference tokens, the 5 later passes (CFG's negative ones too) use their kept K/V, and the latents
    equal recomputing the reference in every pass (standin_cache False) within BOUND (the FFN row count, above);
    another reference gives other latents; a second call with another reference does not reuse the first's K/V.
    The reference is Stand-In's 512x512 image (1024 tokens) at this 32x48 video; one of the video's size is refused.
    The references are two drawn persons, a landscape and a square picture (framed to 512x512 as read)."""
    from a2.images import load_references
    from a2.kinds.conditioning import make_layout
    from a2.pipeline import A2Pipeline

    pipe = A2Pipeline.from_pretrained("tiny-t2v")
    their_file(tiny_t2v(), tmp_path / "standin.ckpt")
    assert standin.load_lora(pipe.transformer, tmp_path / "standin.ckpt") == RANK
    h, w = 32, 48
    layout = make_layout("standin", 9, (1,), e2v_type="vae")
    files = [tmp_path / "person.png", tmp_path / "other.png"]
    drawn_person((720, 1280)).save(files[0])
    drawn_person((1250, 1250), seed=1, background="white").save(files[1])
    refs = [load_references([(Element("face", ()), p)], (h, w), layout=layout)[0] for p in files]
    assert refs[0].shape == (1, 1, 3, 512, 512)
    lengths = []
    pipe.transformer.blocks[0].attn1.register_forward_pre_hook(lambda m, a, kw: lengths.append(a[0].shape[1]),
                                                               with_kwargs=True)

    def sample(ref):
        return pipe("a face", ref, None, layout=pipe.plan(9, (1,)), height=h, width=w, num_inference_steps=3,
                    guidance_scale=5.0, generator=torch.Generator().manual_seed(0), decode="none",
                    progress=False)["latents"]  # the file's kind, its encode

    ref_tokens = 32 * 32  # whatever the video's size
    video_tokens = 3 * (h // 16) * (w // 16)
    cached = sample(refs[0])
    assert lengths == [video_tokens + ref_tokens] + [video_tokens] * 5
    other = sample(refs[1])
    assert lengths[6] == video_tokens + ref_tokens  # a new reference: computed again, not the kept one
    again = sample(refs[0])
    pipe.transformer.standin_cache = False
    uncached = sample(refs[0])
    assert lengths[18:] == [video_tokens + ref_tokens] * 6
    assert torch.equal(cached, again) and (cached - uncached).abs().max() <= BOUND
    assert (cached - other).abs().max() > 100 * BOUND
    with pytest.raises(ValueError, match=r"the standin kind takes 1 reference image\(s\) for the element repeats "
                                         r"\(1,\), got 2"):
        pipe("a face", torch.cat(refs, 1), None, layout=pipe.plan(9, (1,)), height=h, width=w, num_inference_steps=1,
             progress=False, decode="none")
    with pytest.raises(ValueError, match=r"the standin kind holds at most 1 reference\(s\) \(its slots\), got 2"):
        pipe.plan(9, (1, 1))
    video_sized = load_references([(Element("face", ()), files[0])], (h, w))[0]
    with pytest.raises(ValueError, match=r"the standin kind's reference is a 512x512 image \(Stand-In's face crop\) "
                                         r"whatever the video's size, got 32x48"):
        pipe("a face", video_sized, None, layout=pipe.plan(9, (1,), STANDIN), height=h, width=w,
             num_inference_steps=1, progress=False, decode="none")


def test_train_export_load_in_theirs_infer_and_compose(data_dir, tmp_path):
    """train_a2.py --reference-layout standin trains Stand-In's reference LoRA alone (no peft adapter) on tiny-t2v and
    exports it as Stand-In's file; their forward (their_standin.py, fed the file's tensors by their key names) equals
    a2's on it; infer.py renders with it, and with it plus an ordinary Wan LoRA (two --lora files, either order):
    each changes the video."""
    import infer
    from a2.pipeline import A2Pipeline
    from tests.conftest import args, train

    kind = ("--reference-layout", "standin", "--num-frames", "9", "--elements", "subject=_person.png",
            "--lora-rank", str(RANK))
    r = train(*args(data_dir, tmp_path, "si", "--max-steps", "2", "--lr", "5e-2", "--warmup-steps", "0", *kind,
                    model="tiny-t2v"))
    assert r["weights"].name == "standin_lora.ckpt"
    state = torch.load(r["weights"], weights_only=True)["state_dict"]  # as their set_condition_branch reads it
    assert all(standin.THEIR_KEY.fullmatch(k) for k in state) and len(state) == 6 * 2
    # trained away from the zero init, except the last block's q: its reference queries' output is never read (the
    # reference tokens do not reach the head), so that LoRA gets no gradient, in Stand-In's training as here
    last_q = "blocks.1.self_attn.q_loras.up.weight"
    assert all(v.abs().max() > 0 for k, v in state.items() if ".up." in k and k != last_q)
    assert state[last_q].abs().max() == 0
    model = A2Pipeline.from_pretrained("tiny-t2v").transformer
    standin.load_lora(model, r["weights"])
    loras = {i: {p: (state[f"blocks.{i}.self_attn.{p}_loras.down.weight"],
                     state[f"blocks.{i}.self_attn.{p}_loras.up.weight"]) for p in "qkv"} for i in range(2)}
    latents, reference, text, _ = inputs()
    t = torch.tensor([500.0])
    with torch.no_grad():
        assert torch.equal(standin.forward(model, latents, t, text, reference_latents=reference),
                           TheirStandIn(model, loras, wan_numerics=False, joint_ffn=True)(latents, t, text, reference))
    wan = train(*args(data_dir, tmp_path, "wan", "--max-steps", "1", "--lr", "5e-2", "--warmup-steps", "0",
                      "--dataset-type", "t2v", "--num-frames", "9", model="tiny-t2v"))["weights"]
    base = dict(model="tiny-t2v", elements=(str(data_dir / "000_person.png"),), element_specs=("subject=_person.png",),
                height=32, width=32, num_frames=9, steps=2, device="cpu", conditioning=STANDIN,
                out=str(tmp_path / "v.mp4"))
    runs = {}
    for name, lora in (("base", ()), ("standin", (str(r["weights"]),)), ("both", (str(r["weights"]), str(wan)))):
        runs[name] = str(tmp_path / f"{name}.pt")
        assert infer.main(infer.InferConfig.from_flags(**base, lora=lora, save_latents=runs[name])) == 0
    assert infer.main(infer.InferConfig.from_flags(**base, lora=(str(r["weights"]),), compare=runs["base"])) == 1
    chosen = {k: v for k, v in base.items() if k != "reference_layout"}  # the file chooses its kind and sampler
    assert infer.main(infer.InferConfig.from_flags(**chosen, lora=(str(r["weights"]),), compare=runs["standin"],
                                                   tolerance=0.0)) == 0
    assert infer.main(infer.InferConfig.from_flags(**base, lora=(str(r["weights"]),), compare=runs["both"])) == 1
    assert infer.main(infer.InferConfig.from_flags(**base, lora=(str(wan), str(r["weights"])), compare=runs["both"],
                                                   tolerance=0.0)) == 0
    with pytest.raises(ValueError, match=r"standin_lora.ckpt: a Stand-In LoRA on a model of 36 input channels"):
        standin.load_lora(A2Pipeline.from_pretrained("tiny").transformer, r["weights"])


# ---------------------------------------------------------------- Stand-In's whole sampler


def record_forwards(*transformers):
    """Every forward's keyword inputs, in call order, over the given transformers (tagged with their index)."""
    seen = []
    for i, model in enumerate(transformers):
        model.register_forward_pre_hook(lambda m, a, kw, i=i: seen.append(dict(kw, expert=i)), with_kwargs=True)
    return seen


@pytest.mark.parametrize("base", ["wan21", "wan22"])
def test_a2_samples_as_stand_ins_pipeline(base, tmp_path, monkeypatch):
    """infer.py with a Stand-In file (--lora; on Wan 2.2 one per expert, --lora-high / --lora-low) and only the flags
    Stand-In's infer.py takes (the image, the prompt, --num_inference_steps; its --seed 0 and Wan's negative prompt
    left to the defaults; the size and frames, which its pipeline fixes at 480x832, 81) against Stand-In's
    WanVideoPipeline.__call__ written out (their_standin.their_pipeline) at its defaults, float32 on the CPU, on
    tiny-t2v (wan21) and on the tiny Wan 2.2 T2V pair (wan22: the low-noise expert from timestep 875 down, its cache
    filled by its first positive pass): the reference latent, the initial noise, every forward's inputs (noisy
    latents, the packed reference, the timestep, text) and the final latents are equal bit for bit, their forward
    computed with the joint FFN and diffusers' rounding (test_forward_is_stand_ins: the only differences); with
    Stand-In's own arithmetic within BOUND. Their schedule is not diffusers' FlowMatchEuler default (which ends near
    sigma 0.005): the same sampler on it gives other latents. The video is 32x48 and the reference Stand-In's 512x512
    face crop (FaceProcessor's size, 1024 tokens), packed after the video's latents in 171 frames of 4x6 latents (the
    last one zero padded)."""
    import infer
    from a2.images import pil_to_tensor, preprocess_image, read_image
    from a2.kinds.kinds import WAN_NEGATIVE_PROMPT
    from a2.model.tiny import model_path
    from a2.pipeline import A2Pipeline, encode_prompt, schedule_sigmas
    from tests.their_standin import flow_match_sigmas, their_pipeline

    model = model_path("tiny-t2v" if base == "wan21" else "tiny-wan22-t2v")
    pipe = A2Pipeline.from_pretrained(model)
    experts = [pipe.transformer] + ([pipe.transformer_2] if base == "wan22" else [])
    sources = [tiny_t2v(seed=2 * i) for i in range(len(experts))]
    files = []
    for i, (expert, source) in enumerate(zip(experts, sources)):
        files.append(str(tmp_path / f"standin{i}.ckpt"))
        their_file(source, files[-1])
        standin.load_lora(expert, files[-1])
    h, w, frames, steps = 32, 48, 9, 3 if base == "wan21" else 4
    photo = tmp_path / "person.png"  # a face crop (a drawn person, landscape)
    drawn_person((720, 1280)).save(photo)
    # a face crop, framed to their 512x512 as a2 frames it (theirs: white pad to square, INTER_AREA resize)
    image = preprocess_image(read_image(photo), "fit_pad_white", (512, 512))
    prompt = "a person smiling"
    text, null = (encode_prompt(pipe.tokenizer, pipe.text_encoder, [p]) for p in (prompt, WAN_NEGATIVE_PROMPT))
    seen, lengths, call = [], [], A2Pipeline.__call__  # the tokens self-attention sees: with the reference's
    # (computed) or the video's alone (cached)

    def recorded(self, *a, **kw):  # every forward's inputs, through infer.py's own pipeline
        models = [m for m in (self.transformer, self.transformer_2) if m is not None]
        handles = [m.register_forward_pre_hook(lambda m, a, kw, i=i: seen.append(dict(kw, expert=i)),
                                               with_kwargs=True) for i, m in enumerate(models)]
        handles += [m.blocks[0].attn1.register_forward_pre_hook(lambda m, a, kw: lengths.append(a[0].shape[1]),
                                                                with_kwargs=True) for m in models]
        try:
            return call(self, *a, **kw)
        finally:
            for handle in handles:
                handle.remove()

    monkeypatch.setattr(A2Pipeline, "__call__", recorded)
    loras = dict(lora=(files[0],)) if base == "wan21" else dict(lora_high=files[0], lora_low=files[1])
    assert infer.main(infer.InferConfig.from_flags(model=str(model), elements=(str(photo),), prompt=prompt, height=h,
                                                   width=w, num_frames=frames, steps=steps, device="cpu", decode="none",
                                                   save_latents=str(tmp_path / "a2.pt"), **loras)) == 0
    ours, calls = torch.load(tmp_path / "a2.pt"), list(seen)
    computed = [n > 3 * (h // 16) * (w // 16) for n in lengths]
    with torch.no_grad():
        kw = dict(num_frames=frames, height=h, width=w, steps=steps)  # their seed: its default, 0
        their = [TheirStandIn(m, their_loras(m), wan_numerics=False, joint_ffn=True) for m in experts]
        them = their_pipeline(their, pipe.vae, image, text, null, **kw)
    assert ours["condition"].shape == (1, 16, 1, 64, 64) and torch.equal(ours["condition"], them["condition"])
    unpacked = [standin.unpack_reference(c["hidden_states"], (64, 64)) for c in calls]
    assert calls[0]["hidden_states"].shape[2] == 3 + 171 and torch.equal(unpacked[0][0], them["initial"])
    last = calls[0]["hidden_states"][:, :, -1].flatten(2)  # (1, 16, 24): the reference's last 4096 - 170·24, zeros
    assert torch.equal(last[:, :, :16], them["condition"].flatten(2)[:, :, -16:]) and last[:, :, 16:].abs().max() == 0
    assert len(calls) == len(them["calls"]) == 2 * steps
    for k, ((x, reference), a, (latents, t, context, ip, expert)) in enumerate(zip(unpacked, calls, them["calls"])):
        assert torch.equal(x, latents), k
        assert torch.equal(reference, them["condition"]), k  # packed; used once, then the cache
        assert a["timestep"].dtype == t.dtype and torch.equal(a["timestep"], t), k
        assert torch.equal(a["encoder_hidden_states"], context) and a["expert"] == expert, k
        assert computed[k] == (ip is not None), k  # the reference computed where theirs passes ip_image, else cached
    if base == "wan22":
        assert [c[4] for c in them["calls"]] == [0, 0, 0, 0, 1, 1, 1, 1]  # timesteps 1000, 938 | 833, 625
        assert [c[3] is not None for c in them["calls"]] == [True, False, False, False, True, False, False, False]
    assert torch.equal(ours["latents"], them["latents"])
    sigmas, _ = flow_match_sigmas(steps)
    assert torch.equal(torch.from_numpy(schedule_sigmas("flowmatch", steps)), torch.linspace(1.0, 0.0, steps + 1)[:-1])
    assert sigmas[0] == 1.0 and sigmas[-1] > 0  # the last step goes from sigmas[-1] to 0
    with torch.no_grad():
        own = their_pipeline([TheirStandIn(m, their_loras(m), wan_numerics=True) for m in experts], pipe.vae, image,
                             text, null, **kw)
        assert 0 < (ours["latents"] - own["latents"]).abs().max() <= BOUND
        diffusers_euler = np.linspace(1.0, 1 / 1000, steps)  # FlowMatchEulerDiscreteScheduler's own, near 0.005
        other = call(pipe, prompt, pil_to_tensor(image)[None, None], None, layout=pipe.plan(frames, (1,)), height=h,
                     width=w, num_inference_steps=steps, sigmas=diffusers_euler, decode="none", progress=False)
    assert (ours["latents"] - other["latents"]).abs().max() > 100 * BOUND


# ---------------------------------------------------------------- Wan 2.2 A14B experts; base vs LoRA rows


def test_wan22_experts_train_export_infer_and_base_rows(data_dir, tmp_path, monkeypatch):
    """train_a2.py --reference-layout standin on each expert of the tiny Wan 2.2 T2V pair exports Stand-In's file per
    expert (standin_lora_high / _low.ckpt, as their Stand-In_wan2.2_T2V_A14B_high / _low.ckpt); infer.py --preset
    standin takes them as --lora-high / --lora-low: each changes the video, repeatably. --prompts-file renders the
    base rows with the reference LoRAs off: equal to a run without the files, bit for bit (the LoRA rows equal a run
    with them). A Stand-In file on an I2V base, or on a base of other dims, fails in one line naming the file."""
    import infer
    from tests.conftest import args, train

    kind = ("--reference-layout", "standin", "--num-frames", "9", "--elements", "subject=_person.png",
            "--lora-rank", str(RANK), "--max-steps", "2", "--lr", "5e-2", "--warmup-steps", "0")
    files = {}
    for expert in ("high", "low"):
        r = train(*args(data_dir, tmp_path, expert, "--expert", expert, *kind, model="tiny-wan22-t2v"))
        files[expert] = r["weights"]
        assert r["weights"].name == f"standin_lora_{expert}.ckpt"
        state = torch.load(r["weights"], weights_only=True)["state_dict"]
        assert all(standin.THEIR_KEY.fullmatch(k) for k in state) and len(state) == 6 * 2
        assert any(v.abs().max() > 0 for k, v in state.items() if ".up." in k)  # trained away from the zero init
    element = str(data_dir / "000_person.png")
    base = dict(model="tiny-wan22-t2v", conditioning=STANDIN, elements=(element,),
                element_specs=("subject=_person.png",), height=32, width=32, num_frames=9, steps=4, device="cpu",
                out=str(tmp_path / "v.mp4"))
    runs = {}
    for name, loras in (("base", {}), ("high", dict(lora_high=str(files["high"]))),
                        ("both", dict(lora_high=str(files["high"]), lora_low=str(files["low"])))):
        runs[name] = str(tmp_path / f"{name}.pt")
        assert infer.main(infer.InferConfig.from_flags(**base, **loras, save_latents=runs[name])) == 0
    both = dict(lora_high=str(files["high"]), lora_low=str(files["low"]))
    assert infer.main(infer.InferConfig.from_flags(**base, lora_high=str(files["high"]), compare=runs["base"])) == 1
    assert infer.main(infer.InferConfig.from_flags(**base, **both, compare=runs["high"])) == 1
    assert infer.main(infer.InferConfig.from_flags(**base, **both, compare=runs["both"], tolerance=0.0)) == 0

    rendered = []  # the latents of each --prompts-file render: base, LoRA
    generate = infer.generate
    monkeypatch.setattr(infer, "generate", lambda *a, **k: rendered.append(generate(*a, **k)) or rendered[-1])
    (tmp_path / "prompts.txt").write_text(infer.InferConfig.prompt + "\n")
    assert infer.main(infer.InferConfig.from_flags(**base, **both, prompts_file=str(tmp_path / "prompts.txt"),
                                                   out_dir=str(tmp_path / "eval"))) == 0
    assert len(rendered) == 2
    assert torch.equal(rendered[0]["latents"], torch.load(runs["base"])["latents"])
    assert torch.equal(rendered[1]["latents"], torch.load(runs["both"])["latents"])

    with pytest.raises(ValueError, match=r"^\S*standin_lora_high\.ckpt: a Stand-In LoRA on \S*tiny-wan22-i2v\S* "
                                         r"\(.*\); Stand-In is a LoRA on Wan T2V: load it on its base \(Stand-In_wan"):
        infer.main(infer.InferConfig.from_flags(**{**base, "model": "tiny-wan22-i2v",
                                                   "conditioning": ConditioningConfig()},
                                                lora_high=str(files["high"])))
    deep = WanTransformer3DModel(**{**preset_config("tiny", e2v=False), "num_layers": 3})
    standin.install(deep, rank=RANK)
    their_file(deep, tmp_path / "deep.ckpt")
    with pytest.raises(ValueError, match=r"deep\.ckpt: a Stand-In LoRA for a 3-layer, 128-wide Wan on this 2-layer, "
                                         r"128-wide model: load it on its base"):
        infer.main(infer.InferConfig.from_flags(**base, lora_low=str(tmp_path / "deep.ckpt")))
