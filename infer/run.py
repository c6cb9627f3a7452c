"""`infer run`: generate text with a prep folder's experts streamed through iod."""

import contextlib
import json
import os
import resource
import sys
from pathlib import Path

from shared.units import format_size, parse_size

from infer.args import (Parser, add_dtype, add_sampling, add_version, iod_target, positive_float, positive_int,
                   seed_int, str2bool)

EPILOG = ("mlx-lm's flags work as in mlx_lm.generate (-m is --max-tokens, -p is --prompt). "
          "Ctrl-C stops the generation (exit status 130).")


def build_parser():
    from infer.spec.decoder import DRAFTS

    p = Parser(prog="infer run", description=__doc__.split(": ", 1)[1], epilog=EPILOG)
    p.add_argument("--model", required=True, help="prep folder (made by `infer prep`)")
    p.add_argument("--prompt", "-p", default="Hello", help="prompt text ('-' reads stdin)")
    add_sampling(p)
    p.add_argument("--seed", type=seed_int, default=None, help="random seed for sampling")
    p.add_argument("--max-kv-size", type=positive_int, default=None,
                   help="keep at most this many tokens in the KV cache (rotating)")
    add_dtype(p)
    p.add_argument("--iod", type=iod_target, default="auto",
                   help="'auto' (the shared daemon, else a private one) or a daemon's socket file "
                        "('{rank}' in it: the rank's number under --ranks)")
    p.add_argument("--iod-timeout", type=positive_float, default=10.0, metavar="S",
                   help="seconds the daemon's loop may stand still (stopped, wedged) before the "
                        "session ends with one line; a slow disk is waited for")
    p.add_argument("--mem-budget", default=None,
                   help="bound on the session's memory, e.g. 4G (default: a quarter of the experts cached)")
    p.add_argument("--ignore-chat-template", action="store_true", help="use the raw prompt")
    p.add_argument("--system-prompt", default=None, help="system message for the chat template")
    p.add_argument("--verbose", type=str2bool, nargs="?", const=True, default=True,
                   help="print the text between '==========' lines and the stats (False: the text only)")
    p.add_argument("--json", action="store_true", help="print one JSON object instead")
    p.add_argument("--draft", default="none", choices=DRAFTS,
                   help="exact speculative decoding (greedy): n-gram lookup, the MTP head, or auto")
    p.add_argument("--num-draft-tokens", "--num-draft", dest="num_draft", type=positive_int, default=4,
                   help="tokens drafted per verify pass")
    p.add_argument("--profile", metavar="DIR", default=None,
                   help="write trace.json, latency.png and summary.{json,md} of the expert requests")
    p.add_argument("--ranks", type=positive_int, default=1, metavar="N",
                   help="run as N local ranks through mlx.launch (ring over loopback), the layers "
                        "split across them; over hosts: docs/distributed.md")
    add_version(p)
    return p


def encode_prompt(tokenizer, prompt, ignore_chat_template=False, system_prompt=None):
    """Prompt ids exactly as `mlx_lm.generate` makes them."""
    use_chat_template = not ignore_chat_template and tokenizer.has_chat_template
    if use_chat_template:
        messages = [{"role": "system", "content": system_prompt}] if system_prompt else []
        messages.append({"role": "user", "content": prompt})
        prompt = tokenizer.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=True
        )
    return tokenizer.encode(prompt, add_special_tokens=not use_chat_template)


def peak_rss_bytes():
    r = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return r if sys.platform == "darwin" else r * 1024


def daemon_bytes_read(source):
    """The daemon's disk bytes so far."""
    return source.stats()["counters"]["bytes_read"]


def session_stats(store, prompt_tps, decode_tps, n_prompt, n_tokens):
    import mlx.core as mx

    return {
        "prompt_tokens": n_prompt,
        "generation_tokens": n_tokens,
        "prompt_tps": prompt_tps,
        "decode_tps": decode_tps,
        "peak_rss": peak_rss_bytes(),
        "peak_mlx_memory": mx.get_peak_memory(),
        "hits": store.stats["hits"],
        "misses": store.stats["misses"],
        "bytes_read": store.stats["fetched_bytes"],
        "stall_s": store.stats["stall_s"],
        "prediction": store.prediction_stats(),
        "gate": store.gate.stats(),  # infer.runtime.gate: passes with prediction on and off
    }


def stats_lines(s):
    """mlx-lm's end-of-run block, then the expert figures (and the prediction
    gate's, once it has passes to tell of)."""
    lines = [
        f"Prompt: {s['prompt_tokens']} tokens, {s['prompt_tps']:.3f} tokens-per-sec",
        f"Generation: {s['generation_tokens']} tokens, {s['decode_tps']:.3f} tokens-per-sec",
        f"Peak memory: {s['peak_mlx_memory'] / 1e9:.3f} GB",
        f"Experts: {s['hits']} hits, {s['misses']} misses, {format_size(s['bytes_read'])} read, "
        f"{s['stall_s']:.3f} s stalled; peak RSS {s['peak_rss'] / 1e9:.3f} GB",
    ]
    g = s.get("gate") or {}
    passes = g.get("passes_on", 0) + g.get("passes_off", 0)
    if passes:
        line = f"Prediction: on in {g['passes_on']} of {passes} decode passes"
        ratio = g["probes"][-1]["off_over_on"] if g["probes"] else None
        if ratio:
            line += (f"; the last probe left it {'on' if g['on'] else 'off'} "
                     f"(a pass without it took {ratio:.2f}x the time of one with it)")
        lines.append(line)
    return lines


def check_profile_dir(folder):
    """Create ``--profile DIR`` now, so an unwritable one fails before the run."""
    path = Path(folder)
    try:
        path.mkdir(parents=True, exist_ok=True)
        probe = path / ".infer-write-test"
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as e:
        raise ValueError(f"--profile {folder}: cannot write there ({e.strerror or e})") from None


def read_stdin_prompt():
    try:
        return sys.stdin.buffer.read().decode("utf-8")
    except UnicodeDecodeError:
        raise ValueError("the prompt on stdin is not UTF-8 text") from None


def prep_folder_hint(model):
    """A one-line pointer when --model is a model folder that was not prepped."""
    p = Path(model)
    if p.is_dir() and (p / "config.json").is_file() and not (p / "manifest.json").exists():
        return f"; prep it first: infer prep --model {model} --out {p.name}-prep"
    if not p.exists() and "/" in model and not model.startswith((".", "/")):
        return "; infer run takes a prep folder: download the model, then `infer prep` it (see README)"
    return ""


def main(argv=None) -> int:
    from infer.runtime.distributed import leave_status

    args = build_parser().parse_args(argv)
    args.argv = sys.argv[1:] if argv is None else list(argv)  # for --ranks' ranks
    rc = _guarded(args)
    leave_status(rc)
    return rc


def _after_text(args):
    """A line break that ends streamed text before an error line (--json streams none)."""
    return "" if args.json else "\n"


class Terminated(BaseException):
    """SIGTERM (e.g. from `timeout`) or SIGHUP (its terminal closed): unwinds
    like Ctrl-C, so the client's close stops a private daemon and removes its
    run dir."""


class _Signals:
    """SIGINT, SIGTERM and SIGHUP end the run by an exception, except while
    the run cleans up (``held``): a signal then waits until the cleanup is
    done. Raised in the middle of the client's close, one left the private
    daemon's run dir behind."""

    def __init__(self):
        self.holding = 0
        self.pending = None

    def __call__(self, signum, frame):
        if self.holding:
            self.pending = self.pending or signum
            return
        raise _interrupt(signum)

    @contextlib.contextmanager
    def held(self):
        self.holding += 1
        try:
            yield
        finally:
            self.holding -= 1
            if not self.holding and self.pending is not None:
                signum, self.pending = self.pending, None
                raise _interrupt(signum)


def _interrupt(signum):
    import signal

    return KeyboardInterrupt() if signum == signal.SIGINT else Terminated(signum)


_SIGNALS = _Signals()


def _guarded(args) -> int:
    import signal

    caught = {}
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        # a caller's own handler wins (and an ignored SIGINT stays ignored)
        if signal.getsignal(sig) in (signal.SIG_DFL, signal.default_int_handler):
            caught[sig] = signal.signal(sig, _SIGNALS)
    try:
        return _main(args)
    except KeyboardInterrupt:
        # the client's close (in _main's finally) has already stopped a private daemon
        print("\ninfer run: interrupted", file=sys.stderr)
        return 130
    except Terminated as e:
        signum = e.args[0]
        try:  # a closed terminal may refuse the line
            print(f"\ninfer run: {'hung up' if signum == signal.SIGHUP else 'terminated'}",
                  file=sys.stderr)
        except OSError:
            pass
        return 128 + signum
    except BrokenPipeError:  # e.g. `infer run ... | head`: stop quietly
        sys.stdout = open(os.devnull, "w")
        return 0
    finally:
        for sig, old in caught.items():
            signal.signal(sig, old)


def _main(args) -> int:
    from infer.runtime import distributed
    from infer.runtime.loader import PrepFolderError, check_prep_folder
    from infer.spec.mtp import drafts_with_mtp
    from infer.spec.decoder import check_draft

    # every check that needs no model comes before loading one
    try:
        try:
            manifest = check_prep_folder(args.model)
        except PrepFolderError as e:
            raise ValueError(f"{e}{prep_folder_hint(args.model)}") from None
        check_draft(args.draft, args.model, args.temp)
        if args.max_kv_size is not None and args.draft != "none":
            raise ValueError("--max-kv-size works without --draft only")
        if args.profile:
            check_profile_dir(args.profile)
        prompt = read_stdin_prompt() if args.prompt == "-" else args.prompt
        try:
            prompt.encode("utf-8")
        except UnicodeEncodeError:
            raise ValueError("the prompt is not UTF-8 text") from None
        if not prompt and args.ignore_chat_template:
            raise ValueError("the prompt is empty")
        group = distributed.group()  # a rank of mlx.launch: this rank's layers only
        if args.ranks > 1 or group is not None:
            if args.draft != "none" or args.profile:
                raise ValueError("--ranks works without --draft and --profile")
            distributed.check_pipelined(args.model, args.ranks)
        if group is not None:
            manifest = distributed.rank_manifest(manifest, args.model, group)
            args.iod = args.iod.replace("{rank}", str(group.rank()))  # a daemon per rank
            distributed.quiet_unless_rank0()
        cache_bytes, client_kw, plan = None, {}, None
        if args.mem_budget is not None:
            from infer.runtime.budget import context_tokens, plan_session

            context = context_tokens(prompt, args.max_tokens, args.system_prompt, args.max_kv_size)
            plan, client_kw = plan_session(parse_size(args.mem_budget), args.model, manifest, args.iod,
                                           dtype=args.dtype, context=context,
                                           mtp_cache=drafts_with_mtp(args.draft, args.model))
            cache_bytes = plan.cache_bytes
    except ValueError as e:
        print(f"infer run: {e}", file=sys.stderr)
        return 2

    if args.ranks > 1 and not distributed.launched():
        stdin_prompt = ["--prompt", prompt] if args.prompt == "-" else []
        return distributed.launch("run", args.ranks, args.argv + stdin_prompt)

    from infer.runtime.budget import top_k
    from infer.runtime.client import DaemonDead, IodError
    from infer.runtime.source import make_source

    try:
        source = make_source(args.model, args.iod, working_set=top_k(args.model),
                             profile=bool(args.profile), timeout=args.iod_timeout, **client_kw)
    except IodError as e:
        print(f"infer run: {e}", file=sys.stderr)
        return 2
    try:
        stats, tokens, text = generate(args, source, manifest, prompt, cache_bytes, plan)
        if group is not None:
            stats = distributed.merge_stats(stats, manifest, group)
    except PrepFolderError as e:
        print(f"infer run: {e}", file=sys.stderr)
        return 2
    except DaemonDead as e:
        print(f"{_after_text(args)}infer run: the iod daemon went away: {e}", file=sys.stderr)
        return 1
    except IodError as e:
        print(f"{_after_text(args)}infer run: {e}", file=sys.stderr)
        return 1
    finally:
        with _SIGNALS.held():
            source.close()

    if args.json:
        print(json.dumps({"tokens": tokens, "text": text, "stats": stats}))
    elif args.verbose:
        print("\n==========")
        if not tokens:
            print("No text generated for this prompt")
        print("\n".join(stats_lines(stats)))
        if "ranks" in stats:
            print(distributed.pipeline_line(stats))
        if "draft" in stats:
            d = stats["draft"]
            print(f"Draft: {d['kind']}, {d['accept_len']:.2f} tokens per pass, "
                  f"acceptance {d['acceptance_rate']:.2f}")
    else:
        print()
    return 0


def generate(args, source, manifest, prompt, cache_bytes, plan=None):
    """Load, then stream the text to stdout; (stats, token ids, text).
    ``plan``: the ``--mem-budget`` plan (``infer.runtime.budget.MemoryPlan``) or None."""
    import mlx.core as mx
    from mlx_lm.generate import stream_generate
    from mlx_lm.sample_utils import make_sampler

    from infer.runtime import budget
    from infer.args import mx_dtype
    from infer.runtime.distributed import group
    from infer.runtime.loader import load_streaming
    from infer.spec.mtp import drafts_with_mtp
    from infer.spec.decoder import DraftedStream

    dtype = mx_dtype(args.dtype)
    if plan is not None:
        budget.limit_process(plan)
    # a memory plan counts an even split of the cache (budget._fill)
    model, tokenizer, store = load_streaming(args.model, source, cache_bytes, dtype=dtype,
                                             group=group(), mtp_cache=drafts_with_mtp(args.draft, args.model),
                                             whole_layers=plan is None)
    if plan is not None:
        budget.release_page_cache(args.model)
    profiler = None
    if args.profile:
        from infer.tools.profile import attach

        profiler = attach(store, source)
    ids = encode_prompt(tokenizer, prompt, args.ignore_chat_template, args.system_prompt)
    if args.seed is not None:
        mx.random.seed(args.seed)
    sampler = make_sampler(args.temp, args.top_p, args.min_p, top_k=args.top_k)
    disk_before = daemon_bytes_read(source)
    tokens, text = [], ""
    response = None
    if args.draft == "none":
        # within a budget, a prefill call's experts are bounded by its tokens
        step = {"prefill_step_size": plan.prefill_step} if plan is not None else {}
        responses = stream_generate(model, tokenizer, ids, max_tokens=args.max_tokens,
                                    sampler=sampler, max_kv_size=args.max_kv_size, **step)
    else:
        responses = DraftedStream(model, tokenizer, ids, args.model, store, args.draft,
                                  args.num_draft, args.max_tokens, manifest)
        mtp = responses.kwargs.get("mtp")
        if dtype is not None and mtp is not None:
            from infer.runtime.loader import cast_model

            cast_model(mtp.head, dtype)
    show = not args.json
    if show and args.verbose:
        print("==========", flush=True)
    for response in responses:
        tokens.append(response.token)
        if profiler:
            profiler.token()
        text += response.text
        if show:
            print(response.text, end="", flush=True)
    if response is not None and response.finish_reason == "stop":
        tokens.pop()  # the eos token is not part of the text
    stats = session_stats(
        store,
        response.prompt_tps if response else 0.0,
        response.generation_tps if response else 0.0,
        len(ids),
        len(tokens),
    )
    if args.draft != "none" and responses.stats is not None:
        stats["draft"] = responses.stats.summary()
    # shared by every session of the daemon: the others' reads count too
    stats["daemon_bytes_read"] = daemon_bytes_read(source) - disk_before
    stats["daemon_pid"] = source.daemon_pid
    if profiler:
        profiler.write(args.profile, stats)
        print(f"infer run: profile in {args.profile}", file=sys.stderr)
    return stats, tokens, text
