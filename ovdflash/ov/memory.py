"""Resident memory: dropping the pages of IR weight files the CPU plugin no longer reads.

Contract:
- `core.read_model` maps each `openvino_model.bin`; at its first inference the CPU plugin repacks
  (and converts) every weight it multiplies into memory of its own, so the mapped file pages stay
  resident beside that copy while only a few (embedding rows) are ever read again.
- `release_mapped_files(paths)` advises the kernel (madvise MADV_DONTNEED) to drop the resident pages
  of every read-only mapping of those files. The pages are clean file pages: any later read
  faults them back from the file, so results never change. Returns the bytes advised; 0 where the
  platform has no /proc/self/maps or madvise (it does nothing there).
- `mapped_resident_bytes(paths)`: the resident bytes of those mappings now (from /proc/self/smaps).
- `release_free_heap()`: hands the free pages of the C heap back to the kernel (glibc's
  malloc_trim); the plugin's per-shape buffers come and go, and glibc keeps what they leave.
  True where it ran; nothing changes for any live allocation.
- `resident_bytes()`: this process's resident set (0 where /proc is missing);
  `available_memory_bytes()`: the kernel's MemAvailable (None where /proc is missing). The one
  place the runtime, the server's metrics and the bench read either.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import os
from pathlib import Path

MADV_DONTNEED = 4


def _mappings(paths) -> list[tuple[int, int, str, list[str]]]:
    """(start, end, perms, smaps lines) of this process's mappings of `paths`."""
    wanted = {os.path.realpath(p) for p in paths}
    try:
        lines = Path("/proc/self/smaps").read_text().splitlines()
    except OSError:
        return []
    out, current = [], None
    for line in lines:
        head = line.split()
        if head and "-" in head[0] and len(head) >= 5 and not head[0].endswith(":"):
            current = None
            if len(head) >= 6 and os.path.realpath(head[5]) in wanted:
                start, end = (int(x, 16) for x in head[0].split("-"))
                current = (start, end, head[1], [])
                out.append(current)
        elif current is not None:
            current[3].append(line)
    return out


def mapped_resident_bytes(paths) -> int:
    total = 0
    for _, _, _, fields in _mappings(paths):
        for line in fields:
            if line.startswith("Rss:"):
                total += int(line.split()[1]) * 1024
    return total


def release_mapped_files(paths) -> int:
    # read-only mappings only: nothing in them can differ from the file
    maps = [(s, e) for s, e, perms, _ in _mappings(paths) if perms.startswith("r") and "w" not in perms]
    if not maps:
        return 0
    libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
    libc.madvise.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
    advised = 0
    for start, end in maps:
        if libc.madvise(ctypes.c_void_p(start), ctypes.c_size_t(end - start), MADV_DONTNEED) == 0:
            advised += end - start
    return advised


def resident_bytes() -> int:
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, IndexError, ValueError):
        return 0


def available_memory_bytes() -> int | None:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def release_free_heap() -> bool:
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        trim = libc.malloc_trim
    except (OSError, AttributeError):  # not glibc
        return False
    trim.argtypes = (ctypes.c_size_t,)
    trim(0)
    return True
