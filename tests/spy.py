"""Spies on what `infer.py`'s main really hands the sampler and the model, for the tests that hold a user's run
against a lab's numbers or a flag against its effect (tests/test_promises.py). The run is `infer.main` on the flags
as a user types them (parse_cli); the spies wrap the library's own functions and record their arguments and results,
calling the real code (nothing is stubbed)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch


@dataclass
class Record:
    scheduler: str = ""  # the scheduler's class
    shift: float | None = None  # its config's shift
    set_timesteps: dict = field(default_factory=dict)  # what set_timesteps was given (steps, or the unshifted sigmas)
    timesteps: list = field(default_factory=list)  # the scheduler's timesteps, in order
    texts: list = field(default_factory=list)  # the texts the T5 encoded, in order (prompt, then the negative one)
    seed: int | None = None  # the noise generator's seed
    calls: list = field(default_factory=list)  # per transformer forward: (timestep, hidden_states shape)
    predictions: list = field(default_factory=list)  # per forward, the video prediction the guidance combines
    step_inputs: list = field(default_factory=list)  # per scheduler step, the model output it was given
    references: torch.Tensor | None = None  # what reached the pipeline as the VAE-path references
    clip_references: torch.Tensor | None = None  # and as the CLIP-path images
    layout: object = None
    out: Path | None = None

    def passes(self) -> list[int]:
        """The transformer forwards per sampling step (1: no guidance, 2: text CFG, 3: + reference guidance)."""
        n = len(self.step_inputs)
        assert n and len(self.calls) % n == 0, (len(self.calls), n)
        return [len(self.calls) // n] * n

    def guidance(self) -> np.ndarray:
        """The weights the steps' model outputs put on each forward's prediction, solved by least squares over every
        step: text CFG u + s (c - u) is (s, 1 - s); with reference guidance n + s_img (u - n) + s (c - u) is
        (s, s_img - s, 1 - s_img). Exact up to float32 rounding of the combination."""
        k = len(self.calls) // len(self.step_inputs)
        rows, rhs = [], []
        for i, m in enumerate(self.step_inputs):
            p = self.predictions[i * k:(i + 1) * k]
            rows.append(torch.stack([x.double().flatten() for x in p], 1))
            rhs.append(m.double().flatten())
        a, b = torch.cat(rows), torch.cat(rhs)
        return torch.linalg.lstsq(a, b[:, None]).solution.flatten().numpy()


def run_infer(monkeypatch, argv: list[str]) -> Record:
    """infer.main on `argv` (the command line after `infer.py`), as its __main__ parses it, with every spy in place.
    Returns what was recorded; asserts the run exits 0."""
    import a2.pipeline as pipeline
    import infer
    from a2.cli import parse_cli
    from config import InferConfig

    rec = Record()
    real_make, real_encode, real_initial = pipeline.make_scheduler, pipeline.encode_prompt, pipeline.initial_latents
    real_video_prediction, real_call = pipeline.video_prediction, pipeline.A2Pipeline.__call__

    def make_scheduler(name, flow_shift, *a, **kw):
        sched = real_make(name, flow_shift, *a, **kw)
        rec.scheduler = type(sched).__name__
        rec.shift = float(sched.config.get("flow_shift") or sched.config.get("shift"))
        real_set, real_step = sched.set_timesteps, sched.step

        def set_timesteps(*args, **kwargs):
            rec.set_timesteps = dict(kwargs, args=args)
            out = real_set(*args, **kwargs)
            rec.timesteps = [float(t) for t in sched.timesteps]
            return out

        def step(model_output, *args, **kwargs):
            rec.step_inputs.append(model_output.detach().clone())
            return real_step(model_output, *args, **kwargs)

        sched.set_timesteps, sched.step = set_timesteps, step
        return sched

    def encode_prompt(tokenizer, text_encoder, prompts, *a, **kw):
        rec.texts += list(prompts)
        return real_encode(tokenizer, text_encoder, prompts, *a, **kw)

    def initial_latents(layout, shape, generator, device):
        rec.seed = generator.initial_seed()
        return real_initial(layout, shape, generator, device)

    def video_prediction(out, c):
        pred = real_video_prediction(out, c)
        rec.predictions.append(pred.detach().clone())
        return pred

    def call(self, prompt, references=None, *a, **kw):
        rec.references, rec.layout = references, kw.get("layout")
        rec.clip_references = a[0] if a else kw.get("clip_references")

        def hook(_module, args, kwargs):
            x, t = kwargs["hidden_states"], kwargs["timestep"]
            rec.calls.append((float(t.flatten()[0]), tuple(x.shape)))

        handles = [m.register_forward_pre_hook(hook, with_kwargs=True)
                   for m in (self.transformer, self.transformer_2) if m is not None]
        try:
            return real_call(self, prompt, references, *a, **kw)
        finally:
            for h in handles:
                h.remove()

    monkeypatch.setattr(pipeline, "make_scheduler", make_scheduler)
    monkeypatch.setattr(pipeline, "encode_prompt", encode_prompt)
    monkeypatch.setattr(pipeline, "initial_latents", initial_latents)
    monkeypatch.setattr(pipeline, "video_prediction", video_prediction)
    monkeypatch.setattr(pipeline.A2Pipeline, "__call__", call)
    cfg = parse_cli(InferConfig, args=argv)
    assert infer.main(cfg) == 0
    rec.out = Path(cfg.out) if cfg.out else None
    return rec


def video_file(path) -> tuple[float, int, tuple[int, int]]:
    """A written mp4's (fps as its stream says, frames, (height, width))."""
    import av

    with av.open(str(path)) as f:
        stream = f.streams.video[0]
        frames = [fr for fr in f.decode(stream)]
        return float(stream.average_rate), len(frames), (frames[0].height, frames[0].width)
