"""Run dirs and checkpoints that survive a cluster: one run per dir (a lock), checkpoints that say they are complete
(a manifest written last), resuming from the newest complete, compatible one (checked before any model loads),
metrics and config history that match the resumed state, and optimizer steps skipped on the device when the loss
or gradient norm is not finite.

A run dir `output_dir/run_name`:
    .lock             flock'ed by the running process (pid, host, start time inside); free when it exits or dies
    config.json       the run's config, written once, plus `resumes`: one entry per resume (step, checkpoint, what
                      changed)
    metrics.jsonl     one row per logged step; cut back to the resumed step on resume
    ckpt-<step>/      trainable.safetensors + optimizer.pt (DDP) or sharded/ (--fsdp, torch.distributed.checkpoint),
                      state.pt (read weights-only: a run dir cannot run code on resume), config.json, and
                      manifest.json, written last: the checkpoint is complete iff its
                      manifest is there and every file has the size (and, up to CHECKSUM_MAX_BYTES, the crc32) it lists
    .tmp-ckpt-<step>/ a checkpoint being written (renamed to ckpt-<step> once its manifest is on disk)

Exit codes of train_a2.py: 0 finished; EXIT_RESUMABLE (143) stopped by SIGTERM/SIGINT after writing a complete
checkpoint of the step it stopped at (run the same command with --resume auto); 128 + the signal (143 SIGTERM, 130
SIGINT) stopped at once by a second signal or one outside the step loop (Stopped: --resume auto continues from the
newest complete checkpoint); 2 an input problem, one line (RunLocked, ResumeError among them); 1 a failure (Diverged
names the last checkpoint with finite weights; CheckpointError: a checkpoint could not be written, e.g. a full disk).
"""

from __future__ import annotations

import fcntl
import importlib
import json
import os
import pickle
import shutil
import signal
import socket
import time
import zlib
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from safetensors import SafetensorError, safe_open
from safetensors.torch import load_file, save_file
from torch.distributed.checkpoint._traverse import set_element
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import StorageMeta
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict

from a2.cli import InputError

EXIT_RESUMABLE = 143  # 128 + SIGTERM: what schedulers (and Kubernetes restart policies) treat as "retry"
MANIFEST = "manifest.json"
CHECKSUM_MAX_BYTES = 256 * 2**20  # files up to this size get a crc32 (LoRA weights, optimizer, state); larger ones
# (full fine-tuning shards, tens of GB) only their size: reading them back would cost minutes per checkpoint
_CKPT_PREFIX = "ckpt-"

# what must agree between a checkpoint's config and the resuming run's: the trainable weights' names and shapes
# (model, expert, LoRA rank/targets), what they mean (alpha scales the LoRA update), and how they are stored (fsdp)
_MUST_MATCH = ("model", "expert", "training_type")
_MUST_MATCH_LORA = ("lora_rank", "lora_alpha", "lora_target")


class RunLocked(InputError):
    """The run dir is in use by another process."""


class ResumeError(InputError):
    """No checkpoint can be resumed as asked; the message says which and why, in one line."""


class Diverged(FloatingPointError):
    """The loss or gradient norm stayed non-finite; the message names the last checkpoint with finite weights."""


class CheckpointError(OSError):
    """A checkpoint could not be written (too little free space, or the write failed); its partial temp dir is
    removed and the earlier checkpoints are untouched. One line."""


class Stopped(KeyboardInterrupt):
    """A SIGTERM/SIGINT that stops the run at once (a second one, or one outside the step loop): no checkpoint of the
    current step; the run resumes from its newest complete checkpoint. A KeyboardInterrupt, so that no `except
    Exception` swallows it and every `finally` (loader workers, temp checkpoint dirs) runs on the way out."""

    def __init__(self, signum: int, why: str):
        self.signum = signum
        super().__init__(f"stopped by {signal.Signals(signum).name} ({why}): the current step is not checkpointed; "
                         "--resume auto continues from the run's newest complete checkpoint")


# ---------------------------------------------------------------- the run-dir lock


_HELD: dict[str, RunLock] = {}  # the locks this process holds, by lock file


class RunLock:
    """An exclusive flock on run_dir/.lock, held until release() or the process ends (a killed process frees it: no
    stale locks). The file says who holds it, so a second run fails at once naming pid, host and start time.
    A process runs one training at a time: a lock it still holds from an earlier one (train_a2.main called in
    process, ended by an exception) is taken over, not refused. (On NFS, Linux emulates flock with fcntl locks,
    which NFS supports; a file system mounted without locking would let two runs through.)"""

    def __init__(self, run_dir):
        self.path = Path(run_dir) / ".lock"
        self.fd: int | None = None

    def acquire(self) -> RunLock:
        key = str(self.path.resolve())
        if key in _HELD:
            _HELD[key].release()
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 4096, 0).decode(errors="replace").strip()
            os.close(fd)
            try:
                h = json.loads(holder)
                who = f"pid {h['pid']} on {h['host']}, running since {h['started']}"
            except (ValueError, KeyError, TypeError):
                who = "a process that has not written its pid yet"
            raise RunLocked(f"{self.path.parent}: in use by another run ({who}); wait for it, stop it, or give "
                            "another --run-name") from None
        info = dict(pid=os.getpid(), host=socket.gethostname(), started=time.strftime("%Y-%m-%d %H:%M:%S"))
        os.ftruncate(fd, 0)
        os.pwrite(fd, json.dumps(info).encode(), 0)
        self.fd = fd
        _HELD[key] = self
        return self

    def release(self) -> None:
        if self.fd is not None:
            os.ftruncate(self.fd, 0)
            fcntl.flock(self.fd, fcntl.LOCK_UN)
            os.close(self.fd)
            self.fd = None
            _HELD.pop(str(self.path.resolve()), None)


# ---------------------------------------------------------------- checkpoint manifest


def _crc32(path: Path) -> str:
    crc = 0
    with open(path, "rb") as f:
        while chunk := f.read(2**22):
            crc = zlib.crc32(chunk, crc)
    return f"{crc:08x}"


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_manifest(ckpt: Path, **meta) -> dict:
    """Make every file under `ckpt` durable (fsync), then write manifest.json (files, sizes, crc32s, `meta`) last,
    durably too. Call it on the temp dir once every rank's files are written, then rename the dir."""
    ckpt = Path(ckpt)
    files = {}
    for f in sorted(p for p in ckpt.rglob("*") if p.is_file() and p.name != MANIFEST):
        _fsync(f)
        size = f.stat().st_size
        files[f.relative_to(ckpt).as_posix()] = dict(size=size, **({"crc32": _crc32(f)}
                                                                    if size <= CHECKSUM_MAX_BYTES else {}))
    manifest = dict(version=1, written=time.strftime("%Y-%m-%d %H:%M:%S"), **meta, files=files)
    tmp = ckpt / (MANIFEST + ".tmp")
    with open(tmp, "w") as fh:
        json.dump(manifest, fh, indent=1)
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, ckpt / MANIFEST)
    for d in {ckpt, *((ckpt / name).parent for name in files)}:
        _fsync(d)
    return manifest


def read_manifest(ckpt: Path) -> dict:
    return json.loads((Path(ckpt) / MANIFEST).read_text())


def checkpoint_problem(ckpt: Path) -> str | None:
    """Why `ckpt` cannot be resumed (incomplete, truncated, corrupt, unreadable), or None when it can. Cheap: sizes,
    the recorded crc32s, and the small files parsed (state.pt, config.json, the safetensors header)."""
    ckpt = Path(ckpt)
    if not ckpt.is_dir():
        return "not a directory"
    try:
        manifest = read_manifest(ckpt)
    except FileNotFoundError:
        return f"incomplete: no {MANIFEST} (its writer was stopped before finishing it)"
    except ValueError as e:
        return f"{MANIFEST} unreadable ({e})"
    for name, want in manifest.get("files", {}).items():
        f = ckpt / name
        if not f.is_file():
            return f"{name} missing"
        size = f.stat().st_size
        if size != want["size"]:
            return f"{name} has {size} bytes, the manifest says {want['size']} (truncated or rewritten)"
        if "crc32" in want and _crc32(f) != want["crc32"]:
            return f"{name}: crc32 {_crc32(f)} != {want['crc32']} in the manifest (corrupt)"
    for name in ("state.pt", "config.json"):
        if name not in manifest.get("files", {}):
            return f"{name} not in the manifest"
    try:
        torch.load(ckpt / "state.pt", weights_only=True, map_location="cpu")
        json.loads((ckpt / "config.json").read_text())
        if (ckpt / "trainable.safetensors").exists():
            with safe_open(ckpt / "trainable.safetensors", "pt") as f:
                f.keys()
        if (ckpt / "sharded").is_dir():
            _ShardedReader(ckpt).read_metadata()
    except Exception as e:  # any reader's error means: not loadable
        return f"unreadable ({type(e).__name__}: {e})"
    return None


def checkpoints(run_dir: Path) -> list[tuple[int, Path]]:
    """(step, dir) of every ckpt-<step> dir of the run, oldest first (complete or not)."""
    out = []
    for p in Path(run_dir).glob(_CKPT_PREFIX + "*"):
        step = p.name[len(_CKPT_PREFIX):]
        if p.is_dir() and step.isdigit():
            out.append((int(step), p))
    return sorted(out)


def commit_checkpoint(tmp: Path, final: Path, keep_last: int, **meta) -> Path:
    """The last act of a checkpoint write: manifest into the temp dir, rename it to `final`, then drop all but the
    newest `keep_last` complete checkpoints (and any incomplete ones older than them)."""
    write_manifest(tmp, **meta)
    if final.exists():
        shutil.rmtree(final)
    os.replace(tmp, final)
    _fsync(final.parent)
    complete = [p for _, p in checkpoints(final.parent) if (p / MANIFEST).exists()]
    keep = set(complete[-keep_last:]) if keep_last > 0 else set(complete)
    oldest_kept = min((int(p.name[len(_CKPT_PREFIX):]) for p in keep), default=0)
    for step, p in checkpoints(final.parent):
        if p not in keep and step < oldest_kept:
            shutil.rmtree(p, ignore_errors=True)
    return final


# ---------------------------------------------------------------- writing and reading checkpoints

def checkpoint_margin(tensor_bytes: int) -> int:
    """The bytes beyond the tensors (state.pt, config.json, the manifest, per-tensor pickle/zip/header overhead): a
    tenth of the tensors' bytes plus 256 KiB, so a small LoRA checkpoint asks for about what it writes, not a fixed
    16 MiB more."""
    return int(tensor_bytes * 0.1) + 2**18


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def checkpoint_bytes(model, opt) -> int:
    """What a checkpoint takes on disk, known before writing it: the trainable weights and every optimizer state
    tensor (under FSDP2 their global sizes: the sum of all ranks' shards), plus a margin proportional to them
    (checkpoint_margin)."""
    weights = sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)
    state = sum(t.numel() * t.element_size() for s in opt.state.values() for t in s.values() if torch.is_tensor(t))
    return weights + state + checkpoint_margin(weights + state)


def _one_line(e: BaseException) -> str:
    return f"{type(e).__name__}: {' '.join(str(e).split())}"


def _gib(n: int) -> str:
    return f"{n / 2**30:.2f} GiB ({n} bytes)"


def save_checkpoint(run_dir: Path, step: int, model, opt, config: dict, keep_last: int, load_failures: dict,
                    fsdp: bool = False) -> Path:
    """Write ckpt-<step> atomically (temp dir, manifest written last, then rename) and keep the last `keep_last`:
    the trainable weights (or adapter), the optimizer, the step, the config and the dropped samples; nothing else is
    read by a resume (the data order and every random draw are functions of (seed, step)).
    DDP: rank 0 writes the trainable weights and optimizer. --fsdp: every rank writes its shards of both
    (torch.distributed.checkpoint, into sharded/), then rank 0 adds state.pt and renames, after a barrier.
    Free space is checked first (checkpoint_bytes; --fsdp: agreed by all ranks); too little, or a failed write,
    raises CheckpointError with the temp dir removed and the earlier checkpoints untouched."""
    run_dir = Path(run_dir)
    final, tmp = run_dir / f"{_CKPT_PREFIX}{step:07d}", run_dir / f".tmp-{_CKPT_PREFIX}{step:07d}"
    need, free = checkpoint_bytes(model, opt), shutil.disk_usage(run_dir).free
    short = [need > free]
    if fsdp and dist.is_initialized():  # ranks on other hosts see other disks: stop all alike, or none
        every: list = [None] * dist.get_world_size()
        dist.all_gather_object(every, short[0])
        short = every
    if any(short):
        raise CheckpointError(f"{run_dir}: not enough free space for the checkpoint of step {step}: {_gib(free)} "
                              f"free, it needs {_gib(need)}; nothing written, the earlier checkpoints are untouched; "
                              "free space and run the same command with --resume auto")
    try:
        if _rank() == 0:
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir(parents=True)
        if fsdp:
            dist.barrier()  # the temp dir is there, with nothing stale in it, before any rank writes
            trained = StateDictOptions(ignore_frozen_params=True)  # a LoRA's: the adapter alone
            model_sd, optim_sd = get_state_dict(model, opt, options=trained)
            dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=tmp / "sharded")
            dist.barrier()  # every rank's shards are on disk
            if _rank() != 0:
                return final
        else:
            trainable = {n: p.detach().cpu().contiguous() for n, p in model.named_parameters() if p.requires_grad}
            save_file(trainable, tmp / "trainable.safetensors")
            torch.save(opt.state_dict(), tmp / "optimizer.pt")
        torch.save(dict(step=step, load_failures=load_failures), tmp / "state.pt")
        (tmp / "config.json").write_text(json.dumps(config, indent=2))
        # data-parallel ranks: a context-parallel group trains one sample stream
        world = (dist.get_world_size() if dist.is_initialized() else 1) // config.get("context_parallel", 1)
        return commit_checkpoint(tmp, final, keep_last, step=step, world_size=world, fsdp=fsdp)  # manifest last
    except BaseException as e:  # a failed write, or a signal that stops at once: no partial checkpoint stays
        shutil.rmtree(tmp, ignore_errors=True)
        if isinstance(e, (OSError, RuntimeError, SafetensorError)):
            raise CheckpointError(f"{run_dir}: writing the checkpoint of step {step} failed ({_one_line(e)}); "
                                  f"{_gib(shutil.disk_usage(run_dir).free)} free, it needs {_gib(need)}; the partial "
                                  f"{tmp.name} is removed, the earlier checkpoints are untouched") from e
        raise


def load_checkpoint(ckpt: Path, model, opt, fsdp: bool = False) -> dict:
    """Restore the trainable weights (or adapter) and the optimizer from ckpt, a checkpoint plan_resume has checked
    (check_compatible: --fsdp against a sharded one, DDP against trainable.safetensors); returns its state.pt (step,
    load_failures)."""
    ckpt = Path(ckpt)
    state = torch.load(ckpt / "state.pt", weights_only=True)  # plain step/skips: a pickle holding code is refused
    if fsdp:
        saved = _ShardedReader(ckpt).read_metadata().state_dict_metadata  # refused here, in one line, if it holds
        # code (dcp wraps its errors)
        trained = StateDictOptions(ignore_frozen_params=True, strict=False)  # a LoRA's: the adapter alone
        # dcp reads the entries the optimizer's state already has: get_state_dict makes AdamW's (torch's zero step at
        # learning rate 0), and an EMA (a2/train/step.py) gets its entry here, which the load then overwrites
        get_state_dict(model, opt, options=trained)
        if any(k.startswith("optim.state.") and k.endswith(".ema") for k in saved):
            for p in (p for g in opt.param_groups for p in g["params"]):
                opt.state[p].setdefault("ema", p.detach().clone())
        model_sd, optim_sd = get_state_dict(model, opt, options=trained)
        sharded = {"model": model_sd, "optim": optim_sd}
        try:
            dcp.load(sharded, storage_reader=_ShardedReader(ckpt), planner=_TensorsOnlyPlanner())  # any world size
        except dcp.api.CheckpointException as e:  # a BaseException, its cause in .failures: {rank: (error, trace)}
            cause = next(iter(e.failures.values()))[0]
            raise ValueError(f"{ckpt}: sharded checkpoint unreadable ({_one_line(cause)})") from None
        set_state_dict(model, opt, model_state_dict=sharded["model"], optim_state_dict=sharded["optim"],
                       options=trained)
    else:
        missing = model.load_state_dict(load_file(ckpt / "trainable.safetensors"), strict=False)
        if missing.unexpected_keys:
            raise ValueError(f"{ckpt}: checkpoint has weights this model lacks: {missing.unexpected_keys[:5]}")
        opt.load_state_dict(torch.load(ckpt / "optimizer.pt", weights_only=True))
    return state


# A run dir may come from someone else: resuming it must not run code from its files. state.pt and optimizer.pt are
# read with torch's weights-only loader; the sharded checkpoint's pickles (torch.distributed.checkpoint's .metadata
# and its non-tensor entries, which torch unpickles freely) through the allow-lists below.
_DCP_METADATA = "torch.distributed.checkpoint.metadata"
_METADATA_GLOBALS = {("torch", "Size"), ("torch.serialization", "_get_layout"), ("collections", "OrderedDict"),
                     ("torch.distributed.checkpoint.filesystem", "_StorageInfo"), ("pathlib", "PosixPath"),
                     ("pathlib", "PurePosixPath"), ("pathlib", "WindowsPath"), ("pathlib", "PureWindowsPath")}


class _MetadataUnpickler(pickle.Unpickler):
    """Unpickles a sharded checkpoint's .metadata: its dataclasses, torch dtypes/sizes and paths, nothing else."""

    def find_class(self, module, name):
        obj = getattr(importlib.import_module(module), name, None) if module in (_DCP_METADATA, "torch") else None
        if ((module, name) in _METADATA_GLOBALS or isinstance(obj, torch.dtype)
                or (module == _DCP_METADATA and isinstance(obj, type) and obj.__module__ == module)):
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"{module}.{name} is not allowed in a checkpoint's metadata (code, not data)")


class _ShardedReader(dcp.FileSystemReader):
    """A checkpoint's sharded/ dir, its .metadata read through _MetadataUnpickler."""

    def __init__(self, ckpt: Path):
        super().__init__(str(Path(ckpt) / "sharded"))

    def read_metadata(self, *args, **kwargs):
        with open(Path(self.path) / ".metadata", "rb") as f:
            metadata = _MetadataUnpickler(f).load()
        if getattr(metadata, "storage_meta", None) is None:  # as torch's own reader fills it in
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


class _TensorsOnlyPlanner(DefaultLoadPlanner):
    def load_bytes(self, read_item, value):  # torch's own unpickles with weights_only=False
        obj = torch.load(value, weights_only=True)
        if self.flatten_state_dict:
            set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], obj)
        else:
            self.state_dict[read_item.dest_index.fqn] = obj


# ---------------------------------------------------------------- resuming


@dataclass
class ResumePoint:
    """Where a run starts: a checkpoint and its step (path None: step 0), and what was skipped or noticed on the way
    (log lines)."""

    path: Path | None = None
    step: int = 0
    skipped: list[tuple[Path, str]] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)


def find_resumable(run_dir: Path) -> tuple[Path | None, list[tuple[Path, str]]]:
    """The newest complete, loadable checkpoint of the run dir (None if there is none), and each newer one that was
    skipped with the reason."""
    skipped = []
    for _, p in reversed(checkpoints(run_dir)):
        problem = checkpoint_problem(p)
        if problem is None:
            return p, skipped
        skipped.append((p, problem))
    return None, skipped


def _same_model(a: str, b: str) -> bool:
    if a == b:
        return True
    try:
        return Path(a).exists() and Path(b).exists() and os.path.samefile(a, b)
    except OSError:
        return False


def check_compatible(ckpt: Path, current: dict, world_size: int) -> list[str]:
    """Raise ResumeError (one line) when `ckpt` cannot be resumed by a run with config `current` (a TrainConfig as a
    dict) at `world_size` ranks: a different model or expert, training type, LoRA rank/alpha/targets, or --fsdp
    against a DDP checkpoint (or the reverse). DDP checkpoints resume at any world size, --fsdp (sharded) ones too
    (torch.distributed.checkpoint reshards). Returns notes on what else differs (e.g. the global batch)."""
    ckpt = Path(ckpt)
    saved = json.loads((ckpt / "config.json").read_text())
    current = json.loads(json.dumps(current))  # tuples as lists, as the saved one reads back
    manifest = read_manifest(ckpt)
    keys = _MUST_MATCH + (_MUST_MATCH_LORA if current.get("training_type") == "lora" else ())
    for k in keys:
        a, b = saved.get(k), current.get(k)
        if a != b and not (k == "model" and _same_model(str(a), str(b))):
            raise ResumeError(f"{ckpt}: trained with --{k.replace('_', '-')} {a}, this run has {b}: the weights do "
                              f"not fit; resume with the checkpoint's setting or start a new --run-name")
    sharded = (ckpt / "sharded").is_dir()
    if sharded != bool(current.get("fsdp")):
        raise ResumeError(f"{ckpt}: a {'sharded --fsdp' if sharded else 'DDP (not --fsdp)'} checkpoint; resume it "
                          f"{'with' if sharded else 'without'} --fsdp")
    notes = []
    old_world = manifest.get("world_size", world_size)
    old_batch = saved.get("micro_batch", 1) * saved.get("grad_accum", 1) * old_world
    new_batch = current.get("micro_batch", 1) * current.get("grad_accum", 1) * world_size
    if old_batch != new_batch:
        notes.append(f"global batch {old_batch} -> {new_batch}: the data order after step {manifest.get('step')} "
                     "differs from the uninterrupted run's")
    changed = sorted(k for k in current if k in saved and saved[k] != current[k] and k not in ("resume",))
    if changed:
        notes.append("changed since the checkpoint: " + ", ".join(f"{k} {saved[k]!r} -> {current[k]!r}"
                                                                   for k in changed))
    return notes


def plan_resume(resume: str | None, run_dir: Path, current: dict, world_size: int,
                named: bool = True) -> ResumePoint:
    """What --resume means for this run, decided before any model loads.

    `auto`: the newest complete, loadable checkpoint of run_dir (newer incomplete ones are skipped and named); a run
    dir that does not exist, or holds no complete checkpoint, starts at 0 and says so in the notes. A path: that
    checkpoint, which must be complete. No --resume: a run dir that already holds complete checkpoints is refused
    (continuing or overwriting it must be asked for). Every resume is checked with check_compatible."""
    run_dir = Path(run_dir)
    if resume is None:
        done = [p for _, p in checkpoints(run_dir) if (p / MANIFEST).exists()]
        if done:
            raise ResumeError(f"{run_dir} already holds checkpoints (newest {done[-1].name}): give --resume auto to "
                              "continue that run, or another --run-name")
        return ResumePoint()
    if resume == "auto":
        if not named:
            raise ResumeError("--resume auto continues the run named by --run-name; without it every run gets a new "
                              "timestamped dir, so there is nothing to resume")
        if not run_dir.is_dir():
            return ResumePoint(notes=[f"--resume auto: {run_dir} does not exist yet: starting a new run at step 0"])
        ckpt, skipped = find_resumable(run_dir)
        if ckpt is None:
            why = "; ".join(f"{p.name}: {r}" for p, r in skipped) or "none written yet"
            return ResumePoint(None, 0, skipped, [f"--resume auto: no complete checkpoint in {run_dir} ({why}): "
                                                     "starting at step 0"])
    else:
        ckpt, skipped = Path(resume), []
        if ckpt.is_dir() and not ckpt.name.startswith(_CKPT_PREFIX) and not (ckpt / MANIFEST).exists():
            inside = [p.name for _, p in checkpoints(ckpt)]  # a run dir given for one of its checkpoints
            raise ResumeError(f"--resume {ckpt}: not a checkpoint (no {MANIFEST}): "
                              + (f"a run dir; give one of its checkpoints ({', '.join(inside)}), or --resume auto "
                                 f"with --output-dir {ckpt.parent} --run-name {ckpt.name}" if inside else
                                 f"give a run's {_CKPT_PREFIX}<step> dir, or --resume auto with the run's --run-name"))
        problem = checkpoint_problem(ckpt)
        if problem:
            raise ResumeError(f"--resume {ckpt}: {problem}")
        newer = [p.name for s, p in checkpoints(run_dir) if s > read_manifest(ckpt)["step"]
                 and (p / MANIFEST).exists() and p.resolve() != ckpt.resolve()]
        if newer:
            raise ResumeError(f"--resume {ckpt}: {run_dir} holds newer checkpoints ({', '.join(newer)}) that going "
                              "back would overwrite; continue from a checkpoint in a new --run-name instead")
    manifest = read_manifest(ckpt)
    notes = check_compatible(ckpt, current, world_size)
    return ResumePoint(ckpt, int(manifest["step"]), skipped, notes)


# ---------------------------------------------------------------- run-dir files on (re)start


def _write_json(path: Path, obj) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(obj, indent=2))
    os.replace(tmp, path)


def record_start(run_dir: Path, current: dict, point: ResumePoint, world_size: int) -> None:
    """config.json: written when the run starts at step 0, else left as it was with this resume appended to its
    `resumes` (step, checkpoint, host, world size, the fields that differ from the run's config). metrics.jsonl: rows
    after the resumed step dropped (they are recomputed). Stale temp checkpoint dirs removed. Call with the lock."""
    run_dir = Path(run_dir)
    current = json.loads(json.dumps(current))  # tuples as lists, as the saved one reads back
    path = run_dir / "config.json"
    cfg = json.loads(path.read_text()) if point.path is not None and path.exists() else {**current, "resumes": []}
    if point.path is not None:  # a resume (from this run's checkpoint, or another run's: a fork)
        changed = {k: [cfg[k], v] for k, v in current.items() if k in cfg and cfg[k] != v and k != "resume"}
        cfg.setdefault("resumes", []).append(dict(
            time=time.strftime("%Y-%m-%d %H:%M:%S"), step=point.step, checkpoint=str(point.path),
            host=socket.gethostname(), world_size=world_size, changed=changed))
    _write_json(path, cfg)
    truncate_metrics(run_dir / "metrics.jsonl", point.step)
    for tmp in run_dir.glob(".tmp-" + _CKPT_PREFIX + "*"):
        shutil.rmtree(tmp, ignore_errors=True)


def truncate_metrics(path: Path, step: int) -> int:
    """Keep the rows of metrics.jsonl logged at or before `step` (and drop a line cut by a kill); returns how many
    rows were dropped."""
    path = Path(path)
    if not path.exists():
        return 0
    keep, dropped = [], 0
    for line in path.read_text().splitlines():
        try:
            row = json.loads(line)
        except ValueError:
            dropped += 1
            continue
        if row.get("step", 0) <= step:
            keep.append(line)
        else:
            dropped += 1
    if dropped:
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text("".join(line + "\n" for line in keep))
        os.replace(tmp, path)
    return dropped


# ---------------------------------------------------------------- non-finite steps


class NonFiniteSteps:
    """Skips the optimizer step of every step whose loss or gradient norm is not finite, on the device and without a
    host sync: fused AdamW's `found_inf` (the mechanism GradScaler uses) leaves weights, moments and step count
    untouched when it is 1. The check rides on the norm clip_grad_norm_ computes anyway. Consecutive and total
    skipped steps are counted on the device; read them (one sync) where the loop syncs anyway (log, checkpoint)."""

    def __init__(self, opt: torch.optim.Optimizer, device):
        if not opt.defaults.get("fused"):
            raise ValueError("NonFiniteSteps skips steps through fused AdamW's found_inf: build it with fused=True")
        self.opt = opt
        self.streak = torch.zeros((), device=device)  # consecutive non-finite steps up to the last one
        self.total = torch.zeros((), device=device)

    def before_step(self, loss: torch.Tensor, grad_norm: torch.Tensor) -> None:
        """Call between clip_grad_norm_ and opt.step() with the step's (rank-averaged) loss and the gradient norm."""
        if hasattr(grad_norm, "full_tensor"):  # FSDP2: a replicated DTensor
            grad_norm = grad_norm.full_tensor()
        bad = (~(torch.isfinite(grad_norm) & torch.isfinite(loss))).float()
        self.opt.found_inf = bad
        self.streak = (self.streak + 1) * bad
        self.total = self.total + bad

    def counts(self) -> tuple[int, int]:
        """(consecutive non-finite steps up to now, all of them): a host sync."""
        return int(self.streak.item()), int(self.total.item())

    def check(self, step: int, limit: int, last_ckpt: Path | None) -> tuple[int, int]:
        """counts() after `step` (1-based, done); raises Diverged once `limit` steps in a row were non-finite, naming
        `last_ckpt`, the run's newest checkpoint (the loop writes none from non-finite weights)."""
        streak, total = self.counts()
        if streak >= limit:
            first = step - streak + 1
            after = ""
            if last_ckpt is not None and int(Path(last_ckpt).name[len(_CKPT_PREFIX):]) == first - 1:
                after = (f" (the step right after it, {first}, was already non-finite: resume it with a lower --lr, or "
                         "go back further)")
            raise Diverged(f"steps {first}-{step}: loss or gradient norm not finite {streak} times in a row (their "
                           f"optimizer steps skipped; {total} skipped since the start); the last checkpoint with "
                           f"finite weights: {last_ckpt or 'none'}{after}")
        return streak, total


def params_finite(params) -> bool:
    """All trainable weights finite (FSDP2: this rank's shards; the caller all-reduces across ranks)."""
    local = [p.to_local() if hasattr(p, "to_local") else p for p in params]
    return bool(torch.stack([torch.isfinite(p.detach()).all() for p in local]).all().item()) if local else True
