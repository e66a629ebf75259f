"""Files written at a path a user named (a checkpoint and its checksum, a trace, a profile) and read back.

The training process and the CLI both write here, often into a directory other users can write too
(``/tmp``, a group-shared project folder). What another user can do there is plant names: a symbolic
link where probe would write, or a file of theirs under the name probe would rename into place. So a
file is written like this, and only like this:

- the directory is opened once and checked: it belongs to this user (or root), and when group or
  others may write it, it is sticky (``/tmp``), so that no one else can rename or remove what probe
  puts there; every later step names files relative to that open directory;
- the content goes to a new file created with ``O_CREAT|O_EXCL|O_NOFOLLOW`` under a name no one can
  predict (``.NAME.<16 hex>.<pid>.tmp``), written through the descriptor that created it and synced;
- it is renamed (or, when it must not replace a file, linked) onto the final name, which must not be
  a symbolic link, a directory or a special file, and the final name is checked to be that very file.

Reading back (``open_own``) takes a file only when it belongs to this user or root. Paths in messages
go through ``printable``: a newline or an escape sequence in a path never reaches a terminal raw.
"""

from __future__ import annotations

import contextlib
import os
import re
import secrets
import stat
from typing import IO, Callable, TypeVar

from .._errors import ProbeError
from .printable import printable


T = TypeVar("T")

_NAME_BYTES = 200  # of the final name kept in a temp name: NAME_MAX is 255 bytes, the rest is ".<16 hex>.<pid>.tmp"


def _me() -> int:
    return os.geteuid()


def check_directory(st: os.stat_result, directory: str, error=ProbeError) -> None:
    """Raise ``error`` unless no user but this one (and root) can replace a file in the directory ``st`` describes."""
    shown = printable(directory)
    if not stat.S_ISDIR(st.st_mode):
        raise error(f"{shown} is not a directory; give a path in an existing directory.")
    if st.st_uid not in (_me(), 0):
        raise error(
            f"the directory {shown} belongs to another user (uid {st.st_uid}), who could replace the file after probe "
            "writes it; write into a directory of your own."
        )
    mode = stat.S_IMODE(st.st_mode)
    if mode & 0o022 and not mode & stat.S_ISVTX:
        raise error(
            f"the directory {shown} is writable by other users (mode {mode:o}) and not sticky, so they could replace "
            f"the file after probe writes it; write into a directory only you can write, or `chmod +t {shown}`."
        )


def check_target(path: str, *, replace: bool, error=ProbeError, dir_fd: int | None = None) -> None:
    """Raise ``error`` when ``path`` cannot be written: a directory, a symbolic link or a special file (even with
    ``replace``), an existing file without it (``FileExistsError``) or another user's with it, or a directory
    others could swap files in.

    With ``dir_fd`` the name is looked up in that open directory (already checked); a missing directory is not
    an error here (the writer creates it or says so)."""
    shown = printable(path)
    if dir_fd is None:
        directory = os.path.dirname(path) or "."
        try:
            check_directory(os.stat(directory), directory, error)
        except FileNotFoundError:
            return
        except NotADirectoryError:
            raise error(f"{shown} is under a path that is not a directory; give a path in a directory.") from None
    try:
        st = os.stat(os.path.basename(path) if dir_fd is not None else path, dir_fd=dir_fd, follow_symlinks=False)
    except FileNotFoundError:
        return
    except NotADirectoryError:
        raise error(f"{shown} is under a path that is not a directory; give a path in a directory.") from None
    if stat.S_ISLNK(st.st_mode):
        raise error(f"{shown} is a symbolic link; probe does not write through links, give the real path.")
    if stat.S_ISDIR(st.st_mode):
        raise error(f"{shown} is a directory; give the path of a file, in it or elsewhere.")
    if not stat.S_ISREG(st.st_mode):
        raise error(f"{shown} is not a regular file (a device, FIFO or socket); give a file path.")
    if not replace:
        raise FileExistsError(path)
    if st.st_uid != _me():
        raise error(
            f"{shown} belongs to another user (uid {st.st_uid}); probe does not replace it, choose another path."
        )


def temp_prefix(name: str) -> str:
    """The start of every temporary name for the final name ``name`` (``.NAME.``, NAME cut to fit NAME_MAX)."""
    raw = os.fsencode(name)[:_NAME_BYTES]
    return "." + os.fsdecode(raw) + "."


def _temp_pattern(name: str) -> re.Pattern:
    return re.compile(re.escape(temp_prefix(name)) + r"[0-9a-f]{16}\.(\d+)\.tmp")


def _open_directory(path: str, error, fix: str) -> int:
    """The directory of ``path``, open and checked (``check_directory``)."""
    directory, shown = os.path.dirname(path), printable(path)
    try:
        fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except FileNotFoundError:
        raise error(f"cannot write {shown}: its directory does not exist; create it first or {fix}.") from None
    except NotADirectoryError:
        raise error(f"cannot write {shown}: a part of its directory is not a directory; {fix}.") from None
    except OSError as exc:
        raise error(f"cannot write {shown}: its directory cannot be opened ({exc.strerror}); {fix}.") from None
    try:
        check_directory(os.fstat(fd), directory, error)
    except BaseException:
        os.close(fd)
        raise
    return fd


def write_file(
    path: str,
    fill: Callable[[IO[bytes]], T],
    *,
    replace: bool = True,
    mode: int = 0o666,
    error=ProbeError,
    fix: str = "choose another path",
) -> T:
    """Write a new file at ``path`` with ``fill(f)`` (``f``: a binary file open for writing and reading); return
    what ``fill`` returned.

    The rules of this module's docstring apply. Without ``replace`` an existing file raises
    ``FileExistsError`` and is left as it was. ``mode`` is the new file's (the umask applies). Any refusal or
    failure of the file system raises ``error`` with one sentence ending in ``fix``; nothing is left behind.
    """
    shown = printable(path)
    if path.endswith(os.sep):
        raise error(f"{shown} ends with {os.sep}, which names a directory; give the path of a file.")
    path = os.path.abspath(path)
    name = os.path.basename(path)
    dfd = _open_directory(path, error, fix)
    tmp = None
    try:
        check_target(path, replace=replace, error=error, dir_fd=dfd)
        tmp = temp_prefix(name) + f"{secrets.token_hex(8)}.{os.getpid()}.tmp"
        flags = os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
        fd = os.open(tmp, flags, mode, dir_fd=dfd)
        with os.fdopen(fd, "w+b") as f:
            result = fill(f)
            f.flush()
            os.fsync(f.fileno())
            mine = os.fstat(f.fileno())
        check_target(path, replace=replace, error=error, dir_fd=dfd)  # again: a link may have appeared meanwhile
        if replace:
            os.replace(tmp, name, src_dir_fd=dfd, dst_dir_fd=dfd)
            tmp = None
        else:
            os.link(tmp, name, src_dir_fd=dfd, dst_dir_fd=dfd, follow_symlinks=False)  # fails if the name appeared
        final = os.stat(name, dir_fd=dfd, follow_symlinks=False)
        if (final.st_dev, final.st_ino) != (mine.st_dev, mine.st_ino) or final.st_uid != _me():
            raise error(f"{shown} was replaced by another file while probe wrote it; {fix}.")
        os.fsync(dfd)
        return result
    except FileExistsError:
        raise FileExistsError(path) from None
    except OSError as exc:
        raise error(f"cannot write {shown} ({exc.strerror or exc}); {fix}.") from None
    finally:
        if tmp is not None:
            with contextlib.suppress(OSError):
                os.unlink(tmp, dir_fd=dfd)
        os.close(dfd)


def sweep_temps(path: str) -> int:
    """Remove the temporary files that a killed writer of ``path`` left (``.NAME.<hex>.<pid>.tmp``, its pid gone,
    a regular file of this user); how many."""
    from .procfs import pid_alive

    directory, name = os.path.split(os.path.abspath(path))
    pattern = _temp_pattern(name)
    removed = 0
    try:
        names = os.listdir(directory)
    except OSError:
        return 0
    for entry in names:
        m = pattern.fullmatch(entry)
        if not m or int(m.group(1)) == os.getpid() or pid_alive(int(m.group(1))):
            continue
        full = os.path.join(directory, entry)
        try:
            st = os.lstat(full)
            if stat.S_ISREG(st.st_mode) and st.st_uid == _me():
                os.unlink(full)
                removed += 1
        except OSError:
            pass
    return removed


def open_own(path: str, error=ProbeError, what: str = "file") -> IO[bytes]:
    """``path`` open for reading when it is a regular file of this user or root; ``error`` with a sentence if not."""
    shown = printable(path)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)  # a FIFO must not block the open
    except FileNotFoundError:
        raise error(f"no {what} at {shown}; check the path.") from None
    except OSError as exc:
        raise error(f"cannot read the {what} {shown} ({exc.strerror or exc}); check the path.") from None
    st = os.fstat(fd)
    if stat.S_ISDIR(st.st_mode):
        os.close(fd)
        raise error(f"{shown} is a directory; give the {what} file in it.")
    if not stat.S_ISREG(st.st_mode):
        os.close(fd)
        raise error(f"{shown} is not a regular file (a device, FIFO or socket); give the {what} file.")
    if st.st_uid not in (_me(), 0):
        os.close(fd)
        raise error(
            f"the {what} {shown} belongs to another user (uid {st.st_uid}); probe loads only files you or root "
            "wrote: check who put it there, and copy it yourself if you trust it."
        )
    os.set_blocking(fd, True)
    return os.fdopen(fd, "rb")
