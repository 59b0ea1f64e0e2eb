"""The process's own (host) memory on Linux/glibc: what it holds, and handing freed memory back.

glibc maps blocks above its mmap threshold (128 KiB at start) and returns them to the system when
they are freed, but it raises the threshold to the size of every mapped block that is freed (up to
32 MiB): after the first training step most tensors come from its heap, where freed blocks stay
resident for reuse, and the resident set grows with the fragments of every step's activations
and temporaries. ``return_large_frees()`` fixes the threshold at its initial 128 KiB. Measured on
the SD1.5-architecture fused-Adafactor benchmark (256 px, batch 1): peak resident set of the first
step 6.17 GiB with glibc's default, 5.72 GiB with the threshold fixed at 1 MiB; of the second step
6.07 GiB at 1 MiB and 5.94 GiB at 128 KiB (README, "Memory").
"""
from __future__ import annotations

import ctypes

GIB = 1024 ** 3
M_MMAP_THRESHOLD = -3  # mallopt parameter (malloc.h)
MMAP_THRESHOLD = 128 * 1024


def _libc():
    try:
        return ctypes.CDLL("libc.so.6")
    except OSError:
        return None  # not glibc: nothing to do


def resident_bytes() -> int | None:
    """This process's resident set size (Linux), or None where /proc is missing."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def trim_heap() -> None:
    """Return freed heap pages to the system (glibc), so the resident set shows what was freed."""
    libc = _libc()
    if libc is not None and hasattr(libc, "malloc_trim"):
        libc.malloc_trim(0)


def return_large_frees() -> bool:
    """Blocks of 128 KiB or more are returned to the system when freed (glibc); True if set."""
    libc = _libc()
    if libc is None or not hasattr(libc, "mallopt"):
        return False
    return bool(libc.mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD))
