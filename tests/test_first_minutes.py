"""What a new user, or one coming from mlx-lm, meets first: the quickstart's
hand-over, the dtype and memory defaults, mlx_lm.generate's flags, signals
at any moment, and run figures that say what they count."""

import json
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from shared.fixtures import daemons_under as _daemons_under, shm_entries, short_dir, wait_for

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PROMPT = "Write a list of colors: red, green, blue"


@pytest.fixture
def run_dir(monkeypatch):
    folder = short_dir("iodf-")
    monkeypatch.setenv("IOD_RUN_DIR", str(folder))
    yield folder
    shutil.rmtree(folder, ignore_errors=True)


def _left_behind(run_dir, daemons):
    """What a run left in its run dir, and the shared memory of its daemons
    (other tests' daemons have theirs)."""
    wait_for(lambda: not _daemons_under(run_dir), what="the private daemon gone")
    return sorted(p.name for p in run_dir.iterdir()), [n for d in daemons for n in shm_entries(d)]


# --- signals at any moment ------------------------------------------------------------------

EXIT = {signal.SIGINT: 130, signal.SIGTERM: 143, signal.SIGHUP: 129}
LINE = {signal.SIGINT: "infer run: interrupted", signal.SIGTERM: "infer run: terminated",
        signal.SIGHUP: "infer run: hung up"}


@pytest.mark.parametrize("where", ["close", "stop"])
@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM, signal.SIGHUP], ids=lambda s: s.name)
def test_a_signal_during_the_cleanup_waits_for_it(prep_model, run_dir, sig, where):
    """A signal that arrived while the session closed (as the run reached its
    last token) was raised in the middle of the close: the private daemon's
    run dir stayed. Sent here at the close's start and just before the run
    dir goes, twice: the run ends as that signal says, with nothing left."""
    code = textwrap.dedent(f"""
        import os, sys
        from infer.runtime import client
        from infer import run
        cls = client.IodClient
        name = {'close' if where == 'close' else '_stop_private'!r}
        real = getattr(cls, name)
        def signalled(self, *a):
            if self._private is not None or name == "close":
                print(self.daemon_pid, flush=True)
                os.kill(os.getpid(), {int(sig)})
                os.kill(os.getpid(), {int(sig)})
            return real(self, *a)
        setattr(cls, name, signalled)
        sys.exit(run.main(sys.argv[1:]))
    """)
    r = subprocess.run([sys.executable, "-c", code, "--model", str(prep_model("qwen3_moe")),
                        "-p", "hi", "-m", "4", "--json"],
                       capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert r.returncode == EXIT[sig], r.stderr
    assert r.stderr.strip().splitlines() == [LINE[sig]], r.stderr
    daemon = int(r.stdout.split()[0])
    assert daemon > 0 and _left_behind(run_dir, [daemon]) == ([], [])


def test_repeated_signals_at_varied_moments_leave_nothing(prep_model, run_dir):
    """Ctrl-C, SIGTERM or SIGHUP, twice in a row, from the first token to
    past the end of the run: whatever the moment, no run dir, daemon or
    shared memory is left, and the exit says what happened."""
    prep = str(prep_model("qwen3_moe"))
    sigs = [signal.SIGINT, signal.SIGTERM, signal.SIGHUP]
    ends = set()
    for i in range(9):
        sig = sigs[i % 3]
        proc = subprocess.Popen([sys.executable, "-m", "infer.cli", "run", "--model", prep, "-p", "hi",
                                 "-m", "40", "--ignore-chat-template"], stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True, start_new_session=True, cwd=ROOT)
        try:
            assert proc.stdout.readline() == "==========\n", proc.stderr.read()
            daemons = _daemons_under(run_dir)
            time.sleep(0.06 * i)  # the moments spread over the generation and its end
            for _ in range(2):
                try:  # SIGTERM to the process alone, as `timeout` sends it; the others to the group
                    os.kill(proc.pid, sig) if sig == signal.SIGTERM else os.killpg(proc.pid, sig)
                except ProcessLookupError:
                    break
                time.sleep(0.02)
            rc = proc.wait(timeout=60)
        finally:
            if proc.poll() is None:
                proc.kill()
        err = proc.stderr.read()
        # finished before the signal (0), stopped by it (one line), or hit
        # as the interpreter exited (the signal's default action)
        assert rc in (0, EXIT[sig], -sig), (i, rc, err)
        if rc == EXIT[sig]:
            assert err.strip().splitlines() == [LINE[sig]], err
        ends.add(rc)
        assert len(daemons) == 1 and _left_behind(run_dir, daemons) == ([], []), (i, sig, rc, err)
    assert ends & set(EXIT.values())  # some signals did stop a generation


# --- iod doctor under a run dir ---------------------------------------------------------------

def test_doctor_under_a_run_dir_sets_that_run_dirs_daemon_only(tmp_path):
    """With IOD_RUN_DIR set, the measurement is stored in that run dir and
    read by its daemon alone: before, it went to ~/.cache/iod/disk.json and
    set every later daemon's reader threads, whatever disk they read."""
    from shared import protocol as P
    from shared.fixtures import LiveDaemon, Raw

    mine, other = short_dir("iodd-"), short_dir("iodd-")
    env = {k: v for k, v in os.environ.items() if k != "IOD_DISK_PROFILE"}
    env.update(IOD_RUN_DIR=str(mine), XDG_CACHE_HOME=str(tmp_path / "cache"), HOME=str(tmp_path))
    try:
        r = subprocess.run([sys.executable, "-m", "iod.cli", "doctor", "--dir", str(tmp_path),
                            "--scratch", str(8 << 20), "--record-size", "65536", "--seconds", "0.05",
                            "--rounds", "1", "--depths", "1,2,3", "--json"],
                           capture_output=True, text=True, timeout=120, env=env)
        assert r.returncode == 0, r.stderr
        knee = json.loads(r.stdout)["knee_depth"]
        assert (mine / "disk.json").is_file() and not (tmp_path / "cache").exists()
        assert f"stored in {mine / 'disk.json'}: iod under this IOD_RUN_DIR prefetches {knee} at a time" \
            in r.stderr, r.stderr
        for folder, workers in ((mine, knee), (other, 4)):  # 4: the default, no profile
            d = LiveDaemon(folder=folder, args=["--arena", "16M"],
                           env={**env, "IOD_RUN_DIR": str(folder)})
            try:
                assert Raw(d.socket).rt(P.Stats(1)).stats["workers"] == workers, folder
            finally:
                d.stop()
    finally:
        shutil.rmtree(mine, ignore_errors=True)
        shutil.rmtree(other, ignore_errors=True)


# --- the quickstart's hand-over ---------------------------------------------------------------

def test_the_commands_the_quickstart_and_readme_give_work_as_pasted(tmp_path):
    """After scripts/quickstart.sh, `infer ...` answered "command not found":
    the commands live in .venv, and nothing said to activate it. The
    quickstart's last lines, pasted into a fresh shell started elsewhere
    (no .venv on PATH), generate; the README says the same before its first
    `infer` command."""
    import re

    env = dict(os.environ, WORK=str(tmp_path / "work"), MAX_TOKENS="4")
    r = subprocess.run([os.path.join(ROOT, "scripts", "quickstart.sh")], capture_output=True, text=True,
                       timeout=600, env=env, cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    pasted = [l.strip() for l in r.stdout.splitlines() if l.startswith("    ")]
    assert pasted[0].startswith("source ") and pasted[1].startswith("infer run "), r.stdout
    shell = {k: v for k, v in os.environ.items() if k not in ("VIRTUAL_ENV", "PYTHONPATH")}
    shell["PATH"] = os.pathsep.join(p for p in shell["PATH"].split(os.pathsep) if ".venv" not in p)
    assert subprocess.run(["bash", "-c", "command -v infer"], env=shell, capture_output=True).returncode != 0
    out = subprocess.run(["bash", "-c", "\n".join(pasted[:1] + [pasted[1] + " -m 4"])], env=shell,
                         capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert out.returncode == 0 and out.stdout.startswith("==========\n"), out.stderr

    readme = open(os.path.join(ROOT, "README.md")).read()
    blocks = re.findall(r"^```\n(.*?)^```", readme, re.S | re.M)
    lines = [l for b in blocks for l in b.splitlines()]
    first = next(i for i, l in enumerate(lines) if re.match(r"(infer|iod) ", l))
    assert "source .venv/bin/activate" in lines[:first], lines[:first]


# --- helpers for runs compared with mlx-lm --------------------------------------------------

def run_cli(args, timeout=300):
    return subprocess.run([sys.executable, "-m", "infer.cli", "run", *args], capture_output=True,
                          text=True, timeout=timeout, env=dict(os.environ), cwd=ROOT)


def run_json(args):
    r = run_cli([*args, "--json"])
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)


def one_line_exit_2(args):
    r = run_cli(args)
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 2 and len(lines) == 1 and lines[0].startswith("infer run: "), \
        (args, r.returncode, r.stderr)
    return lines[0]


def mlx_ids(src, prompt_ids=None, prompt=PROMPT, max_tokens=24, adapter_path=None, tokenizer_edit=None,
            seed=None, sampler=None, **kw):
    """mlx-lm's own ids (stream_generate, as mlx_lm.generate calls it), the
    eos token left out as infer run does; ``seed`` set before the load, as
    there; ``sampler(tokenizer)`` makes the sampler."""
    import mlx.core as mx
    from mlx_lm import load, stream_generate

    from infer.run import encode_prompt

    if seed is not None:
        mx.random.seed(seed)
    model, tokenizer = load(str(src), adapter_path=adapter_path)
    if sampler is not None:
        kw["sampler"] = sampler(tokenizer)
    if tokenizer_edit:
        tokenizer_edit(tokenizer)
    ids = prompt_ids(tokenizer) if prompt_ids else encode_prompt(tokenizer, prompt)
    out = []
    for r in stream_generate(model, tokenizer, ids, max_tokens=max_tokens, **kw):
        out.append(r.token)
    if r.finish_reason == "stop":
        out.pop()
    return out


# --- dtype auto -------------------------------------------------------------------------------

def test_dtype_auto_computes_a_16_bit_folder_in_float32_where_bfloat16_is_slow(synth_model, prep_model,
                                                                                tmp_path, run_dir):
    """On MLX's CPU backend on x86 a bfloat16 folder ran ~8x slower than with
    --dtype float32, and nothing said so: --dtype auto (the default) computes
    it in float32 there, with mlx-lm's float32 ids; elsewhere the folder's
    dtype. --dtype bfloat16 still keeps it. The choice is in --json and in
    the verbose block."""
    from mlx_lm.convert import convert

    from infer.args import resolve_dtype, slow_bfloat16

    src, prep = synth_model("qwen3_moe", dtype="bfloat16"), prep_model("qwen3_moe", dtype="bfloat16")
    assert resolve_dtype("auto", prep, slow=True)[0] == "float32"
    assert resolve_dtype("auto", prep, slow=False) == (None, "bfloat16 (auto: the folder's)")
    assert resolve_dtype("auto", prep_model("qwen3_moe"), slow=True)[0] is None  # float32 already
    assert resolve_dtype("bfloat16", prep, slow=True)[0] == "bfloat16"

    f32 = tmp_path / "f32"
    convert(str(src), str(f32), dtype="float32")
    slow = slow_bfloat16()  # True on this project's x86 CPU
    out = run_json(["--model", str(prep), "-p", PROMPT, "-m", "24"])
    assert out["tokens"] == mlx_ids(f32 if slow else src)
    assert out["stats"]["dtype"] == ("float32" if slow else "bfloat16")
    kept = run_json(["--model", str(prep), "-p", PROMPT, "-m", "24", "--dtype", "bfloat16"])
    assert kept["tokens"] == mlx_ids(src) and kept["stats"]["dtype"] == "bfloat16"
    assert kept["stats"]["dtype_choice"] == "bfloat16 (--dtype bfloat16)"
    r = run_cli(["--model", str(prep), "-p", PROMPT, "-m", "4"])
    assert r.returncode == 0, r.stderr
    settings = [l for l in r.stdout.splitlines() if l.startswith("Settings: ")]
    want = ("dtype float32 (auto: the folder's bfloat16 is slow on this CPU; --dtype bfloat16 keeps it)"
            if slow else "dtype bfloat16 (auto: the folder's)")
    assert len(settings) == 1 and settings[0].startswith(f"Settings: {want}; "), r.stdout


# --- --mem-budget auto ------------------------------------------------------------------------

def _files(root, tree):
    for name, text in tree.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)


def test_auto_budget_is_sized_from_the_memory_available(tmp_path):
    """MemAvailable, or less where a memory cgroup (v2 or v1, the tightest
    of the process's cgroup and its parents) leaves less, with the margin:
    80%, and at least 256 MiB left over."""
    from infer.runtime.budget import AUTO_RESERVE, AUTO_SHARE, auto_budget, available_memory

    G, M = 1 << 30, 1 << 20
    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemTotal:       16000000 kB\nMemFree:          500000 kB\n"
                       "MemAvailable:    8000000 kB\n")
    none = dict(meminfo=meminfo, cgroup=tmp_path / "no-cgroup-file", root=tmp_path / "no-root")
    assert available_memory(**none) == (8000000 * 1024, "MemAvailable")
    budget, why = auto_budget(**none)
    assert budget == int(8000000 * 1024 * AUTO_SHARE) and why == "80% of the 7.6 GiB available by MemAvailable"

    # cgroup v2: the parent's limit is the tighter; its inactive file pages are room
    v2 = tmp_path / "v2"
    _files(v2, {"user.slice/memory.max": f"{3 * G}\n", "user.slice/memory.current": f"{G}\n",
                "user.slice/memory.stat": f"anon {G}\ninactive_file {100 * M}\n",
                "user.slice/app/memory.max": "max\n", "user.slice/app/memory.current": f"{G}\n"})
    (tmp_path / "cgroup2").write_text("0::/user.slice/app\n")
    where = dict(meminfo=meminfo, cgroup=tmp_path / "cgroup2", root=v2)
    assert available_memory(**where) == (2 * G + 100 * M, f"the memory cgroup {v2 / 'user.slice'}'s limit")
    assert auto_budget(**where)[0] == int((2 * G + 100 * M) * AUTO_SHARE)

    # cgroup v1 (the memory controller's own hierarchy); "unlimited" is no limit
    v1 = tmp_path / "v1"
    _files(v1, {"memory/docker/abc/memory.limit_in_bytes": f"{2 * G}\n",
                "memory/docker/abc/memory.usage_in_bytes": f"{512 * M}\n",
                "memory/docker/abc/memory.stat": "total_inactive_file 0\n",
                "memory/memory.limit_in_bytes": "9223372036854771712\n",
                "memory/memory.usage_in_bytes": f"{G}\n"})
    (tmp_path / "cgroup1").write_text("5:cpu,cpuacct:/docker/abc\n4:memory:/docker/abc\n")
    assert available_memory(meminfo=meminfo, cgroup=tmp_path / "cgroup1", root=v1)[0] == 2 * G - 512 * M
    (tmp_path / "cgroup1-free").write_text("4:memory:/\n")
    assert available_memory(meminfo=meminfo, cgroup=tmp_path / "cgroup1-free", root=v1)[0] == 8000000 * 1024

    # a container sees its own cgroup as the mount's root, whatever its path says
    _files(tmp_path / "ns", {"memory.max": f"{G}\n", "memory.current": f"{256 * M}\n"})
    (tmp_path / "cgroup-ns").write_text("0::/kubepods/pod1/ctr\n")
    assert available_memory(meminfo=meminfo, cgroup=tmp_path / "cgroup-ns",
                            root=tmp_path / "ns")[0] == 768 * M

    # a small machine keeps its reserve; nothing known is one line
    meminfo.write_text("MemAvailable:     300000 kB\n")
    assert auto_budget(**none)[0] == 300000 * 1024 - AUTO_RESERVE
    meminfo.write_text("MemTotal: 1 kB\n")
    with pytest.raises(ValueError, match="--mem-budget auto: this system does not say"):
        auto_budget(**none)


def test_mem_budget_auto_and_a_default_that_would_not_fit(synth_model, prep_model, run_dir, monkeypatch,
                                                          capsys):
    """--mem-budget auto plans the session in 80% of the memory available
    and says so; without --mem-budget the cache is a quarter of the experts,
    unless the memory available would not hold that: then auto's plan, or
    the smallest where even that does not fit. Ids equal mlx-lm's each way."""
    from infer import run
    from infer.runtime import budget

    src, prep = synth_model("qwen3_moe"), str(prep_model("qwen3_moe"))
    want = mlx_ids(src)
    out = run_json(["--model", prep, "-p", PROMPT, "-m", "24", "--mem-budget", "auto"])
    assert out["tokens"] == want
    choice = out["stats"]["memory_choice"]
    assert choice.startswith("memory budget ") and " (auto: 80% of the " in choice, choice
    # the tiny model fits whole: its cache holds every expert, preloaded
    assert out["stats"]["misses"] == 0 and out["stats"]["preloaded_bytes"] == out["stats"]["bytes_read"] > 0

    def run_in(available):
        monkeypatch.setattr(budget, "auto_budget", lambda **kw: (available, "a test's figure"))
        rc = run.main(["--model", prep, "-p", PROMPT, "-m", "24", "--json"])
        captured = capsys.readouterr()
        assert rc == 0, captured.err
        return json.loads(captured.out)

    from shared.blob import Manifest

    manifest = Manifest.load(prep)
    quarter = budget.cached_expert_bytes(manifest) // 4
    floor = budget.minimum_budget(prep, manifest, context=budget.context_tokens(PROMPT, 24))
    roomy = run_in(1 << 40)
    assert roomy["stats"]["memory_choice"] == f"expert cache {budget.format_size(quarter)} (a quarter of the experts)"
    short = run_in(floor + quarter // 4)
    assert short["tokens"] == want and short["stats"]["cache_bytes"] < quarter
    assert "(auto: a test's figure; a quarter of the experts would not fit)" in short["stats"]["memory_choice"]
    none = run_in(floor // 2)
    assert none["tokens"] == want
    assert none["stats"]["memory_choice"].startswith(f"memory budget {budget.format_size(floor)}, the least "
                                                     f"this session takes (more than auto's ")


# --- mlx_lm.generate's flags ------------------------------------------------------------------

# reads enable_thinking (mlx-lm passes the tokenizer's has_thinking, False
# here, unless told otherwise) and a key of its own
THINKING_TEMPLATE = (
    "{%- if effort is defined %}{{- 'Effort: ' + effort + '\\n' }}{%- endif %}"
    "{%- for message in messages %}{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] "
    "+ '<|im_end|>' + '\\n' }}{%- endfor %}{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking %}{{- '<think>\\n' }}{%- endif %}{%- endif %}")


def _with_thinking_template(folder, dest):
    """A copy of ``folder`` whose chat template takes arguments, as Qwen3's does."""
    shutil.copytree(folder, dest)
    config = json.loads((dest / "tokenizer_config.json").read_text())
    config["chat_template"] = THINKING_TEMPLATE
    (dest / "tokenizer_config.json").write_text(json.dumps(config))
    return dest


def test_chat_template_config_prefill_response_and_escapes_as_mlx_lm_generate(synth_model, prep_model,
                                                                              tmp_path, run_dir):
    """--chat-template-config (Qwen3's {"enable_thinking": false}),
    --prefill-response, --system-prompt and \\n typed in -p give the text
    mlx_lm.generate itself prints for the same flags."""
    from infer.prep.prep import prep as make_prep

    src = _with_thinking_template(synth_model("qwen3_moe"), tmp_path / "src")
    prep = tmp_path / "prep"
    make_prep(src, prep, progress=False)
    flags = ["-p", "Name three colors:\\nred", "-m", "24", "--system-prompt", "Be brief.",
             "--chat-template-config", '{"effort": "low"}', "--prefill-response", "Sure, "]
    ours = run_json(["--model", str(prep), *flags])
    ref = subprocess.run([sys.executable, "-m", "mlx_lm", "generate", "--model", str(src), *flags,
                          "--verbose", "False"], capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert ref.returncode == 0, ref.stderr
    assert ours["text"] == ref.stdout[:-1]  # print's newline
    plain = run_json(["--model", str(prep), "-p", "Name three colors:\nred", "-m", "24",
                      "--system-prompt", "Be brief."])

    def prompt_ids(tokenizer):
        messages = [{"role": "system", "content": "Be brief."},
                    {"role": "user", "content": "Name three colors:\nred"},
                    {"role": "assistant", "content": "Sure, "}]
        text = tokenizer.apply_chat_template(messages, tokenize=False, continue_final_message=True,
                                             add_generation_prompt=False, effort="low")
        assert text.startswith("Effort: low\n") and text.endswith("assistant\nSure, ")
        return tokenizer.encode(text, add_special_tokens=False)

    assert ours["tokens"] == mlx_ids(src, prompt_ids) != plain["tokens"]
    # Qwen3's switch, the other way here: the answer opens with a think tag
    thinking = run_json(["--model", str(prep), "-p", "hi", "-m", "8", "--chat-template-config",
                         '{"enable_thinking": true}'])
    enable = lambda tok: tok.encode(tok.apply_chat_template(  # noqa: E731
        [{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True,
        enable_thinking=True), add_special_tokens=False)
    assert thinking["tokens"] == mlx_ids(src, enable, max_tokens=8)
    assert thinking["stats"]["prompt_tokens"] > run_json(["--model", str(prep), "-p", "hi", "-m", "8"])[
        "stats"]["prompt_tokens"]


def test_extra_eos_kv_bits_prefill_step_and_no_limit_as_mlx_lm(synth_model, prep_model, run_dir):
    """--extra-eos-token (an id or a token's text), --kv-bits with
    --kv-group-size and --quantized-kv-start, --prefill-step-size, and
    -m -1 (until the eos token) give mlx-lm's ids for the same arguments."""
    src, prep = synth_model("qwen3_moe"), str(prep_model("qwen3_moe"))
    base = run_json(["--model", prep, "-p", PROMPT, "-m", "24"])["tokens"]
    stop = base[6]
    cut = base[: base.index(stop)]
    for token in (str(stop), None):
        if token is None:  # its text, as the tokenizer spells it
            from mlx_lm import load

            token = load(str(src))[1]._tokenizer.convert_ids_to_tokens(stop)
        out = run_json(["--model", prep, "-p", PROMPT, "-m", "24", "--extra-eos-token", "99999", token]
                       if False else ["--model", prep, "-p", PROMPT, "-m", "24", "--extra-eos-token", token])
        assert out["tokens"] == cut == mlx_ids(src, tokenizer_edit=lambda t: t.add_eos_token(str(stop)))

    kv = run_json(["--model", prep, "-p", PROMPT, "-m", "24", "--kv-bits", "4", "--kv-group-size", "32",
                   "--quantized-kv-start", "20"])["tokens"]
    assert kv == mlx_ids(src, kv_bits=4, kv_group_size=32, quantized_kv_start=20) != base

    step = run_json(["--model", prep, "-p", PROMPT, "-m", "24", "--prefill-step-size", "5"])["tokens"]
    assert step == mlx_ids(src, prefill_step_size=5)

    ids = lambda tok: tok.encode("hi")  # noqa: E731  (the raw prompt, as --ignore-chat-template)
    endless = run_json(["--model", prep, "-p", "hi", "-m", "-1", "--ignore-chat-template"])
    assert endless["tokens"] == mlx_ids(src, ids, max_tokens=-1)
    assert 24 < len(endless["tokens"]) < 32768  # it ran to the eos token


def test_draft_model_as_mlx_lm_generate(synth_model, prep_model, run_dir):
    """--draft-model: mlx-lm's own speculative decoding with a model held in
    memory (here the streamed model's own folder), mlx-lm's ids, and its
    default of 3 draft tokens."""
    from mlx_lm import load

    src, prep = synth_model("qwen3_moe"), str(prep_model("qwen3_moe"))
    out = run_json(["--model", prep, "-p", PROMPT, "-m", "24", "--draft-model", str(src)])
    draft, _ = load(str(src))
    assert out["tokens"] == mlx_ids(src, draft_model=draft, num_draft_tokens=3)
    assert out["stats"]["draft"]["kind"] == "model" and out["stats"]["draft"]["from_draft"] > 0
    r = run_cli(["--model", prep, "-p", PROMPT, "-m", "8", "--draft-model", str(src)])
    assert r.returncode == 0 and f"Draft: {src}, " in r.stdout, r.stderr
    assert "a prep folder" in one_line_exit_2(["--model", prep, "--draft-model", prep])
    assert "not both" in one_line_exit_2(["--model", prep, "--draft-model", str(src), "--draft", "ngram"])


def _adapter(src, folder, keys):
    """An mlx-lm LoRA adapter of ``src``'s last two layers on ``keys``
    (None: mlx-lm's default, every linear layer, the experts' included),
    its lora_b random so that it changes the output."""
    import mlx.core as mx
    from mlx.utils import tree_flatten
    from mlx_lm import load
    from mlx_lm.tuner.utils import linear_to_lora_layers

    model, _ = load(str(src))
    params = {"rank": 4, "scale": 20.0, "dropout": 0.0, "keys": keys}
    linear_to_lora_layers(model, 2, params)
    mx.random.seed(3)
    weights = {k: (mx.random.normal(v.shape) * 0.2 if k.endswith("lora_b") else v)
               for k, v in tree_flatten(model.parameters()) if k.endswith(("lora_a", "lora_b"))}
    folder.mkdir()
    mx.save_safetensors(str(folder / "adapters.safetensors"), weights)
    (folder / "adapter_config.json").write_text(json.dumps(
        {"fine_tune_type": "lora", "num_layers": 2, "lora_parameters": params}))
    return folder


def test_adapter_path_as_mlx_lm_or_one_line_where_it_changes_the_experts(synth_model, prep_model, tmp_path,
                                                                         run_dir):
    src, prep = synth_model("qwen3_moe"), str(prep_model("qwen3_moe"))
    attention = _adapter(src, tmp_path / "attn", ["self_attn.q_proj", "self_attn.v_proj", "mlp.gate"])
    out = run_json(["--model", prep, "-p", PROMPT, "-m", "24", "--adapter-path", str(attention)])
    plain = run_json(["--model", prep, "-p", PROMPT, "-m", "24"])
    assert out["tokens"] == mlx_ids(src, adapter_path=str(attention)) != plain["tokens"]
    everything = _adapter(src, tmp_path / "all", None)
    line = one_line_exit_2(["--model", prep, "--adapter-path", str(everything)])
    assert "changes the experts (model.layers.2.mlp.switch_mlp and 1 more)" in line, line
    assert "adapter_config.json" in one_line_exit_2(["--model", prep, "--adapter-path", str(tmp_path)])


def test_mlx_lm_flag_misuse_is_one_line_exit_2(prep_model, synth_model, run_dir):
    prep = str(prep_model("qwen3_moe"))
    for args, word in [
        (["-m", "0"], "-1 for no limit"), (["--kv-bits", "7"], "--kv-bits"),
        (["--kv-group-size", "48"], "--kv-group-size"),
        (["--kv-bits", "4", "--max-kv-size", "64"], "rotating"), (["--kv-bits", "4", "--draft", "ngram"], "--draft"),
        (["--chat-template-config", "{bad"], "not JSON"), (["--chat-template-config", "[1]"], "JSON object"),
        (["--extra-eos-token", "no-such-token-here"], "not a token"),
        (["--draft-model", "/nonexistent"], "no config.json"),
        (["--prefill-step-size", "8", "--draft", "ngram"], "--prefill-step-size"),
        (["--xtc-threshold", "0.7"], "--xtc-threshold"),
    ]:
        line = one_line_exit_2(["--model", prep, "-m", "2", *args] if args[0] != "-m" else
                               ["--model", prep, *args])
        assert word in line, (args, line)


def test_seeded_sampling_xtc_and_min_tokens_to_keep_as_mlx_lm(synth_model, prep_model, run_dir):
    """--seed is set before the model is built, as mlx_lm.generate does (its
    layers' initial values draw from the random state): the same seed gives
    mlx-lm's samples; XTC and --min-tokens-to-keep sample as there."""
    from mlx_lm.sample_utils import make_sampler

    src, prep = synth_model("qwen3_moe"), str(prep_model("qwen3_moe"))
    out = run_json(["--model", prep, "-p", PROMPT, "-m", "24", "--temp", "1.0", "--xtc-probability", "0.5",
                    "--xtc-threshold", "0.05", "--min-p", "0.05", "--min-tokens-to-keep", "3", "--seed", "11"])

    def sampler(tokenizer):
        return make_sampler(1.0, 1.0, 0.05, 3, top_k=0, xtc_probability=0.5, xtc_threshold=0.05,
                            xtc_special_tokens=tokenizer.encode("\n") + list(tokenizer.eos_token_ids))

    assert out["tokens"] == mlx_ids(src, seed=11, sampler=sampler)
    # and as mlx_lm.generate's own command prints it, seeded before the model is built
    flags = ["-p", PROMPT, "-m", "24", "--temp", "0.9", "--top-k", "20", "--seed", "5"]
    ours = run_json(["--model", prep, *flags])
    ref = subprocess.run([sys.executable, "-m", "mlx_lm", "generate", "--model", str(src), *flags,
                          "--verbose", "False"], capture_output=True, text=True, timeout=300)
    assert ref.returncode == 0 and ours["text"] == ref.stdout[:-1], ref.stderr


# --- figures that say what they count ------------------------------------------------------------

def test_run_figures_say_what_they_count(prep_model, run_dir, tmp_path):
    """Before: "0 misses" beside "486 MiB read, 0.48 s stalled" (the read was
    the cache's preload), "MiB read" that were bytes copied from the arena,
    a peak RSS that counted a shared daemon's arena, and a prediction line
    that did not say what it compared. Now each figure says what it is."""
    import re

    from shared.fixtures import LiveDaemon

    prep = str(prep_model("qwen3_moe"))
    # a cache that holds every expert is preloaded: no misses, all of it copied at the start
    r = run_cli(["--model", prep, "-p", PROMPT, "-m", "8", "--mem-budget", "auto"])
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    experts = next(l for l in lines if l.startswith("Experts: "))
    m = re.fullmatch(r"Experts: (\d+) hits, 0 misses in the session's cache; (.+) copied into it "
                     r"\((.+) of it preloaded at the start\), [\d.]+ s waiting for records"
                     r"( \([\d.]+ s of it preloading\))?", experts)
    assert m and m.group(2) == m.group(3), experts
    assert re.fullmatch(r"Disk: .+ read by iod for this session \(its private daemon\)",
                        next(l for l in lines if l.startswith("Disk: "))), lines
    # a shared daemon: its reads are everyone's, its arena is its own memory
    daemon = LiveDaemon(run_dir, args=["--arena", "64M"])
    try:
        r = run_cli(["--model", prep, "-p", PROMPT, "-m", "8"])
        out = run_json(["--model", prep, "-p", PROMPT, "-m", "8"])
    finally:
        daemon.stop()
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    assert re.fullmatch(r"Disk: .+ read by the shared iod while this session ran \(for all its sessions\)",
                        next(l for l in lines if l.startswith("Disk: "))), lines
    memory = next(l for l in lines if l.startswith("Memory: "))
    assert re.fullmatch(r"Memory: peak RSS .+; at the end .+: .+ the session's own, .+ iod's shared arena "
                        r"mapped here \(the daemon's memory\)", memory), memory
    s = out["stats"]
    assert not s["daemon_private"] and s["rss_end_shared"] > 0 and s["peak_rss"] >= s["rss_end"] > s["rss_end_shared"]
    assert next(l for l in lines if l.startswith("Prediction ")).startswith(
        "Prediction (hinting iod the next layers' likely experts): on in ")


def test_the_profile_line_comes_after_the_text_and_its_figures(prep_model, run_dir, tmp_path):
    """`infer run --profile DIR`'s "profile in DIR" landed inside the text
    block (stderr, before the closing '=========='), in a terminal's view."""
    r = subprocess.run([sys.executable, "-m", "infer.cli", "run", "--model", str(prep_model("qwen3_moe")),
                        "-p", PROMPT, "-m", "8", "--profile", str(tmp_path / "prof")],
                       stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=300, cwd=ROOT)
    assert r.returncode == 0, r.stdout
    lines = r.stdout.splitlines()
    assert lines[-1] == f"infer run: profile in {tmp_path / 'prof'}", lines
    assert lines.count("==========") == 2 and lines.index("==========", 1) < len(lines) - 2
    assert (tmp_path / "prof" / "summary.json").is_file()
