"""In-process expert sources, for comparison with iod in benchmarks and tests.

They have the same ``fetch / release / prefetch / cancel / close`` methods as
``infer.client.IodClient``. ``SyncSource`` reads each missed record when it is
demanded; ``ThreadedSource`` adds reader threads that prefetch inside the
inference process — the single-process design that iod replaces.
"""

import os
import queue
import threading
from pathlib import Path

import numpy as np

import native
from iod.reader import TokenBucket
from shared.blob import RECORD_ALIGN, Manifest, verify_record


def _open_direct(path):
    """Open for reads that bypass the page cache, where the OS allows it."""
    flags = os.O_RDONLY
    if hasattr(os, "O_DIRECT"):
        try:
            return os.open(path, flags | os.O_DIRECT), True
        except OSError:
            pass
    fd = os.open(path, flags)
    if hasattr(os, "posix_fadvise"):
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    else:  # macOS
        import fcntl

        fcntl.fcntl(fd, getattr(fcntl, "F_NOCACHE", 48), 1)
    return fd, False


def _aligned_buffer(nbytes):
    raw = np.empty(nbytes + RECORD_ALIGN, dtype=np.uint8)
    start = -raw.ctypes.data % RECORD_ALIGN
    return raw[start : start + nbytes]


class SyncSource:
    """Reads each record on demand in the calling thread."""

    def __init__(self, model_dir, read_rate=0.0):
        self.model_dir = Path(model_dir)
        self.bucket = TokenBucket(read_rate) if read_rate > 0 else None
        self.manifest = Manifest.load(self.model_dir)
        self.layouts = {l.layer: l for l in self.manifest.layers}
        self._fds = {}
        self.bytes_read = 0
        self.reads = 0

    def _fd(self, layout):
        if layout.layer not in self._fds:
            self._fds[layout.layer] = _open_direct(self.model_dir / layout.file)[0]
        return self._fds[layout.layer]

    def read(self, layer, expert):
        layout = self.layouts[layer]
        buf = _aligned_buffer(layout.stride)
        if self.bucket is not None:
            self.bucket.take(layout.stride)
        n = native.pread_full(self._fd(layout), buf, 0, layout.stride, expert * layout.stride)
        self.bytes_read += n
        self.reads += 1
        if not verify_record(layout, expert, memoryview(buf)[:n]):
            raise IOError(f"layer {layer} expert {expert}: record checksum mismatch")
        return memoryview(buf)[: layout.record_bytes]

    def fetch(self, layer, experts):
        return {e: self.read(layer, e) for e in experts}

    def release(self, layer, experts):
        pass

    def prefetch(self, layer, experts):
        pass

    def cancel(self, layer=-1):
        pass

    def close(self):
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()


class ThreadedSource(SyncSource):
    """Prefetches with reader threads inside the inference process."""

    def __init__(self, model_dir, workers=4, read_rate=0.0):
        super().__init__(model_dir, read_rate)
        self._lock = threading.Lock()
        self._pending = {}  # (layer, expert) -> Future-like event holder
        self._queue = queue.Queue()
        self._threads = [
            threading.Thread(target=self._work, daemon=True) for _ in range(workers)
        ]
        for t in self._threads:
            t.start()

    def _work(self):
        while True:
            key = self._queue.get()
            if key is None:
                return
            with self._lock:
                slot = self._pending.get(key)
            if slot is None or slot["done"].is_set():
                continue  # cancelled, or a repeat of a request already served
            try:
                slot["data"] = self.read(*key)
            except Exception as e:
                slot["error"] = e
            slot["done"].set()

    def _request(self, layer, expert):
        key = (layer, expert)
        with self._lock:
            slot = self._pending.get(key)
            if slot is None:
                slot = self._pending[key] = {"done": threading.Event()}
                self._queue.put(key)
        return slot

    def _fd(self, layout):
        with self._lock:
            return super()._fd(layout)

    def prefetch(self, layer, experts):
        for e in experts:
            self._request(layer, int(e))

    def fetch(self, layer, experts):
        slots = {e: self._request(layer, e) for e in experts}
        out = {}
        for e, slot in slots.items():
            slot["done"].wait()
            with self._lock:
                self._pending.pop((layer, e), None)
            if "error" in slot:
                raise slot["error"]
            out[e] = slot["data"]
        return out

    def cancel(self, layer=-1):
        """Forget the prefetches of ``layer`` (-1: all) that were not fetched:
        queued ones are skipped, read ones are dropped."""
        with self._lock:
            for key in [k for k in self._pending if layer == -1 or k[0] == layer]:
                del self._pending[key]

    def close(self):
        for _ in self._threads:
            self._queue.put(None)
        for t in self._threads:
            t.join()
        super().close()
