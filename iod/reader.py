"""The reader pool: threads that pread expert records straight into slot
memory, bypassing the page cache, and verify each record's checksum (a
record a demand waits for by its reader, at once).

Threads only read and hash; every decision stays with the daemon's main
thread. Finished jobs go back through a queue, and one byte on a pipe wakes
the main loop. The main thread hands a job to the pool only when a worker
is free, so its own queues keep their order (demand before prefetch).
"""

import errno
import itertools
import os
import queue
import sys
import threading
import time

import native
from shared import blob
from shared.blob import record_checksum

from .sched import DEMAND

O_DIRECT = getattr(os, "O_DIRECT", 0)


def open_blob(folder, layout) -> tuple:
    """Open a layer's blob file for page-cache-bypassing reads: O_DIRECT on
    Linux, F_NOCACHE on macOS, else plain reads followed by fadvise(DONTNEED).
    The file is checked by ``shared.blob.open_blob`` (inside the folder, a
    regular file, long enough). Returns (fd, mode) with mode one of
    "direct", "nocache", "fadvise"; raises ManifestError."""
    if O_DIRECT:
        try:
            fd = blob.open_blob(folder, layout, O_DIRECT)
        except blob.ManifestError:
            pass  # O_DIRECT refused (EINVAL): try without; a real problem shows again
        else:
            if _probe_direct(fd):
                return fd, "direct"
            os.close(fd)
    fd = blob.open_blob(folder, layout)
    if sys.platform == "darwin":
        import fcntl

        fcntl.fcntl(fd, getattr(fcntl, "F_NOCACHE", 48), 1)
        return fd, "nocache"
    return fd, "fadvise"


def _probe_direct(fd) -> bool:
    """Some file systems accept O_DIRECT at open and refuse the read."""
    import mmap

    buf = mmap.mmap(-1, 4096)
    try:
        native.pread_full(fd, buf, 0, 4096, 0)
        return True
    except OSError:
        return False
    finally:
        buf.close()


class Faults:
    """Test-only fault injection, from ``IOD_FAULTS`` read at daemon start:
    comma-separated ``KIND:LAYER:EXPERT:COUNT`` with KIND one of ``eio``
    (the read fails with EIO), ``short`` (the read returns half the bytes)
    and ``corrupt`` (one byte of the slot is flipped after the read).
    Each rule fires COUNT times for that record, then the record reads fine.
    ``handler:MSGKIND:0:COUNT`` makes the daemon's handler of that request
    kind raise (a stand-in for a bug: the reply must be INTERNAL)."""

    KINDS = ("eio", "short", "corrupt", "handler")

    def __init__(self, spec: str = ""):
        self.rules = {}
        self.lock = threading.Lock()
        for item in filter(None, (spec or "").split(",")):
            kind, layer, expert, count = item.split(":")
            if kind not in self.KINDS:
                raise ValueError(f"IOD_FAULTS: unknown fault {kind!r}")
            self.rules[(kind, int(layer), int(expert))] = int(count)

    def take(self, kind, layer, expert) -> bool:
        if not self.rules:
            return False
        with self.lock:
            n = self.rules.get((kind, layer, expert), 0)
            if n > 0:
                self.rules[(kind, layer, expert)] = n - 1
                return True
        return False


class TokenBucket:
    """Emulates a slower device for benchmarks: at most ``rate`` bytes/s
    across all workers (a burst of one second's worth is allowed)."""

    def __init__(self, rate: float):
        self.rate = rate
        self.tokens = 0.0
        self.t = time.monotonic()
        self.lock = threading.Lock()

    def take(self, n: int) -> None:
        with self.lock:
            now = time.monotonic()
            self.tokens = min(self.tokens + (now - self.t) * self.rate, max(self.rate, n))
            self.t = now
            self.tokens -= n
            wait = -self.tokens / self.rate if self.tokens < 0 else 0.0
        if wait > 0:
            time.sleep(wait)


class Job:
    __slots__ = (
        "key", "fd", "mode", "dest", "nbytes", "file_off", "record_bytes",
        "checksum", "layer", "expert", "read_start", "read_end", "error", "got", "urgent",
    )

    def __init__(self, key, fd, mode, dest, nbytes, file_off, record_bytes, checksum, layer, expert):
        self.key = key
        self.fd, self.mode = fd, mode
        self.dest = dest  # writable memoryview of the slot
        self.nbytes, self.file_off = nbytes, file_off
        self.record_bytes, self.checksum = record_bytes, checksum
        self.layer, self.expert = layer, expert
        self.read_start = self.read_end = 0
        self.error = None  # None, or (ErrorCode name, message)
        self.got = 0
        self.urgent = False  # a demand waits for it: checked by its reader, at once


class ReaderPool:
    """``workers`` threads read; with ``hashers`` > 0 the checksum of a
    prefetched record is left to that many other threads, so a reader starts
    its next read at once and the device queue stays ``workers`` deep. A
    record a demand waits for is checked by its reader at once: a hand-off
    to a hasher thread would add a thread's wake-up to the demand's wait,
    and queue it behind prefetched records."""

    def __init__(self, workers: int, wake_fd: int, read_rate: float = 0.0, faults: Faults = None,
                 hashers: int = 0):
        # (class, seq, job): a demand submitted later still starts before
        # prefetches that were handed over but not started
        self.jobs = queue.PriorityQueue()
        self.done = queue.SimpleQueue()
        self.to_hash = queue.SimpleQueue()
        self.seq = itertools.count()  # the jobs' tie-break
        self.wake_fd = wake_fd
        self.bucket = TokenBucket(read_rate) if read_rate > 0 else None
        self.faults = faults or Faults()
        self.threads = [
            threading.Thread(target=self._run, name=f"iod-reader-{i}", daemon=True)
            for i in range(workers)
        ]
        self.hashers = [
            threading.Thread(target=self._run_hasher, name=f"iod-hasher-{i}", daemon=True)
            for i in range(hashers)
        ]
        for t in self.threads + self.hashers:
            t.start()

    def submit(self, job: Job, cls: int = DEMAND) -> None:
        job.urgent = job.urgent or cls == DEMAND
        self.jobs.put((cls, next(self.seq), job))

    def stop(self, timeout=None) -> bool:
        """Let jobs already submitted finish, then end the threads; give up
        waiting after ``timeout`` seconds (a read stuck in a device or a
        throttle must not hold a stopping daemon). True when all ended."""
        end = None if timeout is None else time.monotonic() + timeout
        left = lambda: None if end is None else max(end - time.monotonic(), 0)  # noqa: E731
        for _ in self.threads:
            self.jobs.put((99, next(self.seq), None))
        for t in self.threads:
            t.join(left())
        for _ in self.hashers:
            self.to_hash.put(None)
        for t in self.hashers:
            t.join(left())
        return not any(t.is_alive() for t in self.threads + self.hashers)

    def _finish(self, job: Job) -> None:
        self.done.put(job)
        if self.wake_fd is None:  # the in-process source blocks on ``done`` itself
            return
        try:
            os.write(self.wake_fd, b"r")
        except BlockingIOError:
            pass  # the pipe is full, so the main loop is awake anyway

    def _run(self) -> None:
        while True:
            job = self.jobs.get()[2]
            if job is None:
                return
            try:
                self._read(job)
                if job.error is None and self.hashers and not job.urgent:
                    self.to_hash.put(job)
                    continue
                if job.error is None:
                    self._verify(job)
            except Exception as e:  # never lose a job: the main thread must hear back
                job.error = ("INTERNAL", f"reader: {type(e).__name__}: {e}")
            self._finish(job)

    def _run_hasher(self) -> None:
        while True:
            job = self.to_hash.get()
            if job is None:
                return
            try:
                self._verify(job)
            except Exception as e:
                job.error = ("INTERNAL", f"hasher: {type(e).__name__}: {e}")
            self._finish(job)

    def _read(self, job: Job) -> None:
        if self.bucket:
            self.bucket.take(job.nbytes)
        job.read_start = time.monotonic_ns()
        f = self.faults
        try:
            if f.take("eio", job.layer, job.expert):
                raise OSError(errno.EIO, "injected EIO")
            n = native.pread_full(job.fd, job.dest, 0, job.nbytes, job.file_off)
            if f.take("short", job.layer, job.expert):
                n = job.record_bytes // 2
            if job.mode == "fadvise":
                os.posix_fadvise(job.fd, job.file_off, job.nbytes, os.POSIX_FADV_DONTNEED)
        except OSError as e:
            job.read_end = time.monotonic_ns()
            job.error = ("IO_ERROR", f"read failed: {os.strerror(e.errno or errno.EIO)}")
            return
        job.read_end = time.monotonic_ns()
        job.got = n
        if n < job.record_bytes:
            job.error = ("IO_ERROR", f"short read: {n} of {job.record_bytes} bytes")

    def _verify(self, job: Job) -> None:
        if self.faults.take("corrupt", job.layer, job.expert):
            job.dest[0] ^= 0xFF
        ok = record_checksum(job.layer, job.expert, job.dest[: job.record_bytes]) == job.checksum
        if not ok:
            job.error = ("CHECKSUM", "record checksum mismatch")
