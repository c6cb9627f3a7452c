"""`infer serve` against hostile or careless clients: each test carries out
the attack for real against a server on 127.0.0.1 (the tiny synthetic model)
and checks that the attacker alone is refused, with a clear 4xx, while the
other clients' requests go on, token for token (docs/reliability.md,
section 10)."""

import http.client
import json
import os
import shutil
import signal
import socket
import subprocess
import sys

import pytest

from shared.fixtures import shm_entries, short_dir, wait_for
from tests.test_serve import PROMPT


def spawn(prep, env, *extra, log_level="WARNING"):
    """An `infer serve` with --iod auto (a private daemon where ``env``'s run
    dir has no shared one): (process, host:port)."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "infer.cli", "serve", "--model", str(prep), "--port", "0",
         "--log-level", log_level, *extra],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, start_new_session=True)
    line = proc.stdout.readline()
    if "listening on http://" not in line:
        proc.kill()
        raise AssertionError(f"no listening line: {line!r} {proc.stderr.read()}")
    return proc, line.strip().rsplit("/", 1)[-1]


def stop(proc):
    if proc.poll() is None:
        proc.kill()
        proc.wait()


def call(hostport, method, path, body=None, headers=None, timeout=60):
    """One request: (status, headers, body)."""
    host, port = hostport.split(":")
    c = http.client.HTTPConnection(host, int(port), timeout=timeout)
    try:
        if isinstance(body, (dict, list)):
            body = json.dumps(body)
        c.request(method, path, body=body, headers={"Content-Type": "application/json", **(headers or {})})
        r = c.getresponse()
        return r.status, {k.lower(): v for k, v in r.getheaders()}, r.read()
    finally:
        c.close()


def complete(hostport, body, timeout=60, path="/v1/completions"):
    status, _, data = call(hostport, "POST", path, body, timeout=timeout)
    return status, json.loads(data)


def test_busy_port_is_one_line_before_anything_loads(prep_model):
    """Issue 50 item 7: on a busy port the server said "Address already in
    use" without the port, then "loaded ...", as if it started."""
    folder = short_dir("iodb-")
    env = dict(os.environ, IOD_RUN_DIR=str(folder))
    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    port = taken.getsockname()[1]
    try:
        r = subprocess.run([sys.executable, "-m", "infer.cli", "serve", "--model", str(prep_model("qwen3_moe")),
                            "--port", str(port)], capture_output=True, text=True, env=env, timeout=120)
    finally:
        taken.close()
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 1 and len(lines) == 1, (r.returncode, r.stderr)
    assert lines[0].startswith(f"infer serve: cannot listen on 127.0.0.1:{port}: "), lines
    assert r.stdout == "" and not list(folder.iterdir())  # no daemon was started
    shutil.rmtree(folder, ignore_errors=True)


@pytest.mark.parametrize("sig,rc_want,line", [(signal.SIGTERM, 143, "infer serve: terminated"),
                                              (signal.SIGINT, 130, "infer serve: interrupted")])
def test_signal_is_one_line_and_leaves_no_daemon(prep_model, sig, rc_want, line):
    """Issue 50 item 7: SIGTERM ended the server with status 0 and nothing
    said. It is one line and 143, as for `infer run` (Ctrl-C: 130), with the
    private daemon, its run dir and its shared memory gone."""
    folder = short_dir("iods-")
    env = dict(os.environ, IOD_RUN_DIR=str(folder))
    proc, hp = spawn(prep_model("qwen3_moe"), env, "--dtype", "float32")
    try:
        status, reply = complete(hp, {"prompt": PROMPT, "max_tokens": 4})
        if status != 200:
            stop(proc)
            pytest.fail(f"{status} {reply} {proc.stderr.read()}")
        daemons = [int(p) for p in open(f"/proc/{proc.pid}/task/{proc.pid}/children").read().split()]
        assert len(daemons) == 1 and shm_entries(daemons[0])
        if sig == signal.SIGINT:
            os.killpg(proc.pid, sig)  # as Ctrl-C in a terminal: the daemon too
        else:
            proc.send_signal(sig)  # as `timeout` or a service manager does
        rc = proc.wait(timeout=60)
        err = proc.stderr.read()
    finally:
        stop(proc)
    assert rc == rc_want, err
    assert err.strip().splitlines() == [line], err
    wait_for(lambda: not os.path.exists(f"/proc/{daemons[0]}"), what="the private daemon gone")
    assert not shm_entries(daemons[0])
    assert not [p for p in folder.iterdir() if p.is_dir()]
    shutil.rmtree(folder, ignore_errors=True)
