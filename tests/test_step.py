"""The training step's pieces called directly (no subprocess): flow matching, the loss's reference slicing, dropout,
sigma ranges per Wan 2.2 expert, the derived Run (the --memory auto rule: tests/test_memory.py)."""

import math

import pytest
import torch
import tyro

import train_a2
from a2.data.loader import collate
from a2.model.transformer import preset_config
from a2.train.flow import flow_loss, noisy_latents
from config import TrainConfig, from_flags
from data import E2VDataset
from tests.conftest import train_config


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    from data import make_synthetic_dataset

    return make_synthetic_dataset(tmp_path_factory.mktemp("data") / "e2v", num_samples=2, num_frames=17,
                                  size=(32, 32))


def setup(data_dir, *extra, model="tiny"):
    """cfg, Run, Encoders and one collated batch, as main() builds them (CPU)."""
    cfg = train_config(["--model", model, "--data-root", str(data_dir), "--resolution", "32", "32",
                                      "--num-frames", "21", "--device", "cpu", *extra])
    ds_cfgs = train_a2.run_datasets(cfg)
    run = train_a2.plan_run(cfg, 1, ds_cfgs, torch.device("cpu"))
    dataset = E2VDataset(ds_cfgs, num_frames=run.layout.clip_frames, verbose=False)
    enc = train_a2.load_run_encoders(cfg, run, torch.device("cpu"), needed=True)
    return cfg, run, enc, collate([dataset[0], dataset[1]])


def test_noisy_latents_and_target():
    g = torch.Generator().manual_seed(0)
    x0, noise = torch.randn(3, 16, 2, 4, 4, generator=g), torch.randn(3, 16, 2, 4, 4, generator=g)
    sigmas = torch.tensor([0.0, 0.25, 1.0])
    x_t, target = noisy_latents(x0, noise, sigmas)
    torch.testing.assert_close(x_t[0], x0[0])  # sigma 0: clean
    torch.testing.assert_close(x_t[2], noise[2])  # sigma 1: pure noise
    torch.testing.assert_close(x_t[1], 0.75 * x0[1] + 0.25 * noise[1])
    torch.testing.assert_close(target, noise - x0)
    # the velocity carries x_t to the noise: x_t + (1 - sigma) * target = noise
    torch.testing.assert_close(x_t[1] + 0.75 * target[1], noise[1])


def test_flow_loss_slices_the_reference_frames_and_weights():
    target = torch.zeros(2, 16, 5, 2, 2)
    pred = target.clone()
    pred[:, :, :2] = 3.0  # wrong only on the first two latent frames (the references, in the prefix layout)
    sigmas = torch.tensor([0.5, 0.5])
    assert flow_loss(pred, target, sigmas, first_frame=2).item() == 0.0
    assert flow_loss(pred, target, sigmas).item() == pytest.approx(9.0 * 2 / 5)
    w = 2 / (math.pi * (1 - 2 * 0.5 + 2 * 0.25))  # cosmap at sigma 0.5
    assert flow_loss(pred, target, sigmas, "cosmap").item() == pytest.approx(9.0 * 2 / 5 * w)


def test_run_derives_a2s_layout(data_dir):
    cfg, run, _, _ = setup(data_dir)
    lay = run.layout
    assert (lay.kind, lay.ref_latents, lay.clip_frames, lay.e2v_type, lay.use_clip) == ("prefix", 3, 9, "dual", True)
    assert run.global_batch == 1 and run.compute_dtype == torch.float32 and run.sigma_range == (0.0, 1.0)
    with pytest.raises(AttributeError):  # frozen: derived once, never written back
        run.layout.clip_frames = 5
    cfg81 = from_flags(data_root=str(data_dir), num_frames=81, device="cpu")
    run81 = train_a2.plan_run(cfg81, 1, train_a2.run_datasets(cfg81), torch.device("cpu"))
    assert run81.layout.clip_frames == 69  # A2: 81 -> 69


def test_model_inputs_dropout(data_dir):
    for drop, want_dropped in ((0.0, False), (1.0, True)):
        cfg, run, enc, batch = setup(data_dir, "--text-dropout", str(drop), "--reference-dropout", str(drop))
        inputs = train_a2.model_inputs(batch, 0, 0, cfg.optim, cfg.objective, cfg.references, run, enc, 0,
                                       torch.device("cpu"))
        b, t_lat = 2, (21 - 1) // 4 + 1
        assert inputs["x0"].shape == inputs["noise"].shape == (b, 16, t_lat, 4, 4)
        cond = inputs["cond"]  # what forward_loss feeds the transformer
        assert cond.condition.shape == (b, 20, t_lat, 4, 4) and cond.image.shape == (b, 3 * 257, 32)
        empty = (inputs["text"] == enc.empty_text).all(dim=(1, 2))
        assert empty.tolist() == [want_dropped] * b
        assert (cond.condition.abs().amax(dim=(1, 2, 3, 4)) == 0).tolist() == [want_dropped] * b
        assert (cond.image.abs().amax(dim=(1, 2)) == 0).tolist() == [want_dropped] * b
        assert cond.ref_latents.abs().max() > 0  # the references stay in x0 (the target) either way
        # the draws are the sample's own: the same batch at another step draws other noise and sigma
        again = train_a2.model_inputs(batch, 1, 0, cfg.optim, cfg.objective, cfg.references, run, enc, 0,
                                      torch.device("cpu"))
        assert not torch.equal(again["noise"], inputs["noise"]) and not torch.equal(again["sigmas"], inputs["sigmas"])


def test_forward_loss_leaves_references_out_when_asked(data_dir):
    cfg, run, enc, batch = setup(data_dir, "--no-loss-on-references")
    inputs = train_a2.model_inputs(batch, 0, 0, cfg.optim, cfg.objective, cfg.references, run, enc, 0,
                                   torch.device("cpu"))
    x_t, target = noisy_latents(inputs["x0"], inputs["noise"], inputs["sigmas"])
    pred = target.clone()
    pred[:, :, : run.layout.ref_latents] += 1.0  # wrong only on the reference latents

    def model(**kw):
        assert kw["hidden_states"].shape[1] == 36 and kw["timestep"].tolist() == (inputs["sigmas"] * 1000).tolist()
        return (pred,)

    model.config = type("C", (), {"patch_size": (1, 2, 2)})
    loss, viz = train_a2.forward_loss(model, inputs, cfg.objective, cfg.references, run,
                                      torch.autocast("cpu", enabled=False), torch.float32)
    assert loss.item() == pytest.approx(0.0, abs=1e-10)
    cfg_all = tyro.cli(TrainConfig, args=["--data-root", str(data_dir)])  # loss_on_references (default)
    loss_all, _ = train_a2.forward_loss(model, inputs, cfg_all.objective, cfg_all.references, run,
                                        torch.autocast("cpu", enabled=False),
                                        torch.float32)
    assert loss_all.item() == pytest.approx(run.layout.ref_latents / x_t.shape[2], rel=1e-5)
    torch.testing.assert_close(viz["predicted_latents"], x_t - inputs["sigmas"].view(-1, 1, 1, 1, 1) * pred)


def test_sigmas_stay_in_the_experts_range(data_dir):
    for expert, (lo, hi) in (("high", (0.9, 1.0)), ("low", (0.0, 0.9))):  # tiny Wan 2.2 I2V: boundary 0.9
        cfg, run, enc, batch = setup(data_dir, "--expert", expert, model="tiny-wan22-i2v")
        assert run.sigma_range == (lo, hi) and run.layout.e2v_type == "vae" and not run.layout.use_clip
        s = torch.cat([train_a2.model_inputs(batch, step, 0, cfg.optim, cfg.objective, cfg.references, run, enc, 0,
                                             torch.device("cpu"))["sigmas"]
                       for step in range(10)])
        assert (s >= lo).all() and (s < hi if hi < 1 else s <= 1).all(), s


def test_random_real_size_model_dir(tmp_path):
    """random-14B: encoders of the real output widths, a transformer config with no weights; random_transformer
    builds it in the compute dtype with diffusers' fp32-kept modules in fp32 (checked on a 2-block cut)."""
    import json

    from a2.model.tiny import save_tiny
    from a2.model.transformer import RANDOM_WEIGHTS, detect_model, random_transformer

    d = save_tiny(tmp_path / "random14b", preset="14B")
    info = detect_model(d)
    assert (info.name, info.in_channels, info.image_encoder_dim) == ("Wan2.1 I2V", 36, 1280)
    assert (d / "transformer" / RANDOM_WEIGHTS).exists() and not list((d / "transformer").glob("*.safetensors"))
    assert json.loads((d / "text_encoder" / "config.json").read_text())["d_model"] == 4096
    model = random_transformer({**preset_config("14B"), "num_layers": 2, "ffn_dim": 64}, torch.bfloat16, "cpu")
    dtypes = {n: p.dtype for n, p in model.named_parameters()}
    assert dtypes["blocks.0.attn1.to_q.weight"] == torch.bfloat16
    assert dtypes["blocks.0.norm2.weight"] == dtypes["scale_shift_table"] == torch.float32
    assert model.blocks[0].attn1.to_q.weight.float().std().item() == pytest.approx(0.02, rel=0.05)
