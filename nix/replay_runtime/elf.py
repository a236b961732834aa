"""The ELF reader: an object's header, load segments, dynamic section (DT_NEEDED, DT_SONAME) and
.note.dlopen table, and the library names it holds as strings. Standard library only."""

from __future__ import annotations

import json
import mmap
import os
import re
import struct
from dataclasses import dataclass, field
from pathlib import Path
from typing import BinaryIO

EM_AARCH64 = 183


@dataclass
class Elf:
    path: Path
    machine: int
    type: int
    needed: list[str] = field(default_factory=list)
    soname: str | None = None
    loads: list[tuple[int, int, int]] = field(default_factory=list)  # (p_offset, p_vaddr, p_align)
    # .note.dlopen (systemd's ELF dlopen metadata): each entry a list of alternative sonames.
    dlopen_notes: list[list[str]] = field(default_factory=list)


def read_elf(path: Path) -> Elf | None:
    """The header, PT_LOAD segments and dynamic section of an ELF file (None if not ELF)."""
    with path.open("rb") as f:
        ident = f.read(16)
        if len(ident) < 16 or ident[:4] != b"\x7fELF":
            return None
        is64, end = ident[4] == 2, "<" if ident[5] == 1 else ">"
        hdr = f.read(48 if is64 else 36)
        try:
            if is64:
                (etype, machine, _, _, phoff, shoff, _, _, phentsize, phnum, shentsize, shnum,
                 shstrndx) = struct.unpack(end + "HHIQQQIHHHHHH", hdr[:48])
            else:
                (etype, machine, _, _, phoff, shoff, _, _, phentsize, phnum, shentsize, shnum,
                 shstrndx) = struct.unpack(end + "HHIIIIIHHHHHH", hdr[:36])
            elf = Elf(path, machine, etype)
            elf.dlopen_notes = read_dlopen_notes(f, end, is64, shoff, shentsize, shnum, shstrndx)
            f.seek(phoff)
            phdrs = f.read(phentsize * phnum)
            dynamic = None
            segs = []
            for i in range(phnum):
                raw = phdrs[i * phentsize:(i + 1) * phentsize]
                if is64:
                    p_type, _, off, vaddr, _, filesz, _, align = struct.unpack(end + "IIQQQQQQ", raw[:56])
                else:
                    p_type, off, vaddr, _, filesz, _, _, align = struct.unpack(end + "IIIIIIII", raw[:32])
                segs.append((p_type, off, vaddr, filesz))
                if p_type == 1:
                    elf.loads.append((off, vaddr, align))
                elif p_type == 2:
                    dynamic = (off, filesz)
            if dynamic is None:
                return elf
            f.seek(dynamic[0])
            data = f.read(dynamic[1])
            size = 16 if is64 else 8
            entries = [struct.unpack(end + ("qQ" if is64 else "iI"), data[i:i + size])
                       for i in range(0, len(data) - size + 1, size)]
            strtab_vaddr = next((v for t, v in entries if t == 5), None)
            if strtab_vaddr is None:
                return elf
            # DT_STRTAB is an address: map it to a file offset through the segment holding it.
            strtab_off = next((off + strtab_vaddr - vaddr for t, off, vaddr, sz in segs
                               if t == 1 and vaddr <= strtab_vaddr < vaddr + sz), strtab_vaddr)

            def string(offset: int) -> str:
                f.seek(strtab_off + offset)
                buf = f.read(4096)
                return buf.split(b"\0", 1)[0].decode(errors="replace")

            for tag, val in entries:
                if tag == 0:
                    break
                if tag == 1:
                    elf.needed.append(string(val))
                elif tag == 14:
                    elf.soname = string(val)
            return elf
        except struct.error:
            return None


NT_FDO_DLOPEN = 0x407C0C0A


def read_dlopen_notes(f: BinaryIO, end: str, is64: bool, shoff: int, shentsize: int, shnum: int,
                      shstrndx: int) -> list[list[str]]:
    """The sonames of a .note.dlopen section (owner "FDO", type 0x407c0c0a, a JSON array of
    {"soname": [...]}): autoPatchelf resolves these as it does DT_NEEDED."""
    if not shoff or not shnum or shstrndx >= shnum:
        return []
    f.seek(shoff)
    raw = f.read(shentsize * shnum)
    fmt, size = (end + "IIQQQQIIQQ", 64) if is64 else (end + "IIIIIIIIII", 40)
    if len(raw) < shentsize * shnum or shentsize < size:
        return []
    sections = [struct.unpack(fmt, raw[i * shentsize:i * shentsize + size]) for i in range(shnum)]
    names_off, names_size = sections[shstrndx][4], sections[shstrndx][5]
    f.seek(names_off)
    names = f.read(names_size)
    out: list[list[str]] = []
    for sec in sections:
        name = names[sec[0]:names.find(b"\0", sec[0])]
        if name != b".note.dlopen" or sec[1] != 7:  # SHT_NOTE
            continue
        f.seek(sec[4])
        data = f.read(sec[5])
        pos = 0
        while pos + 12 <= len(data):
            namesz, descsz, ntype = struct.unpack(end + "III", data[pos:pos + 12])
            pos += 12
            owner = data[pos:pos + namesz].rstrip(b"\0")
            pos += (namesz + 3) & ~3
            desc = data[pos:pos + descsz]
            pos += (descsz + 3) & ~3
            if owner == b"FDO" and ntype == NT_FDO_DLOPEN:
                try:
                    entries = json.loads(desc.rstrip(b"\0").decode())
                    out += [[str(n) for n in e["soname"]] for e in entries]
                except (ValueError, KeyError, TypeError):
                    continue
    return out


def elf_objects(prefix: Path) -> list[Elf]:
    out = []
    for root, _, files in os.walk(prefix):
        for name in files:
            p = Path(root) / name
            if p.is_symlink() or not p.is_file():
                continue
            elf = read_elf(p)
            if elf is not None:
                out.append(elf)
    return out


# A library name as a string of its own in an object (a dlopen argument): "libibverbs.so.1".
SONAME_STRING = re.compile(rb"lib[A-Za-z0-9_+\-.]*?\.so(?:\.[0-9]+)*(?=\x00)")


def named_sonames(path: Path) -> set[str]:
    """The library names an object holds as whole strings: NUL-terminated, and preceded by a NUL
    or another byte that is not printable (a length prefix), so that a name inside a message
    ("Failed to open libgdrapi.so.2") is not taken for one. Not seen: a name built at run time
    ("libnvrtc.so.%d", "lib%s.so") or one the compiler stores inside instructions."""
    out: set[str] = set()
    with path.open("rb") as f:
        if os.fstat(f.fileno()).st_size == 0:
            return out
        with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as m:
            for match in SONAME_STRING.finditer(m):
                before = m[match.start() - 1] if match.start() > 0 else 0
                if before < 0x20 or before > 0x7E:
                    out.add(match.group().decode())
    return out

