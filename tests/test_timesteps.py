"""--timestep-buckets N: the sigmas of a global batch are stratified over N equal-probability buckets of the sigma
distribution (every bucket once per N samples), as a function of (seed, step, global sample index): one process,
gradient accumulation and 2 DDP ranks draw the same sigmas."""

import json
import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch

from a2.train.flow import sample_sigma, sigma_cdf, timestep_bucket
from tests.conftest import ROOT, args

DISTRIBUTIONS = [dict(sigma_sampling="logit_normal", logit_mean=0.0, logit_std=1.0),
                 dict(sigma_sampling="uniform"), dict(sigma_sampling="shifted", sigma_shift=5.0)]


@pytest.mark.parametrize("dist", DISTRIBUTIONS, ids=lambda d: d["sigma_sampling"])
@pytest.mark.parametrize("n, batch", [(4, 4), (4, 8), (4, 6), (3, 2), (8, 8)])
def test_every_bucket_is_covered_per_global_batch(dist, n, batch):
    cfg = SimpleNamespace(**dist, timestep_buckets=n)
    for step in range(20):
        buckets = [timestep_bucket(7, step, k, n) for k in range(batch)]
        for start in range(0, batch - n + 1, n):  # each full run of n samples: every bucket once
            assert sorted(buckets[start:start + n]) == list(range(n))
        rest = buckets[batch // n * n:]
        assert len(set(rest)) == len(rest)  # a partial run: distinct buckets
        for lo, hi in ((0.0, 1.0), (0.0, 0.875)):  # the whole range, a Wan 2.2 low-noise expert's
            a, b = sigma_cdf(cfg, lo), sigma_cdf(cfg, hi)
            for k, bucket in enumerate(buckets):
                g = torch.Generator().manual_seed(1000 * step + k)
                u = (sigma_cdf(cfg, sample_sigma(cfg, g, lo, hi, bucket)) - a) / (b - a)  # its quantile in the range
                assert bucket / n - 1e-9 <= u <= (bucket + 1) / n + 1e-9, (bucket, u)
    # the assignment changes from step to step (a permutation per step, not a fixed order)
    assert len({tuple(timestep_bucket(7, s, k, n) for k in range(n)) for s in range(20)}) > 1
    assert timestep_bucket(7, 0, 0, 0) is None


RECORD = """
import json, sys
sys.path.insert(0, {root!r})
import tyro
import train_a2
from config import TrainConfig

out, argv = sys.argv[1], sys.argv[2:]
forward_loss = train_a2.forward_loss


def recorded(model, inputs, *a, **k):  # each micro-batch's sigmas, in order, per rank
    with open(f"{{out}}.{{train_a2.RANK}}", "a") as f:
        f.write(json.dumps(inputs["sigmas"].tolist()) + "\\n")
    return forward_loss(model, inputs, *a, **k)


train_a2.forward_loss = recorded
train_a2.main(tyro.cli(TrainConfig, args=argv))
"""


def sigmas_of(tmp_path, data_dir, name, nproc, *flags) -> dict[int, list[float]]:
    """step -> the global batch's sigmas in global sample order, recorded from each rank's forward_loss calls."""
    script = tmp_path / "record.py"
    script.write_text(RECORD.format(root=str(ROOT)))
    pre = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(nproc)] \
        if nproc > 1 else [sys.executable]
    out = tmp_path / name
    p = subprocess.run([*pre, str(script), str(out), *args(data_dir, tmp_path, name, *flags)], capture_output=True,
                       text=True, timeout=600)
    assert p.returncode == 0, (p.stdout + p.stderr)[-4000:]
    calls = [[json.loads(line) for line in (tmp_path / f"{name}.{r}").read_text().splitlines()] for r in range(nproc)]
    per_step = len(calls[0]) // 3
    steps = {}
    for s in range(3):  # micro-step j of rank r holds global samples (j * world + r) * micro ...
        mine = [calls[r][s * per_step:(s + 1) * per_step] for r in range(nproc)]
        steps[s] = [x for j in range(per_step) for r in range(nproc) for x in mine[r][j]]
    return steps


def test_stratified_sigmas_are_the_same_for_every_topology(data_dir, tmp_path):
    flags = ["--timestep-buckets", "2", "--max-steps", "3", "--sigma-sampling", "logit_normal"]  # DISTRIBUTIONS[0]
    one = sigmas_of(tmp_path, data_dir, "micro2", 1, *flags, "--micro-batch", "2")
    assert one == sigmas_of(tmp_path, data_dir, "accum2", 1, *flags, "--micro-batch", "1", "--grad-accum", "2")
    assert one == sigmas_of(tmp_path, data_dir, "ddp", 2, *flags, "--micro-batch", "1")
    cfg = SimpleNamespace(**DISTRIBUTIONS[0], timestep_buckets=2)
    for step, sigmas in one.items():  # one sigma below the median and one above, in the buckets of the rule
        assert [int(sigma_cdf(cfg, s) * 2) for s in sigmas] == [timestep_bucket(0, step, k, 2) for k in range(2)]
