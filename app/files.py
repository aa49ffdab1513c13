"""How KV Valet writes its files: private (folders 0700, files 0600, whatever the umask), whole
(:func:`write_atomic`: a unique temporary file, fsynced, renamed, the folder fsynced), TOML edited
in place (:func:`edit_toml`: the user's comments survive), and JSON that two processes may update
at once (:func:`update_json`, under :func:`locked`). Where they go is :mod:`app.paths`.
"""

from __future__ import annotations

import contextlib
import json
import os
import tempfile
import time
from pathlib import Path
from typing import Any, BinaryIO, Callable, Iterator

try:
    import fcntl
except ImportError:  # pragma: no cover - not POSIX
    fcntl = None  # type: ignore[assignment]


# -- private folders and files ----------------------------------------------------------------
# Parked sessions hold whole conversations, profiles hold API keys, logs hold prompts: every
# folder KV Valet creates is 0700 and every file it writes 0600, whatever the umask.

PRIVATE_DIR_MODE = 0o700
PRIVATE_FILE_MODE = 0o600


def private_dir(path: str | os.PathLike) -> Path:
    """Create ``path`` and its missing parents, each 0700; a folder that exists is left as
    it is (it may be the user's own, chosen in the preferences)."""
    path = Path(path)
    missing = []
    p = path
    while not os.path.lexists(p) and p != p.parent:
        missing.append(p)
        p = p.parent
    for d in reversed(missing):
        try:
            d.mkdir(mode=PRIVATE_DIR_MODE)
        except FileExistsError:
            continue  # made meanwhile by another process (or thread)
        os.chmod(d, PRIVATE_DIR_MODE)  # the umask only takes bits away; be exact all the same
    if not path.is_dir():
        path.mkdir(parents=True, exist_ok=True)  # raises the error that says why not
    return path


def make_private(path: str | os.PathLike) -> None:
    """chmod 0600 a file KV Valet owns (a state file the server wrote with its umask); a
    symlink is not followed, and a file of another user is left as it is."""
    try:
        if not os.path.islink(path):
            os.chmod(path, PRIVATE_FILE_MODE)
    except OSError:
        pass


def touch_private(path: str | os.PathLike) -> None:
    """Create ``path`` empty and 0600 if it is missing (a file another program then writes
    into, as SQLite its catalog: its -wal and -shm files take the same mode), or make ours
    0600. Errors are left to that program to report."""
    try:
        if os.path.islink(path):
            return
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_NONBLOCK, PRIVATE_FILE_MODE)
    except OSError:
        return
    try:
        os.fchmod(fd, PRIVATE_FILE_MODE)
    except OSError:
        pass
    finally:
        os.close(fd)


def open_private(path: str | os.PathLike, mode: str = "w", **kw):
    """``open(path, mode)`` for writing ("w", "a", "wb", "ab"), the file created 0600 (and an
    existing one of ours made 0600)."""
    flags = os.O_WRONLY | os.O_CREAT | (os.O_APPEND if "a" in mode else os.O_TRUNC)
    fd = os.open(path, flags, PRIVATE_FILE_MODE)
    try:
        os.fchmod(fd, PRIVATE_FILE_MODE)
    except OSError:
        pass
    return os.fdopen(fd, mode, **kw)


@contextlib.contextmanager
def atomic_writer(path: str | os.PathLike, *, mode: int = PRIVATE_FILE_MODE) -> Iterator[BinaryIO]:
    """``with atomic_writer(path) as f: f.write(...)``: the bytes go to a temporary file of a
    unique name beside ``path`` (``.<name>.<random>.tmp``); when the block ends they are
    flushed and fsynced, the file is renamed over ``path`` and the folder fsynced, so ``path``
    is the old file or the whole new one, also after a crash or a power cut. An exception in
    the block (or in the write) leaves the old file as it was and removes the temporary one.

    ``mode``: the new file's permission bits, exactly (0600 by default: a file of ours may
    hold a key or a prompt). A missing folder is created, 0700 for a private file."""
    path = Path(path)
    folder = path.parent
    if mode & 0o077:
        folder.mkdir(parents=True, exist_ok=True)
    else:
        private_dir(folder)
    fd, tmp = tempfile.mkstemp(dir=folder, prefix=f".{path.name}.", suffix=".tmp")
    try:
        f = os.fdopen(fd, "wb")
    except BaseException:
        os.close(fd)
        os.unlink(tmp)
        raise
    try:
        with f:
            with contextlib.suppress(OSError):  # a filesystem without modes (FAT) keeps its own
                os.fchmod(f.fileno(), mode)
            yield f
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    fsync_dir(folder)


def fsync_file(path: str | os.PathLike) -> None:
    """fsync a file's data (one another process wrote: the server's saved state), so a rename of it
    that is then fsynced in its folder survives a power cut with its bytes, not as an empty file."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_dir(folder: str | os.PathLike) -> None:
    """fsync a folder, so a rename in it survives a power cut (where the platform allows it)."""
    try:
        fd = os.open(folder, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass  # some filesystems cannot fsync a folder: the rename is done all the same
    finally:
        os.close(fd)


def write_atomic(path: str | os.PathLike, data: str | bytes, *, mode: int = PRIVATE_FILE_MODE,
                 encoding: str = "utf-8") -> Path:
    """Write ``path`` whole or not at all (see :func:`atomic_writer`), 0600 by default."""
    path = Path(path)
    with atomic_writer(path, mode=mode) as f:
        f.write(data.encode(encoding) if isinstance(data, str) else data)
    return path


def write_private(path: str | os.PathLike, data: str | bytes, *, encoding: str = "utf-8") -> Path:
    """:func:`write_atomic`, 0600 (the name the callers knew)."""
    return write_atomic(path, data, encoding=encoding)


# -- TOML files the user may edit too ------------------------------------------------------------


def write_toml(path: str | os.PathLike, values: dict[str, Any], *, defaults: dict[str, Any] | None = None,
               header: str = "", base: str | os.PathLike | None = None, drop_unknown: bool = False) -> Path:
    """Write the TOML file ``path`` (atomically, 0600) holding ``values``, by editing the
    document already there, or in ``base`` (a file being renamed to ``path``): see
    :func:`edit_toml`. A file that cannot be read or is not TOML is replaced by a new one."""
    text = None
    for source in ((base, path) if base is not None else (path,)):
        try:
            text = Path(source).read_text(encoding="utf-8")
            break
        except FileNotFoundError:
            continue
        except (OSError, ValueError):
            break  # unreadable: a new file replaces it
    return write_atomic(path, edit_toml(text, values, defaults=defaults, header=header, drop_unknown=drop_unknown))


def edit_toml(text: str | None, values: dict[str, Any], *, defaults: dict[str, Any] | None = None,
              header: str = "", drop_unknown: bool = False) -> str:
    """``text`` (a TOML document; None or not TOML: a new one) edited with tomlkit to hold
    ``values``: the user's comments, key order, formatting and the keys this version does not
    know (tables included) survive; only the keys that changed are rewritten.

    ``values``: key -> value; ``None`` removes the key. A value equal to its ``defaults`` entry
    is not written, and an existing key is removed, unless the file already says exactly that
    (a default the user wrote out by hand stays, with its comment). ``drop_unknown``: remove the
    keys not in ``values`` (a format that refuses unknown keys). ``header``: the comment a new
    document starts with."""
    import enum

    import tomlkit

    doc = None
    if text is not None:
        try:
            doc = tomlkit.parse(text)
        except (ValueError, RecursionError, tomlkit.exceptions.TOMLKitError):
            doc = None  # not TOML: a new document replaces it
    if doc is None:
        doc = tomlkit.document()
        for line in header.splitlines():
            doc.add(tomlkit.comment(line.removeprefix("#").removeprefix(" ")))

    def plain(v: Any) -> Any:
        if isinstance(v, enum.Enum):
            v = v.value
        if isinstance(v, (tuple, list)):
            return [plain(x) for x in v]
        return v

    def same(old: Any, new: Any) -> bool:
        old = old.unwrap() if hasattr(old, "unwrap") else old
        if isinstance(new, bool) or isinstance(old, bool):
            return old is new
        if isinstance(new, str):  # an int where text is read as text ("gpu_layers = 99") is the same
            return old == new if isinstance(old, str) else isinstance(old, int) and str(old) == new
        if isinstance(new, (int, float)):
            return isinstance(old, (int, float)) and old == new
        return old == new

    defaults = defaults or {}
    if drop_unknown:
        for key in [k for k in doc if k not in values]:
            del doc[key]
    for key, value in values.items():
        value = plain(value)
        present = key in doc
        if value is None or (key in defaults and value == plain(defaults[key])):
            if present and (value is None or not same(doc[key], value)):
                del doc[key]
            continue
        if not present or not same(doc[key], value):
            doc[key] = value
    out = tomlkit.dumps(doc).rstrip()  # no blank lines left at the end by a removed table
    return out + "\n" if out else ""


# -- caches that several processes update ------------------------------------------------------

#: How long an update of a cache waits for another process's (each holds it milliseconds).
LOCK_WAIT_S = 30.0


def take_flock(fd: int, timeout: float, why: str) -> None:
    """An exclusive ``flock`` on ``fd``, polled (a worker thread can give up): TimeoutError(why)
    after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return
        except BlockingIOError:
            if time.monotonic() > deadline:
                raise TimeoutError(why) from None
            time.sleep(0.002)  # a lock retry, not a wait for an event


@contextlib.contextmanager
def locked(path: str | os.PathLike, timeout: float = LOCK_WAIT_S) -> Iterator[None]:
    """Hold an exclusive ``flock`` on ``<path>.lock`` (created 0600) for the block: one
    read-modify-write of ``path`` at a time, across processes and threads (each holder opens
    the lock file anew). The kernel releases it when its holder dies. TimeoutError (an
    OSError) after ``timeout`` seconds. POSIX only; elsewhere the block runs unlocked."""
    if fcntl is None:  # pragma: no cover - not POSIX
        yield
        return
    lock = Path(str(path) + ".lock")
    private_dir(lock.parent)
    fd = os.open(lock, os.O_RDWR | os.O_CREAT, PRIVATE_FILE_MODE)
    try:
        take_flock(fd, timeout, f"{lock} has been locked by another process for {timeout:.0f} s")
        yield
    finally:
        os.close(fd)  # the only descriptor of this hold: closing it releases the flock


def read_json_object(path: str | os.PathLike) -> dict:
    """The JSON object in ``path``; ``{}`` when it is missing, unreadable or not an object."""
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except (OSError, ValueError, RecursionError):
        return {}
    return data if isinstance(data, dict) else {}


def update_json(path: str | os.PathLike, change: Callable[[dict], Any], *, indent: int | None = 1,
                timeout: float = LOCK_WAIT_S) -> dict:
    """Read-modify-write a JSON cache without losing another process's entries: under
    :func:`locked`, the file is read again, ``change(data)`` edits the dict in place, and the
    result is written with :func:`write_atomic`. Returns what was written."""
    with locked(path, timeout):
        data = read_json_object(path)
        change(data)
        write_atomic(path, json.dumps(data, indent=indent, sort_keys=True))
    return data
