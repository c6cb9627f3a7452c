"""What one request may cost the shared daemon (docs/reliability.md, 8.12),
performed for real: a HELLO naming a huge manifest (a 160,000-entry shape
stalled the daemon 26 s) is refused with BAD_MODEL while another session is
answered.

Figures are printed as one JSON line per check (run with -s to see them)."""

import json
import os
import shutil
import time

import pytest

from infer.runtime.client import IodClient
from shared import blob
from shared import protocol as P
from shared.fixtures import LiveDaemon, Raw, record_bytes
from tests.test_trust import emit

E = P.ErrorCode
STATS_BOUND_S = 5.0  # what another session's STATS may wait while a HELLO is handled


def _hostile(model, tmp_path, name, edit):
    """A copy of the fake prep folder whose manifest ``edit`` changed."""
    folder = tmp_path / name
    shutil.copytree(model, folder)
    d = json.loads((folder / blob.MANIFEST_NAME).read_text())
    edit(d)
    (folder / blob.MANIFEST_NAME).write_text(json.dumps(d, separators=(",", ":")))
    return folder


def _more_layers(d):
    d["layers"] = [dict(d["layers"][0], layer=i) for i in range(blob.MANIFEST_MAX_LAYERS + 1)]


CASES = {
    # a 2.2 MB manifest: old code multiplied 160,000 40-bit numbers (26 s here)
    "shape": (lambda d: d["layers"][0]["segments"][0].update(shape=[(1 << 40) - 1] * 160_000),
              "shape of 160000 dimensions, more than 8"),
    "values": (lambda d: d["layers"][0].update(num_experts=1 << 30,
                                                 checksums=["0"] * blob.MANIFEST_MAX_VALUES),
               f"more than {blob.MANIFEST_MAX_VALUES} values, the most a manifest may have"),
    "layers": (_more_layers, f"{blob.MANIFEST_MAX_LAYERS + 1} layers, more than "
                             f"{blob.MANIFEST_MAX_LAYERS}"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_a_hello_naming_a_huge_manifest_is_refused_and_stalls_nobody(model, tmp_path, case):
    """A session is live on the good model; a hostile peer says HELLO naming
    a folder whose manifest is huge; while the daemon handles it, the live
    session asks STATS: answered within STATS_BOUND_S, the HELLO refused with
    BAD_MODEL naming the bound, and the live session still reads the file's
    bytes."""
    edit, why = CASES[case]
    folder = _hostile(model, tmp_path, case, edit)
    d = LiveDaemon(args=["--arena", "16M"])
    hostile = Raw(d.socket)
    try:
        with IodClient(model, iod=str(d.socket)) as live:
            hello = P.Hello(hostile.req(), P.PROTOCOL_VERSION, os.getpid(), str(folder), "0" * 16,
                            1, False)
            t0 = time.monotonic()
            hostile.send(hello)
            time.sleep(0.2)  # the daemon is at it
            t = time.monotonic()
            st = live.stats()
            stats_s = time.monotonic() - t
            reply = hostile.until(hello.req_id, timeout=120)
            hello_s = time.monotonic() - t0
            assert stats_s < STATS_BOUND_S, f"STATS waited {stats_s:.1f} s behind the HELLO"
            assert isinstance(reply, P.Error) and reply.code == E.BAD_MODEL, reply
            assert why in reply.message and "\n" not in reply.message
            assert st["pid"] == d.proc.pid
            layout = live.manifest.layer(0)
            assert live.read(0, [5]) == {5: record_bytes(model, layout, 5)}
            assert live.stats()["counters"]["internal_errors"] == 0
        size = (folder / blob.MANIFEST_NAME).stat().st_size
        emit("huge_manifest", {"case": case, "manifest_bytes": size,
                               "stats_answered_s": round(stats_s, 3),
                               "hello_refused_s": round(hello_s, 3)})
    finally:
        hostile.close()
        d.stop()

