"""The daemon's core inside an inference process, with its own reader threads.

``InprocSource`` is an ``ExpertSource`` like ``infer.runtime.client.IodClient``,
with the same scheduler, arena, directory and pins, but no socket and no
second process: a demand is a method call, and the caller waits on the
reader pool's completions. It is what the benchmarks compare iod with (the
single-process design: IO threads share the interpreter with the model).
"""

import queue
from pathlib import Path

from shared import protocol as P
from shared.blob import Manifest
from shared.source import ExpertSource, SourceError

from .arena import Arena
from .core import Config, Core, Failure
from .reader import Faults, ReaderPool

_ME = b"inproc"


class InprocSource(ExpertSource):
    """A session of an in-process core for one prep folder. ``arena``: bytes
    of (private, anonymous) staging memory; ``read_rate``: bytes/s cap on
    reads (0: none); ``workers``: reader threads."""

    def __init__(self, model_dir, arena=512 << 20, workers=4, read_rate=0.0, hashers=0,
                 profile=False, working_set=1):
        import os

        self.model_dir = Path(model_dir).resolve()
        self.manifest, mhash = Manifest.load_with_hash(self.model_dir)
        self.profile = profile
        self.daemon_pid = 0
        self._reset_counters()
        self._next_req = 1
        self._memory = Arena(None, int(arena), anonymous=True)
        self.pool = ReaderPool(workers, None, read_rate, Faults(), hashers)
        self.core = Core(Config(arena_size=int(arena), workers=workers, max_sessions=1),
                         self._memory, self.pool)
        ok = self._call(P.Hello(self._req(), P.PROTOCOL_VERSION, os.getpid(),
                                str(self.model_dir), mhash,
                                working_set, profile))
        self.session_id = ok.session_id
        self._attach_arena(self._memory.buf, self._memory.pins_buf, ok, self.manifest)
        self._closed = False

    def _req(self):
        self._next_req += 1
        return self._next_req - 1

    def _reply(self, req_id):
        for i, (_, msg) in enumerate(self.core.outbox):
            if getattr(msg, "req_id", None) == req_id:
                del self.core.outbox[i]
                return msg
        return None

    def _call(self, msg):
        """Handle a call and run the core until its reply is out."""
        try:
            self.core.handle(_ME, msg)
        except Failure as f:
            raise SourceError(f"iod {P.ErrorCode(f.code).name}: {f}", P.ErrorCode(f.code),
                              f.layer, f.expert) from None
        while True:
            self._complete(block=False)
            self.core.pump()
            reply = self._reply(msg.req_id)
            if reply is not None:
                break
            self._complete(block=True)
        if isinstance(reply, P.Error):
            raise SourceError(f"iod {P.ErrorCode(reply.code).name}: {reply.message}",
                              P.ErrorCode(reply.code), reply.layer, reply.expert)
        return reply

    def _complete(self, block):
        """Feed finished reads to the core (waiting for one if ``block``)."""
        try:
            job = self.pool.done.get(timeout=1.0) if block else self.pool.done.get_nowait()
        except queue.Empty:
            return
        while job is not None:
            self.core.completed(job)
            try:
                job = self.pool.done.get_nowait()
            except queue.Empty:
                job = None

    def _poll(self):
        """Publish what the readers finished meanwhile, start what is queued."""
        self._complete(block=False)
        self.core.pump()

    def _send_prefetch(self, hints, now):
        self.core.handle(_ME, P.Prefetch(self._req(), self.model_id, now, hints))
        self._complete(block=False)
        self.core.pump()
        self.core.outbox.clear()  # hints get no reply

    def _demand(self, layer, experts):
        reply = self._call(P.Demand(self._req(), self.model_id, layer, experts, self.layer_calls))
        return reply.refs, reply.stamps

    def stats(self) -> dict:
        return self.core.stats()

    def reconnect(self) -> None:
        """The core lives and dies with this process: nothing to attach to."""
        raise SourceError("an in-process core cannot be reattached")

    @property
    def bytes_read(self) -> int:
        return self.core.c["bytes_read"]

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self.pool.stop()
        self._complete(block=False)
        self.core.shutdown("closed")
        self._unpin_cuda()
        self._memory.close(unlink=False)

