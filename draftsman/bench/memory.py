"""Peak memory of one generate call, above what was in use just before it.

CUDA: torch.cuda.max_memory_allocated (exact, tensors only). CPU: a thread samples every
millisecond the bytes the C allocator has handed out (glibc `mallinfo2`: in-use heap + mmapped
blocks, where torch's CPU tensors live), so pages the allocator keeps after a free do not hide
the peak; a peak shorter than the sampling interval can be missed. Without glibc it falls back to
the process RSS (/proc/self/statm or psutil), a lower bound because freed pages stay resident.
Measured in a separate untimed call, since the sampling thread competes for the GIL.
"""
from __future__ import annotations

import ctypes
import os
import threading
from typing import Callable

import torch


class _Mallinfo2(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks",
                                                "fsmblks", "uordblks", "fordblks", "keepcost")]


def _malloc_reader() -> Callable[[], int] | None:
    try:
        fn = ctypes.CDLL(None).mallinfo2  # glibc >= 2.33
    except (OSError, AttributeError):
        return None
    fn.restype = _Mallinfo2

    def read() -> int:
        m = fn()
        return m.uordblks + m.hblkhd
    return read


def _rss_reader() -> Callable[[], int] | None:
    if os.path.exists("/proc/self/statm"):
        page = os.sysconf("SC_PAGE_SIZE")

        def read() -> int:
            with open("/proc/self/statm", "rb") as f:
                return int(f.read().split()[1]) * page
        return read
    try:
        import psutil
    except ImportError:
        return None
    proc = psutil.Process()
    return lambda: proc.memory_info().rss


class PeakMemory:
    def __init__(self, device: torch.device):
        self.device = device
        self._read = None
        if device.type == "cuda":
            self.method = "torch.cuda.max_memory_allocated during the call, minus memory_allocated before it"
        elif (reader := _malloc_reader()) is not None:
            self._read = reader
            self.method = ("bytes allocated by the C heap (glibc mallinfo2) sampled every 1 ms during an untimed "
                           "call, peak minus the level before it")
        elif (reader := _rss_reader()) is not None:
            self._read = reader
            self.method = ("process RSS sampled every 1 ms during an untimed call, peak minus the level before it "
                           "(a lower bound: freed pages stay resident)")
        else:
            self.method = "unavailable (no glibc, no /proc, no psutil)"

    def measure(self, fn: Callable[[], object]) -> int | None:
        """Bytes above the pre-call level at the call's peak (None when it cannot be measured)."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            before = torch.cuda.memory_allocated(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            fn()
            torch.cuda.synchronize(self.device)
            return torch.cuda.max_memory_allocated(self.device) - before
        if self._read is None:
            fn()
            return None
        before = self._read()
        peak = [before]
        done = threading.Event()

        def sample():
            while not done.wait(0.001):
                peak[0] = max(peak[0], self._read())

        thread = threading.Thread(target=sample, daemon=True)
        thread.start()
        try:
            fn()
        finally:
            done.set()
            thread.join()
        return max(peak[0], self._read()) - before
