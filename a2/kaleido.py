"""Kaleido (zai-org/Kaleido, weights zai-org/Kaleido-14B-S2V): Wan2.1-T2V-14B with up to three subject references
as clean latent frames before the video's, each at its own RoPE position.

What is particular to it, read from the lab's code (zai-org/Kaleido @ 4c6c757):
- the references, each its own 1-frame clip, posterior mean, framed at the video's size (Lanczos fit on white:
  sample_video.py:212-230), are prepended to x_t on the time axis (dit_video_crossattn.py:1198), share the sample's
  timestep, attend the text like the video tokens (image_cross_text, the model yaml :102), and their output is
  dropped before the head (:610-611); the conditioning rows of that (a2/kinds/conditioning.py) are the table's;
- RoPE (Rotary3DPositionEmbeddingMixin, :470-528 with the yaml's shiftT/H/W, overloop, max_h = max_w = 80): video
  frame f at (t=f, y, x) and reference i at (t=i, 80 + y, 80 + x), so reference i shares its time with video frame i
  and sits past a 80x80-token grid in height and width: KaleidoRope, installed by `prepare`;
- the release is SAT's: `<dir>/latest` naming an iteration, `<dir>/<iter>/mp_rank_00_model_states.pt` = {"module":
  state dict} in SAT's names with fused q|k|v and k|v (sat/training/model_io.py:41-53, 311-403); `sat_to_original`
  inverts the lab's own Wan -> SAT converter (convert_ckpt_init_wan2sat.py:30-120) and a2 reads the result as any
  original-Wan checkpoint (diffusers' converter);
- training: RFLoss's sigma, sigmoid(N(0, 1)) shifted by exp(mu) with mu linear in the latent tokens per frame
  (sgm/modules/diffusionmodules/loss.py:16-29, 579-583): --sigma-sampling logit_normal_shifted at config.py's rf_shift;
  their data layout: `data.py index kaleido ROOT OUT` (a2/data/public_index.py).
"""

from __future__ import annotations

from pathlib import Path

import torch
from diffusers.models.transformers.transformer_wan import WanRotaryPosEmbed

OFFSET = 80  # max_h = max_w of the model yaml (:85-86): the references' row and column offset, in tokens
CHECKPOINT = "mp_rank_00_model_states.pt"  # SAT's file of model-parallel rank 0 (get_checkpoint_name)
PREFIX = "model.diffusion_model."  # SAT's names of the DiT inside its engine


class KaleidoRope(WanRotaryPosEmbed):
    """diffusers' Wan RoPE with Kaleido's positions for the `references` leading latent frames (set per call by
    prepare): reference i at (t=i, OFFSET + y, OFFSET + x), video frame f at (t=f, y, x). With none, diffusers' own."""

    references = 0

    def forward(self, hidden_states: torch.Tensor):
        n = self.references
        if not n:
            return super().forward(hidden_states)
        _, _, frames, height, width = hidden_states.shape
        p_t, p_h, p_w = self.patch_size
        f, h, w = frames // p_t, height // p_h, width // p_w
        device = self.freqs_cos.device
        frame = torch.arange(f, device=device)
        ref = frame < n
        t = torch.where(ref, frame, frame - n)
        rows = torch.arange(h, device=device)[None] + OFFSET * ref[:, None]  # (f, h)
        cols = torch.arange(w, device=device)[None] + OFFSET * ref[:, None]  # (f, w)
        out = []
        for table in (self.freqs_cos, self.freqs_sin):
            ft, fh, fw = table.split([self.t_dim, self.h_dim, self.w_dim], dim=1)
            out.append(torch.cat([ft[t].view(f, 1, 1, -1).expand(f, h, w, -1),
                                  fh[rows].view(f, h, 1, -1).expand(f, h, w, -1),
                                  fw[cols].view(f, 1, w, -1).expand(f, h, w, -1)], -1).reshape(1, f * h * w, 1, -1))
        return tuple(out)


def prepare(transformer, references: int) -> None:
    """The kaleido kind's transformer for a batch (or sampling call) of `references` reference latent frames before
    the video's: its RoPE module becomes KaleidoRope (its tables kept), told this call's count."""
    if not isinstance(transformer.rope, KaleidoRope):
        transformer.rope.__class__ = KaleidoRope
    transformer.rope.references = references


# ---------------------------------------------------------------- the SAT checkpoint

# Wan original name -> SAT name (without PREFIX), the lab's convert_ckpt_init_wan2sat.py; fused ones below
SAT_TOP = {
    "patch_embedding": "mixins.patch_embed.proj", "text_embedding.0": "text_embedding.0",
    "text_embedding.2": "text_embedding.2", "head.modulation": "mixins.final_layer.adaLN_modulation",
    "head.head": "mixins.final_layer.linear", "time_embedding.0": "time_embed.0", "time_embedding.2": "time_embed.2",
    "time_projection.1": "adaln_projection.1",
}
SAT_BLOCK = {  # {i}: the block
    "self_attn.o": "transformer.layers.{i}.attention.dense",
    "self_attn.norm_q": "mixins.adaln_layer.query_layernorm_list.{i}",
    "self_attn.norm_k": "mixins.adaln_layer.key_layernorm_list.{i}",
    "ffn.0": "transformer.layers.{i}.mlp.dense_h_to_4h", "ffn.2": "transformer.layers.{i}.mlp.dense_4h_to_h",
    "cross_attn.o": "transformer.layers.{i}.cross_attention.dense",
    "cross_attn.q": "transformer.layers.{i}.cross_attention.query",
    "norm3": "transformer.layers.{i}.post_cross_attention_layernorm",
    "cross_attn.norm_q": "mixins.adaln_layer.cross_query_layernorm_list.{i}",
    "cross_attn.norm_k": "mixins.adaln_layer.cross_key_layernorm_list.{i}",
}
SAT_FUSED = {"transformer.layers.{i}.attention.query_key_value": ("self_attn.q", "self_attn.k", "self_attn.v"),
             "transformer.layers.{i}.cross_attention.key_value": ("cross_attn.k", "cross_attn.v")}
SAT_MODULATION = "mixins.adaln_layer.adaLN_modulations.{i}"  # a bare parameter: blocks.{i}.modulation


def _layers(sd: dict) -> int:
    ids = {int(k.split(".")[k.split(".").index("layers") + 1]) for k in sd if ".layers." in k}
    return 1 + max(ids) if ids else 0


def original_to_sat(sd: dict) -> dict:
    """Wan original names -> Kaleido's SAT checkpoint names (PREFIX included), the lab's converter
    (convert_ckpt_init_wan2sat.py:30-120): q|k|v and k|v concatenated on dim 0. What a2's tiny-kaleido is written
    with, as the release's layout."""
    n = 1 + max(int(k.split(".")[1]) for k in sd if k.startswith("blocks."))
    out = {}
    for name, sat in SAT_TOP.items():
        for p in ("weight", "bias") if name != "head.modulation" else ("",):
            out[PREFIX + sat + (f".{p}" if p else "")] = sd[name + (f".{p}" if p else "")]
    for i in range(n):
        for name, sat in SAT_BLOCK.items():
            for p in ("weight", "bias"):
                if f"blocks.{i}.{name}.{p}" in sd:
                    out[f"{PREFIX}{sat.format(i=i)}.{p}"] = sd[f"blocks.{i}.{name}.{p}"]
        for sat, parts in SAT_FUSED.items():
            for p in ("weight", "bias"):
                out[f"{PREFIX}{sat.format(i=i)}.{p}"] = torch.cat([sd[f"blocks.{i}.{q}.{p}"] for q in parts], 0)
        out[PREFIX + SAT_MODULATION.format(i=i)] = sd[f"blocks.{i}.modulation"]
    return out


def sat_to_original(sd: dict) -> dict:
    """Kaleido's SAT checkpoint (its "module" dict; PREFIX optional) -> Wan original names, the inverse of the lab's
    converter: query_key_value split in three equal rows (q, k, v), key_value in two (k, v). A key it does not know
    keeps its name (the model's strict load names it)."""
    sd = {k.removeprefix(PREFIX): v for k, v in sd.items()}
    back = {sat: name for name, sat in SAT_TOP.items()}
    out = {}
    for i in range(_layers(sd)):
        back.update({sat.format(i=i): f"blocks.{i}.{name}" for name, sat in SAT_BLOCK.items()})
        back[SAT_MODULATION.format(i=i)] = f"blocks.{i}.modulation"
        for sat, parts in SAT_FUSED.items():
            for p in ("weight", "bias"):
                key = f"{sat.format(i=i)}.{p}"
                if key in sd:
                    for name, chunk in zip(parts, sd.pop(key).chunk(len(parts), 0), strict=True):
                        out[f"blocks.{i}.{name}.{p}"] = chunk
    for k, v in sd.items():
        stem, _, p = k.rpartition(".")
        out[f"{back[stem]}.{p}" if stem in back else back.get(k, k)] = v
    return out


def checkpoint(path) -> Path | None:
    """The SAT checkpoint file of a Kaleido release: `path` itself (a .pt), or under `path` or `path`/model (the
    release's dir, sample yaml :9) the `latest` tracker's iteration dir's mp_rank_00_model_states.pt; None when
    `path` is not one."""
    path = Path(path)
    if path.is_file():
        return path if path.name == CHECKPOINT else None
    for d in (path, path / "model"):
        tracker = d / "latest"
        if tracker.is_file():
            return d / tracker.read_text().strip() / CHECKPOINT
    return None


def save(d, sd: dict) -> Path:
    """Weights `sd` in Wan original names as a SAT load dir `d` (their --load): `latest` naming iteration 1 and
    1/mp_rank_00_model_states.pt = {"module": SAT names} (original_to_sat). Returns the file."""
    d = Path(d)
    (d / "1").mkdir(parents=True, exist_ok=True)
    (d / "latest").write_text("1")
    torch.save({"module": {k: v.contiguous() for k, v in original_to_sat(sd).items()}}, d / "1" / CHECKPOINT)
    return d / "1" / CHECKPOINT


def read(file: Path) -> dict:
    """The state dict of a SAT checkpoint file in Wan original names (memory-mapped: the 14B's is 28 GB in bf16)."""
    sd = torch.load(file, map_location="cpu", mmap=True, weights_only=True)
    sd = sd.get("module", sd)
    if any(k.startswith(PREFIX) for k in sd):  # the DiT of SAT's engine, not its VAE or text encoder if saved
        sd = {k: v for k, v in sd.items() if k.startswith(PREFIX)}
    return sat_to_original(sd)
