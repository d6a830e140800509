"""a2/trace.py: the live-bytes count of a step, checked against a hand count, and the same on fake tensors (no data)
as on real ones."""

import torch

from a2.trace import GB, LiveBytes, fake_tensors, trace_steps


def test_live_bytes_match_a_hand_count():
    """Three fp32 tensors of 1 MiB made and freed in a known order: the count follows each allocation and each last
    reference (views share their storage; an in-place op makes nothing), and the peak is the most at once."""
    n = 1 << 18  # fp32: 1 MiB
    tracer = LiveBytes(device="cpu")
    with tracer:
        tracer.phase = "forward"
        a = torch.ones(n)
        b = a * 2  # 2 MiB live
        view = b[: n // 2]  # a view: no storage of its own
        b.add_(1)  # in place: nothing new
        del b  # the view keeps b's storage
        assert tracer.live["device"] == 2 << 20
        c = a + view.sum()  # 0-dim sum (4 bytes), then c: 3 MiB + 4 bytes at the peak
        del view  # b's storage freed
        assert tracer.live["device"] == 2 << 20
        del a, c
    assert tracer.live["device"] == 0
    assert tracer.peak.total == (3 << 20) + 4


def tiny_lora_step(tracer):
    """Two steps of the tiny Wan transformer with LoRA (fp32, CPU) under `tracer`; inputs made inside it."""
    from peft import LoraConfig

    from a2.transformer import preset_config, random_transformer
    from config import LORA_TARGETS

    cfg = preset_config("tiny")
    model = random_transformer(cfg, torch.float32, "cpu")
    model.requires_grad_(False)
    model.add_adapter(LoraConfig(r=4, lora_alpha=4, target_modules=LORA_TARGETS))
    model.train()
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    x = torch.zeros(1, cfg["in_channels"], 3, 8, 8)
    text = torch.zeros(1, 512, cfg["text_dim"])
    image = torch.zeros(1, 257, cfg["image_dim"])

    def forward():
        out = model(x, torch.full((1,), 500.0), text, encoder_hidden_states_image=image, return_dict=False)[0]
        return out.pow(2).mean()

    trace_steps(tracer, model, opt, forward)
    return model


def test_fake_tensors_count_what_real_ones_allocate():
    """The tiny model's LoRA step counted on real CPU tensors and on fake ones (shapes only): the same live bytes at
    every point, so the same peak and categories; the peak is above the weights and below weights + all
    activations of a step, and it falls in the backward."""
    real, fake = LiveBytes(device="cpu"), LiveBytes(device="cpu")
    with real:
        model = tiny_lora_step(real)
    with fake_tensors(), fake:
        tiny_lora_step(fake)
    r, f = real.peak.by_category(), fake.peak.by_category()
    # what the step makes (activations, gradients in flight) is counted the same to the byte; the fake mode's
    # 0-dim constants (the optimizer's step counters) can differ by a few hundred bytes
    assert (r["kept"], r["transient"]) == (f["kept"], f["transient"])
    assert abs(real.peak.total - fake.peak.total) < 4096 and real.peak.phase == fake.peak.phase == "backward"
    weights = sum(p.numel() * 4 for p in model.parameters()) + sum(b.numel() * b.element_size()
                                                                  for b in model.buffers())
    cats = real.peak.by_category()
    assert cats["weights"] + cats["state"] >= weights and cats["kept"] > 0 and cats["transient"] > 0
    assert real.peak.total < 2 * GB
