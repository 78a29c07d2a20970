"""Output files, checked before any work and written atomically (a bottom-layer module).

Every command that writes (``report``, ``report --stats``, ``heads --out``, ``stats``) checks
its output path first with ``check_output``: not empty, not a directory, not one of the run's
inputs (compared as files, so a symlink or a hard link to an input is caught), in a folder that
exists or can be created and is writable. ``write_bytes``/``write_text`` then write through a
temporary file in the same folder (``.NAME.XXXXXXXX.tmp``, locked while it is written) and
``os.replace`` it into place, so a reader never sees half a file and an interrupted write leaves
the old file whole. Ctrl-C or SIGTERM during a write (in the main thread) is held until the
temporary file is removed, then raised: the old file stays as it was and no temporary is left,
whenever the signal comes (between creating the temporary file and the ``try`` that removes it
there was a window).
``check_output`` creates (and removes) such a temporary file itself, so a
folder that takes no files fails before any work, and removes the ones a killed write of the same
output left (``remove_stale_temporaries``: its own pattern only, none a live writer holds); any
later failure to write is a ``TLDynamicsError`` naming the path.
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import stat
import tempfile
import threading
from pathlib import Path
from typing import Any, Iterable, Iterator

from tl_dynamics.errors import TLDynamicsError

try:  # POSIX: a writer holds a lock on its temporary file, so no other run removes it
    import fcntl
except ImportError:  # pragma: no cover - Windows: nothing is locked, and nothing is removed
    fcntl = None  # type: ignore[assignment]

PARTIAL_SUFFIX = ".partial"
# tempfile's names: the prefix given, 8 characters of its alphabet, the suffix given
_RANDOM = re.compile(r"[a-z0-9_]{8}")
_KINDS = (
    (stat.S_ISDIR, "is a directory"),
    (stat.S_ISFIFO, "is a named pipe (FIFO)"),
    (stat.S_ISCHR, "is a character device"),
    (stat.S_ISBLK, "is a block device"),
    (stat.S_ISSOCK, "is a socket"),
)


def same_file(a: str | os.PathLike, b: str | os.PathLike) -> bool:
    """Whether two paths name the same file: equal resolved paths, or (both existing) the same
    inode (hard links, symlinks, bind mounts)."""
    pa, pb = Path(a).expanduser(), Path(b).expanduser()
    try:
        if pa.resolve() == pb.resolve():
            return True
    except (OSError, RuntimeError):  # a symlink loop: compare what can be compared
        pass
    try:
        return pa.exists() and pb.exists() and os.path.samefile(pa, pb)
    except OSError:
        return False


def model_inputs(model: str | None) -> list[tuple[str, Path]]:
    """The files of a ``--model`` folder (an output must not overwrite its weights or config)."""
    if not model:
        return []
    folder = Path(model).expanduser()
    try:
        return [("--model", p) for p in folder.iterdir() if p.is_file()] if folder.is_dir() else []
    except OSError:
        return []


def check_output(
    out: str | os.PathLike,
    *,
    what: str = "--out",
    example: str = "report.html",
    inputs: Iterable[tuple[str, str | os.PathLike | None]] = (),
) -> Path:
    """The output path, checked before any work; ``inputs`` are ``(option, path)`` pairs the
    output must not overwrite. Raises ``TLDynamicsError`` saying what is wrong and touches
    nothing; once the path is good, removes the temporary files a killed write of it left
    (``remove_stale_temporaries``)."""
    text = os.fspath(out)
    if not text.strip():
        raise TLDynamicsError(f"{what} is empty: give a file path, e.g. {example}")
    path = Path(text).expanduser()
    try:
        is_dir = path.is_dir()
    except OSError as exc:  # a symlink loop, a name too long, ...
        raise TLDynamicsError(
            f"{what} {text!r}: not a usable path ({exc.strerror or exc})"
        ) from None
    if is_dir:
        raise TLDynamicsError(
            f"{what} {text!r} is a directory: give a file path, e.g. {path / example}"
        )
    for option, source in inputs:
        if source is not None and same_file(path, source):
            raise TLDynamicsError(
                f"{what} {text!r} is the same file as {option} {str(source)!r}: "
                "writing it would destroy the input; choose another output path"
            )
    if path.is_symlink() and not path.exists():
        raise TLDynamicsError(
            f"{what} {text!r} is a dangling or looping symlink: remove it or "
            "choose another output path"
        )
    if path.exists() and not os.access(path, os.W_OK):
        raise TLDynamicsError(f"{what} {text!r}: the file exists and is not writable")
    parent = path.absolute().parent
    if not parent.exists():  # a typo in a folder name must not grow a tree of new folders
        missing = parent
        while not missing.parent.exists():
            missing = missing.parent
        if missing.parent.is_dir():
            raise TLDynamicsError(
                f"{what} {text!r}: the folder {missing} does not exist; create "
                "it first or choose an existing folder"
            )
        parent = missing.parent
    if not parent.is_dir():
        raise TLDynamicsError(
            f"{what} {text!r}: {parent} is a file, so nothing can be written under it"
        )
    if not os.access(parent, os.W_OK | os.X_OK):
        raise TLDynamicsError(f"{what} {text!r}: the folder {parent} is not writable")
    _probe(parent, path.name, f"{what} {text!r}")
    remove_stale_temporaries(path)
    return path


def temporary_prefix(path: Path) -> str:
    """The name every temporary file of ``path``'s atomic writes starts with (then 8 random
    characters and ``.tmp``)."""
    return f".{path.name}."


def remove_stale_temporaries(path: str | os.PathLike) -> list[Path]:
    """Remove the temporary files a killed write of ``path`` left next to it: only names of
    its own pattern (``.NAME.XXXXXXXX.tmp``), only regular files, and only those no live writer
    holds (a writer keeps a lock on its temporary file until it is renamed into place).

    Returns:
        The files removed.

    Example:
        >>> import tempfile, pathlib
        >>> folder = pathlib.Path(tempfile.mkdtemp())
        >>> _ = (folder / ".out.html.abcd1234.tmp").write_text("half a page")
        >>> _ = (folder / ".other.html.abcd1234.tmp").write_text("not ours")
        >>> [p.name for p in remove_stale_temporaries(folder / "out.html")]
        ['.out.html.abcd1234.tmp']
    """
    path = Path(path).expanduser()
    prefix, removed = temporary_prefix(path), []
    if fcntl is None:
        return removed
    try:
        names = [n for n in os.listdir(path.absolute().parent) if n.startswith(prefix)]
    except OSError:
        return removed
    for name in sorted(names):
        middle = name[len(prefix) : -len(".tmp")] if name.endswith(".tmp") else ""
        if not _RANDOM.fullmatch(middle):
            continue
        candidate = path.absolute().parent / name
        if _remove_unheld(candidate):
            removed.append(candidate)
    return removed


def _remove_unheld(candidate: Path) -> bool:
    if fcntl is None:  # nothing is locked here, so nothing can be told stale
        return False
    try:
        fd = os.open(candidate, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError:
        return False
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return False
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # held by a live writer: BlockingIOError
        if os.stat(candidate, follow_symlinks=False).st_ino != os.fstat(fd).st_ino:
            return False
        os.unlink(candidate)
        return True
    except OSError:
        return False
    finally:
        os.close(fd)


def not_a_file(path: str | os.PathLike) -> str | None:
    """None for an existing regular file (or a link to one); else what ``path`` is, in words
    (``"is a directory"``, ``"is a named pipe (FIFO)"``, ``"is a character device"``,
    ``"does not exist"``, ...), found without opening it.

    Example:
        >>> not_a_file("/dev/zero"), not_a_file("/"), not_a_file("/no/such/file")
        ('is a character device', 'is a directory', 'does not exist')
    """
    try:
        mode = os.stat(path).st_mode
    except FileNotFoundError:
        return "is a dangling symlink" if os.path.islink(path) else "does not exist"
    except OSError as exc:
        return f"cannot be looked at ({exc.strerror or exc})"
    if stat.S_ISREG(mode):
        return None
    return next((words for test, words in _KINDS if test(mode)), "is not a regular file")


def _probe(folder: Path, name: str, what: str) -> None:
    """Create (and remove) the kind of temporary file ``write_bytes`` will write, so a folder
    that refuses files (``/proc``, a read-only mount that ``os.access`` calls writable, a full
    disk's inodes) is an error before any work, not after it."""
    try:
        fd, tmp = tempfile.mkstemp(prefix=f".{name}.", suffix=".tmp", dir=folder)
    except OSError as exc:
        raise TLDynamicsError(
            f"{what}: cannot create a file in {folder} ({exc.strerror or exc}); choose "
            "another output folder"
        ) from None
    os.close(fd)
    Path(tmp).unlink(missing_ok=True)


def write_bytes(path: str | os.PathLike, data: bytes) -> Path:
    """Write ``data`` to ``path`` atomically (a temporary file in the same folder, then
    ``os.replace``); missing parent folders are created. A failure to write (a read-only
    folder, ``/proc``, a full disk) is a ``TLDynamicsError`` naming the path, and leaves neither
    a partial file nor the temporary one behind (an existing file at ``path`` stays whole)."""
    path = Path(path)
    try:
        return _write_atomically(path, data)
    except OSError as exc:
        raise TLDynamicsError(
            f"could not write {path} ({exc.strerror or exc}); nothing was written there"
        ) from exc


def _held_temporary(path: Path) -> tuple[int, str]:
    """A new temporary file next to ``path``, locked against ``remove_stale_temporaries`` (if
    another run removed it before the lock was taken, another is made)."""
    while True:
        fd, tmp = tempfile.mkstemp(prefix=temporary_prefix(path), suffix=".tmp", dir=path.parent)
        if fcntl is None:
            return fd, tmp
        fcntl.flock(fd, fcntl.LOCK_EX)
        try:
            if os.stat(tmp).st_ino == os.fstat(fd).st_ino:
                return fd, tmp
        except FileNotFoundError:
            pass
        os.close(fd)


@contextlib.contextmanager
def _interrupts_deferred() -> Iterator[list[int]]:
    """SIGINT and SIGTERM arriving inside the block are held (the list it yields names them) and
    raised at its end, to the handlers from before (the main thread only: Python delivers
    signals nowhere else). A signal the process ignores stays ignored: a background job of a
    shell ignores SIGINT, and holding it would stop the write for a signal that means nothing."""
    held: list[int] = []
    if threading.current_thread() is not threading.main_thread():
        yield held
        return
    previous: dict[int, Any] = {}
    try:
        for sig in (signal.SIGINT, signal.SIGTERM):
            handler = signal.getsignal(sig)  # None: set outside Python, not ours to hold
            if handler is not None and handler != signal.SIG_IGN:
                previous[sig] = signal.signal(sig, lambda signum, frame: held.append(signum))
        yield held
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        if held:
            signal.raise_signal(held[0])


def _write_atomically(path: Path, data: bytes) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    with _interrupts_deferred() as held:
        fd, tmp = _held_temporary(path)
        replaced = False
        try:
            with os.fdopen(fd, "wb") as handle:
                handle.write(data)
                handle.flush()
                os.fsync(handle.fileno())
            if path.exists():  # keep the permissions of the file it replaces
                os.chmod(tmp, path.stat().st_mode & 0o777)
            else:
                umask = os.umask(0)
                os.umask(umask)
                os.chmod(tmp, 0o666 & ~umask)
            if not held:  # interrupted meanwhile: the old file stays as it was
                os.replace(tmp, path)
                replaced = True
        finally:
            if not replaced:
                Path(tmp).unlink(missing_ok=True)
    return path


def write_text(path: str | os.PathLike, text: str) -> Path:
    """``write_bytes`` of ``text`` in UTF-8."""
    return write_bytes(path, text.encode("utf-8"))


def is_file(path: str | os.PathLike) -> bool:
    """Whether ``path`` is an existing regular file; False (not an error) for a path the system
    cannot even look at (a symlink loop, a name too long)."""
    try:
        return Path(path).is_file()
    except OSError:
        return False
