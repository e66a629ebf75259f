"""Read one exported constant of an ELF file without running it: which Python a static interpreter is.

A Python linked statically (Debian's ``/usr/bin/python3.X``, conda's, python-build-standalone's)
maps no ``libpython``; since 3.11 it exports ``Py_Version`` (``PY_VERSION_HEX``) in its
dynamic symbol table. This module reads that constant from the file the process runs
(``/proc/PID/exe``, the inode it executes even when its path was replaced since) with
bounded reads: a hostile file yields ``None``, never an exception or a large allocation.
"""

from __future__ import annotations

import os
import stat
import struct

__all__ = ["py_version_hex"]

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
