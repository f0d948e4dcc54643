"""Files the commands read and write: atomic writes, output paths (files and folders) checked before the work.

A command killed (Ctrl-C, a signal, a file-size limit, a full disk) while
writing must leave the old file or none, never half a plan or a gzip without
its end: everything is written to a temporary file in the same directory,
flushed and fsync'ed, then renamed over the target (`os.replace` is atomic on
one file system). The file gets the mode `open()` would give it (0666 less the
umask), not the temporary file's 0600.
"""
from __future__ import annotations

import argparse
import contextlib
import gzip
import io
import os
import tempfile


def output_path(path: str) -> str:
    """argparse type of an output file flag: checked when the command line is read, before any work.
    Refuses a directory, and a path under a file; creates nothing (the write makes missing parents)."""
    if not path:
        raise argparse.ArgumentTypeError("empty path")
    if os.path.isdir(path):
        raise argparse.ArgumentTypeError(f"{path}: is a directory, not a file")
    _check_folder(path, os.path.dirname(os.path.abspath(path)))
    return path


def output_dir(path: str) -> str:
    """argparse type of an output folder flag (the files a command writes into it): checked like
    `output_path`. Refuses a file, and a path under a file; creates nothing (the command makes it)."""
    if not path:
        raise argparse.ArgumentTypeError("empty path")
    if os.path.exists(path) and not os.path.isdir(path):
        raise argparse.ArgumentTypeError(f"{path}: is a file, not a directory")
    _check_folder(path, os.path.abspath(path))
    return path


def _check_folder(path: str, folder: str) -> None:
    """`folder` (where `path` is written) exists and takes a new file, or its nearest existing ancestor is
    a directory this process can create it in."""
    ancestor = folder
    while not os.path.exists(ancestor):
        ancestor = os.path.dirname(ancestor)
    if not os.path.isdir(ancestor):
        raise argparse.ArgumentTypeError(f"{path}: {ancestor} is not a directory")
    if not os.access(ancestor, os.W_OK | os.X_OK):
        raise argparse.ArgumentTypeError(f"{path}: {ancestor} is not writable")
    if ancestor == folder:  # the folder exists: try the write's first step
        try:
            fd, probe = tempfile.mkstemp(dir=ancestor, prefix="." + os.path.basename(path) + ".", suffix=".tmp")
        except OSError as exc:  # /proc, a read-only mount: os.access cannot tell
            raise argparse.ArgumentTypeError(f"{path}: cannot write there ({exc.strerror or exc})") from None
        os.close(fd)
        os.unlink(probe)


def _umask() -> int:
    """The process's umask: read from /proc where it can be (setting it to read it back is not thread-safe)."""
    try:
        with open("/proc/self/status", encoding="ascii") as f:
            for line in f:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


class AtomicFile:
    """A file that appears at `path` only when `commit()` is called; `discard()` (or a failed commit)
    leaves the old file, or none. Text (UTF-8) unless `binary`; gzip'ed when `compress` (default: the
    name ends in .gz). `file` is the stream to write to."""

    def __init__(self, path: str, binary: bool = False, compress: bool | None = None):
        self.path = path
        self._compress = str(path).endswith(".gz") if compress is None else compress
        parent = os.path.dirname(os.path.abspath(path))
        try:
            os.makedirs(parent, exist_ok=True)
            fd, self._tmp = tempfile.mkstemp(dir=parent, prefix="." + os.path.basename(path) + ".", suffix=".tmp")
        except OSError as exc:  # name the user's path, not the temporary file's
            raise OSError(exc.errno, exc.strerror or str(exc), path) from None
        os.fchmod(fd, 0o666 & ~_umask())  # mkstemp makes 0600; a written file honours the umask like open()
        self._raw = os.fdopen(fd, "wb")
        self._stream = gzip.GzipFile(fileobj=self._raw, mode="wb", filename="", mtime=0) if self._compress \
            else self._raw
        self.file = self._stream if binary else io.TextIOWrapper(self._stream, encoding="utf-8")

    def commit(self) -> None:
        try:
            self.file.flush()
            if self.file is not self._stream:
                self.file.detach()
            if self._compress:
                self._stream.close()  # writes the gzip trailer
            self._raw.flush()
            os.fsync(self._raw.fileno())
            self._raw.close()
            os.replace(self._tmp, self.path)
        except BaseException:
            self.discard()
            raise

    def discard(self) -> None:
        with contextlib.suppress(Exception):
            self._raw.close()
        with contextlib.suppress(OSError):
            os.unlink(self._tmp)


@contextlib.contextmanager
def atomic_write(path: str, binary: bool = False, compress: bool | None = None):
    """`with atomic_write(path) as f: ...`: the file appears whole when the block succeeds, else never."""
    out = AtomicFile(path, binary, compress)
    try:
        yield out.file
        out.commit()
    except OSError as exc:  # a full disk, a file-size limit: name the file the command was writing
        out.discard()
        if exc.filename is None:
            raise OSError(exc.errno, exc.strerror or str(exc), path) from None
        raise
    except BaseException:
        out.discard()
        raise


def write_text(path: str, text: str) -> None:
    """`Path(path).write_text(text)`, atomically (`atomic_write`: the parents made, the old file or the new)."""
    with atomic_write(path) as f:
        f.write(text)
