"""`infer run`: generate text with a prep folder's experts streamed through iod."""

import argparse
import json
import resource
import sys

import mlx.core as mx
from mlx_lm.generate import stream_generate
from mlx_lm.sample_utils import make_sampler

from shared.units import format_size, parse_size

from .loader import PrepFolderError, check_prep_folder, load_streaming
from .speculative import DRAFTS, DraftedStream, check_draft


def build_parser():
    p = argparse.ArgumentParser(prog="infer run", description=__doc__)
    p.add_argument("--model", required=True, help="prep folder (made by `infer prep`)")
    p.add_argument("--prompt", default="Hello", help="prompt text ('-' reads stdin)")
    p.add_argument("--max-tokens", type=int, default=100)
    p.add_argument("--temp", type=float, default=0.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--iod", default="auto", help="'auto' or a daemon's socket file")
    p.add_argument("--mem-budget", default=None, help="bound on the session's memory, e.g. 4G")
    p.add_argument("--ignore-chat-template", action="store_true")
    p.add_argument("--system-prompt", default=None)
    p.add_argument("--json", action="store_true", help="print one JSON object instead")
    p.add_argument("--draft", default="none", choices=DRAFTS,
                   help="speculative decoding (greedy): n-gram lookup, the MTP head, or auto")
    p.add_argument("--num-draft", type=int, default=4, help="tokens drafted per verify pass")
    p.add_argument("--profile", metavar="DIR", default=None,
                   help="write trace.json, latency.png and summary.{json,md} of the expert requests")
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
    """The daemon's disk bytes so far (0 for sources without a daemon)."""
    stats = getattr(source, "stats", None)
    return stats()["counters"]["bytes_read"] if callable(stats) else 0


def session_stats(store, prompt_tps, decode_tps, n_prompt, n_tokens):
    stats = {
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
    }
    return stats


def summary_line(s):
    return (
        f"prompt: {s['prompt_tokens']} tokens, {s['prompt_tps']:.1f} tok/s | "
        f"decode: {s['generation_tokens']} tokens, {s['decode_tps']:.2f} tok/s | "
        f"peak memory {format_size(s['peak_rss'])} | experts: {s['hits']} hits, "
        f"{s['misses']} misses, {format_size(s['bytes_read'])} read"
    )


def cache_bytes_for(budget, model_dir, manifest, private_daemon=True):
    """Expert cache size that keeps the session within ``budget``."""
    from .budget import plan_memory

    return plan_memory(budget, model_dir, manifest, private_daemon).cache_bytes


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    from .budget import top_k
    from .client import DaemonDead, IodClient, IodError

    try:
        manifest = check_prep_folder(args.model)
        check_draft(args.draft, args.model, args.temp)
        cache_bytes, client_kw = None, {}
        if args.mem_budget is not None:
            from .budget import plan_memory, shared_daemon_running

            # a private daemon and its staging arena are part of the budget
            private = args.iod == "auto" and not shared_daemon_running()
            plan = plan_memory(parse_size(args.mem_budget), args.model, manifest, private)
            cache_bytes = plan.cache_bytes
            if private:
                client_kw["arena"] = plan.arena_bytes
    except (PrepFolderError, ValueError) as e:
        print(f"infer run: {e}", file=sys.stderr)
        return 2
    try:
        source = IodClient(args.model, iod=args.iod, working_set=top_k(args.model),
                           profile=bool(args.profile), **client_kw)
    except IodError as e:
        print(f"infer run: {e}", file=sys.stderr)
        return 2

    try:
        model, tokenizer, store = load_streaming(args.model, source, cache_bytes)
        profiler = None
        if args.profile:
            from .profile import attach

            profiler = attach(store, source)
        prompt = sys.stdin.read() if args.prompt == "-" else args.prompt
        ids = encode_prompt(tokenizer, prompt, args.ignore_chat_template, args.system_prompt)
        if args.seed is not None:
            mx.random.seed(args.seed)
        sampler = make_sampler(args.temp, args.top_p)
        disk_before = daemon_bytes_read(source)
        tokens, text = [], ""
        response = None
        if args.draft == "none":
            responses = stream_generate(
                model, tokenizer, ids, max_tokens=args.max_tokens, sampler=sampler
            )
        else:
            responses = DraftedStream(model, tokenizer, ids, args.model, store, args.draft,
                                      args.num_draft, args.max_tokens, manifest)
        for response in responses:
            tokens.append(response.token)
            if profiler:
                profiler.token()
            text += response.text
            if not args.json:
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
        stats["daemon_pid"] = getattr(source, "daemon_pid", 0)
        if profiler:
            profiler.write(args.profile, stats)
            print(f"infer run: profile in {args.profile}", file=sys.stderr)
    except DaemonDead as e:
        print(f"\ninfer run: the iod daemon went away: {e}", file=sys.stderr)
        return 1
    except IodError as e:
        print(f"\ninfer run: {e}", file=sys.stderr)
        return 1
    finally:
        source.close()

    if args.json:
        print(json.dumps({"tokens": tokens, "text": text, "stats": stats}))
    else:
        print()
        print(summary_line(stats), file=sys.stderr)
    return 0
