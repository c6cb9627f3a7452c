"""`infer serve` against hostile or careless clients: each test carries out
the attack for real against a server on 127.0.0.1 (the tiny synthetic model)
and checks that the attacker alone is refused, with a clear 4xx, while the
other clients' requests go on, token for token (docs/reliability.md,
section 10)."""

import http.client
import http.server
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time

import pytest
from mlx_lm import generate as mlx_generate
from mlx_lm import load as mlx_load

from shared.fixtures import LiveDaemon, shm_entries, short_dir, wait_for
from tests.test_serve import PROMPT, server_on_a_daemon, spawn_server, start_server

LONG = 600  # tokens the bystanders generate while the attacks come
NAN = float("nan")


def spawn(prep, env, *extra, log_level="WARNING"):
    """An `infer serve` with --iod auto (a private daemon where ``env``'s run
    dir has no shared one), in a session of its own: (process, host:port)."""
    return spawn_server(prep, env, *extra, log_level=log_level, new_session=True)


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


def stream(hostport, body, timeout=120):
    """A streamed completion: (its text, its raw events, whether it ended with [DONE])."""
    status, _, data = call(hostport, "POST", "/v1/completions", {**body, "stream": True}, timeout=timeout)
    assert status == 200, data
    events = [line[len("data: "):] for line in data.decode().split("\n") if line.startswith("data: ")]
    done = bool(events) and events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events if e != "[DONE]"]
    text = "".join(c["choices"][0]["text"] for c in chunks if c.get("choices"))
    return text, chunks, done


def rss(pid, children=True) -> int:
    """Resident bytes of ``pid`` (and its children: a private daemon)."""
    pids = [pid]
    if children:
        try:
            pids += [int(p) for p in open(f"/proc/{pid}/task/{pid}/children").read().split()]
        except OSError:
            pass
    total = 0
    for p in pids:
        try:
            for line in open(f"/proc/{p}/status"):
                if line.startswith("VmRSS:"):
                    total += int(line.split()[1]) * 1024
        except OSError:
            pass
    return total


class Peak:
    """The largest ``rss(pid)`` seen while the block runs, sampled every 10 ms."""

    def __init__(self, pid):
        self.pid, self.peak, self._done = pid, 0, threading.Event()

    def __enter__(self):
        self.before = rss(self.pid)
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()
        return self

    def _sample(self):
        while not self._done.is_set():
            self.peak = max(self.peak, rss(self.pid))
            time.sleep(0.01)

    def __exit__(self, *exc):
        self._done.set()
        self._thread.join()


def cpu_seconds(pid) -> float:
    fields = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


@pytest.fixture(scope="module")
def served(prep_model):
    """One server on a shared daemon, as users run it (no new option)."""
    prep = prep_model("qwen3_moe")
    folder, daemon, proc, hostport = server_on_a_daemon(prep, "iodh-")
    yield dict(proc=proc, hostport=hostport, prep=prep, daemon=daemon)
    stop(proc)
    daemon.stop()
    shutil.rmtree(folder, ignore_errors=True)


@pytest.fixture(scope="module")
def expected(synth_model):
    """mlx-lm's greedy text for PROMPT, the whole model in memory."""
    model, tokenizer = mlx_load(str(synth_model("qwen3_moe")))
    return {n: mlx_generate(model, tokenizer, tokenizer.encode(PROMPT), max_tokens=n) for n in (16, LONG)}


def vocab_of(prep):
    return json.loads((prep / "config.json").read_text())["vocab_size"]


def test_bad_sampling_parameters_are_400_and_the_batch_goes_on(served, expected):
    """Issue 52 item 2: top_k past the vocabulary, a NaN min_p, a context size
    of 10**12, an XTC threshold over 0.5 (and the like) raised on the
    generation thread: the connection closed with no reply, and every request
    generating beside it died too; the failed compiled sampler also left MLX's
    random state unusable for later sampled requests."""
    hp, vocab = served["hostport"], vocab_of(served["prep"])
    bad = [
        ({"top_k": 100000, "temperature": 1.0}, "top_k"),
        ({"top_k": vocab, "temperature": 1.0}, "top_k"),
        ({"min_p": NAN, "temperature": 1.0}, "min_p"),
        ({"temperature": NAN}, "temperature"),
        ({"temperature": float("inf")}, "temperature"),
        ({"top_p": NAN, "temperature": 1.0}, "top_p"),
        ({"repetition_penalty": 1.1, "repetition_context_size": 10 ** 12}, "repetition_context_size"),
        ({"presence_penalty": 0.5, "presence_context_size": 10 ** 12}, "presence_context_size"),
        ({"frequency_penalty": 0.5, "frequency_context_size": 10 ** 12}, "frequency_context_size"),
        ({"repetition_penalty": NAN}, "repetition_penalty"),
        ({"logit_bias": {"5": NAN}}, "logit_bias"),
        ({"xtc_probability": 0.5, "xtc_threshold": 0.7, "temperature": 1.0}, "xtc_threshold"),
        ({"prompt": ["two", "prompts"]}, "prompt"),
        ({"max_tokens": True}, "max_tokens"),
    ]
    results, started = [None] * 3, threading.Barrier(4, timeout=120)

    def bystander(i):
        try:
            # streamed: the first event says it is generating
            host, port = hp.split(":")
            c = http.client.HTTPConnection(host, int(port), timeout=300)
            c.request("POST", "/v1/completions", body=json.dumps(
                {"prompt": PROMPT, "max_tokens": LONG, "temperature": 0, "stream": True}))
            r = c.getresponse()
            lines, text, first = [], "", True
            for raw in r:
                line = raw.decode().strip()
                if not line.startswith("data: "):
                    continue
                if first:
                    started.wait()
                    first = False
                lines.append(line)
                if line != "data: [DONE]":
                    event = json.loads(line[len("data: "):])
                    text += "".join(c["choices"][0]["text"] for c in [event] if c.get("choices"))
            results[i] = (text, lines[-1] if lines else None, time.monotonic())
        except Exception as e:  # noqa: BLE001 - reported by the assertion below
            results[i] = (repr(e), None, time.monotonic())
            started.abort()

    threads = [threading.Thread(target=bystander, args=(i,)) for i in range(3)]
    for t in threads:
        t.start()
    started.wait()  # all three are generating
    for extra, word in bad:
        for streamed in (False, True):
            status, _, body = call(hp, "POST", "/v1/completions", json.dumps(
                {"prompt": PROMPT, "max_tokens": 8, "stream": streamed, **extra}))
            assert status == 400 and word in json.loads(body)["error"], (extra, status, body)
    refused = time.monotonic()
    for t in threads:
        t.join(timeout=300)
    for text, last, ended in results:
        assert (text, last) == (expected[LONG], "data: [DONE]")
        assert ended > refused  # the attacks came while it generated
    # the random state is whole: sampled requests (XTC too) are served
    for extra in ({"temperature": 1.0}, {"temperature": 1.0, "xtc_probability": 1.0, "xtc_threshold": 0.1},
                  {"temperature": 1.0, "top_k": vocab - 1, "min_p": 0.05}):
        status, body = complete(hp, {"prompt": PROMPT, "max_tokens": 8, **extra})
        assert status == 200 and body["usage"]["completion_tokens"] > 0, (extra, body)
    assert served["proc"].poll() is None


def test_stream_options_without_include_usage_ends_with_done(served, expected):
    """Issue 52 item 2: `stream_options: {}` cut the stream before [DONE]."""
    hp = served["hostport"]
    body = {"prompt": PROMPT, "max_tokens": 16, "temperature": 0}
    text, chunks, done = stream(hp, {**body, "stream_options": {}})
    assert done and text == expected[16] and not any("usage" in c for c in chunks)
    text, chunks, done = stream(hp, {**body, "stream_options": {"include_usage": True}})
    assert done and text == expected[16] and chunks[-1]["usage"]["completion_tokens"] == 16
    for options in ("yes", [], {"include_usage": "yes"}):
        status, reply = complete(hp, {**body, "stream": True, "stream_options": options})
        assert status == 400 and "stream_options" in reply["error"], (options, reply)


def test_image_part_is_400_and_nothing_is_fetched(served):
    """Issue 52 item 3: an image_url part made the server fetch that URL (a
    local address here) and read 8 MB into memory before answering 400."""
    hits = []

    class Image(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            hits.append(self.path)
            self.send_response(200)
            self.send_header("Content-Type", "image/png")
            self.send_header("Content-Length", str(8 << 20))
            self.end_headers()
            self.wfile.write(b"\0" * (8 << 20))

        def log_message(self, *a):
            pass

    web = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Image)
    threading.Thread(target=web.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{web.server_address[1]}/secret.png"
    parts = [{"type": "image_url", "image_url": {"url": url}},
             {"type": "image_url", "image_url": url},
             {"type": "input_image", "image_url": url},
             {"type": "image", "image": url},
             {"type": "input_audio", "input_audio": {"data": "AAAA", "format": "wav"}}]
    try:
        replies = [complete(served["hostport"], {"max_tokens": 4, "messages": [
            {"role": "user", "content": [{"type": "text", "text": "What is this?"}, part]}]},
            path="/v1/chat/completions") for part in parts]
    finally:
        web.shutdown()
        web.server_close()
    assert hits == []
    for part, (status, reply) in zip(parts, replies):
        assert status == 400 and "only text content parts" in reply["error"], (part, reply)
    status, reply = complete(served["hostport"], {"max_tokens": 4, "messages": [
        {"role": "user", "content": [{"type": "text", "text": "Hello"}, {"type": "text", "text": " there"}]}]},
        path="/v1/chat/completions")
    assert status == 200, reply


def test_no_cross_origin_access_by_default(served):
    """Issue 52 item 4: `Access-Control-Allow-Origin: *` let any web page
    drive the local server. Now no CORS header is sent, a preflight is 403,
    and a browser's request (it carries an Origin) is refused before it runs;
    a client that is no browser (no Origin) is served."""
    hp, evil = served["hostport"], {"Origin": "http://evil.example"}
    status, headers, _ = call(hp, "GET", "/health", headers=evil)
    assert status == 200 and "access-control-allow-origin" not in headers, headers
    status, headers, _ = call(hp, "OPTIONS", "/v1/completions", headers={
        **evil, "Access-Control-Request-Method": "POST", "Access-Control-Request-Headers": "content-type"})
    assert status == 403 and "access-control-allow-origin" not in headers, (status, headers)
    # a page needs no preflight for a text/plain POST: it is refused all the same
    body = json.dumps({"prompt": PROMPT, "max_tokens": 4})
    status, headers, reply = call(hp, "POST", "/v1/completions", body,
                                  headers={**evil, "Content-Type": "text/plain"})
    assert status == 403 and "--allow-origin" in json.loads(reply)["error"], (status, reply)
    assert "access-control-allow-origin" not in headers
    status, headers, _ = call(hp, "POST", "/v1/completions", body)
    assert status == 200 and "access-control-allow-origin" not in headers


@pytest.fixture(scope="module")
def configured(prep_model):
    """A server with the options of these tests: two origins allowed, a
    context of 128 tokens, bodies of 64 KiB at most."""
    folder = short_dir("iodo-")
    env = dict(os.environ, IOD_RUN_DIR=str(folder))
    daemon = LiveDaemon(folder, env=env)
    proc, hostport = start_server(prep_model("qwen3_moe"), daemon.socket, env, "--dtype", "float32",
                                  "--allow-origin", "http://a.example,http://b.example",
                                  "--allow-origin", "http://c.example",
                                  "--max-context", "128", "--max-body", "64K")
    yield dict(proc=proc, hostport=hostport)
    stop(proc)
    daemon.stop()
    shutil.rmtree(folder, ignore_errors=True)


def test_allowed_origins_only(configured):
    hp = configured["hostport"]
    for origin in ("http://a.example", "http://c.example"):
        status, headers, _ = call(hp, "OPTIONS", "/v1/chat/completions", headers={
            "Origin": origin, "Access-Control-Request-Method": "POST",
            "Access-Control-Request-Headers": "authorization, content-type"})
        assert status == 204 and headers["access-control-allow-origin"] == origin, headers
        assert "authorization" in headers["access-control-allow-headers"]
        status, headers, _ = call(hp, "POST", "/v1/completions", {"prompt": PROMPT, "max_tokens": 4},
                                  headers={"Origin": origin})
        assert status == 200 and headers["access-control-allow-origin"] == origin
    status, headers, _ = call(hp, "OPTIONS", "/v1/completions", headers={"Origin": "http://a.example.evil"})
    assert status == 403 and "access-control-allow-origin" not in headers
    status, _, _ = call(hp, "POST", "/v1/completions", {"prompt": PROMPT, "max_tokens": 4},
                        headers={"Origin": "null"})
    assert status == 403


def test_context_limit_and_default_max_tokens(configured):
    """--max-context: prompt and max_tokens together; a request that gives no
    max_tokens gets what the context leaves of the server's default."""
    hp = configured["hostport"]
    status, reply = complete(hp, {"prompt": PROMPT, "max_tokens": 129})
    assert status == 400 and "128" in reply["error"], reply
    status, reply = complete(hp, {"prompt": PROMPT, "max_tokens": 120})
    assert status == 400 and "128 tokens together" in reply["error"], reply
    status, reply = complete(hp, {"prompt": PROMPT, "temperature": 0, "logit_bias": {"2": -1e9}})
    assert status == 200, reply
    usage = reply["usage"]
    assert usage["prompt_tokens"] + usage["completion_tokens"] == 128, usage
    status, reply = complete(hp, {"prompt": "red green " * 200, "max_tokens": 1})
    assert status == 400 and "more than 128 tokens" in reply["error"], reply


def test_max_body(configured):
    hp = configured["hostport"]
    status, _, reply = call(hp, "POST", "/v1/completions", {"prompt": "x" * (64 << 10), "max_tokens": 1})
    assert status == 413 and "64.0 KiB" in json.loads(reply)["error"], reply
    status, reply = complete(hp, {"prompt": PROMPT, "max_tokens": 4})
    assert status == 200, reply


def test_oversized_body_is_413_unread(served):
    """Issue 52 item 5: a 64 MB body was read, parsed and tokenized (200,
    +169 MB). It is refused (413) before it is read."""
    hp, pid = served["hostport"], served["proc"].pid
    body = json.dumps({"prompt": "red green " * ((64 << 20) // 10), "max_tokens": 1})
    with Peak(pid) as peak:
        status, _, reply = call(hp, "POST", "/v1/completions", body, timeout=120)
    assert status == 413 and "--max-body" in json.loads(reply)["error"], reply[:200]
    assert peak.peak - peak.before < 16 << 20, (peak.before, peak.peak)
    for head in (b"Content-Length: -5\r\n", b"Content-Length: many\r\n", b""):
        s = socket.create_connection(tuple(hp.split(":")), timeout=30)
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n" + head + b"\r\n{}")
        reply = s.recv(65536)
        s.close()
        assert reply.startswith(b"HTTP/1.0 411" if not head else b"HTTP/1.0 400"), reply
    status, reply = complete(hp, {"prompt": PROMPT, "max_tokens": 4})
    assert status == 200


def test_prompt_past_the_context_is_400_without_tokenizing_it(served):
    """Issue 52 item 5: a prompt of ~500k tokens against the model's 32k
    context got no reply in 20 s, RSS 125 -> 565 MB. It is refused within the
    20 s, counted a piece at a time: RSS grows by the body held as bytes and
    text a few times over (~20 MB here), not by a million tokens."""
    hp, pid = served["hostport"], served["proc"].pid
    text = "red green blue sky " * 125000  # 2.4 MB, ~500k tokens
    for path, body in (("/v1/completions", {"prompt": text, "max_tokens": 8}),
                       ("/v1/chat/completions", {"messages": [{"role": "user", "content": text}],
                                                 "max_tokens": 8})):
        with Peak(pid) as peak:
            status, reply = complete(hp, body, timeout=20, path=path)
        assert status == 400 and "32768" in reply["error"], reply
        assert peak.peak - peak.before < 32 << 20, (peak.before, peak.peak)
    status, reply = complete(hp, {"prompt": PROMPT, "max_tokens": 4})
    assert status == 200


def test_max_tokens_past_the_context_is_400(served):
    """Issue 52 item 7: max_tokens 10**9 was accepted."""
    hp = served["hostport"]
    for n in (10 ** 9, 32769):
        status, reply = complete(hp, {"prompt": PROMPT, "max_tokens": n})
        assert status == 400 and "max_tokens" in reply["error"], reply
    status, reply = complete(hp, {"prompt": PROMPT, "max_tokens": 32768 - 5})
    assert status == 400 and "32768 tokens together" in reply["error"], reply


def _leave_after_start(hostport, body):
    """Send a request, wait until it generates (a second), close the connection."""
    s = socket.create_connection(tuple(hostport.split(":")), timeout=30)
    data = json.dumps(body).encode()
    s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
              + f"Content-Length: {len(data)}\r\n\r\n".encode() + data)
    time.sleep(1.0)
    s.close()


def test_a_client_that_leaves_stops_its_generation(served, expected):
    """Issue 52 item 7: after a client left, the server went on generating
    (max_tokens 10**9: for ever); a request served alone (a seed) kept the
    next request waiting: no reply in 20 s."""
    hp, pid = served["hostport"], served["proc"].pid
    never_eos = {"logit_bias": {"2": -100.0}}  # the random model's eos, sampled now and then
    _leave_after_start(hp, {"prompt": PROMPT, "max_tokens": 30000, "seed": 3, "temperature": 1.0, **never_eos})
    status, reply = complete(hp, {"prompt": PROMPT, "max_tokens": 16, "temperature": 0}, timeout=20)
    assert status == 200 and reply["choices"][0]["text"] == expected[16]
    # batched: the batch drops it, and the server goes idle
    _leave_after_start(hp, {"prompt": PROMPT, "max_tokens": 30000, "temperature": 1.0, **never_eos})

    def idle():
        before = cpu_seconds(pid)
        time.sleep(2.0)
        return cpu_seconds(pid) - before < 0.1

    wait_for(idle, timeout=30, what="the server idle after its client left")


def test_mem_budget_holds_across_concurrent_requests(prep_model):
    """Issue 52 item 6: `--mem-budget 200M` with 8 clients sending a 4,000
    token prompt each peaked at 1,458 MB (server and private daemon). The
    requests now wait for room in the KV cache the plan counted, prompts are
    prefilled one at a time in the plan's steps; RSS (the server's and its
    private daemon's) stays within the budget."""
    folder = short_dir("iodm-")
    env = dict(os.environ, IOD_RUN_DIR=str(folder))
    prep = prep_model("qwen3_moe")
    proc, hp = spawn(prep, env, "--dtype", "float32", "--mem-budget", "200M")
    try:
        words = "red green blue sky tree house river stone cloud light".split()
        prompts = [" ".join(words[(i * 7 + j * 3) % 10] for j in range(1950)) + f" {i}" for i in range(8)]
        replies = [None] * 8

        def one(i):
            replies[i] = complete(hp, {"prompt": prompts[i], "max_tokens": 8, "temperature": 0}, timeout=600)

        with Peak(proc.pid) as peak:
            threads = [threading.Thread(target=one, args=(i,)) for i in range(8)]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
        for status, reply in replies:
            assert status == 200 and 3800 <= reply["usage"]["prompt_tokens"] <= 4088, reply
        print(json.dumps({"check": "serve_mem_budget", "budget_mib": 200, "before_mib": peak.before >> 20,
                          "peak_mib": round(peak.peak / 2 ** 20, 1)}))
        assert peak.peak <= 200 << 20, peak.peak
    finally:
        stop(proc)
        shutil.rmtree(folder, ignore_errors=True)


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
