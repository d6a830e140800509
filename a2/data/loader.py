"""The loader plumbing of training: a micro-batch of dataset items (collate: a sample that failed to load travels
as a failed batch), the failures handled alike on every rank and across resumes (LoadFailures), and the loader
workers with the stop signals (a preempted run checkpoints its step before the workers go)."""

from __future__ import annotations

import hashlib
import multiprocessing.context
import os
import signal
import sys
import traceback
from contextlib import contextmanager

import torch
import torch.distributed as dist

from a2.data.media import Problem


def collate(items: list[dict]) -> dict:
    """One micro-batch; {indices, failed: [(index, problem line)]} when an item failed to load, or when the items
    cannot be batched (then each is named with its file): in a loader worker an exception would end the run with
    a raw traceback on this rank alone, a failed batch ends it in one line on every rank (LoadFailures)."""
    indices = [it["index"] for it in items]
    if any("failed" in it for it in items):
        return dict(indices=indices, failed=[(it["index"], it["failed"]) for it in items if "failed" in it])
    try:
        return stack_items(items, indices)
    except Exception as ex:
        return dict(indices=indices, failed=[(it["index"], str(Problem(
            it["id"], it["file"], f"failed to batch ({type(ex).__name__}: {ex})"))) for it in items])


def stack_items(items: list[dict], indices: list[int]) -> dict:
    first = items[0]
    if any(it["bucket"] != first["bucket"] for it in items):
        raise ValueError(f"a batch mixes buckets: {[it['bucket'] for it in items]}")
    out = dict(indices=indices, ids=[it["id"] for it in items], prompts=[it["prompt"] for it in items],
               element_names=first["element_names"], repeats=first["repeats"])
    # pixels: video (B, 3, F, H, W), ref_vae (B, N, 3, H, W), ref_clip (B, N, 3, h, w); from the precompute cache:
    # text (B, 512, D), clip, align; both: region. None where the run has none.
    for k in ("video", "ref_vae", "ref_clip", "text", "clip", "align", "region"):
        if k in first:
            out[k] = None if first[k] is None else torch.stack([it[k] for it in items])
    if "posteriors" in first:  # per VAE encode: (B, 32, T, h, w), and the shapes of the pixels they encode
        out.update(posteriors=[torch.stack(encodes) for encodes in zip(*(it["posteriors"] for it in items))],
                   video_shape=(len(items), *first["video_shape"]), ref_shape=(len(items), *first["ref_shape"]))
    return out


class LoadFailures:
    """Samples that failed to load mid-run, handled the same on every rank and after a resume.

    Every rank calls refuses() on each micro-batch: it gathers the failures of all ranks, so all ranks agree that the
    step is not trained (no optimizer step). With skip_bad_samples the sample is dropped for the rest of the run: each
    later micro-batch holding it is refused too, whether it loads then or not (named by path), and the dropped set
    goes into checkpoints by path (state_dict). Without, the run checkpoints the state before the step and stops with
    stop_message()."""

    def __init__(self, skip_bad_samples: bool, keys: list[str] | None = None, stamp=None):
        self.skip = skip_bad_samples
        # what each sample index is (its video path, @window): a resume on a changed dataset finds the dropped
        # samples by it, not by their position
        self.keys = list(keys or [])
        # sample index -> what its files are now (E2VDataset.stamp): a dropped sample whose files were replaced
        # since is read again on resume, one left as it was stays dropped
        self.stamp = stamp
        self.dropped: dict[int, str] = {}  # sample index -> its problem line
        self.stamps: dict[int, str] = {}  # dropped sample index -> its files when it was dropped
        self.new: dict[int, str] = {}  # failures of the current step
        self.held: list[int] = []  # samples dropped before that the current step holds
        self.last: list[str] = []  # those of the last step not trained
        self.skipped_steps = 0

    def refuses(self, batch: dict, group=None) -> bool:
        """Whether this micro-batch must not train (a sample of it failed now, on any rank, or was dropped before).
        A collective over `group` when torch.distributed is initialised."""
        mine = list(batch.get("failed", [])) + [(i, self.dropped[i]) for i in batch["indices"] if i in self.dropped]
        if dist.is_available() and dist.is_initialized():
            every: list = [None] * dist.get_world_size(group)
            dist.all_gather_object(every, mine, group=group)
            mine = [x for rank_failures in every for x in rank_failures]
        self.new.update((i, line) for i, line in mine if i not in self.dropped)
        self.held += [i for i in dict.fromkeys(i for i, _ in mine) if i in self.dropped and i not in self.held]
        return bool(mine)

    def name(self, i: int) -> str:
        return self.keys[i] if i < len(self.keys) else f"sample {i}"

    def skip_step(self, step: int) -> list[str]:
        """After a step with a refused micro-batch: count it, drop its new failures (with skip_bad_samples), and
        return the lines to log."""
        self.skipped_steps += 1
        self.last = list(self.new.values())
        lines = [f"step {step}: sample failed to load: {line}" for line in self.new.values()]
        if self.held:  # which clip a step leaves out is always said, by path
            lines.append(f"step {step}: holds sample(s) dropped before: {', '.join(map(self.name, self.held))}")
        if self.skip:
            self.dropped.update(self.new)
            if self.stamp:
                self.stamps.update((i, self.stamp(i)) for i in self.new)
            lines.append(f"step {step} not trained; {len(self.dropped)} sample(s) dropped so far")
        self.new, self.held = {}, []
        return lines

    def stop_message(self, step: int) -> str:
        """The run's last line: the step, the first failure (sample, file, problem), what to do."""
        more = f" (and {len(self.last) - 1} more above)" if len(self.last) > 1 else ""
        return (f"stopped at step {step} on a sample that failed to load: {self.last[0] if self.last else '?'}{more}; "
                "the checkpoint before it is written: fix or remove the file and --resume auto, or --resume auto "
                "--skip-bad-samples to drop it")

    def summary(self) -> str:
        return f"{len(self.dropped)} sample(s) dropped after failing to load; {self.skipped_steps} step(s) not trained"

    def state_dict(self) -> dict:
        state = dict(dropped=dict(self.dropped), skipped_steps=self.skipped_steps)
        if self.keys:  # the dataset it is of, and the dropped samples by path (and their files then)
            state.update(dropped_keys={i: self.keys[i] for i in self.dropped if i < len(self.keys)},
                         dropped_stamps={i: self.stamps[i] for i in self.dropped if i in self.stamps},
                         dataset=dataset_digest(self.keys), samples=len(self.keys))
        return state

    def load_state_dict(self, state: dict) -> list[str]:
        """Restore the dropped samples, found by path; returns the lines to log: whether the dataset changed since
        the checkpoint, and each dropped sample by path: dropped still, read again (its files were replaced since),
        or gone from the dataset. A resume never leaves out a clip without naming it."""
        self.skipped_steps = state["skipped_steps"]
        dropped = {int(k): v for k, v in state["dropped"].items()}
        if "dataset" not in state or not self.keys:  # a checkpoint of an older a2: by position, as it was
            self.dropped = dropped
            return [f"the checkpoint does not record its samples' paths: its {len(dropped)} dropped sample(s) are "
                    "taken by position, now " + ", ".join(map(self.name, dropped))] if dropped and self.keys else []
        lines = []
        if state["dataset"] != dataset_digest(self.keys):
            lines.append(f"the dataset changed since the checkpoint ({state.get('samples', '?')} samples then, "
                         f"{len(self.keys)} now): the data order from here, and an --eval-split's draw of held-out "
                         "clips, are not the uninterrupted run's")
        index = {k: i for i, k in enumerate(self.keys)}
        keys = {int(i): k for i, k in state.get("dropped_keys", {}).items()}
        stamps = {int(i): v for i, v in state.get("dropped_stamps", {}).items()}
        now = {i: index[keys[i]] for i in dropped if keys.get(i) in index}  # checkpoint's index -> this run's
        fixed = [i for i in now if self.stamp and i in stamps and self.stamp(now[i]) != stamps[i]]
        self.dropped = {now[i]: dropped[i] for i in now if i not in fixed}
        self.stamps = {now[i]: stamps[i] for i in now if i not in fixed and i in stamps}
        gone = [keys.get(i, f"sample {i}") for i in dropped if i not in now]
        if self.dropped:
            lines.append(f"{len(self.dropped)} sample(s) dropped before the checkpoint stay dropped: "
                         + ", ".join(map(self.name, self.dropped)))
        if fixed:
            lines.append("read again, their files changed since they were dropped: "
                         + ", ".join(keys[i] for i in fixed))
        if gone:
            lines.append("dropped before the checkpoint, no longer in the dataset: " + ", ".join(gone))
        return lines


def dataset_digest(keys: list[str]) -> str:
    """What a checkpoint records of its dataset: a hash of the samples' paths in order."""
    return hashlib.sha256("\n".join(keys).encode("utf-8", "surrogateescape")).hexdigest()[:16]


# ---------------------------------------------------------------- loader workers and stop signals
# A scheduler preempts by sending SIGTERM to the whole process group (Ctrl-C sends SIGINT to it): loader workers
# that died of it would make the DataLoader raise in the middle of the step that is to be checkpointed. So workers
# ignore both; the main process catches them, finishes its step, checkpoints and shuts the workers down.
STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)


def ignore_stop_signals(worker_id: int = 0) -> None:
    """DataLoader worker_init_fn: SIGTERM and SIGINT are the main process's to handle."""
    for s in STOP_SIGNALS:
        signal.signal(s, signal.SIG_IGN)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, STOP_SIGNALS)  # blocked by stop_signals_blocked while it started


@contextmanager
def stop_signals_blocked():
    """Start loader workers inside this: a spawned worker inherits the blocked mask, so a signal that arrives while it
    imports torch (seconds, before its worker_init_fn runs) waits and is then ignored, instead of killing it. The
    main process gets a signal that arrived meanwhile when the block is lifted."""
    old = signal.pthread_sigmask(signal.SIG_BLOCK, STOP_SIGNALS)
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, old)


class LoaderError(RuntimeError):
    """A loader worker that died (killed by a signal: the kernel's OOM killer) or raised outside a sample: the run
    ends in one line, exit 1."""


def next_batch(batches, step: int) -> dict:
    """The next micro-batch of step `step` (0-based). A sample that fails comes back as a failed batch (collate);
    what the DataLoader itself raises about a worker becomes LoaderError, one line, instead of its traceback."""
    try:
        return next(batches)
    except Exception as e:
        text = (e.args[0] if e.args and isinstance(e.args[0], str) else str(e)).strip()  # a KeyError's str quotes
        if "DataLoader worker" not in text:
            raise
        lines = text.splitlines()  # "Caught X in DataLoader worker process 0. Original Traceback ... X: msg"
        raise LoaderError(f"step {step + 1}: a loader worker failed: "
                          f"{lines[-1] if text.startswith('Caught ') else lines[0]}") from None


class WorkerProcess(multiprocessing.context.SpawnProcess):
    """A spawned loader worker that leaves with os._exit once its loop has returned, as a forked one does. Left to
    spawn's sys.exit, the interpreter finalizes while the worker's queue feeder thread may still be sharing the last
    batch's tensors into shared memory with the GIL released (torch's worker loop cancels that thread's join at
    shutdown); CPython then ends the thread with pthread_exit as it retakes the GIL, and the forced unwind through
    torch's C++ frame calls std::terminate: `terminate called without an active exception`, the worker killed by
    SIGABRT, and the main process's DataLoader raising in the middle of its own exit."""

    def run(self):
        code = 0
        try:
            super().run()  # torch's _worker_loop
        except BaseException:  # what multiprocessing's _bootstrap would print before exiting 1
            traceback.print_exc()
            code = 1
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


class WorkerContext(multiprocessing.context.SpawnContext):
    """DataLoader multiprocessing_context: spawned workers (a process running CUDA and OpenMP threads cannot fork
    safely) that exit without finalizing (WorkerProcess)."""

    Process = WorkerProcess


def stop_workers(batches) -> None:
    """Shut the workers of a DataLoader iterator down now (what its __del__ does when the last reference goes), with
    the stop signals held back meanwhile. An exception leaving the loop keeps the iterator alive in its traceback, and
    at interpreter exit multiprocessing stops daemonic workers with SIGTERM, which they ignore, then waits for them
    forever: so every exit path calls this. Workers still alive after the shutdown are killed."""
    if not hasattr(batches, "_shutdown_workers"):  # None, or num_workers 0: nothing runs beside this process
        return
    with stop_signals_blocked():
        batches._shutdown_workers()
        for w in batches._workers:
            if w.is_alive():
                w.kill()
                w.join()
