"""bench.py: the FLOP formula against the figures stated for the real shapes, and a CPU run on tiny."""

import pytest

from a2.transformer import preset_config
from bench import BenchConfig, forward_flops, main


def test_flops_match_the_stated_real_shapes():
    tokens = 21 * (480 // 16) * (832 // 16)  # 81 frames -> 21 latents; 32,760 video tokens
    assert tokens == 32760
    l14, c14 = forward_flops(preset_config("14B"), tokens, 512 + 3 * 257)
    l13, c13 = forward_flops(preset_config("1.3B"), tokens, 512)
    assert (l14 + c14) / 1e15 == pytest.approx(1.70, rel=0.01)
    assert (l13 + c13) / 1e15 == pytest.approx(0.28, rel=0.02)
    assert c14 / (l14 + c14) > 0.5  # at 32k tokens attention dominates


@pytest.mark.parametrize("mode", ["lora", "full"])
def test_bench_runs_on_cpu(mode):
    r = main(BenchConfig(preset="tiny", frames=9, height=32, width=32, refs=2, mode=mode, steps=1, warmup=1,
                         dtype="float32", device="cpu", gradient_checkpointing=True, save_attention=mode == "lora",
                         peak_tflops=1.0))
    assert r["hfu"] > r["mfu"] > 0  # the recomputed forward is hardware work on top of the model FLOPs
    assert r["tokens"] == 3 * 2 * 2 and r["s_per_step"] > 0 and r["tflops"] > 0


def test_bench_runs_each_memory_piece_on_cpu():
    """bench.py with offload, block swap and fp8 (the flags, as --memory manual): the plan is reported with host
    memory, and the step is timed (that they change no result is tests/test_offload.py's and test_fp8.py's)."""
    r = main(BenchConfig(preset="tiny", frames=9, height=32, width=32, refs=2, mode="lora", steps=1, warmup=1,
                         dtype="float32", device="cpu", gradient_checkpointing=True, save_attention=True,
                         offload_activations=True, swap_blocks=1, fp8_base=True, peak_tflops=1.0))
    assert (r["offload"], r["swap_blocks"], r["fp8"]) == (True, 1, True)
    assert "1 blocks swapped to host" in r["plan"] and r["host_gb"] > 0 and r["s_per_step"] > 0
