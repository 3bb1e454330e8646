"""Checkpoints of a parameter server: a named set of flat float32 arrays plus the step, in `safetensors`.

What a checkpoint is: ``{name: 1-D float32 array}`` (the parameters, the optimizer's state: for the
central parameter server ``params`` and ``momentum``; a parameter-server shard would write its own
partition under the same names with its own `prefix`), the number of optimizer steps applied, and a
small JSON document of run metadata (train time so far, the model description ...). Nothing else: no
pickle, no ``torch.save``; a file is the safetensors layout (an 8-byte little-endian header length, a
JSON header, the raw little-endian tensor bytes), which a reader parses without running code.

Writing (`CheckpointStore.save`) is atomic: the bytes go to a temporary file in the same folder
(``.<name>.<random>``, `wiiide.atomic_write.write_bytes_atomic`), which is fsync'ed, then ``os.replace``'d
over the final name and the folder fsync'ed, so a crash at any instant leaves the previous
checkpoints intact and at worst a temporary file that loading ignores (the next save removes it).
The newest `keep` files are kept, older ones deleted.

Integrity: the header's metadata carries ``sha256``, the SHA-256 (FIPS 180-4, `hashlib`) of the step and
of every tensor's name, shape and bytes in name order (`tensors_sha256`). Loading
(`CheckpointStore.load_newest`) tries the files newest first and takes the first that parses, whose hash
verifies and whose tensors have the shapes the caller expects; every file it passes over is refused
with a logged error saying why (truncated, hash mismatch, wrong shape ...), and the previous one is used.

File names: ``<prefix>-step<step, 12 digits>.safetensors``, so names sort by step.

Several writers whose files belong together (the shards of a sharded parameter server, prefix
``ps-shard-<i>``, all writing at the same steps): `load_newest_complete` takes the newest step at which
every one of them has a file that verifies, so the restored parts are consistent.
"""

from __future__ import annotations

import hashlib
import json
import re
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

import numpy as np
from safetensors import safe_open
from safetensors.numpy import save as safetensors_bytes

from wiiide.errors import WiiideError
from wiiide.metrics import write_bytes_atomic

FORMAT = "wiiide-checkpoint"
FORMAT_VERSION = "1"
SUFFIX = ".safetensors"
MAX_NAME_CHARS = 64
_NAME = re.compile(r"^[A-Za-z0-9_.-]{1,64}$")


class CheckpointError(WiiideError):
    """A checkpoint cannot be written, or a file is not a valid checkpoint (the message says why)."""


@dataclass(frozen=True)
class Checkpoint:
    """One loaded checkpoint.

    Attributes:
        step: optimizer steps applied when it was written (>= 0).
        tensors: name -> 1-D float32 array (C-contiguous, a private copy).
        run: the run metadata given to `CheckpointStore.save` (JSON values).
        path: the file it was read from.
        created_unix_s: wall-clock seconds (time.time()) when it was written.
    """

    step: int
    tensors: dict[str, np.ndarray]
    run: dict[str, Any]
    path: Path
    created_unix_s: float


def tensors_sha256(step: int, tensors: Mapping[str, np.ndarray]) -> str:
    """Hex SHA-256 over the step and, in name order, each tensor's name, shape and raw bytes.

    Covering names, shapes and the step (not only the bytes) means a file whose header was edited to
    claim another step or to rename a tensor fails verification too.
    """
    digest = hashlib.sha256(f"{FORMAT}/{FORMAT_VERSION} step={int(step)}\n".encode())
    for name in sorted(tensors):
        array = tensors[name]
        digest.update(f"{name}\0{list(array.shape)}\0{array.dtype.str}\0".encode())
        digest.update(memoryview(np.ascontiguousarray(array)).cast("B"))
    return digest.hexdigest()


def _check_tensors(tensors: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
    if not tensors:
        raise CheckpointError("a checkpoint needs at least one tensor")
    out = {}
    for name, array in tensors.items():
        if not isinstance(name, str) or not _NAME.match(name):
            raise CheckpointError(f"tensor name {name!r:.80}: allowed 1..{MAX_NAME_CHARS} of A-Z a-z 0-9 _ . -")
        array = np.asarray(array)
        if array.dtype != np.float32 or array.ndim != 1:
            raise CheckpointError(f"tensor {name!r} is {array.dtype} of shape {array.shape}; a checkpoint holds "
                                  "flat (1-D) float32 arrays")
        out[name] = np.ascontiguousarray(array).astype("<f4", copy=False)
    return out


class CheckpointStore:
    """The checkpoints of one parameter server (or shard) in one folder.

    Args:
        directory: the folder (created on the first save); in containers, a volume the restarted
            node sees again.
        prefix: names this writer's files (``coordinator``, ``ps-shard-3``...): 1..64 of A-Z a-z 0-9 _ . -.
        keep: newest files kept after each save (>= 1).
        log_error: receives one line per refused file (e.g. ``TieredLog.error``); default: nothing.

    Raises:
        CheckpointError: a bad prefix or `keep`.
    """

    def __init__(self, directory: str | Path, prefix: str = "coordinator", keep: int = 3,
                 log_error: Callable[..., None] | None = None) -> None:
        if not _NAME.match(prefix):
            raise CheckpointError(f"checkpoint prefix {prefix!r:.80}: allowed 1..{MAX_NAME_CHARS} of A-Z a-z 0-9 _ . -")
        if keep < 1:
            raise CheckpointError(f"keep={keep}: at least 1 checkpoint must be kept")
        self.directory = Path(directory)
        self.prefix = prefix
        self.keep = keep
        self._log_error = log_error or (lambda *args: None)
        self.refused: list[dict[str, str]] = []  # every file load_newest passed over: {"path", "cause"}

    def path_for(self, step: int) -> Path:
        """The file of the checkpoint at `step`."""
        return self.directory / f"{self.prefix}-step{int(step):012d}{SUFFIX}"

    def files(self) -> list[Path]:
        """This prefix's checkpoint files, newest (highest step) first; temporary files are not listed."""
        return list(self.steps().values())

    def steps(self) -> dict[int, Path]:
        """This prefix's checkpoint files by step, newest (highest step) first (unverified: `read` checks)."""
        pattern = re.compile(rf"^{re.escape(self.prefix)}-step(\d{{12}}){re.escape(SUFFIX)}$")
        if not self.directory.is_dir():
            return {}
        found = [(int(m.group(1)), p) for p in self.directory.iterdir() if (m := pattern.match(p.name))]
        return dict(sorted(found, reverse=True))

    def save(self, step: int, tensors: Mapping[str, np.ndarray], run: Mapping[str, Any] | None = None) -> Path:
        """Write a checkpoint of `tensors` (name -> 1-D float32 array) at `step`, atomically, then
        delete all but the newest `keep` files (and temporary files this prefix left behind).

        Args:
            step: optimizer steps applied (>= 0).
            tensors: name -> 1-D float32 array (copied into the file; the caller may go on updating).
            run: JSON-ready run metadata, returned as `Checkpoint.run` (e.g. train time so far).

        Returns:
            The file's path.

        Raises:
            CheckpointError: a bad step, name, dtype or shape, or metadata that is not JSON.
            OSError: the folder or file cannot be written (the previous checkpoints are untouched).
        """
        if isinstance(step, bool) or not isinstance(step, int) or step < 0:
            raise CheckpointError(f"step {step!r}: a checkpoint's step is an integer >= 0")
        arrays = _check_tensors(tensors)
        try:
            run_json = json.dumps(dict(run or {}), allow_nan=False, sort_keys=True)
        except (TypeError, ValueError) as exc:
            raise CheckpointError(f"run metadata is not JSON: {exc}") from None
        metadata = {"format": FORMAT, "format_version": FORMAT_VERSION, "step": str(step),
                    "sha256": tensors_sha256(step, arrays), "run": run_json, "created_unix_s": repr(time.time())}
        data = safetensors_bytes(arrays, metadata=metadata)
        final = self.path_for(step)
        write_bytes_atomic(final, data, durable=True)
        self._prune()
        return final

    def _prune(self) -> None:
        for old in self.files()[self.keep:]:
            try:
                old.unlink()
            except FileNotFoundError:
                pass
        for tmp in self.directory.glob(f".{self.prefix}-step*{SUFFIX}.*"):  # left by a killed writer
            try:
                tmp.unlink()
            except FileNotFoundError:
                pass

    def read(self, path: Path, expected_shapes: Mapping[str, tuple[int, ...]] | None = None,
             expected_run: Mapping[str, Any] | None = None) -> Checkpoint:
        """Read and verify one checkpoint file.

        Args:
            path: a file `save` wrote.
            expected_shapes: name -> shape every listed tensor must have (missing or other shapes are
                refused); tensors not listed are returned as they are. None: no shape check.
            expected_run: run metadata keys that must hold these values (e.g. the training knobs the
                state depends on), so that a folder reused by another run's configuration is refused.

        Raises:
            CheckpointError: the file cannot be read or parsed (truncated, not safetensors), is not a
                checkpoint of this format, its hash does not verify, or a tensor is missing or has
                another shape or dtype; the message names the file and the cause.
        """
        where = str(path)
        try:
            with safe_open(str(path), framework="np") as fh:
                metadata = dict(fh.metadata() or {})
                tensors = {name: np.array(fh.get_tensor(name), copy=True) for name in fh.keys()}
        except Exception as exc:  # SafetensorError (truncated, bad header), OSError, ...: unreadable
            raise CheckpointError(f"{where}: unreadable ({type(exc).__name__}: {str(exc)[:200]})") from None
        if metadata.get("format") != FORMAT or metadata.get("format_version") != FORMAT_VERSION:
            raise CheckpointError(f"{where}: not a {FORMAT} v{FORMAT_VERSION} file (format "
                                  f"{metadata.get('format')!r:.40}, version {metadata.get('format_version')!r:.10})")
        try:
            step = int(metadata["step"])
            run = json.loads(metadata.get("run") or "{}")
            created = float(metadata.get("created_unix_s") or 0.0)
        except (KeyError, ValueError) as exc:
            raise CheckpointError(f"{where}: bad metadata ({type(exc).__name__}: {str(exc)[:100]})") from None
        for name, array in tensors.items():
            if array.dtype != np.float32 or array.ndim != 1:
                raise CheckpointError(f"{where}: tensor {name!r} is {array.dtype} {array.shape}, expected flat float32")
        actual = tensors_sha256(step, tensors)
        if actual != metadata.get("sha256"):
            raise CheckpointError(f"{where}: SHA-256 mismatch (file says {str(metadata.get('sha256'))[:16]}..., "
                                  f"tensors hash to {actual[:16]}...): corrupted or altered")
        for name, shape in (expected_shapes or {}).items():
            if name not in tensors:
                raise CheckpointError(f"{where}: no tensor {name!r} (has {sorted(tensors)})")
            if tuple(tensors[name].shape) != tuple(shape):
                raise CheckpointError(f"{where}: tensor {name!r} has shape {tuple(tensors[name].shape)}, the model "
                                      f"needs {tuple(shape)}")
        for key, value in (expected_run or {}).items():
            if not isinstance(run, dict) or run.get(key) != value:
                got = run.get(key) if isinstance(run, dict) else None
                raise CheckpointError(f"{where}: written by another run configuration ({key} {got!r:.80}, "
                                      f"this run has {value!r:.80})")
        return Checkpoint(step, tensors, run if isinstance(run, dict) else {}, Path(path), created)

    def load_newest(self, expected_shapes: Mapping[str, tuple[int, ...]] | None = None,
                    expected_run: Mapping[str, Any] | None = None) -> Checkpoint | None:
        """The newest checkpoint that reads and verifies (`read`), or None when there is none.

        Every newer file that fails is refused: logged through `log_error` with its cause and appended
        to `refused`; loading then tries the previous one. Never raises for a bad file.
        """
        for path in self.files():
            try:
                return self.read(path, expected_shapes, expected_run)
            except CheckpointError as exc:
                self.refused.append({"path": str(path), "cause": str(exc)})
                self._log_error("refused checkpoint %s; trying the previous one", exc)
        return None


def load_newest_complete(stores: Sequence[CheckpointStore],
                         expected_shapes: Sequence[Mapping[str, tuple[int, ...]] | None],
                         expected_run: Sequence[Mapping[str, Any] | None],
                         log_error: Callable[..., None] | None = None) -> tuple[int, list[Checkpoint]] | None:
    """The newest step at which EVERY store (e.g. one per parameter-server shard) has a checkpoint that
    reads and verifies (`CheckpointStore.read` with that store's `expected_shapes[i]` and
    `expected_run[i]`), with those checkpoints in store order; None when no step is complete.

    This is the manifest of a sharded checkpoint, computed from the files themselves (each carries its
    own hash), so it cannot disagree with them. A step some store has no file for is incomplete; a
    step where one store's file fails (hash, truncation, shape, run) is incomplete too: the failure is
    logged through `log_error` and appended to that store's `refused`, and the previous step common to
    every store is tried. Never raises for a bad file.
    """
    log_error = log_error or (lambda *args: None)
    by_store = [store.steps() for store in stores]
    if not by_store:
        return None
    common = sorted(set(by_store[0]).intersection(*by_store[1:]), reverse=True)
    for step in common:
        loaded: list[Checkpoint] = []
        for store, files, shapes, run in zip(stores, by_store, expected_shapes, expected_run):
            try:
                checkpoint = store.read(files[step], shapes, run)
            except CheckpointError as exc:
                store.refused.append({"path": str(files[step]), "cause": str(exc)})
                log_error("step %d is incomplete, refused %s; trying the previous step every %d stores have",
                          step, exc, len(stores))
                break
            if checkpoint.step != step:
                store.refused.append({"path": str(files[step]), "cause": f"holds step {checkpoint.step}"})
                log_error("step %d is incomplete: %s holds step %d", step, files[step], checkpoint.step)
                break
            loaded.append(checkpoint)
        else:
            return step, loaded
    return None


@dataclass
class CheckpointSchedule:
    """When the next checkpoint is due: every `every_steps` steps and/or every `every_s` seconds
    (0: that trigger is off; both 0: never).

    `due(step, now_s)` is True when `every_steps` steps or `every_s` seconds (any monotonic clock)
    passed since the last `mark`; the first interval counts from construction (`last_step`,
    `last_s`), e.g. from the restored step.
    """

    every_steps: int
    every_s: float
    last_step: int = 0
    last_s: float = field(default_factory=time.monotonic)

    @property
    def enabled(self) -> bool:
        """True if either trigger is on."""
        return self.every_steps > 0 or self.every_s > 0

    def due(self, step: int, now_s: float) -> bool:
        """Whether a checkpoint should be written after `step` steps at `now_s`."""
        if step <= self.last_step:
            return False
        return ((self.every_steps > 0 and step - self.last_step >= self.every_steps)
                or (self.every_s > 0 and now_s - self.last_s >= self.every_s))

    def mark(self, step: int, now_s: float) -> None:
        """Record that a checkpoint of `step` was written at `now_s`."""
        self.last_step, self.last_s = step, now_s

