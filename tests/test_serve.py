"""`infer serve`: the openai client against a live server on a shared daemon.

One server subprocess (on a free port) is shared by the module's tests; its
greedy answers are compared with mlx-lm's on the same synthetic model held
whole in memory."""

import json
import os
import shutil
import signal
import socket
import subprocess
import sys

import pytest
from mlx_lm import generate as mlx_generate
from mlx_lm import load as mlx_load

from shared import protocol as P
from shared.fixtures import LiveDaemon, Raw, short_dir, wait_for

openai = pytest.importorskip("openai")

PROMPT = "Write a list of colors: red, green, blue"
N = 16


def spawn_server(prep, env, *extra, log_level="WARNING", new_session=False):
    """An `infer serve` on a free port, once it listens: (process, host:port)."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "infer.cli", "serve", "--model", str(prep), "--port", "0",
         "--log-level", log_level, *extra],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, start_new_session=new_session)
    line = proc.stdout.readline()
    if "listening on http://" not in line:
        proc.kill()
        raise AssertionError(f"no listening line: {line!r} {proc.stderr.read()}")
    return proc, line.strip().rsplit("/", 1)[-1]


def start_server(prep, sock, env, *extra):
    """``spawn_server`` on the daemon at ``sock``."""
    return spawn_server(prep, env, "--iod", str(sock), *extra)


def server_on_a_daemon(prep, prefix):
    """A daemon in a run dir of its own and an `infer serve` on it, --dtype
    float32 (on a float32 folder: the flag's path, same answers):
    (run dir, daemon, process, host:port)."""
    folder = short_dir(prefix)
    env = dict(os.environ, IOD_RUN_DIR=str(folder))
    daemon = LiveDaemon(folder, env=env)
    proc, hostport = start_server(prep, daemon.socket, env, "--dtype", "float32")
    return folder, daemon, proc, hostport


@pytest.fixture(scope="module")
def live(prep_model):
    prep = prep_model("qwen3_moe")
    folder, daemon, proc, hostport = server_on_a_daemon(prep, "iodv-")
    client = openai.OpenAI(base_url=f"http://{hostport}/v1", api_key="none", timeout=120,
                           max_retries=0)
    yield dict(daemon=daemon, proc=proc, hostport=hostport, client=client, prep=prep)
    if proc.poll() is None:
        proc.kill()
        proc.wait()
    daemon.stop()
    shutil.rmtree(folder, ignore_errors=True)


@pytest.fixture(scope="module")
def reference(synth_model):
    model, tokenizer = mlx_load(str(synth_model("qwen3_moe")))
    chat_ids = tokenizer.apply_chat_template(
        [{"role": "user", "content": PROMPT}], add_generation_prompt=True)
    return {
        "chat": mlx_generate(model, tokenizer, chat_ids, max_tokens=N),
        "text": mlx_generate(model, tokenizer, tokenizer.encode(PROMPT), max_tokens=N),
    }


def daemon_stats(daemon):
    r = Raw(daemon.socket)
    try:
        return r.rt(P.Stats(r.req())).stats
    finally:
        r.close()


def test_chat_completion(live, reference):
    r = live["client"].chat.completions.create(
        model="default_model", messages=[{"role": "user", "content": PROMPT}],
        max_tokens=N, temperature=0)
    assert r.choices[0].message.content == reference["chat"]
    assert r.usage.completion_tokens == N and r.choices[0].finish_reason == "length"


def test_chat_completion_streaming(live, reference):
    chunks = live["client"].chat.completions.create(
        model="default_model", messages=[{"role": "user", "content": PROMPT}],
        max_tokens=N, temperature=0, stream=True)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == reference["chat"]


def test_completion(live, reference):
    r = live["client"].completions.create(model="default_model", prompt=PROMPT, max_tokens=N,
                                          temperature=0)
    assert r.choices[0].text == reference["text"]


def test_completion_streaming(live, reference):
    chunks = live["client"].completions.create(model="default_model", prompt=PROMPT,
                                               max_tokens=N, temperature=0, stream=True)
    assert "".join(c.choices[0].text for c in chunks) == reference["text"]


def test_model_by_folder_path_and_unknown_model(live, reference):
    c = live["client"]
    r = c.completions.create(model=str(live["prep"]), prompt=PROMPT, max_tokens=N, temperature=0)
    assert r.choices[0].text == reference["text"]
    with pytest.raises(openai.APIStatusError):
        c.completions.create(model="someone/else", prompt=PROMPT, max_tokens=2)


def test_models_lists_the_served_folder_and_its_names_work(live, reference):
    """The openai client's models.list / models.retrieve; the listed id, the
    --model argument and the absolute path are accepted as request models."""
    c = live["client"]
    models = c.models.list()
    name = live["prep"].resolve().name
    assert [m.id for m in models.data] == [name]
    assert c.models.retrieve(name).id == name
    with pytest.raises(openai.NotFoundError):
        c.models.retrieve("someone-else")
    for model in (name, str(live["prep"].resolve())):
        r = c.completions.create(model=model, prompt=PROMPT, max_tokens=N, temperature=0)
        assert r.choices[0].text == reference["text"]


def test_server_is_a_session_of_the_shared_daemon(live):
    st = daemon_stats(live["daemon"])
    mine = [s for s in st["sessions"] if s["pid"] == live["proc"].pid]
    assert len(mine) == 1 and mine[0]["requests"] > 0
    assert st["counters"]["bytes_read"] > 0


def test_client_disconnect_mid_stream_leaves_server_and_daemon_unharmed(live, reference):
    host, port = live["hostport"].split(":")
    body = json.dumps({"prompt": PROMPT, "max_tokens": 5000, "stream": True}).encode()
    s = socket.create_connection((host, int(port)), timeout=60)
    s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
              + f"Content-Length: {len(body)}\r\n\r\n".encode() + body)
    got = b""
    while got.count(b"data: ") < 3:
        chunk = s.recv(4096)
        assert chunk, got
        got += chunk
    s.close()  # gone mid-stream
    # the server carries on: the next requests are answered exactly
    r = live["client"].completions.create(model="default_model", prompt=PROMPT, max_tokens=N,
                                          temperature=0)
    assert r.choices[0].text == reference["text"]
    assert live["proc"].poll() is None and live["daemon"].proc.poll() is None
    assert daemon_stats(live["daemon"])["counters"]["internal_errors"] == 0


def test_two_servers_share_the_daemon_and_sigterm_ends_one_cleanly(live, reference):
    env = dict(os.environ, IOD_RUN_DIR=str(live["daemon"].folder))
    proc, hostport = start_server(live["prep"], live["daemon"].socket, env)
    try:
        other = openai.OpenAI(base_url=f"http://{hostport}/v1", api_key="none", timeout=120,
                              max_retries=0)
        live["client"].completions.create(model="default_model", prompt=PROMPT, max_tokens=N,
                                          temperature=0)
        wait_for(lambda: (lambda st: st["queued_reads"] + st["inflight_reads"] == 0)(
            daemon_stats(live["daemon"])), what="no reads under way")
        reads = daemon_stats(live["daemon"])["counters"]["reads"]
        r = other.completions.create(model="default_model", prompt=PROMPT, max_tokens=N,
                                     temperature=0)
        assert r.choices[0].text == reference["text"]
        st = daemon_stats(live["daemon"])
        assert proc.pid in {s["pid"] for s in st["sessions"]}
        mine = next(s for s in st["sessions"] if s["pid"] == proc.pid)
        # the first server already brought in the records this prompt needs:
        # the second finds them in the arena with no message, and its few
        # demands and prefetches (records the first never needed) add few reads
        assert mine["misses"] <= reads // 4 and st["counters"]["reads"] - reads <= reads // 4
        proc.send_signal(signal.SIGTERM)
        rc = proc.wait(timeout=30)
        assert rc == 143, proc.stderr.read()[-4000:]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    wait_for(lambda: proc.pid not in {s["pid"] for s in daemon_stats(live["daemon"])["sessions"]},
             what="the stopped server's session gone")
    r = live["client"].completions.create(model="default_model", prompt=PROMPT, max_tokens=4)
    assert r.choices[0].text


def test_bad_input_is_one_line_exit_2(tmp_path, prep_model):
    prep = str(prep_model("qwen3_moe"))
    for args in (["--model", str(tmp_path), "--port", "0"], ["--model", prep, "--port", "70000"],
                 ["--model", prep, "--temp", "-1"], ["--model", prep, "--top-p", "7"],
                 ["--model", prep, "--max-tokens", "0"], ["--model", prep, "--dtype", "int4"],
                 ["--model", prep, "--chat-template-args", "[1, 2]"], ["--model", prep, "--iod", ""],
                 ["--model", prep, "--top-k", "1024"], ["--model", prep, "--max-body", "lots"],
                 ["--model", prep, "--max-context", "0"]):
        r = subprocess.run([sys.executable, "-m", "infer.cli", "serve", *args],
                           capture_output=True, text=True, timeout=60)
        lines = r.stderr.strip().splitlines()
        assert r.returncode == 2 and len(lines) == 1 and lines[0].startswith("infer serve: "), (args, r.stderr)


def test_concurrent_requests_are_batched_and_exact(live, reference):
    from concurrent.futures import ThreadPoolExecutor

    other = "Once upon a time"

    def one(prompt):
        return live["client"].completions.create(model="default_model", prompt=prompt,
                                                 max_tokens=N, temperature=0).choices[0].text

    alone = one(other)
    with ThreadPoolExecutor(4) as ex:
        outs = list(ex.map(one, [PROMPT, other, PROMPT, other]))
    assert outs == [reference["text"], alone, reference["text"], alone]


def post(hostport, path, body, content_type="application/json"):
    """One raw POST: (status, the reply's body)."""
    import http.client

    host, port = hostport.split(":")
    c = http.client.HTTPConnection(host, int(port), timeout=120)
    try:
        c.request("POST", path, body=body, headers={"Content-Type": content_type})
        r = c.getresponse()
        return r.status, r.read()
    finally:
        c.close()


def health(hostport):
    import urllib.request

    with urllib.request.urlopen(f"http://{hostport}/health", timeout=30) as r:
        return r.status


def test_empty_prompt_is_400_and_the_server_carries_on(live, reference):
    """An empty prompt once ended mlx-lm's generation thread: no reply, and
    every later request failed."""
    for stream in (False, True):
        status, body = post(live["hostport"], "/v1/completions",
                            json.dumps({"prompt": "", "max_tokens": 4, "stream": stream}))
        assert status == 400 and len(body.splitlines()) == 1, (status, body)
        assert "prompt is empty" in json.loads(body)["error"]
    assert health(live["hostport"]) == 200
    r = live["client"].completions.create(model="default_model", prompt=PROMPT, max_tokens=N,
                                          temperature=0)
    assert r.choices[0].text == reference["text"]
    assert live["proc"].poll() is None


def test_body_not_utf8_is_400(live, reference):
    status, body = post(live["hostport"], "/v1/completions", b'{"prompt": "\xff\xfe", "max_tokens": 4}')
    assert status == 400 and "UTF-8" in json.loads(body)["error"], (status, body)
    r = live["client"].completions.create(model="default_model", prompt=PROMPT, max_tokens=N,
                                          temperature=0)
    assert r.choices[0].text == reference["text"]


def test_out_of_range_parameters_are_400_and_the_server_carries_on(live, reference):
    """A logit_bias id past the vocabulary once indexed the logits out of
    bounds and killed the server (SIGSEGV); a negative seed and a stop that
    is no string failed after the headers (no reply, or a 500)."""
    vocab = json.loads((live["prep"] / "config.json").read_text())["vocab_size"]
    bad = [
        ({"logit_bias": {str(vocab): 5}}, "outside the vocabulary"),
        ({"logit_bias": {"99999999": 5}}, "outside the vocabulary"),
        ({"logit_bias": {"-1": 5}}, "outside the vocabulary"),
        ({"seed": -5}, "seed"),
        ({"seed": 2 ** 64}, "seed"),
        ({"stop": 123}, "stop"),
        ({"stop": ["a", 1]}, "stop"),
    ]
    for extra, word in bad:
        for stream in (False, True):
            status, body = post(live["hostport"], "/v1/completions", json.dumps(
                {"prompt": PROMPT, "max_tokens": 3, "stream": stream, **extra}))
            assert status == 400 and word in json.loads(body)["error"], (extra, status, body)
    assert live["proc"].poll() is None
    # in range, the same fields are served
    status, _ = post(live["hostport"], "/v1/completions", json.dumps(
        {"prompt": PROMPT, "max_tokens": 3, "seed": 7, "stop": ["zz"],
         "logit_bias": {str(vocab - 1): 0.0}}))
    assert status == 200
    r = live["client"].completions.create(model="default_model", prompt=PROMPT, max_tokens=N,
                                          temperature=0)
    assert r.choices[0].text == reference["text"]


def test_empty_messages_is_400(live, reference):
    for messages in ([], None, "hi"):
        status, body = post(live["hostport"], "/v1/chat/completions",
                            json.dumps({"messages": messages, "max_tokens": 4}))
        assert status == 400 and "messages" in json.loads(body)["error"], (messages, status, body)
    with pytest.raises(openai.BadRequestError):
        live["client"].chat.completions.create(model="default_model", messages=[], max_tokens=4)
    r = live["client"].chat.completions.create(
        model="default_model", messages=[{"role": "user", "content": PROMPT}],
        max_tokens=N, temperature=0)
    assert r.choices[0].message.content == reference["chat"]


def test_a_daemon_restarted_at_the_socket_is_reattached(prep_model, reference):
    """The server outlives its daemon: with the daemon gone a request fails
    (the server carries on); once a daemon answers at the socket again, the
    next request attaches there and is answered exactly."""
    folder = short_dir("iodw-")
    env = dict(os.environ, IOD_RUN_DIR=str(folder))
    # caches far smaller than the model: each request reads, and after the
    # first daemon dies that read needs a daemon (an arena hit needs none)
    arena = ["--arena", "2M"]  # 63 slots for 128 records
    first = LiveDaemon(folder, args=arena, env=env)
    proc, hostport = start_server(prep_model("qwen3_moe"), first.socket, env, "--dtype", "float32",
                                  "--mem-budget", "129M")
    second = None
    try:
        client = openai.OpenAI(base_url=f"http://{hostport}/v1", api_key="none", timeout=120,
                               max_retries=0)

        def ask():
            r = client.completions.create(model="default_model", prompt=PROMPT, max_tokens=N,
                                          temperature=0)
            return r.choices[0].text

        assert ask() == reference["text"]
        first.kill()
        with pytest.raises(openai.APIError):
            ask()
        assert proc.poll() is None
        second = LiveDaemon(folder, args=arena, env=env)
        assert ask() == reference["text"]
        st = daemon_stats(second)
        assert proc.pid in {s["pid"] for s in st["sessions"]} and st["counters"]["bytes_read"] > 0
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 143, proc.stderr.read()[-4000:]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        for d in (second, first):
            if d is not None and d.proc.poll() is None:
                d.stop()
        shutil.rmtree(folder, ignore_errors=True)


@pytest.mark.parametrize("arch", ["qwen3_moe", "qwen3_next"])
def test_layer_major_prefill_gives_mlx_lms_answer_and_reads_less(synth_model, prep_model, arch):
    """`--prefill layer-major`: a prompt of 19 chunks of 8 tokens passes each
    streamed layer chunk after chunk, and the answer is mlx-lm's with the
    same chunks (the model held whole); the daemon, whose arena holds a
    third of the records, reads less from the disk than for `chunked`.
    qwen3_next makes its mask from its first full-attention layer's cache,
    the last of the tiny model's four: a chunk starts only once the one
    ahead has reached the last layer, so its reads are not compared here
    (tests/test_prefill.py compares a session's reads on every architecture)."""
    prompt = " ".join(["Write a list of colors: red, green, blue, and then more of them"] * 6)
    model, tokenizer = mlx_load(str(synth_model(arch)))
    want = mlx_generate(model, tokenizer, tokenizer.encode(prompt), max_tokens=N, prefill_step_size=8)
    read = {}
    for mode in ("chunked", "layer-major"):
        folder = short_dir("iodl-")
        env = dict(os.environ, IOD_RUN_DIR=str(folder))
        daemon = LiveDaemon(folder, args=["--arena", "1792K", "--slot-size", "16K"], env=env)  # 48 slots
        proc = None
        try:
            proc, hostport = start_server(prep_model(arch), daemon.socket, env, "--dtype", "float32",
                                          "--prefill", mode, "--prefill-step-size", "8")
            client = openai.OpenAI(base_url=f"http://{hostport}/v1", api_key="none", timeout=120,
                                   max_retries=0)
            r = client.completions.create(model="default_model", prompt=prompt, max_tokens=N, temperature=0)
            assert r.usage.prompt_tokens > 8 * 18
            assert r.choices[0].text == want, mode
            read[mode] = daemon_stats(daemon)["counters"]["bytes_read"]
        finally:
            if proc is not None:
                proc.kill()
                proc.wait()
            daemon.stop()
            shutil.rmtree(folder, ignore_errors=True)
    if arch == "qwen3_moe":
        assert read["layer-major"] < 0.8 * read["chunked"], read


def test_layer_major_prefill_is_refused_with_a_memory_plan_or_ranks(prep_model):
    for extra in (["--mem-budget", "200M"], ["--ranks", "2"]):
        r = subprocess.run([sys.executable, "-m", "infer.cli", "serve", "--model", str(prep_model("qwen3_moe")),
                            "--prefill", "layer-major", *extra], capture_output=True, text=True, timeout=60)
        assert r.returncode == 2 and r.stderr.strip().splitlines() == [
            "infer serve: --prefill layer-major works without --mem-budget and --ranks"], r.stderr
