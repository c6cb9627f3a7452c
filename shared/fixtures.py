"""Fake prep folders, a live daemon and a raw peer, for the tests and benchmarks of iod, built directly with shared.blob.

A fake model is a manifest plus one blob file per layer holding random
record bytes with correct checksums; no real weights are involved.
"""

import os
import shutil
import signal
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from shared.blob import Manifest, plan_layer, record_checksum

DEFAULT_RECORDS = (40_000, 130_000, 300_000)  # record bytes per layer


def make_prep(folder, records=DEFAULT_RECORDS, num_experts=16, seed=0) -> Manifest:
    """Write a fake prep folder: layer i has ``num_experts`` records of
    ``records[i]`` random bytes. Returns the manifest."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    layers = []
    for i, nbytes in enumerate(records):
        layout = plan_layer(
            i, f"model.layers.{i}.mlp.switch_mlp",
            [("blob", "weight", "uint8", [nbytes], 1, num_experts)],
        )
        with open(folder / layout.file, "wb") as f:
            for e in range(num_experts):
                data = rng.integers(0, 256, layout.record_bytes, dtype=np.uint8).tobytes()
                layout.checksums.append(f"{record_checksum(i, e, data):016x}")
                f.write(data + bytes(layout.stride - layout.record_bytes))
        layers.append(layout)
    manifest = Manifest(model_type="fake", layers=layers)
    manifest.save(folder)
    return manifest


def record_bytes(folder, layout, expert) -> bytes:
    """The record as the blob file holds it (plain buffered read)."""
    with open(Path(folder) / layout.file, "rb") as f:
        return os.pread(f.fileno(), layout.record_bytes, expert * layout.stride)


# ---- live daemons for tests -------------------------------------------------------


SHORT_DIRS = []  # every short_dir made in this process, for the test session's end to remove


def short_dir(prefix="iodt-") -> Path:
    """A fresh 0700 folder with a short path (AF_UNIX paths are limited)."""
    folder = Path(tempfile.mkdtemp(prefix=prefix, dir="/tmp"))
    SHORT_DIRS.append(folder)
    return folder


class LiveDaemon:
    """``iod start --foreground`` as a child process, ready when constructed."""

    def __init__(self, folder=None, args=(), env=None):
        from shared.launch import spawn

        self.owns_folder = folder is None  # then stop() removes it
        self.folder = Path(folder or short_dir())
        self.socket = self.folder / "iod.sock"
        e = dict(os.environ)
        e.update(env or {})
        self.log = self.folder / "iod.log"
        # the daemon watches this pipe: if the test process dies, so does it
        r, self._parent_w = os.pipe()
        try:
            self.proc, self.pid = spawn(self.socket, list(args), log=self.log, env=e,
                                        parent_fd=r)
        finally:
            os.close(r)

    def shm_name(self) -> str:
        return (self.folder / "arena.name").read_text().split()[0]  # then the pin table's

    def stop(self, timeout=10) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        rc = self.proc.wait(timeout)
        self._close_pipe()
        if self.owns_folder:
            shutil.rmtree(self.folder, ignore_errors=True)
        return rc

    def _close_pipe(self):
        if self._parent_w is not None:
            os.close(self._parent_w)
            self._parent_w = None

    def kill(self):
        self.proc.kill()
        self.proc.wait()
        self._close_pipe()

    def logtext(self) -> str:
        try:
            return self.log.read_text()
        except OSError:
            return ""


class Raw:
    """A bare DEALER for protocol tests: send any frames, read replies."""

    def __init__(self, sock):
        import zmq

        self.zmq = zmq
        # one process-wide context: a per-Raw context left to the garbage
        # collector can block in Context.term() and hang the test run
        self.ctx = zmq.Context.instance()
        self.s = self.ctx.socket(zmq.DEALER)
        self.s.setsockopt(zmq.LINGER, 0)
        self.s.connect(f"ipc://{sock}")
        self.next = 100

    def req(self):
        self.next += 1
        return self.next

    def send(self, msg):
        from shared import codec

        self.s.send_multipart(codec.encode(msg))

    def send_frames(self, frames):
        self.s.send_multipart(frames)

    def recv(self, timeout=10.0):
        from shared import codec

        if not self.s.poll(int(timeout * 1000)):
            raise TimeoutError("no message from iod")
        return codec.decode(self.s.recv_multipart())

    def rt(self, msg, timeout=10.0):
        """Send, then return the terminal reply to it (notifications kept in .notes)."""
        self.send(msg)
        return self.until(msg.req_id, timeout)

    def until(self, req_id, timeout=10.0):
        self.notes = getattr(self, "notes", [])
        while True:
            m = self.recv(timeout)
            if getattr(m, "req_id", None) == req_id:
                return m
            self.notes.append(m)

    def hello(self, model_dir, pid=None, working_set=1):
        from shared import protocol as P
        from shared.blob import Manifest

        try:  # the hash a session would have loaded (a hostile folder may have none)
            mhash = Manifest.load_with_hash(model_dir)[1]
        except Exception:
            mhash = "unreadable"
        return self.rt(P.Hello(self.req(), P.PROTOCOL_VERSION, pid or os.getpid(), str(model_dir),
                               mhash, working_set, False))

    def close(self):
        self.s.close()


def unpin_refs(hello, refs):
    """Drop a Raw session's pins the way a client does: in its pin-table row."""
    import mmap

    import native
    from shared import slots as S

    fd = native.shm_open_rw(hello.pins_name)
    try:
        mm = mmap.mmap(fd, os.fstat(fd).st_size)
    finally:
        os.close(fd)
    native.unpin(mm, S.PinLayout(hello.slot_count, hello.pin_rows).pins(hello.pin_row),
                 hello.slot_count, np.array([r.slot for r in refs], np.int32))
    mm.close()


def slot_bytes(daemon, hello, ref) -> bytes:
    """A granted record's bytes, read through the arena's shm file."""
    from shared import slots as S

    with open("/dev/shm" + daemon.shm_name(), "rb") as f:
        f.seek(S.Layout(hello.slot_size, hello.slot_count).data(ref.slot))
        return f.read(ref.size)


def wait_for(cond, timeout=10.0, what="condition"):
    """Poll ``cond`` until true (tests only; no timing thresholds are asserted)."""
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        v = cond()
        if v:
            return v
        time.sleep(0.02)
    raise AssertionError(f"timed out waiting for {what}")


def shm_entries(pid=None):
    prefix = f"iod.{os.getuid()}."
    names = [n for n in os.listdir("/dev/shm") if n.startswith(prefix)]
    if pid is not None:
        names = [n for n in names if n.split(".")[2] == str(pid)]
    return names


PY = sys.executable


def daemons_under(folder):
    """Pids of the iod daemons whose command line names ``folder`` (a run
    dir: the private daemons started there)."""
    out = []
    for p in os.listdir("/proc"):
        if p.isdigit():
            try:
                cmd = open(f"/proc/{p}/cmdline", "rb").read().decode(errors="replace")
            except OSError:
                continue
            if str(folder) in cmd and "iod.cli" in cmd:
                out.append(int(p))
    return out


def daemon_stats(sock) -> dict:
    """The daemon's STATS at ``sock``, asked on a connection of its own."""
    from shared import protocol as P

    r = Raw(sock)
    try:
        return r.rt(P.Stats(r.req())).stats
    finally:
        r.close()
