"""What we can learn about a target pid before touching it, and the plain diagnoses.

Every check reads ``/proc`` only (no ptrace), so it is safe on any process. The
exit codes are distinct per cause so scripts can tell them apart; ``docs/attach.md``
lists them.

Which Python a static interpreter is (``py_version_hex``), read from its ELF file without running it: a Python
linked statically (Debian's ``/usr/bin/python3.X``, conda's, python-build-standalone's) maps no ``libpython``;
since 3.11 it exports ``Py_Version`` (``PY_VERSION_HEX``) in its dynamic symbol table. That constant is read
from the file the process runs (``/proc/PID/exe``, the inode it executes even when its path was replaced since)
with bounded reads: a hostile file yields ``None``, never an exception or a large allocation.
"""

from __future__ import annotations

import os
import re
import stat
import struct
import sys
from dataclasses import dataclass

from probe._errors import AttachError


EXIT_CODES = {
    "no_such_pid": 10,
    "not_python": 11,
    "other_user": 12,
    "ptrace_blocked": 13,
    "no_rung": 14,
    "version_mismatch": 15,
    "bootstrap_failed": 16,
    "no_answer": 17,
    "tool_failed": 18,
}

_CAP_SYS_PTRACE = 19
_VERSION_RE = re.compile(r"(?:python|libpython)(\d)\.(\d+)")


@dataclass
class ProcessInfo:
    """A live process and the Python it runs, as far as /proc tells."""

    pid: int
    uid: int
    exe: str
    cmdline: list
    version: tuple | None  # (major, minor) of its Python, None when it does not run one

    @property
    def version_text(self) -> str:
        return "%d.%d" % self.version if self.version else "unknown"


def _read(path: str, mode: str = "r"):
    with open(path, mode) as f:
        return f.read()


def _uid_of(pid: int) -> int:
    for line in _read(f"/proc/{pid}/status").splitlines():
        if line.startswith("Uid:"):
            return int(line.split()[1])
    raise OSError("no Uid line")


def _python_version(pid: int, exe: str) -> tuple | None:
    """(major, minor) from a mapped libpython, the ``Py_Version`` the running binary exports, or its name.

    Nothing here runs anything: the executable's path belongs to the target's owner, who can
    replace the file after the process started, so asking the binary (``exe -c ...``) would run
    their code as us. ``/proc/PID/exe`` opens the inode the process executes, whatever its path
    holds now, and only its symbol table is read.
    """
    try:
        maps = _read(f"/proc/{pid}/maps")
    except OSError:
        maps = ""
    for line in maps.splitlines():
        m = re.search(r"/libpython(\d)\.(\d+)[^/]*\.so", line)
        if m:
            return int(m.group(1)), int(m.group(2))
    hexversion = py_version_hex(f"/proc/{pid}/exe")
    if hexversion is not None and hexversion >> 24 == 3:
        return 3, hexversion >> 16 & 0xFF
    m = _VERSION_RE.search(os.path.basename(exe))
    if m:
        return int(m.group(1)), int(m.group(2))
    return None


def inspect_process(pid: int, *, need_python: bool = True) -> ProcessInfo:
    """Check that ``pid`` exists, belongs to us (or we may trace it) and runs Python."""
    if pid <= 0:
        raise AttachError(
            f"{pid} is not a process id; pass the pid shown by ps or top.", exit_code=EXIT_CODES["no_such_pid"]
        )
    if not os.path.exists(f"/proc/{pid}"):
        raise AttachError(
            f"no process with pid {pid} is running; check the pid with `ps -p {pid}` or `probe list`.",
            exit_code=EXIT_CODES["no_such_pid"],
        )
    try:
        uid = _uid_of(pid)
        cmdline = [p.decode(errors="replace") for p in _read(f"/proc/{pid}/cmdline", "rb").split(b"\0") if p]
    except (OSError, ValueError):
        raise AttachError(
            f"process {pid} exited or cannot be read; check it with `ps -p {pid}`.", exit_code=EXIT_CODES["no_such_pid"]
        ) from None
    me = os.geteuid()
    if uid != me and me != 0 and not _has_cap_sys_ptrace():
        raise AttachError(
            f"process {pid} belongs to uid {uid}, not to you (uid {me}); run probe as that user "
            f"(e.g. `sudo -u '#{uid}' probe ...`).",
            exit_code=EXIT_CODES["other_user"],
        )
    try:
        exe = os.readlink(f"/proc/{pid}/exe")
    except OSError:
        exe = cmdline[0] if cmdline else ""
    exe = exe.removesuffix(" (deleted)")
    version = _python_version(pid, exe)
    if need_python and version is None:
        what = os.path.basename(exe) or (cmdline[0] if cmdline else "?")
        if re.match(r"python\d?$", what):
            raise AttachError(
                f"process {pid} runs a file named {what} that shows no Python version in what probe can "
                "read without running it (no libpython mapped, no Py_Version symbol), and probe never "
                "runs a target's executable to ask; if it is a static Python older than 3.11, start the "
                "job with `import probe.auto` or read its stacks with `py-spy dump --pid "
                f"{pid}`.",
                exit_code=EXIT_CODES["not_python"],
            )
        raise AttachError(
            f"process {pid} ({what}) is not a Python process; pass the pid of the python interpreter "
            "(for torchrun, a worker's pid from `ps --ppid`).",
            exit_code=EXIT_CODES["not_python"],
        )
    return ProcessInfo(pid, uid, exe, cmdline, version)


def _has_cap_sys_ptrace() -> bool:
    try:
        for line in _read("/proc/self/status").splitlines():
            if line.startswith("CapEff:"):
                return bool(int(line.split()[1], 16) >> _CAP_SYS_PTRACE & 1)
    except (OSError, ValueError):
        pass
    return os.geteuid() == 0


def _is_ancestor_of(pid: int) -> bool:
    """Whether this process is an ancestor of ``pid`` (Yama scope 1 allows tracing descendants)."""
    me = os.getpid()
    while pid > 1:
        try:
            stat = _read(f"/proc/{pid}/stat")
            pid = int(stat[stat.rindex(")") + 2 :].split()[1])
        except (OSError, ValueError, IndexError):
            return False
        if pid == me:
            return True
    return False


def ptrace_problem(pid: int) -> str | None:
    """Why ptrace (gdb, py-spy) will be refused for ``pid``, with the setting to change; None if it should work."""
    try:
        scope = int(_read("/proc/sys/kernel/yama/ptrace_scope").strip())
    except (OSError, ValueError):
        return None
    cap = _has_cap_sys_ptrace()
    if scope == 3:
        return (
            "ptrace is disabled on this host (kernel.yama.ptrace_scope=3, which only a reboot resets); "
            "set it to 0 or 1 at boot to attach"
        )
    if scope == 2 and not cap:
        return (
            "ptrace is limited to administrators (kernel.yama.ptrace_scope=2); run probe with sudo "
            "or grant CAP_SYS_PTRACE"
        )
    if scope == 1 and not cap and not _is_ancestor_of(pid):
        return (
            "ptrace is limited to child processes (kernel.yama.ptrace_scope=1); run "
            "`sudo sysctl kernel.yama.ptrace_scope=0`, or run probe with sudo / CAP_SYS_PTRACE"
        )
    return None


def explain_ptrace_failure(pid: int, text: str) -> str | None:
    """A diagnosis for a tool's 'Operation not permitted' that /proc did not predict (containers, seccomp)."""
    low = text.lower()
    if "operation not permitted" in low or "permission denied" in low or "eperm" in low:
        return ptrace_problem(pid) or (
            "ptrace was refused by the system although Yama allows it; in a container, start it with "
            "`--cap-add=SYS_PTRACE` (docker) or allow ptrace in its seccomp profile"
        )
    return None


def cli_version() -> tuple:
    return sys.version_info[:2]


_MAX_TABLE = 32 << 20  # bytes of a symbol or string table we read at most
_SHT_SYMTAB, _SHT_DYNSYM = 2, 11


def _pread(fd: int, size: int, offset: int) -> bytes:
    if size < 0 or offset < 0 or size > _MAX_TABLE:
        raise ValueError("out of bounds")
    data = os.pread(fd, size, offset)
    if len(data) != size:
        raise ValueError("short read")
    return data


def py_version_hex(path: str, name: bytes = b"Py_Version") -> int | None:
    """The value of the integer constant ``name`` exported by the ELF file at ``path``, or None."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NONBLOCK)
    except OSError:
        return None
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return None
        return _lookup(fd, name)
    except (OSError, ValueError, struct.error):
        return None
    finally:
        os.close(fd)


def _lookup(fd: int, name: bytes) -> int | None:
    ident = _pread(fd, 16, 0)
    if ident[:4] != b"\x7fELF" or ident[4] not in (1, 2) or ident[5] not in (1, 2):
        return None
    wide, end = ident[4] == 2, "<" if ident[5] == 1 else ">"
    if wide:
        shoff, shentsize, shnum = struct.unpack(end + "Q10xHH", _pread(fd, 22, 40))  # e_shoff .. e_shnum
        shdr, sym, symsize = end + "IIQQQQIIQQ", end + "IBBHQQ", 24
    else:
        shoff = struct.unpack(end + "I", _pread(fd, 4, 32))[0]
        shentsize, shnum = struct.unpack(end + "HH", _pread(fd, 4, 46))
        shdr, sym, symsize = end + "IIIIIIIIII", end + "IIIBBH", 16
    if shentsize != struct.calcsize(shdr) or not 0 < shnum <= 4096:
        return None
    raw = _pread(fd, shentsize * shnum, shoff)
    sections = [struct.unpack_from(shdr, raw, i * shentsize) for i in range(shnum)]
    for kind in (_SHT_DYNSYM, _SHT_SYMTAB):
        for sh in sections:
            if sh[1] != kind or not 0 <= sh[6] < shnum:
                continue
            strtab = sections[sh[6]]
            strings = _pread(fd, strtab[5], strtab[4])
            table = _pread(fd, sh[5], sh[4])
            for i in range(len(table) // symsize):
                fields = struct.unpack_from(sym, table, i * symsize)
                if wide:
                    st_name, st_shndx, st_value, st_size = fields[0], fields[3], fields[4], fields[5]
                else:
                    st_name, st_value, st_size, st_shndx = fields[0], fields[1], fields[2], fields[5]
                if strings[st_name : st_name + len(name) + 1] != name + b"\0" or not 0 < st_shndx < shnum:
                    continue
                home = sections[st_shndx]  # (name, type, flags, addr, offset, size, ...)
                delta = st_value - home[3]
                if st_size not in (4, 8) or home[1] == 8 or not 0 <= delta <= home[5] - st_size:  # 8: SHT_NOBITS
                    return None
                return struct.unpack(end + ("I" if st_size == 4 else "Q"), _pread(fd, st_size, home[4] + delta))[0]
    return None
