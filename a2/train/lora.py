"""LoRA files: what training exports and what `infer.py --lora` reads.

Export writes the adapter twice, with peft's scaling (alpha/r) folded into the up matrix so that both files mean
`W + up @ down` under every loader's no-alpha convention (diffusers without metadata takes alpha = r):
  pytorch_lora_weights.safetensors        diffusers keys  transformer.blocks.0.attn1.to_q.lora_A.weight
  pytorch_lora_weights_comfy.safetensors  original Wan    diffusion_model.blocks.0.self_attn.q.lora_down.weight
A LoRA trained on a T2V base expanded to the E2V inputs also trains the weights the expansion created (the widened
patch embedding; with CLIP the image embedder and image K/V) in full. They are written beside the adapter, under
their module names (`transformer.patch_embedding.weight`, ...), in e2v_weights.safetensors: diffusers'
`load_lora_weights` refuses a file holding any key without `lora` (and its Wan loader has no rule for a widened
input layer), so the adapter files stay plain LoRA, loadable by diffusers on an expanded model, and `load_expanded`
builds that model (base T2V + expand_to_e2v + these weights) for infer.py. ComfyUI's Wan LoRA loader cannot widen
a 16-channel base: such a run loads in a2 (or diffusers after load_expanded) only.
The second is what ComfyUI's Wan LoRA loader, the Wan repo's key names and diffusers'
`_convert_non_diffusers_wan_lora_to_diffusers` read. Loading goes through diffusers' own `lora_state_dict`, which
converts original (`diffusion_model.`) and musubi-tuner (`lora_unet_`) keys itself; a peft `save_pretrained` dir is
converted here (peft_dir_state_dict). VACE's context blocks (`vace_blocks.N`) have original keys too
(`diffusion_model.vace_blocks.0.self_attn.q.lora_down.weight`): ComfyUI loads them, as every
`diffusion_model.<module>` of its model (comfy/lora.py model_lora_keys_unet), but diffusers' converter knows no VACE
key, so a file holding them is converted here (read_original).
A training run's export (export: the trained weights and their EMA, a LoRA's files or a full fine-tune's dirs) is
at the end of this file.
"""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import torch
from diffusers.loaders import WanLoraLoaderMixin
from peft import LoraConfig
from peft.tuners.lora import LoraLayer
from peft.utils.other import get_pattern_key
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from torch._subclasses.fake_tensor import is_fake

from a2 import kaleido
from a2.cli import InputError
from a2.config.sections import LORA_TARGETS, LoraSection, OptimConfig, ParallelConfig, TrainModelConfig
from a2.kinds import align, standin
from a2.kinds.conditioning import kind_weights, prepare_model
from a2.model.parallel import gathered
from a2.model.transformer import (
    EXPERTS,
    diffusers_to_original,
    expand_to_e2v,
    is_e2v,
    is_expansion_weight,
    original_to_diffusers,
    original_wan_config,
    save_wan_checkpoint,
    wan_module_name,
    weights_in,
)
from a2.plan import Run
from a2.train.step import TrainState, ema_weights

DIFFUSERS_NAME = "pytorch_lora_weights.safetensors"
E2V_NAME = "e2v_weights.safetensors"  # the expansion's full weights (module docstring); not *pytorch_lora_weights
COMFY_NAME = "pytorch_lora_weights_comfy.safetensors"  # not *pytorch_lora_weights.safetensors: diffusers' dir lookup
# picks the file ending in that name, so a run dir still loads as the diffusers file

# the modules whose LoRA the ComfyUI / diffusers loaders of original-Wan LoRA keys map back (diffusers'
# _convert_non_diffusers_wan_lora_to_diffusers): a LoRA on any other module (a norm, the patch embedding) has no
# original-Wan file, so a run targeting one is refused before training (check_lora_export)
_LORA_BLOCK = ("attn1.to_q", "attn1.to_k", "attn1.to_v", "attn1.to_out.0", "attn2.to_q", "attn2.to_k", "attn2.to_v",
               "attn2.to_out.0", "attn2.add_k_proj", "attn2.add_v_proj", "ffn.net.0.proj", "ffn.net.2",
               "proj_in", "proj_out")  # the last two: VACE's context blocks' before_proj / after_proj
_LORA_TOP = ("proj_out", "condition_embedder.time_proj", "condition_embedder.text_embedder.linear_1",
             "condition_embedder.text_embedder.linear_2", "condition_embedder.time_embedder.linear_1",
             "condition_embedder.time_embedder.linear_2", "condition_embedder.image_embedder.ff.net.0.proj",
             "condition_embedder.image_embedder.ff.net.2")
# safetensors metadata of the two files: which loader each is for ("format": "pt" is safetensors' framework key,
# which transformers and diffusers check)
_LOADER = {
    "diffusers": "diffusers load_lora_weights / a2 infer.py --lora; ComfyUI loads 0 of its keys: use the _comfy file",
    "comfyui": "ComfyUI LoraLoader / LoraLoaderModelOnly (original Wan keys); also a2 infer.py --lora",
}


def original_module(name: str) -> str:
    """diffusers WanTransformer3DModel module name of a LoRA -> the original Wan (and ComfyUI) one."""
    m = re.fullmatch(r"(?:vace_)?blocks\.\d+\.(.+)", name)
    if (m[1] if m else name) in (_LORA_BLOCK if m else _LORA_TOP):
        return wan_module_name(name)
    raise ValueError(f"LoRA on {name!r}: no original-Wan name that ComfyUI/diffusers loaders map back")


def make_trainable(transformer, layout, training_type: str, rank: int, alpha: float, dropout: float = 0.0,
                   target: str = LORA_TARGETS) -> None:
    """What a run trains of `transformer` (train_a2.py and bench.py alike), in place. The kind's own modules
    (Stand-In's processors and reference LoRA of `rank`), then full fine-tuning: every weight, as it is (fp32 master
    weights); a LoRA: the frozen base with the kind's own LoRA, else a peft LoRA (rank, alpha, dropout) on the
    modules `target` matches, the image K/V only where the step feeds CLIP tokens and an expansion does not create
    them, checked exportable before any step (ValueError naming the cause); the weights an expansion creates train
    in full beside it (they have nothing to adapt and ship in e2v_weights); trainable weights in fp32."""
    prepare_model(transformer, layout, rank)
    if training_type != "lora":
        return
    transformer.requires_grad_(False)
    own = kind_weights(transformer, layout)  # Stand-In: its reference LoRA is the adapter
    for p in own:
        p.requires_grad_(True)
    if not own:
        keep_kv = layout.use_clip and not layout.expand  # an expansion's image K/V train in full (below)
        transformer.add_adapter(LoraConfig(r=rank, lora_alpha=alpha, lora_dropout=dropout, init_lora_weights=True,
                                       target_modules=target if keep_kv else
                                       target.replace("|add_k_proj|add_v_proj", "")))
        if transformer.device.type != "meta":  # (a replica of a model checked so: FSDP's, a2/model/parallel.py)
            check_lora_export(transformer)  # export writes original-Wan keys too: a target with none fails now
    if layout.expand:
        for name, p in transformer.named_parameters():
            if is_expansion_weight(name) and ".lora_" not in name:
                p.requires_grad_(True)
    for p in transformer.parameters():
        if p.requires_grad:
            p.data = p.data.float()


def adapter_state_dict(model, adapter: str = "default") -> dict[str, torch.Tensor]:
    """The adapter as `<module>.lora_A/lora_B.weight` (peft names, no prefix), scaling folded into lora_B."""
    sd = {}
    for name, m in model.named_modules():
        if not isinstance(m, LoraLayer) or adapter not in m.lora_A:
            continue
        if m.use_dora.get(adapter) or m.lora_bias.get(adapter):
            raise ValueError(f"{name}: DoRA / LoRA bias have no plain lora_A/lora_B export")
        sd[f"{name}.lora_A.weight"] = m.lora_A[adapter].weight.detach().float().cpu().contiguous()
        sd[f"{name}.lora_B.weight"] = (m.lora_B[adapter].weight.detach().float() * m.scaling[adapter]).cpu()
    if not sd:
        raise ValueError(f"the model has no LoRA adapter {adapter!r}")
    return sd


def to_original(state_dict: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """diffusers LoRA keys (with or without the `transformer.` prefix, scale 1) -> original Wan / ComfyUI keys."""
    out = {}
    for key, value in state_dict.items():
        m = re.fullmatch(r"(?:transformer\.)?(.+)\.lora_(A|B)\.weight", key)
        if m is None:
            raise ValueError(f"{key}: not a diffusers LoRA key (<module>.lora_A/lora_B.weight)")
        out[f"diffusion_model.{original_module(m[1])}.lora_{'down' if m[2] == 'A' else 'up'}.weight"] = value
    return out


def read_original(state_dict: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Original Wan / ComfyUI LoRA keys -> diffusers keys (`transformer.<module>.lora_A/lora_B.weight`): VACE's context
    blocks' here (lora_down -> lora_A, no alpha: a2's files fold it), the rest through diffusers' Wan converter."""
    vace = {k: v for k, v in state_dict.items() if k.startswith("diffusion_model.vace_blocks.")}
    rest = {k: v for k, v in state_dict.items() if k not in vace}
    out = dict(WanLoraLoaderMixin.lora_state_dict(rest)) if rest else {}
    for key, value in vace.items():
        m = re.fullmatch(r"diffusion_model\.(.+)\.lora_(down|up)\.weight", key)
        if m is None:
            raise ValueError(f"{key}: not an original-Wan LoRA weight (<module>.lora_down/lora_up.weight)")
        vace[key] = (f"{m[1]}.lora_{'A' if m[2] == 'down' else 'B'}.weight", value)
    out.update((f"transformer.{k}", v) for k, v in original_to_diffusers(dict(vace.values())).items())
    return out


def check_lora_export(model, adapter: str = "default") -> dict[str, torch.Tensor]:
    """The model's adapter as both export files will hold it: every adapted module has an original-Wan name, and the
    original-Wan keys read back (read_original: diffusers' converter, what infer.py --lora and diffusers do with the
    _comfy file; VACE's keys a2's) give the same tensors. Run before training on the freshly adapted model (a
    --lora-target that cannot be exported fails before step 1), and on the written file at export. Returns the
    original-Wan state dict."""
    sd = adapter_state_dict(model, adapter)
    original = to_original(sd)
    try:
        back = read_original(dict(original))
    except Exception as e:  # the converter's own errors say little about which module is the cause
        raise ValueError(f"the original-Wan LoRA keys do not read back ({type(e).__name__}: {e}): adapted modules "
                         f"{sorted({k.rsplit('.lora_', 1)[0] for k in sd})[:6]}...; diffusers' Wan converter (infer.py "
                         "--lora, load_lora_weights) reads image K/V LoRAs only as a pair: add_k_proj with "
                         "add_v_proj") from None
    want = {f"transformer.{k}": v for k, v in sd.items()}
    # a dry run's adapter has shapes only (fake tensors): its keys are checked
    if back.keys() != want.keys() or any(not is_fake(want[k]) and not torch.equal(back[k], want[k]) for k in want):
        raise ValueError(f"the original-Wan LoRA keys read back as {sorted(set(back) ^ set(want))[:4]} ...: not the "
                         "adapter that was trained")
    return original


def shape_signature(config) -> str:
    """A transformer's shapes as one string (a WanTransformer3DModel config): what tells bases apart that a LoRA's
    own shapes do not (A2-14B and Phantom-Wan-14B have the same attention and FFN widths, not the same inputs)."""
    c = dict(config)
    patch = "x".join(str(p) for p in c.get("patch_size", ()))
    return (f"layers {c.get('num_layers')}, width {c.get('num_attention_heads', 0) * c.get('attention_head_dim', 0)}, "
            f"ffn {c.get('ffn_dim')}, in {c.get('in_channels')}, out {c.get('out_channels')}, text "
            f"{c.get('text_dim')}, image {c.get('image_dim')}, patch {patch}")


def base_metadata(config, family: str, kind: str, model: str) -> dict[str, str]:
    """What an exported LoRA records of what it was trained on (its safetensors metadata; a Stand-In .ckpt's
    "a2_metadata"): the base model as given, its family (detect_model's name, and the released weights' kind),
    its shape signature, and the conditioning kind of the run."""
    return dict(a2_base_model=str(model), a2_base_family=family, a2_base_shapes=shape_signature(config),
                a2_kind=kind)


def read_base_metadata(path) -> dict[str, str]:
    """An a2 LoRA file's base_metadata ({} for a file from another tool or an older a2, or a peft dir)."""
    path = Path(path)
    if path.is_dir():
        path = path / DIFFUSERS_NAME
    if not path.is_file():
        return {}
    if path.suffix == ".safetensors":
        with safe_open(path, "pt") as f:
            meta = f.metadata() or {}
    else:
        try:
            state = torch.load(path, map_location="cpu", weights_only=True)
        except Exception:  # unreadable: the loader says so, in its own words
            return {}
        meta = state.get("a2_metadata", {}) if isinstance(state, dict) else {}
    return {k: v for k, v in meta.items() if k.startswith(("a2_base_", "a2_kind"))}


def base_mismatch(path, meta: dict, config, family: str, kind: str) -> str | None:
    """One line when a LoRA file was trained on another base (family or shapes) or conditioning kind than the run
    it is loaded into; None when it was not (or the file does not say)."""
    if not meta:
        return None
    here = dict(a2_base_family=family, a2_base_shapes=shape_signature(config), a2_kind=kind)
    what = {"a2_base_family": "model", "a2_base_shapes": "shapes", "a2_kind": "kind"}
    diffs = [f"{what[k]} {meta[k]!r}, here {v!r}" for k, v in here.items() if k in meta and meta[k] != v]
    if not diffs:
        return None
    return (f"warning: --lora {path} was trained on another base ({meta.get('a2_base_model', '?')}): "
            + "; ".join(diffs))


def lora_fit_problems(model, sd: dict) -> list[str]:
    """`module: why` for each LoRA pair of a diffusers-keyed state dict that does not fit `model`: a module it lacks,
    or other in/out features than the pair's."""
    problems = []
    for key, t in sd.items():
        m = re.fullmatch(r"transformer\.(.+)\.lora_([AB])\.weight", key)
        if m is None:
            continue
        try:
            module = model.get_submodule(m.group(1))
        except AttributeError:
            if m.group(2) == "A":
                problems.append(f"{m.group(1)}: no such module")
            continue
        base = getattr(module, "base_layer", module)
        side, have, got = (("in", base.in_features, t.shape[1]) if m.group(2) == "A" else
                           ("out", base.out_features, t.shape[0]))
        if have != got:
            problems.append(f"{m.group(1)}: {side} features {got}, the model's {have}")
    return problems


def export_lora(run_dir: Path, model, expert: str | None = None, tag: str = "",
                metadata: dict[str, str] | None = None) -> tuple[Path, Path]:
    """Write both files (module docstring) into run_dir; returns (diffusers file, original/ComfyUI file). Each says in
    its safetensors metadata which loader it is for (a2_format, a2_loader), the _comfy file is read back before it is
    named, and a line names the file for ComfyUI.
    A Wan 2.2 expert's files carry its name: pytorch_lora_weights_high.safetensors, ..._high_comfy.safetensors;
    `tag` follows it (_ema: pytorch_lora_weights_ema.safetensors, ..._ema_comfy.safetensors, e2v_weights_ema)."""
    def meta(fmt):
        return {"format": "pt", "a2_format": fmt, "a2_loader": _LOADER[fmt], **(metadata or {})}

    part = (f"_{expert}" if expert else "") + tag
    names = [n.replace("weights", f"weights{part}") for n in (DIFFUSERS_NAME, COMFY_NAME)]
    sd = adapter_state_dict(model)
    WanLoraLoaderMixin.save_lora_weights(run_dir, transformer_lora_layers=sd, weight_name=names[0],
                                         save_function=lambda w, f: save_file(w, f, metadata=meta("diffusers")))
    comfy, original = run_dir / names[1], check_lora_export(model)
    save_file({k: v.contiguous() for k, v in original.items()}, comfy, metadata=meta("comfyui"))
    written = load_file(comfy)
    if written.keys() != original.keys() or any(not torch.equal(written[k], v) for k, v in original.items()):
        raise OSError(f"{comfy}: does not read back as written")
    full = {f"transformer.{n}": p.detach().float().cpu().contiguous() for n, p in model.named_parameters()
            if p.requires_grad and ".lora_" not in n}  # an expansion's weights (build_transformer trains them)
    if full:
        save_file(full, expansion_file(run_dir / names[0]), metadata={"format": "pt"})
    print(f"LoRA for ComfyUI (LoraLoader, original Wan keys): {comfy}; {run_dir / names[0]} has diffusers keys "
          "(diffusers, infer.py), of which ComfyUI loads none")
    return run_dir / names[0], comfy


def expansion_file(lora: Path) -> Path:
    """Where a LoRA's expansion weights are: e2v_weights[_<expert>][_ema].safetensors beside its file (or in its
    dir)."""
    lora = Path(lora)
    if lora.is_dir():
        return lora / E2V_NAME
    part = re.fullmatch(r"pytorch_lora_weights((?:_high|_low)?(?:_ema)?)(?:_comfy)?\.safetensors", lora.name)
    return lora.parent / (E2V_NAME.replace("weights", f"weights{part[1]}") if part else E2V_NAME)


def load_expanded(base, lora):
    """The T2V transformer `base` expanded to the E2V inputs with the weights a LoRA run trained for the expansion
    (expansion_file(lora)); None when the LoRA has none (its base was not expanded). The image branch is built when
    the file holds one. The LoRA itself is loaded afterwards (load_lora), as on any E2V model."""
    path = expansion_file(lora)
    if not path.is_file():
        return None
    sd = {k.removeprefix("transformer."): v for k, v in load_file(path).items()}
    if is_e2v(base):
        raise ValueError(f"{path}: expansion weights for a T2V base, but the model already takes the E2V inputs")
    norm = sd.get("condition_embedder.image_embedder.norm1.weight")
    model = expand_to_e2v(base, image_dim=None if norm is None else norm.shape[0])
    wanted = {n for n, _ in model.named_parameters() if is_expansion_weight(n)}
    if set(sd) != wanted:
        raise ValueError(f"{path}: expansion weights {sorted(set(sd) ^ wanted)[:4]} do not match this model's "
                         "expansion (another base model?)")
    model.load_state_dict({k: v.to(model.dtype) for k, v in sd.items()}, strict=False)
    return model


def peft_dir_state_dict(path: Path) -> dict[str, torch.Tensor]:
    """A peft `save_pretrained` dir (adapter_config.json + adapter_model.safetensors, what `get_peft_model(...)
    .save_pretrained` writes) -> diffusers keys with peft's scaling folded into lora_B."""
    cfg = json.loads((path / "adapter_config.json").read_text())
    if cfg.get("peft_type", "LORA") != "LORA" or cfg.get("use_dora"):
        raise ValueError(f"{path}: a {cfg.get('peft_type')}{' (DoRA)' if cfg.get('use_dora') else ''} adapter; "
                         "only plain LoRA loads")
    weights = path / "adapter_model.safetensors"
    if not weights.exists():
        raise FileNotFoundError(f"{path}: adapter_config.json without adapter_model.safetensors")
    sd, out = load_file(weights), {}
    for key, value in sd.items():
        m = re.fullmatch(r"(?:base_model\.model\.)?(.+)\.lora_(A|B)\.weight", key)
        if m is None:
            raise ValueError(f"{weights}: {key}: not a lora_A/lora_B weight (LoRA bias, modules_to_save do not load)")
        if m[2] == "B":  # scaling = alpha / r (rsLoRA: alpha / sqrt(r)), alpha per module if alpha_pattern says so
            r = sd[key.replace(".lora_B.", ".lora_A.")].shape[0]
            patterns = cfg.get("alpha_pattern") or {}
            alpha = patterns.get(get_pattern_key(patterns.keys(), m[1]), cfg["lora_alpha"])
            value = value.float() * (alpha / (math.sqrt(r) if cfg.get("use_rslora") else r))
        out[f"transformer.{m[1]}.lora_{m[2]}.weight"] = value
    return out


def load_lora(pipe, path: str, scale: float = 1.0, adapter: str = "default", low_expert: bool = False,
              force: bool = False) -> str:
    """A LoRA -> pipe.transformer (pipe.transformer_2: low_expert, Wan 2.2's low-noise expert). Read: a file or dir in
    diffusers, original Wan/ComfyUI or musubi-tuner keys (diffusers converts them), or a peft save_pretrained dir.
    Returns a line saying what was loaded: the key format, how many LoRA weights the file holds and how many
    modules of the transformer took them (a module adapted without a weight from the file is not counted).

    A file whose pairs do not all fit the transformer (trained on another base: a module it lacks, other widths) is
    refused in one line; force=True loads the pairs that fit. diffusers only warns when no key matched the model,
    so that is an error here. A Stand-In file installs its reference LoRA instead of an adapter (a2.kinds.standin)."""
    path_ = Path(path)
    if not path_.exists():
        raise FileNotFoundError(f"--lora {path}: no such file or dir")
    peft_dir = path_.is_dir() and (path_ / "adapter_config.json").exists()
    target = "transformer_2" if low_expert else "transformer"
    model = getattr(pipe, target)
    if standin.is_lora_file(path_):
        return f"Stand-In LoRA {path}: rank {standin.load_lora(model, path_)} on the {target}, reference tokens only"
    if peft_dir:
        source = peft_dir_state_dict(path_)
    elif _vace_keys(path_):  # diffusers' converter refuses VACE's keys
        source = read_original(load_file(path_))
    else:  # the file's tensors after diffusers' key conversion (what it tries to match)
        source = pipe.lora_state_dict(path)
        source = source[0] if isinstance(source, tuple) else source
    problems = lora_fit_problems(model, source)
    pairs = sum(bool(re.search(r"\.lora_A\.weight$", k)) for k in source)
    misfit = {p.split(":")[0] for p in problems}
    if problems and not force:
        raise InputError(f"--lora {path}: {len(misfit)} of {pairs} LoRA pairs do not fit the {target} "
                         f"({problems[0]}{', ...' if len(problems) > 1 else ''}): trained on another base; "
                         "--force loads the pairs that fit")
    if problems:
        source = {k: v for k, v in source.items() if re.sub(r"^transformer\.|\.lora_[AB]\.weight$", "", k)
                  not in misfit}
    pipe.load_lora_weights(source, adapter_name=adapter, load_into_transformer_2=low_expert)
    if adapter not in (getattr(model, "peft_config", None) or {}):
        raise InputError(f"--lora {path}: no LoRA key matched the {target} (expected diffusers `transformer.`, "
                         "original `diffusion_model.` or musubi `lora_unet_` keys, or a peft adapter dir)")
    model.set_adapters([adapter], [scale])
    modules = pairs - len(misfit)
    fmt = "peft adapter dir" if peft_dir else _key_format(path_)
    return (f"LoRA {path} ({fmt}): {2 * pairs} lora_A/lora_B weights, {modules} modules of {target} adapted "
            f"({2 * modules} weights matched)" + (f", {len(misfit)} pairs skipped (--force)" if misfit else "")
            + f", scale {scale:g}")


LORA_FILES = ("a LoRA .safetensors (a2's pytorch_lora_weights.safetensors, a ComfyUI / musubi-tuner file), a training "
              "run's dir, a peft adapter dir, or a Stand-In .ckpt")


def lora_file_problem(path) -> str | None:
    """Why `path` is no LoRA file or dir load_lora (or Stand-In's loader) reads, in the user's terms; None when it
    is one. Reads the file's keys only (a safetensors header; a torch file's pickle), so a text file, a config.json,
    an empty or truncated file or a dir of no adapter is named before any model loads."""
    path = Path(path)
    if path.is_dir():
        if (path / "adapter_config.json").is_file():
            return None
        inside = next((path / n for n in (DIFFUSERS_NAME, "pytorch_lora_weights.bin") if (path / n).is_file()), None)
        if inside is None:
            return f"a dir without {DIFFUSERS_NAME} or a peft adapter_config.json"
        path = inside
    suffix = path.suffix.lower()
    if suffix not in (".safetensors", ".ckpt", ".pt", ".pth", ".bin"):
        return f"a {suffix or 'suffix-less'} file"
    try:
        keys = list(weights_in(path, shapes_only=True))
    except Exception as e:  # safetensors, zipfile and pickle raise many types for a file that is not theirs
        if not path.stat().st_size:
            return "an empty file"
        return ("not a safetensors file: " + " ".join(str(e).split())[:80] if suffix == ".safetensors" else
                f"not a PyTorch checkpoint of tensors ({type(e).__name__})")
    if not any("lora" in k.lower() for k in keys):
        return f"{len(keys)} tensors, none a LoRA weight" + (f" (e.g. {keys[0]})" if keys else "")
    return None


def _vace_keys(path: Path) -> bool:
    """A LoRA file with keys of VACE's context blocks (original Wan keys: diffusion_model.vace_blocks.N...)."""
    return path.is_file() and any(k.startswith("diffusion_model.vace_blocks.") for k in weights_in(path, True))


def _key_format(path: Path) -> str:
    """diffusers | original Wan / ComfyUI | musubi-tuner, from the first key of the file (a dir: diffusers' file)."""
    f = path if path.is_file() else next(iter(sorted(path.glob("*.safetensors"))), None)
    if f is None or f.suffix != ".safetensors":  # a .bin/.pt file: diffusers reads those too
        return "diffusers keys"
    with safe_open(f, "pt") as fh:
        key = next(iter(fh.keys()), "")
    return ("original Wan / ComfyUI keys" if key.startswith("diffusion_model.") else
            "musubi-tuner keys" if key.startswith("lora_unet_") else "diffusers keys")


# ---------------------------------------------------------------- a training run's export (train_a2.py)


def export_weights(run_dir: Path, model, lora: LoraSection, expert: str | None, tag: str = "",
                   metadata: dict | None = None, original_keys: str | None = None, log=print) -> Path:
    """LoRA -> pytorch_lora_weights.safetensors (diffusers format, load_lora_weights reads it) and
    pytorch_lora_weights_comfy.safetensors (original Wan keys: ComfyUI), export_lora;
    full fine-tune -> a save_pretrained transformer dir, and the same weights as one bf16 file in original Wan keys,
    transformer_comfy.safetensors (ComfyUI, Wan's code). `model`: unsharded (--fsdp: a2/model/parallel.py gathered's).
    A Wan 2.2 expert's export names it: pytorch_lora_weights_high|low*.safetensors (keys `transformer.*`, as
    diffusers writes both; `load_lora_weights(..., load_into_transformer_2=True)` puts the low one on its expert),
    or transformer/ (high) | transformer_2/ (low), the subfolder it replaces in the model dir.
    `tag` ends the names (_ema: the EMA weights, export). original_keys (a full fine-tune of an original-key
    checkpoint: its kind's Layout.original_export, Phantom-Wan.pth or RefAlign's refalign_model.safetensors): also
    transformer_original/<original_keys>, the weights in original-Wan keys as Phantom's own code
    loads them (torch.load), with the Wan config.json a2 reads them back with."""
    if lora.training_type == "lora":
        if standin.installed(getattr(model, "module", model)):  # Stand-In's file, its keys (their loader reads it)
            return standin.export_lora(run_dir, getattr(model, "module", model),
                                       (f"_{expert}" if expert else "") + tag, metadata)
        with align.without_projectors(model) as bare:  # (trainable, not LoRA: e2v_weights would take them)
            return export_lora(run_dir, bare, expert, tag, metadata)[0]
    out = run_dir / ((EXPERTS[expert] if expert else "transformer") + tag)
    with align.without_projectors(model) as model:  # the alignment loss's projectors are no part of the model
        model.save_pretrained(out)
        comfy = save_wan_checkpoint(model.state_dict(), out.with_name(f"{out.name}_comfy.safetensors"))
        log(f"full model for ComfyUI (Load Diffusion Model) and Wan's own code, bf16 in original Wan keys: {comfy}")
        if original_keys:
            original = run_dir / "transformer_original"
            original.mkdir(exist_ok=True)
            (original / "config.json").write_text(json.dumps(original_wan_config(model.config), indent=2))
            sd = {k: v.detach().cpu().contiguous() for k, v in diffusers_to_original(model.state_dict()).items()}
            if original_keys == kaleido.CHECKPOINT:  # Kaleido's SAT load dir (sample_video.py's --load)
                kaleido.save(original, sd)
            elif original_keys.endswith(".safetensors"):  # (RefAlign's pipeline reads safetensors)
                save_file(sd, original / original_keys)
            else:
                torch.save(sd, original / original_keys)
    return out


def export(run_dir: Path, state: TrainState, model: TrainModelConfig, lora: LoraSection, optim: OptimConfig,
           parallel: ParallelConfig, run: Run, rank: int, prepare, log=print) -> dict:
    """The trained weights, and with --ema-decay their EMA beside them (tag _ema: pytorch_lora_weights_ema.safetensors
    + _ema_comfy, e2v_weights_ema, or transformer_ema/), exported from rank 0 (--fsdp: gathered first by
    a2/model/parallel.py gathered, a collective on every rank), each LoRA file with its base's metadata; a full
    fine-tune of a lab's original-key checkpoint (Phantom-Wan, RefAlign) also in those keys (the trained weights alone:
    the EMA's would take the same transformer_original/ name). `prepare(model)` makes a gathered model trainable as the
    run's was (train_a2.py prepare_trainable)."""
    original_keys = run.layout.original_export if run.info.original_weights else None
    metadata = base_metadata(state.transformer.config, run.info.name, run.layout.kind, model.model)
    out = {}
    for key, tag in (("weights", ""), ("ema_weights", "_ema"))[:2 if optim.ema_decay else 1]:
        with ema_weights(state.opt, state.params, enabled=bool(tag)):
            trained = (gathered(state.transformer, prepare, lora.training_type == "lora") if parallel.fsdp
                       else state.transformer)
            out[key] = None if rank else export_weights(run_dir, trained, lora, model.expert, tag, metadata,
                                                        None if tag else original_keys, log)
        del trained
        log(f"exported {'the EMA weights ' if tag else ''}{out[key]}")
    return out
