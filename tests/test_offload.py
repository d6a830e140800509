"""Activation offload and block swap (a2/memory/offload.py): a LoRA model's training steps with what they move to host
memory give exactly (bit for bit) the plain steps' losses and LoRA gradients, with and without recomputation and
kept attention, and the swapped blocks' weights are really gone from the device between their uses."""

import pytest
import torch
from diffusers import WanTransformer3DModel
from peft import LoraConfig

from a2.memory.fp8 import quantize_base_weights
from a2.memory.offload import apply_offload
from a2.model.transformer import configure_blocks, preset_config

LAYERS = 4


def lora_model():
    torch.manual_seed(0)
    model = WanTransformer3DModel(**{**preset_config("tiny"), "num_layers": LAYERS})
    model.requires_grad_(False)
    model.add_adapter(LoraConfig(r=4, lora_alpha=4, target_modules=["to_q", "to_k", "to_v", "to_out.0", "ffn.net.2"]))
    g = torch.Generator().manual_seed(1)
    for name, p in model.named_parameters():
        if "lora_B" in name:  # nonzero B: every LoRA matrix gets a gradient from the first step
            p.data = 0.1 * torch.randn(p.shape, generator=g)
    return model


class Watch:
    """After each block's forward (and after the offload hooks): a swapped block's weights are on the device only
    while it runs (the last block's stay for the backward, which starts with it), the next block's are on their
    way, and a swapped block not on the device holds none (its frozen parameters are empty tensors). When a
    block's backward starts: its weights and the previous block's (on their way), no others."""

    def __init__(self, model):
        self.model, self.seen, self.seen_backward = model, 0, 0
        if getattr(model, "a2_offload", None) is not None:
            self.backward_starts_offload = model.a2_offload._backward_starts
            model.a2_offload._backward_starts = self.backward_starts
        for i, block in enumerate(model.blocks):
            block.register_forward_hook(lambda b, a, o, i=i: self.check(i))

    def backward_starts(self, i):
        """In the backward, block i's weights and at most block i-1's (on their way) are on the device."""
        owner = self.model.a2_offload
        self.backward_starts_offload(i)
        self.seen_backward += 1
        assert set(owner.resident()) <= {i, i - 1}, (i, owner.resident())
        assert i - 1 not in owner.swap or i - 1 in owner.resident(), i  # prefetched while block i computes

    def check(self, i):
        owner = getattr(self.model, "a2_offload", None)
        if owner is None or not owner.swap:
            return
        self.seen += 1
        on_device = [j for j in owner.swap if owner.state[j] == "device"]
        assert on_device == ([i] if i == LAYERS - 1 else []), (i, on_device)
        assert set(owner.resident()) - set(on_device) <= {i + 1}, (i, owner.resident())
        assert i + 1 not in owner.swap or i + 1 in owner.resident(), i  # prefetched while block i computed
        for j in owner.swap:
            frozen = [p for p in self.model.blocks[j].parameters() if not p.requires_grad]
            assert all(p.numel() == 0 for p in frozen) == (j not in on_device), (i, j)


def steps(fraction, save_attention, offload, swap, compile=False, n=2, fp8=False):
    model = lora_model()
    if fp8:  # e4m3 weight parameters and fp32 scale buffers (a2/memory/fp8.py): swapped like any frozen tensor
        quantize_base_weights(model)
    swapped = apply_offload(model, offload, swap, "cpu", min_bytes=0)  # before configure_blocks, as in train_a2
    configure_blocks(model, fraction, save_attention, compile)
    offloaded = [i for i, b in enumerate(model.blocks) if b.recomputed] if offload else []
    watch = Watch(model)
    lora = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(lora, lr=1e-2)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(1, 36, 3, 8, 8, generator=g)  # 48 video tokens; 512 text and 2 x 257 image keys
    text, image = torch.randn(1, 512, 32, generator=g), torch.randn(1, 2 * 257, 32, generator=g)
    out = []
    for _ in range(n):
        opt.zero_grad(set_to_none=True)
        pred = model(x, torch.tensor([500.0]), text, encoder_hidden_states_image=image, return_dict=False)[0]
        loss = pred.pow(2).mean()
        if offload:  # every recomputed block keeps its input, and with save_attention the attention, in the host
            kept = [len(model.a2_offload.saved[i]) for i in offloaded]  # (compiled: also what the graph saves)
            print("offloaded tensors per recomputed block", kept)
            assert kept and all(k == (3 if save_attention else 1) or compile and k > 3 for k in kept), kept
        loss.backward()
        out.append((loss.detach(), [p.grad.clone() for p in lora]))
        opt.step()
        if swap:
            assert model.a2_offload.resident() == []  # all swapped weights are released after the backward
    if swap:  # the host copies take their bytes, not torch's pinned allocator's power-of-two rounding
        held = sum(b.numel() for b in model.a2_offload.buffers)
        assert 0 < swapped <= held < swapped + 256 * sum(len(f) for f in model.a2_offload.frozen.values())
        assert swapped > 0 and watch.seen == watch.seen_backward == n * LAYERS
    return out


def same(a, b):
    return all(torch.equal(la, lb) and all(torch.equal(x, y) for x, y in zip(ga, gb)) for (la, ga), (lb, gb)
               in zip(a, b, strict=True))


@pytest.mark.parametrize("fraction,save_attention", [(1.0, False), (0.5, True), (0.0, False)])
def test_offload_and_swap_are_exact(fraction, save_attention):
    ref = steps(fraction, save_attention, False, 0)
    for offload, swap in ((True, 0), (False, 2), (False, LAYERS), (True, 2)):
        if offload and fraction == 0:
            continue  # nothing is recomputed: nothing to offload
        assert same(steps(fraction, save_attention, offload, swap), ref), (offload, swap)


def test_compiled_blocks_offload_and_swap_are_exact():
    """Saved-tensor hooks around a compiled recomputed block see what its one autograd function saves (the input,
    the kept attention, the weights, which stay): the same steps as the compiled plain run."""
    ref = steps(1.0, True, False, 0, compile=True)
    assert same(steps(1.0, True, True, 2, compile=True), ref)


def test_fp8_base_weights_offload_and_swap_are_exact():
    ref = steps(1.0, True, False, 0, fp8=True)
    assert same(steps(1.0, True, True, 2, fp8=True), ref)
