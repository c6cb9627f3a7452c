"""Trust and fault boundaries (docs/reliability.md, section 8): each test
performs the attack or the fault for real.

Another user is a real non-root account (created with useradd, kept for
later runs) in a forked child that has dropped to it: the venv's python
lives under /root, which that user cannot exec, so the child runs the code
this process has already imported. Root only; Linux only (/dev/shm, unshare).
"""

import json
import mmap
import os
import pwd
import select
import shutil
import signal
import socket
import stat
import subprocess
import sys
import tempfile
import time
import traceback  # noqa: F401  (imported before any fork: the other user cannot read the stdlib)
from pathlib import Path

import pytest

import iod.cli  # noqa: F401  (the same: everything a forked daemon needs)
import iod.core  # noqa: F401
import iod.shell  # noqa: F401
import native
from iod import runtime
from shared import blob, paths, trust
from shared import protocol as P
from shared import slots as S
from shared.fixtures import PY, LiveDaemon, Raw, make_prep, record_bytes, short_dir, wait_for

pytestmark = pytest.mark.skipif(os.geteuid() != 0 or not sys.platform.startswith("linux"),
                                reason="needs root (real other users) and Linux")

E = P.ErrorCode
ATTACKER = "iodtrust"  # another user of the machine
VICTIM = "iodtrust2"  # a non-root user whose daemon must start despite the attacker


def account(name):
    """(uid, gid) of a real non-root account, created if needed."""
    try:
        pw = pwd.getpwnam(name)
    except KeyError:
        subprocess.run(["useradd", "--system", "--no-create-home", "--shell", "/usr/sbin/nologin",
                        name], check=True, capture_output=True)
        pw = pwd.getpwnam(name)
    assert pw.pw_uid != 0
    return pw.pw_uid, pw.pw_gid


class AsUser:
    """``fn(report_fd)`` in a forked child that has become ``user``; the child
    reports lines on the pipe and runs until ``fn`` returns or ``stop()``."""

    def __init__(self, user, fn):
        uid, gid = account(user)
        self.r, w = os.pipe()
        self.buf = b""
        self.pid = os.fork()
        if self.pid == 0:  # the child: never returns into pytest
            code = 1
            try:
                os.close(self.r)
                os.setgroups([])
                os.setgid(gid)
                os.setuid(uid)
                code = fn(w) or 0
            except BaseException as e:  # noqa: BLE001  (report anything)
                os.write(w, f"error {e!r}\n".encode())
            finally:
                os._exit(code)
        os.close(w)

    def line(self, timeout=20.0) -> str:
        end = time.monotonic() + timeout
        while b"\n" not in self.buf:
            left = end - time.monotonic()
            if left <= 0 or not select.select([self.r], [], [], left)[0]:
                raise TimeoutError("no report from the other user's process")
            chunk = os.read(self.r, 4096)
            if not chunk:
                raise EOFError(f"the other user's process ended: {self.buf!r}")
            self.buf += chunk
        line, self.buf = self.buf.split(b"\n", 1)
        return line.decode()

    def lines_now(self) -> list:
        out = []
        while select.select([self.r], [], [], 0.2)[0]:
            chunk = os.read(self.r, 4096)
            if not chunk:
                break
            self.buf += chunk
        while b"\n" in self.buf:
            line, self.buf = self.buf.split(b"\n", 1)
            out.append(line.decode())
        return out

    def wait(self, timeout=20.0) -> int:
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            pid, status = os.waitpid(self.pid, os.WNOHANG)
            if pid:
                self.pid = 0
                os.close(self.r)
                return os.waitstatus_to_exitcode(status)
            time.sleep(0.02)
        raise TimeoutError(f"pid {self.pid} did not exit")

    def stop(self, sig=signal.SIGTERM) -> int:
        if not self.pid:
            return 0
        os.kill(self.pid, sig)
        try:
            return self.wait()
        except TimeoutError:
            os.kill(self.pid, signal.SIGKILL)
            return self.wait()


def as_user(user, fn):
    """The JSON result of ``fn()`` run as ``user`` (a one-shot AsUser)."""
    def child(w):
        os.write(w, (json.dumps(fn()) + "\n").encode())

    p = AsUser(user, child)
    try:
        line = p.line()
        assert not line.startswith("error"), line
        return json.loads(line)
    finally:
        p.wait()


def sticky_dir() -> Path:
    """A root-owned, world-writable, sticky folder: what /tmp is."""
    d = Path(tempfile.mkdtemp(prefix="iodtt-", dir="/tmp"))
    d.chmod(0o1777)
    return d


def cli(*args, timeout=60):
    t = time.monotonic()
    p = subprocess.run([PY, "-m", "iod.cli", *map(str, args)], capture_output=True, text=True,
                       timeout=timeout)
    return p, time.monotonic() - t


def emit(check, figures):
    """One JSON line of figures per check (run with -s to see them)."""
    print(json.dumps({"check": check, **figures}))


def one_line(text) -> str:
    lines = text.strip().splitlines()
    assert len(lines) == 1, lines
    return lines[0]


def gone(pid) -> bool:
    """Exited (a zombie nobody reaped counts: it holds nothing)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"
    except FileNotFoundError:
        return True


def shm_exists(name) -> bool:
    return os.path.lexists("/dev/shm" + name)


# ---- 1. a session trusts only a daemon of its own uid ----------------------------


def fake_daemon(folder: Path, mhash: str, slot_size: int):
    """The attacker's daemon (run as the attacker): makes the victim's run
    dir first, holds its lock, and answers HELLO with an arena of the
    attacker's bytes that the victim could map (0644)."""
    import fcntl

    import zmq

    from shared import codec

    def run(w):
        os.umask(0)
        folder.mkdir(mode=0o755)
        lock = os.open(folder / "iod.lock", os.O_RDWR | os.O_CREAT, 0o644)
        fcntl.flock(lock, fcntl.LOCK_EX)
        os.write(lock, f"{os.getpid()}\n".encode())
        lay = S.Layout(slot_size, 4)
        name = f"/iod.{os.getuid()}.{os.getpid()}.evil"
        pins = name + "p"
        fd = native.shm_create(name, lay.nbytes)
        os.fchmod(fd, 0o644)
        mm = mmap.mmap(fd, lay.nbytes)
        mm[:] = b"\xaa" * lay.nbytes  # the attacker's "expert" bytes
        S.ARENA_HEADER.pack_into(mm, 0, S.ARENA_MAGIC, S.ARENA_VERSION, slot_size, 4,
                                 lay.data_offset, os.getpid(), lay.dir_offset, lay.dir_entries,
                                 lay.headers_offset)
        pfd = native.shm_create(pins, S.PinLayout(4, 1).nbytes)
        os.fchmod(pfd, 0o666)
        ctx = zmq.Context()
        s = ctx.socket(zmq.ROUTER)
        s.bind(f"ipc://{folder / 'iod.sock'}")
        os.chmod(folder / "iod.sock", 0o666)
        os.write(w, f"ready {name}\n".encode())
        stop = []
        signal.signal(signal.SIGTERM, lambda *a: stop.append(1))
        try:
            while not stop:
                if not s.poll(100):
                    continue
                ident, *frames = s.recv_multipart()
                msg = codec.decode(frames)
                if isinstance(msg, P.Hello):
                    os.write(w, f"hello {msg.pid}\n".encode())
                    s.send_multipart([ident, *codec.encode(P.HelloOk(
                        msg.req_id, 1, 1, os.getpid(), name, pins, 0, 1, slot_size, 4, 0,
                        mhash))])
        finally:
            native.shm_unlink(name)
            native.shm_unlink(pins)
            s.close(linger=0)
            ctx.term()

    return run


def test_shared_daemon_of_another_user_is_refused(model, monkeypatch, capfd):
    """Another user makes our default run dir first and runs a daemon there
    that would serve us its own bytes: the session refuses it with one line
    naming the path and owner, and a private daemon serves the file's bytes."""
    from infer.runtime.client import IodClient

    auid, _ = account(ATTACKER)
    base = sticky_dir()
    run = base / "run"
    stride = blob.Manifest.load(model).max_stride
    evil = AsUser(ATTACKER, fake_daemon(run, blob.manifest_hash(model), S.round_up(stride, S.PAGE)))
    try:
        ready = evil.line()
        assert ready.startswith("ready"), ready
        evil_shm = ready.split()[1]
        # the attack is real: that daemon answers a session's HELLO with its own arena
        r = Raw(run / "iod.sock")
        ok = r.hello(model)
        r.close()
        assert isinstance(ok, P.HelloOk) and ok.shm_name == evil_shm
        assert evil.line() == f"hello {os.getpid()}"

        monkeypatch.setenv("IOD_RUN_DIR", str(run))
        capfd.readouterr()
        with IodClient(model, iod="auto") as c:
            assert c.shm_name != evil_shm and c.daemon_pid != evil.pid
            assert c._private is not None and c.shm_name.startswith("/iod.0.")
            err = capfd.readouterr().err
            said = [x for x in err.splitlines() if x.startswith("iod:")]
            assert said == [
                f"iod: the shared daemon at {run / 'iod.sock'} is not usable (run dir {run} is "
                f"owned by uid {auid} ({ATTACKER}), not by you (uid 0 (root))); starting a "
                f"private one"], err
            layout = c.manifest.layers[0]
            got = c.read(layout.layer, [0, 1])
            assert all(got[e] == record_bytes(model, layout, e) for e in (0, 1))
        assert evil.lines_now() == []  # the session never said HELLO to it
        assert sorted(os.listdir(run)) == ["iod.lock", "iod.sock"]  # nothing of ours went there
    finally:
        evil.stop()
        shutil.rmtree(base, ignore_errors=True)
    assert not shm_exists(evil_shm)


def test_socket_of_ours_served_by_another_uid_is_refused(model, tmp_path):
    """A socket file we own in a run dir we own, but another uid listens on
    it: the kernel's peer credentials refuse it (explicit --iod SOCKET)."""
    from infer.runtime.client import IodClient, IodError

    auid, agid = account(ATTACKER)
    theirs = Path(tempfile.mkdtemp(prefix="iodtt-", dir="/tmp"))
    os.chown(theirs, auid, agid)
    ours = short_dir()

    def listen(w):
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.bind(str(theirs / "s.sock"))
        s.listen(8)
        os.write(w, b"ready\n")
        while True:  # until SIGTERM
            time.sleep(1)

    listener = AsUser(ATTACKER, listen)
    sock = ours / "iod.sock"
    try:
        assert listener.line() == "ready"
        os.rename(theirs / "s.sock", sock)  # the file is ours now; the listener is not
        os.lchown(sock, 0, 0)
        trust.check_run_dir(ours)
        trust.check_socket(sock)
        with pytest.raises(trust.Untrusted) as e:
            trust.daemon_peer(sock)
        want = f"socket {sock} is served by pid {listener.pid} of uid {auid} ({ATTACKER})"
        assert want in str(e.value)
        with pytest.raises(IodError) as e:
            IodClient(model, iod=str(sock))
        assert one_line(str(e.value)).startswith(f"refusing the iod daemon at {sock}: {want}")
    finally:
        listener.stop()
        shutil.rmtree(theirs, ignore_errors=True)
        shutil.rmtree(ours, ignore_errors=True)


def test_arena_segment_of_another_user_or_mode_is_refused():
    auid, _ = account(ATTACKER)
    theirs = f"/iodtt.{os.getpid()}.a"
    loose = f"/iodtt.{os.getpid()}.b"

    def make():
        os.close(native.shm_create(theirs, 4096))
        os.chmod("/dev/shm" + theirs, 0o644)
        return "ok"

    try:
        assert as_user(ATTACKER, make) == "ok"
        fd = native.shm_open_readonly(theirs)
        with pytest.raises(trust.Untrusted) as e:
            trust.check_arena_fd(fd, theirs)
        os.close(fd)
        assert str(e.value) == (f"shared memory {theirs} is owned by uid {auid} ({ATTACKER}), "
                                f"not by you (uid 0 (root))")
        os.close(native.shm_create(loose, 4096))
        os.chmod("/dev/shm" + loose, 0o644)
        fd = native.shm_open_readonly(loose)
        with pytest.raises(trust.Untrusted) as e:
            trust.check_arena_fd(fd, loose)
        os.close(fd)
        assert "has mode 0644, not 0600" in str(e.value)
    finally:
        native.shm_unlink(theirs)
        native.shm_unlink(loose)


def test_explicit_socket_in_a_loose_run_dir_is_refused(model):
    from infer.runtime.client import IodClient, IodError

    d = LiveDaemon(args=["--arena", "16M"])
    try:
        d.folder.chmod(0o755)
        with pytest.raises(IodError) as e:
            IodClient(model, iod=str(d.socket))
        assert one_line(str(e.value)) == (f"refusing the iod daemon at {d.socket}: run dir "
                                          f"{d.folder} has mode 0755, not 0700: others can "
                                          f"reach it")
        d.folder.chmod(0o700)
        with IodClient(model, iod=str(d.socket)) as c:
            assert c.daemon_pid == d.pid
    finally:
        d.stop()


# ---- 2a. the daemon adopts nothing it did not make: run dir, lock, log, arena.name ---


def test_run_dir_under_a_folder_others_can_write_is_refused(tmp_path):
    loose = tmp_path / "loose"
    loose.mkdir()
    loose.chmod(0o777)  # not sticky: anyone could rename our run dir away
    with pytest.raises(trust.Untrusted) as e:
        runtime.ensure_run_dir(loose / "run")
    assert str(e.value).startswith(f"run dir {loose / 'run'}: its ancestor {loose} (owned by "
                                   f"uid 0 (root)) is writable by others (mode 0777)")
    loose.chmod(0o1777)  # sticky, as /tmp: fine
    runtime.ensure_run_dir(loose / "run")


def test_foreign_or_symlinked_run_dir_is_refused_untouched():
    """Another user plants the run dir, as a folder of theirs or as a
    symlink to a folder of ours: `iod start` refuses with one line, chmods
    nothing and writes nothing there."""
    auid, agid = account(ATTACKER)
    base = Path(tempfile.mkdtemp(prefix="iodtt-", dir="/tmp"))
    os.chown(base, auid, agid)
    target = Path(tempfile.mkdtemp(prefix="iodtt-", dir="/tmp"))
    target.chmod(0o755)
    (target / "keep").write_text("precious")

    def plant():
        (base / "mine").mkdir(mode=0o777)
        os.chmod(base / "mine", 0o777)
        os.symlink(target, base / "link")
        return "ok"

    try:
        assert as_user(ATTACKER, plant) == "ok"
        p, _ = cli("start", "--socket", base / "link" / "iod.sock", "--arena", "16M")
        assert p.returncode == 1
        assert one_line(p.stderr) == (f"iod: run dir {base / 'link'} is a symlink (to {target}), "
                                      f"owned by uid {auid} ({ATTACKER})")
        assert stat.S_IMODE(target.stat().st_mode) == 0o755  # not chmodded
        assert sorted(os.listdir(target)) == ["keep"]  # nothing written through the link
        p, _ = cli("start", "--socket", base / "mine" / "iod.sock", "--arena", "16M")
        assert p.returncode == 1
        assert one_line(p.stderr) == (f"iod: run dir {base / 'mine'} is owned by uid {auid} "
                                      f"({ATTACKER}), not by you (uid 0 (root))")
        assert os.listdir(base / "mine") == []
        assert stat.S_IMODE((base / "mine").stat().st_mode) == 0o777
    finally:
        shutil.rmtree(base, ignore_errors=True)
        shutil.rmtree(target, ignore_errors=True)


def test_own_run_dir_with_a_loose_mode_is_refused_not_chmodded():
    folder = short_dir()
    try:
        folder.chmod(0o750)
        p, _ = cli("start", "--socket", folder / "iod.sock", "--arena", "16M")
        assert p.returncode == 1
        assert one_line(p.stderr) == (f"iod: run dir {folder} has mode 0750, not 0700: others "
                                      f"can reach it")
        assert stat.S_IMODE(folder.stat().st_mode) == 0o750 and os.listdir(folder) == []
    finally:
        shutil.rmtree(folder)


@pytest.mark.parametrize("name", ["iod.lock", "iod.log"])
def test_symlinked_lock_or_log_is_never_written_through(name):
    folder = short_dir()
    target = Path(tempfile.mkdtemp(prefix="iodtt-", dir="/tmp")) / "precious"
    target.write_text("precious\n")
    target.chmod(0o644)
    os.symlink(target, folder / name)
    try:
        p, _ = cli("start", "--socket", folder / "iod.sock", "--arena", "16M")
        assert p.returncode == 1, p.stderr
        want = {"iod.lock": f"iod: lock {folder / name} is a symlink (owned by uid 0 (root))",
                "iod.log": f"iod: log {folder / name} is a symlink; iod writes through none"}
        assert one_line(p.stderr) == want[name]
        assert target.read_text() == "precious\n" and stat.S_IMODE(target.stat().st_mode) == 0o644
        assert sorted(os.listdir(folder)) == [name]  # no daemon, nothing else made
    finally:
        shutil.rmtree(folder)
        shutil.rmtree(target.parent)


def test_symlinked_arena_record_is_replaced_not_followed(model):
    folder = short_dir()
    target = Path(tempfile.mkdtemp(prefix="iodtt-", dir="/tmp")) / "precious"
    target.write_text("precious\n")
    for name in ("arena.name", "arena.name.tmp"):
        os.symlink(target, folder / name)
    d = LiveDaemon(folder, args=["--arena", "16M"])
    try:
        assert target.read_text() == "precious\n"
        rec = folder / "arena.name"
        assert stat.S_ISREG(rec.lstat().st_mode) and stat.S_IMODE(rec.lstat().st_mode) == 0o600
        assert shm_exists(d.shm_name())
    finally:
        d.stop()
        shutil.rmtree(folder)
        shutil.rmtree(target.parent)


# ---- 2b. the daemon adopts nothing it did not make: shared-memory names ----------


def test_squatted_shm_names_do_not_block_a_start():
    """Another user creates, under a non-root user's prefix, segments that
    look stale (a dead pid) and a name that user's next segment would have:
    the sweep leaves them alone, creation skips a taken name, and the
    daemon starts."""
    from iod.arena import create_segment

    auid, _ = account(ATTACKER)
    vuid, vgid = account(VICTIM)
    dead = 4194303  # above any pid_max in use: never a live process
    stale = [f"/iod.{vuid}.{dead}.0", f"/iod.{vuid}.{dead}.abcdefghij"]
    taken = f"/iod.{vuid}.{dead - 1}.taken"

    def squat():
        for name in stale + [taken]:
            os.close(native.shm_create(name, 4096))
        return "ok"

    base = sticky_dir()
    folder = base / "v"

    def victim_daemon(w):
        os.environ["IOD_RUN_DIR"] = str(folder)
        # the name that is taken is skipped for a fresh one
        name, fd = create_segment(1 << 20, iter([taken, paths.shm_name()]))
        os.close(fd)
        native.shm_unlink(name)
        os.write(w, f"created {name}\n".encode())
        return iod.cli.main(["start", "--foreground", "--socket", str(folder / "iod.sock"),
                             "--arena", "16M", "--ready-fd", str(w)])

    try:
        assert as_user(ATTACKER, squat) == "ok"
        v = AsUser(VICTIM, victim_daemon)
        try:
            created = v.line()
            assert created.startswith(f"created /iod.{vuid}.") and created.split()[1] != taken
            ready = v.line()
            assert ready == f"READY {v.pid}", ready
            mine = (folder / "arena.name").read_text().split()[0]
            assert paths.is_shm_name(mine.replace(f".{vuid}.", f".{os.getuid()}.", 1))
            st = os.stat("/dev/shm" + mine)
            assert st.st_uid == vuid and stat.S_IMODE(st.st_mode) == 0o600
        finally:
            assert v.stop() == 0
        assert not shm_exists(mine)
        for name in stale + [taken]:  # the other user's segments, untouched
            assert os.stat("/dev/shm" + name).st_uid == auid
    finally:
        for name in stale + [taken]:
            native.shm_unlink(name)
        shutil.rmtree(base, ignore_errors=True)


def test_shm_names_are_fresh_and_short():
    names = {paths.shm_name(4194303) for _ in range(100)}
    assert len(names) == 100
    assert all(len(n) <= paths.SHM_NAME_MAX and paths.is_shm_name(n) for n in names)
    assert paths.shm_pid(next(iter(names))) == 4194303


def test_a_taken_name_is_skipped_and_running_out_is_one_line():
    from iod.arena import ArenaError, create_segment

    name = paths.shm_name()
    os.close(native.shm_create(name, 4096))
    try:
        fresh, fd = create_segment(4096, iter([name, paths.shm_name()]))
        os.close(fd)
        native.shm_unlink(fresh)
        assert fresh != name
        with pytest.raises(ArenaError) as e:
            create_segment(4096, iter([name, name]))
        assert str(e.value) == "no free shared-memory name after 2 tries"
    finally:
        native.shm_unlink(name)


# ---- 3. the prep folder is a boundary --------------------------------------------


def _prep_variant(root: Path, name: str, edit=None, blob_as=None) -> Path:
    """A small prep folder whose manifest (edit(dict)) or layer-0 blob is changed."""
    folder = root / name
    make_prep(folder, records=(5000,), num_experts=2)
    if edit:
        d = json.loads((folder / blob.MANIFEST_NAME).read_text())
        edit(d)
        (folder / blob.MANIFEST_NAME).write_text(json.dumps(d))
    if blob_as:
        (folder / "layer000.blob").unlink()
        blob_as(folder / "layer000.blob")
    return folder


def _sparse_manifest(folder: Path):
    folder.mkdir()
    with open(folder / blob.MANIFEST_NAME, "wb") as f:
        f.truncate(blob.MANIFEST_MAX_BYTES + 1)


def test_prep_folder_is_a_boundary(model, tmp_path):
    """A FIFO manifest or blob is refused at once (the daemon's loop never
    blocks on it), a blob named by absolute path, by `..` or by a symlink
    out of the folder is refused, an oversized manifest is refused; the
    daemon answers `iod status` throughout and serves a good model after."""
    outside = tmp_path / "outside.blob"
    outside.write_bytes(bytes(16384))
    cases = {
        "fifo_manifest": (tmp_path / "fifo_manifest",
                          lambda f: (f.mkdir(), os.mkfifo(f / blob.MANIFEST_NAME)),
                          "manifest.json is not a regular file"),
        "fifo_blob": (_prep_variant(tmp_path, "fifo_blob", blob_as=os.mkfifo), None,
                      "layer000.blob is not a regular file"),
        "absolute": (_prep_variant(tmp_path, "absolute",
                                   edit=lambda d: d["layers"][0].update(file=str(outside))), None,
                     f"file name {str(outside)!r} is not a plain relative path"),
        "dotdot": (_prep_variant(tmp_path, "dotdot",
                                 edit=lambda d: d["layers"][0].update(file="../outside.blob")),
                   None, "file name '../outside.blob' is not a plain relative path"),
        "symlink_out": (_prep_variant(tmp_path, "symlink_out",
                                      blob_as=lambda p: os.symlink(outside, p)), None,
                        f"resolves to {outside}, outside the prep folder"),
        "device": (_prep_variant(tmp_path, "device", blob_as=lambda p: os.symlink("/dev/zero", p)),
                   None, "resolves to /dev/zero, outside the prep folder"),
        "no_experts": (_prep_variant(tmp_path, "no_experts", edit=lambda d: d["layers"][0].update(
            num_experts=0, checksums=[])), None, "impossible layout (experts 0"),
        "huge_manifest": (tmp_path / "huge_manifest", _sparse_manifest,
                          f"{blob.MANIFEST_MAX_BYTES + 1} bytes, more than the 64 MiB a "
                          f"manifest may have"),
    }
    d = LiveDaemon(args=["--arena", "16M"])
    try:
        r = Raw(d.socket)
        assert isinstance(r.hello(model), P.HelloOk)  # lays out the slots for the big model
        refused_ms = {}
        for case, (folder, make, want) in cases.items():
            if make:
                make(folder)
            t = time.monotonic()
            bad = Raw(d.socket)
            reply = bad.hello(folder, pid=os.getpid())
            bad.close()
            assert isinstance(reply, P.Error) and reply.code == E.BAD_MODEL, (case, reply)
            assert want in reply.message and "\n" not in reply.message, (case, reply.message)
            refused_ms[case] = round((time.monotonic() - t) * 1e3, 1)
            assert refused_ms[case] < 10e3, case  # refused, not waited on
            p, _ = cli("status", "--json", "--socket", d.socket, "--timeout", "5")
            assert p.returncode == 0 and json.loads(p.stdout)["pid"] == d.pid, (case, p.stderr)
        reply = r.rt(P.Demand(r.req(), 1, 0, [0], 1))
        assert isinstance(reply, P.DemandOk)
        assert d.proc.poll() is None and "Traceback" not in d.logtext()
        r.close()
        emit("prep_boundary", {"refused_ms": refused_ms})
    finally:
        d.stop()


# ---- 4. `iod stop` ends a daemon in bounded time; `iod status --json` in every state


def test_stop_ends_a_sigstopped_daemon():
    folder = short_dir()
    sock = folder / "iod.sock"
    p, _ = cli("start", "--socket", sock, "--arena", "16M")
    assert p.returncode == 0, p.stderr
    pid = int((folder / "iod.lock").read_text())
    shm = (folder / "arena.name").read_text().split()[0]
    try:
        os.kill(pid, signal.SIGSTOP)
        p, _ = cli("status", "--json", "--socket", sock, "--timeout", "1")
        st = json.loads(p.stdout)
        assert p.returncode == 1 and st["running"] is True and st["pid"] == pid
        assert "no reply" in st["error"]
        grace = 3.0
        p, took = cli("stop", "--socket", sock, "--grace", grace)
        assert p.returncode == 0, p.stderr
        assert took < grace + 10  # the bound: grace, then SIGKILL and a few seconds
        wait_for(lambda: gone(pid), 5, "the daemon's exit")
        assert sorted(x.name for x in folder.iterdir()) == ["iod.log"]
        assert not shm_exists(shm)
        p, _ = cli("status", "--json", "--socket", sock)
        assert p.returncode == 1 and json.loads(p.stdout)["running"] is False
        emit("stop_sigstopped", {"grace_s": grace, "stop_s": round(took, 2)})
    finally:
        if not gone(pid):
            os.kill(pid, signal.SIGKILL)
        native.shm_unlink(shm)
        shutil.rmtree(folder)


def test_stop_kills_a_daemon_stuck_in_shutdown_and_cleans_up(model):
    """A read in flight at 2 KB/s holds the graceful shutdown (it lets
    reads finish): after the grace period SIGKILL, then the leftovers go."""
    d = LiveDaemon(args=["--arena", "16M", "--read-rate", "0.002"])
    try:
        shm = d.shm_name()
        r = Raw(d.socket)
        h = r.hello(model)
        r.send(P.Demand(r.req(), h.model_id, 2, [0], 1))  # a 300 KB record: minutes
        wait_for(lambda: r.rt(P.Stats(r.req())).stats["inflight_reads"] == 1, 10, "a read")
        p, took = cli("stop", "--socket", d.socket, "--grace", "1")
        assert p.returncode == 0, p.stderr
        assert one_line(p.stderr) == f"iod: pid {d.pid} did not stop within 1 s; sending SIGKILL"
        assert p.stdout.startswith(f"iod killed (pid {d.pid}); removed {shm}")
        assert d.proc.wait(5) == -signal.SIGKILL
        assert sorted(x.name for x in d.folder.iterdir()) == ["iod.log"]
        assert not shm_exists(shm)
        r.close()
        emit("stop_stuck", {"grace_s": 1, "stop_s": round(took, 2)})
    finally:
        d.stop()


def test_status_json_when_stopped():
    folder = short_dir()
    try:
        p, _ = cli("status", "--json", "--socket", folder / "iod.sock")
        assert p.returncode == 1
        assert json.loads(p.stdout) == {"running": False, "pid": None, "error": "not running",
                                        "socket": str(folder / "iod.sock")}
        assert one_line(p.stderr) == "iod is not running"
        p, _ = cli("stop", "--help")
        assert "--grace GRACE" in p.stdout and "(default: 10.0)" in p.stdout
    finally:
        shutil.rmtree(folder)


# ---- 6. bounded resources: the arena ---------------------------------------------


def in_small_shm(cmd, tmp_path, size="64m"):
    """Run ``cmd`` in a private mount namespace whose /dev/shm is a tmpfs
    of ``size``; returns (completed process, what was left in that /dev/shm)."""
    left = tmp_path / "left"
    script = (f'mount -t tmpfs -o size={size} tmpfs /dev/shm || exit 97; "$@"; rc=$?; '
              f'ls -A /dev/shm > {left}; exit $rc')
    p = subprocess.run(["unshare", "-m", "--propagation", "private", "sh", "-c", script, "sh",
                        *map(str, cmd)], capture_output=True, text=True, timeout=120)
    assert p.returncode != 97, p.stderr
    return p, left.read_text().split()


def test_arena_larger_than_shared_memory_fails_start_with_one_line(tmp_path):
    folder = short_dir()
    run = folder / "run"
    try:
        p, left = in_small_shm([PY, "-m", "iod.cli", "start", "--socket", run / "iod.sock",
                                "--arena", "100M"], tmp_path)
        assert p.returncode == 2
        assert one_line(p.stderr) == ("iod: --arena 100.0 MiB is more than 75% of the free space "
                                      "in /dev/shm (64.0 MiB free): at most 48.0 MiB here")
        assert left == [] and not run.exists()  # nothing made, nothing leaked
        # past the size check (free space shrank meanwhile): committing fails
        # at creation with one line, where ftruncate alone would have
        # succeeded and a later write faulted (SIGBUS)
        code = ("import os, native\n"
                "from iod.arena import Arena, ArenaError\n"
                "fd = os.open('/dev/shm/sparse', os.O_RDWR | os.O_CREAT, 0o600)\n"
                "os.ftruncate(fd, 100 << 20); os.close(fd); os.unlink('/dev/shm/sparse')\n"
                "print('ftruncate ok')\n"
                "try:\n    Arena(None, 100 << 20)\nexcept ArenaError as e:\n    print(e)\n")
        p, left = in_small_shm([PY, "-c", code], tmp_path)
        assert p.returncode == 0, p.stderr
        assert p.stdout.splitlines() == ["ftruncate ok", "an arena of 100 MiB cannot be committed "
                                         "in shared memory: No space left on device"]
        assert left == []
        # and one that fits starts and stops cleanly there
        code = ("import subprocess, sys\n"
                f"s = {str(run / 'iod.sock')!r}\n"
                "def c(*a):\n"
                "    return subprocess.run([sys.executable, '-m', 'iod.cli', *a, '--socket', s])\n"
                "sys.exit(c('start', '--arena', '40M').returncode or c('stop').returncode)\n")
        p, left = in_small_shm([PY, "-c", code], tmp_path)
        assert p.returncode == 0, p.stderr
        assert left == [] and sorted(os.listdir(run)) == ["iod.log"]
    finally:
        shutil.rmtree(folder)


def test_arena_size_bounds_are_usage_errors():
    folder = short_dir()
    try:
        for size, want in [("999G", "iod: --arena 999.0 GiB is more than 75% of "),
                           ("1k", "iod: --arena 1024 bytes is less than the minimum, 1036 KiB")]:
            p, _ = cli("start", "--socket", folder / "run" / "iod.sock", "--arena", size)
            assert p.returncode == 2 and one_line(p.stderr).startswith(want), p.stderr
        assert os.listdir(folder) == []
        p, _ = cli("start", "--help")
        assert p.returncode == 0 and "(default: 512M)" in " ".join(p.stdout.split())
    finally:
        shutil.rmtree(folder)


def test_close_does_not_wait_for_the_prefault():
    from iod.arena import Arena

    a = Arena(None, 512 << 20, prefault=True)
    name = a.name
    t = time.monotonic()
    a.close()
    took = time.monotonic() - t
    assert a.prefaulted_bytes < a.size, "the prefault ran to the end before close"
    assert not shm_exists(name)
    emit("prefault_close", {"arena_mb": 512, "close_s": round(took, 3),
                            "prefaulted_mb": a.prefaulted_bytes >> 20})
