"""The language model's corpus: a fixed, versioned subset of the Python standard library's own source.

Real text that no one here wrote and that needs no download: every Python installation carries it.
The subset is `STDLIB_MODULES`, 113 top-level modules (sorted by name) whose files are byte for byte
the same in CPython 3.11.7 (this project's host) and in Debian bookworm's 3.11.2 (the node image's
Python): the 55 other top-level modules differ between those two patch releases. The subset is pinned
by `STDLIB_TOTAL_BYTES` and `STDLIB_SHA256` (`corpus_sha256`: SHA-256 over each file's name and
SHA-256, in order); a Python whose files differ is refused with a `ConfigError` saying so, rather than
training on other text than the run next door.

Split by file: every tenth file in sorted order (indices 9, 19, ...) is validation, the rest is
training, so no validation byte was ever seen in training context. Tokens are bytes (0..255).
"""

from __future__ import annotations

import hashlib
import sys
import sysconfig
from dataclasses import dataclass, field
from pathlib import Path
from typing import Sequence

import numpy as np

from wiiide.errors import ConfigError

VOCAB_SIZE = 256  # byte-level tokens
VALIDATION_EVERY_FILES = 10  # file i (sorted) is validation when i % 10 == 9

STDLIB_MODULES: tuple[str, ...] = (
    '__future__', '__hello__', '_aix_support', '_bootsubprocess', '_collections_abc', '_compat_pickle',
    '_compression', '_markupbase', '_osx_support', '_py_abc', '_pydecimal', '_pyio', '_sitebuiltins',
    '_strptime', '_threading_local', '_weakrefset', 'aifc', 'antigravity', 'asynchat', 'asyncore', 'bisect',
    'bz2', 'cgi', 'cgitb', 'chunk', 'cmd', 'code', 'compileall', 'contextvars', 'copy', 'copyreg', 'crypt',
    'csv', 'decimal', 'difflib', 'filecmp', 'fnmatch', 'fractions', 'ftplib', 'functools', 'genericpath',
    'getopt', 'getpass', 'glob', 'graphlib', 'gzip', 'hashlib', 'heapq', 'hmac', 'imaplib', 'imghdr', 'imp',
    'keyword', 'linecache', 'lzma', 'mailbox', 'mailcap', 'mimetypes', 'modulefinder', 'netrc', 'nntplib',
    'nturl2path', 'numbers', 'opcode', 'operator', 'optparse', 'os', 'pickle', 'pickletools', 'pipes',
    'poplib', 'pprint', 'pstats', 'pyclbr', 'queue', 'random', 'reprlib', 'rlcompleter', 'runpy', 'sched',
    'secrets', 'shelve', 'shlex', 'signal', 'smtpd', 'smtplib', 'sndhdr', 'socketserver', 'sre_compile',
    'sre_constants', 'sre_parse', 'stat', 'statistics', 'string', 'stringprep', 'struct', 'sunau',
    'symtable', 'tabnanny', 'telnetlib', 'textwrap', 'this', 'token', 'tokenize', 'tracemalloc', 'tty',
    'types', 'uuid', 'warnings', 'weakref', 'xdrlib', 'zipapp', 'zipimport',
)
STDLIB_TOTAL_BYTES = 2_189_707
STDLIB_SHA256 = "5f455821278b62c2a0222059decad0e3a086ff8b15440308320e1dcf86502380"
STDLIB_PYTHON = "3.11"  # the minor version the subset was pinned on (3.11.2 and 3.11.7 checked)


@dataclass(frozen=True)
class Corpus:
    """The corpus split by file.

    train / validation: the bytes of the training / validation files, concatenated in file order.
    train_files / validation_files: the file names (``os.py``), sorted.
    """

    name: str
    root: str
    train: bytes
    validation: bytes
    train_files: tuple[str, ...]
    validation_files: tuple[str, ...]
    sha256: str
    python_version: str = field(default_factory=lambda: sys.version.split()[0])

    @property
    def total_bytes(self) -> int:
        """Bytes of every file, training and validation."""
        return len(self.train) + len(self.validation)

    def info(self) -> dict:
        """What a report records: name, root, Python version, hash, files and bytes of each split."""
        return {"name": self.name, "root": self.root, "python_version": self.python_version, "sha256": self.sha256,
                "total_bytes": self.total_bytes, "train_bytes": len(self.train),
                "validation_bytes": len(self.validation), "train_files": list(self.train_files),
                "validation_files": list(self.validation_files)}


def stdlib_root() -> Path:
    """The folder of the running Python's standard library (``sysconfig``'s ``stdlib`` path)."""
    return Path(sysconfig.get_paths()["stdlib"])


def corpus_sha256(names: Sequence[str], contents: Sequence[bytes]) -> str:
    """SHA-256 (hex) over ``name + NUL + sha256(content)`` of every file, in order."""
    digest = hashlib.sha256()
    for name, content in zip(names, contents):
        digest.update(name.encode("utf-8") + b"\0" + hashlib.sha256(content).digest())
    return digest.hexdigest()


def load_corpus(root: Path | str | None = None, modules: Sequence[str] = STDLIB_MODULES,
                expected_sha256: str | None = STDLIB_SHA256, expected_bytes: int | None = STDLIB_TOTAL_BYTES) -> Corpus:
    """Read ``<root>/<module>.py`` for every module (sorted) and split them by file.

    Args:
        root: the folder (default: this Python's standard library).
        modules: module names; the default is the pinned subset.
        expected_sha256 / expected_bytes: the pin; None skips the check (for another list).

    Raises:
        ConfigError: no modules, a missing root or file, an empty corpus or an empty split, or files that
            differ from the pin (another Python minor version or a patched standard library).
    """
    root = Path(root) if root is not None else stdlib_root()
    names = sorted(f"{m}.py" for m in modules)
    if not names:
        raise ConfigError("corpus: the list of files is empty; give at least 2 modules (one goes to validation)")
    if not root.is_dir():
        raise ConfigError(f"corpus: folder {str(root)!r} does not exist (the Python standard library's sources "
                          "are needed: a Python without its .py files cannot run model=transformer)")
    contents = []
    for name in names:
        try:
            contents.append((root / name).read_bytes())
        except OSError as exc:
            raise ConfigError(f"corpus: cannot read {name} in {root}: {exc.strerror or exc}") from None
    total = sum(len(c) for c in contents)
    if total == 0:
        raise ConfigError(f"corpus: the {len(names)} file(s) in {root} are empty")
    sha = corpus_sha256(names, contents)
    if (expected_bytes is not None and total != expected_bytes) or (expected_sha256 is not None and sha != expected_sha256):
        raise ConfigError(f"corpus: the {len(names)} pinned standard-library files in {root} hold {total} bytes "
                          f"(sha256 {sha[:16]}...), the pin is {expected_bytes} bytes (sha256 "
                          f"{(expected_sha256 or '')[:16]}...): this Python ({sys.version.split()[0]}) ships "
                          f"different files than the {STDLIB_PYTHON} it was pinned on; run every node on the "
                          "same Python (the node image's) so that runs stay comparable")
    val = [i for i in range(len(names)) if i % VALIDATION_EVERY_FILES == VALIDATION_EVERY_FILES - 1]
    train = [i for i in range(len(names)) if i not in set(val)]
    if not val or not train or not any(contents[i] for i in val) or not any(contents[i] for i in train):
        raise ConfigError(f"corpus: {len(names)} file(s) leave an empty training or validation split "
                          f"(every {VALIDATION_EVERY_FILES}th file is validation); give at least "
                          f"{VALIDATION_EVERY_FILES} non-empty files")
    return Corpus(name="python-stdlib" if tuple(modules) == STDLIB_MODULES else "custom", root=str(root),
                  train=b"".join(contents[i] for i in train), validation=b"".join(contents[i] for i in val),
                  train_files=tuple(names[i] for i in train), validation_files=tuple(names[i] for i in val),
                  sha256=sha)


def windows(text: bytes, context: int) -> tuple[np.ndarray, np.ndarray]:
    """Non-overlapping next-byte windows of `text`: x int64 (n, context) and y int64 (n, context) with
    ``y[i, t] = x[i, t + 1]`` (the byte after), n = (len - 1) // context.

    Raises:
        ConfigError: the text is shorter than one window plus one byte.
    """
    n = (len(text) - 1) // context
    if n < 1:
        raise ConfigError(f"corpus: {len(text)} bytes make no window of context {context} + 1")
    data = np.frombuffer(text, dtype=np.uint8)
    x = data[: n * context].reshape(n, context).astype(np.int64)
    y = data[1: n * context + 1].reshape(n, context).astype(np.int64)
    return x, y


def unigram_loss_nats(train: bytes, validation: bytes) -> float:
    """Cross-entropy (nats per byte) of the validation bytes under the training bytes' frequencies
    (add-one smoothing over 256 values): the loss of predicting by byte frequency alone, the baseline
    the language model's target is set against."""
    counts = np.bincount(np.frombuffer(train, dtype=np.uint8), minlength=VOCAB_SIZE).astype(np.float64) + 1.0
    log_p = np.log(counts / counts.sum())
    val = np.bincount(np.frombuffer(validation, dtype=np.uint8), minlength=VOCAB_SIZE).astype(np.float64)
    return float(-(val * log_p).sum() / max(1.0, val.sum()))


__all__ = ["Corpus", "load_corpus", "windows", "unigram_loss_nats", "corpus_sha256", "stdlib_root",
           "STDLIB_MODULES", "STDLIB_TOTAL_BYTES", "STDLIB_SHA256", "VOCAB_SIZE"]
