"""`infer run`: generate text with a prep folder's experts streamed through iod."""

import argparse
import contextlib
import json
import os
import resource
import struct
import sys
import time
from pathlib import Path

from shared.units import format_size, parse_size

from infer.args import (Parser, add_device_wait, add_dtype, add_prefill, add_sampling, add_version, first_line, iod_target, json_object,
                        nonneg_int, one_of, positive_float, positive_int, seed_int, str2bool, unit_float)
from infer.runtime.budget import AUTO_SHARE
from infer.runtime.device import path_line

EPILOG = ("mlx_lm.generate's flags work as there (-m is --max-tokens, -p is --prompt); the "
          "differences are in README.md. Ctrl-C stops the generation (exit status 130).")


def build_parser():
    from mlx_lm.generate import DEFAULT_QUANTIZED_KV_START

    from infer.spec.decoder import DRAFTS

    p = Parser(prog="infer run", description=__doc__.split(": ", 1)[1], epilog=EPILOG)
    p.add_argument("--model", required=True, help="prep folder (made by `infer prep`)")
    p.add_argument("--prompt", "-p", default="Hello",
                   help="prompt text ('-' reads stdin; \\n and \\t in it are a newline and a tab)")
    add_sampling(p, no_limit=True)
    p.add_argument("--xtc-probability", type=unit_float, default=0.0,
                   help="probability of XTC sampling for each token (0: off)")
    p.add_argument("--xtc-threshold", type=_xtc_threshold, default=0.1,
                   help="XTC drops the tokens above this probability but the least likely of them")
    p.add_argument("--min-tokens-to-keep", type=positive_int, default=1,
                   help="tokens min-p sampling keeps at least")
    p.add_argument("--seed", type=seed_int, default=None, help="random seed for sampling")
    p.add_argument("--max-kv-size", type=positive_int, default=None,
                   help="keep at most this many tokens in the KV cache (rotating)")
    p.add_argument("--kv-bits", type=one_of(2, 3, 4, 5, 6, 8), default=None,
                   help="quantize the KV cache to this many bits (default: not quantized)")
    p.add_argument("--kv-group-size", type=one_of(32, 64, 128), default=64,
                   help="group size of the KV cache's quantization")
    p.add_argument("--quantized-kv-start", type=nonneg_int, default=DEFAULT_QUANTIZED_KV_START,
                   help="with --kv-bits: quantize the KV cache from this many tokens on")
    p.add_argument("--prefill-step-size", type=positive_int, default=None,
                   help="prompt tokens per prefill call (default: 2048, or less where --mem-budget "
                        "needs it)")
    add_prefill(p)
    add_dtype(p)
    add_device_wait(p)
    p.add_argument("--iod", type=iod_target, default="auto",
                   help="'auto' (the shared daemon, else a private one) or a daemon's socket file "
                        "('{rank}' in it: the rank's number under --ranks)")
    p.add_argument("--iod-timeout", type=positive_float, default=10.0, metavar="S",
                   help="seconds the daemon's loop may stand still (stopped, wedged) before the "
                        "session ends with one line; a slow disk is waited for")
    p.add_argument("--mem-budget", default=None, metavar="SIZE|auto",
                   help="bound on the session's memory, e.g. 4G; auto: "
                        f"{AUTO_SHARE * 100:.0f}%% of the memory available (MemAvailable, or a memory "
                        "cgroup's limit; vm_stat on macOS). Default: a quarter of the experts "
                        "cached, or as auto where the memory available would not hold that")
    p.add_argument("--ignore-chat-template", action="store_true", help="use the raw prompt")
    p.add_argument("--system-prompt", default=None, help="system message for the chat template")
    p.add_argument("--chat-template-config", type=json_object, default=None, metavar="JSON",
                   help="more arguments for the chat template, e.g. '{\"enable_thinking\": false}'")
    p.add_argument("--prefill-response", default=None,
                   help="the start of the answer, continued by the model (with the chat template)")
    p.add_argument("--extra-eos-token", nargs="+", default=None, metavar="TOKEN",
                   help="more tokens that end the generation (a token's text or id)")
    p.add_argument("--verbose", type=str2bool, nargs="?", const=True, default=True,
                   help="print the text between '==========' lines and the stats (False: the text only)")
    p.add_argument("--json", action="store_true", help="print one JSON object instead")
    p.add_argument("--draft", default="none", choices=DRAFTS,
                   help="exact speculative decoding (greedy): n-gram lookup, the MTP head, or auto")
    p.add_argument("--draft-model", default=None, metavar="DIR",
                   help="speculative decoding with this mlx-lm model folder (held in memory), as "
                        "mlx_lm.generate does it")
    p.add_argument("--num-draft-tokens", "--num-draft", dest="num_draft", type=positive_int, default=None,
                   help="tokens drafted per verify pass (default: 3 with --draft-model, as mlx-lm; "
                        "4 with --draft)")
    p.add_argument("--adapter-path", default=None, metavar="DIR",
                   help="an mlx-lm LoRA/DoRA adapter (adapter_config.json, adapters.safetensors) "
                        "that leaves the experts as they are")
    p.add_argument("--profile", metavar="DIR", default=None,
                   help="write trace.json, latency.png and summary.{json,md} of the expert requests")
    p.add_argument("--ranks", type=positive_int, default=1, metavar="N",
                   help="run as N local ranks through mlx.launch (ring over loopback), the layers "
                        "split across them; over hosts: docs/distributed.md")
    add_version(p)
    return p


def _xtc_threshold(text):
    # mlx-lm's make_sampler refuses a threshold outside [0, 0.5]
    x = unit_float(text)
    if x > 0.5:
        raise argparse.ArgumentTypeError(f"must be <= 0.5 (got {text})")
    return x


_xtc_threshold.__name__ = "float"


def encode_prompt(tokenizer, prompt, ignore_chat_template=False, system_prompt=None,
                  prefill_response=None, template_kwargs=None):
    """Prompt ids exactly as `mlx_lm.generate` makes them: a system message,
    the start of the answer to continue, the chat template's own arguments."""
    use_chat_template = not ignore_chat_template and tokenizer.has_chat_template
    if use_chat_template:
        messages = [{"role": "system", "content": system_prompt}] if system_prompt is not None else []
        messages.append({"role": "user", "content": prompt})
        prefill = prefill_response is not None
        if prefill:
            messages.append({"role": "assistant", "content": prefill_response})
        prompt = tokenizer.apply_chat_template(
            messages, tokenize=False, continue_final_message=prefill,
            add_generation_prompt=not prefill, **(template_kwargs or {})
        )
    return tokenizer.encode(prompt, add_special_tokens=not use_chat_template)


def peak_rss_bytes():
    r = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return r if sys.platform == "darwin" else r * 1024


def rss_now():
    """(resident bytes, of which shared memory) of this process now, from
    /proc/self/status; None where there is none. The shared part is iod's
    arena (and pin table) as mapped here: the daemon's memory, which a
    memory cgroup charges to the daemon, not to this session."""
    try:
        fields = dict(line.split(":", 1) for line in Path("/proc/self/status").read_text().splitlines()
                      if ":" in line)
        return int(fields["VmRSS"].split()[0]) * 1024, int(fields["RssShmem"].split()[0]) * 1024
    except (OSError, KeyError, ValueError, IndexError):
        return None


def daemon_bytes_read(source):
    """The daemon's disk bytes so far."""
    return source.stats()["counters"]["bytes_read"]


def session_stats(store, prompt_tps, decode_tps, n_prompt, n_tokens, at_load=None):
    """The session's figures; ``at_load``: the store's figures when the model
    had loaded (the cache's preload), told apart from the generation's."""
    import mlx.core as mx

    at_load = at_load or {}
    rss = rss_now()
    peak = max(peak_rss_bytes(), rss[0] if rss else 0)  # the kernel's high-water mark lags a little
    return {
        "prompt_tokens": n_prompt,
        "generation_tokens": n_tokens,
        "prompt_tps": prompt_tps,
        "decode_tps": decode_tps,
        "peak_rss": peak,
        "rss_end": rss[0] if rss else None,
        "rss_end_shared": rss[1] if rss else None,  # iod's arena mapped here
        "peak_mlx_memory": mx.get_peak_memory(),
        "hits": store.stats["hits"],
        "misses": store.stats["misses"],
        # record bytes copied into the session's cache (from the daemon's
        # arena: read from disk or not), preload included
        "bytes_read": store.stats["fetched_bytes"],
        "preloaded_bytes": at_load.get("fetched_bytes", 0),
        "stall_s": store.stats["stall_s"],
        "preload_stall_s": at_load.get("stall_s", 0.0),
        "cache_bytes": store.cache_bytes,
        # which path the streamed layers took (infer.runtime.device)
        "device_wait": store.device is not None,
        "layer_calls": {"device": store.stats["device_calls"], "synced": store.stats["synced_calls"],
                        "whole": store.stats["whole_calls"]},
        "prediction": store.prefetcher.prediction_stats(),
        "gate": store.prefetcher.gate.stats(),  # infer.runtime.gate: passes with prediction on and off
    }


def stats_lines(s):
    """mlx-lm's end-of-run block, then what the experts cost (the cache, the
    disk, the process's memory), the prediction gate's choice once it has
    passes to tell of, and the settings chosen for the user."""
    lines = [
        f"Prompt: {s['prompt_tokens']} tokens, {s['prompt_tps']:.3f} tokens-per-sec",
        f"Generation: {s['generation_tokens']} tokens, {s['decode_tps']:.3f} tokens-per-sec",
        f"Peak memory: {s['peak_mlx_memory'] / 1e9:.3f} GB",
    ]
    pre, pre_s = s.get("preloaded_bytes", 0), s.get("preload_stall_s", 0.0)
    line = (f"Experts: {s['hits']} hits, {s['misses']} misses in the session's cache; "
            f"{format_size(s['bytes_read'])} copied into it")
    if pre and "ranks" not in s:
        line += f" ({format_size(pre)} of it preloaded at the start)"
    line += f", {s['stall_s']:.3f} s waiting for records"
    if pre_s and "ranks" not in s:
        line += f" ({pre_s:.3f} s of it preloading)"
    lines.append(line)
    if s.get("daemon_bytes_read") is not None:
        total = s["daemon_bytes_read"] + s.get("daemon_bytes_read_at_start", 0)
        if s.get("daemon_private"):
            line = f"Disk: {format_size(total)} read by iod for this session (its private daemon)"
        else:
            line = (f"Disk: {format_size(total)} read by the shared iod while this session ran "
                    f"(for all its sessions)")
        lines.append(line)
    line = f"Memory: peak RSS {format_size(s['peak_rss'])}"
    if s.get("rss_end") is not None:
        shared = s.get("rss_end_shared") or 0
        line += f"; at the end {format_size(s['rss_end'])}"
        if shared:
            line += (f": {format_size(s['rss_end'] - shared)} the session's own, {format_size(shared)} "
                     f"iod's shared arena mapped here (the daemon's memory)")
    lines.append(line)
    g = s.get("gate") or {}
    passes = g.get("passes_on", 0) + g.get("passes_off", 0)
    if passes:
        line = (f"Prediction (hinting iod the next layers' likely experts): on in {g['passes_on']} "
                f"of {passes} decode passes")
        probe = g["probes"][-1] if g["probes"] else None
        if probe and probe.get("off_over_on"):
            line += (f"; the last probe timed decode passes with and without it: without took "
                     f"{probe['off_over_on']:.2f}x the time, so it is {'on' if g['on'] else 'off'}")
        lines.append(line)
    if s.get("dtype_choice"):
        lines.append(f"Settings: dtype {s['dtype_choice']}; {s['memory_choice']}")
    if s.get("layer_calls"):
        lines.append(path_line(s["layer_calls"], s["device_wait"]))
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


class UsageError(ValueError):
    """Bad input found once the model has loaded (an --extra-eos-token the
    tokenizer lacks, a draft model with another vocabulary): exit status 2."""


def context_length(model_dir):
    """The model's context (max_position_embeddings), or None."""
    from infer.runtime.budget import model_config

    try:
        n = int(model_config(model_dir).get("max_position_embeddings") or 0)
    except (OSError, ValueError, TypeError):
        return None
    return n or None


def check_mlx_lm_flags(args, manifest):
    """mlx_lm.generate's flags that need no model: their combinations, the
    adapter (refused where it changes the streamed experts), the draft
    model's folder. Returns the adapter's config (or None)."""
    if args.kv_bits is not None and args.draft != "none":
        raise ValueError("--kv-bits works without --draft (with --draft-model it does)")
    if args.kv_bits is not None and args.max_kv_size is not None:
        raise ValueError("--kv-bits works without --max-kv-size (mlx-lm cannot quantize a rotating "
                         "KV cache)")
    if args.draft_model is not None:
        if args.draft != "none":
            raise ValueError("--draft-model or --draft, not both")
        if args.max_kv_size is not None:
            raise ValueError("--max-kv-size works without --draft-model (mlx-lm ignores it there)")
        folder = Path(args.draft_model)
        if (folder / "manifest.json").exists():
            raise ValueError(f"--draft-model {folder}: a prep folder; give the mlx-lm folder it was "
                             f"prepped from (a draft model is held in memory)")
        if not (folder / "config.json").is_file():
            raise ValueError(f"--draft-model {folder}: not an mlx-lm model folder (no config.json); "
                             f"download it first")
    if args.prefill_step_size is not None and args.draft != "none":
        raise ValueError("--prefill-step-size works without --draft")
    if args.num_draft is None:
        args.num_draft = 3 if args.draft_model is not None else 4  # mlx_lm.generate's 3
    if args.adapter_path is None:
        return None
    return read_adapter(args.adapter_path, manifest)


def _safetensors_names(path):
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(n))
    header.pop("__metadata__", None)
    return list(header)


def read_adapter(path, manifest):
    """An mlx-lm adapter's config, or ValueError: one that changes the
    experts cannot be applied, as they stream from the prep folder as it
    was prepped."""
    folder = Path(path)
    try:
        config = json.loads((folder / "adapter_config.json").read_text())
        names = _safetensors_names(folder / "adapters.safetensors")
    except OSError as e:
        raise ValueError(f"--adapter-path {path}: {e.filename or path}: {e.strerror or e}") from None
    except (ValueError, struct.error) as e:
        raise ValueError(f"--adapter-path {path}: not an mlx-lm adapter ({first_line(e)})") from None
    if not isinstance(config, dict) or ("lora_parameters" not in config and
                                        config.get("fine_tune_type") != "full"):
        raise ValueError(f"--adapter-path {path}: adapter_config.json has no lora_parameters")
    experts = sorted({l.module for l in manifest.layers
                      for n in names if n.startswith(l.module + ".")})
    if experts:
        more = f" and {len(experts) - 1} more" if len(experts) > 1 else ""
        raise ValueError(f"--adapter-path {path}: the adapter changes the experts ({experts[0]}{more}), "
                         f"which stream from the prep folder as prepped; fuse it into the model "
                         f"(mlx_lm.fuse) and prep that instead")
    return config


def apply_adapter(model, path, config):
    """mlx-lm's ``load_adapters``, its default layers taken outside the
    streamed experts (the adapter leaves them alone: ``read_adapter``)."""
    import mlx.core as mx
    import mlx.nn as nn
    from mlx.utils import tree_flatten
    from mlx_lm.models.switch_layers import QuantizedSwitchLinear, SwitchLinear
    from mlx_lm.tuner.utils import linear_to_lora_layers

    from infer.runtime.streaming import StreamingExperts

    kind = config.get("fine_tune_type", "lora")
    if kind != "full":
        params = dict(config["lora_parameters"])
        if params.get("keys") is None:  # mlx-lm's default: every linear layer of a block
            kinds = (nn.Linear, nn.QuantizedLinear, SwitchLinear, QuantizedSwitchLinear,
                     nn.Embedding, nn.QuantizedEmbedding)
            keys = set()
            for layer in model.layers:
                mods = layer.named_modules()
                streamed = [k for k, m in mods if isinstance(m, StreamingExperts)]
                keys.update(k for k, m in mods if (hasattr(m, "to_lora") or isinstance(m, kinds))
                            and not any(k == e or k.startswith(e + ".") for e in streamed))
            params["keys"] = keys
        try:
            linear_to_lora_layers(model, config["num_layers"], params, use_dora=kind == "dora")
        except (KeyError, ValueError, TypeError) as e:
            raise UsageError(f"--adapter-path {path}: {first_line(e)}") from None
    try:
        weights = mx.load(str(Path(path) / "adapters.safetensors"))
    except (OSError, ValueError, RuntimeError) as e:
        raise UsageError(f"--adapter-path {path}: adapters.safetensors: {first_line(e)}") from None
    have = dict(tree_flatten(model.parameters()))
    if kind != "full":
        have = {k: v for k, v in have.items() if k.rsplit(".", 1)[-1] in ("lora_a", "lora_b", "m")}
    for name, w in weights.items():
        if name not in have or have[name].shape != w.shape:
            raise UsageError(f"--adapter-path {path}: {name} is not a parameter of this model's "
                             f"adapter layers (or not of its shape)")
    model.load_weights(list(weights.items()), strict=False)
    model.eval()


def plan_memory_choice(args, manifest, prompt, group, mtp):
    """(plan or None, IodClient arguments, the cache bytes to load with or
    None for the default, the memory setting in words) for --mem-budget:
    a size, auto, or none (a quarter of the experts, or as auto where the
    memory available would not hold that)."""
    from infer.runtime.budget import (auto_budget, cached_expert_bytes, context_tokens, kv_bytes_per_token,
                                      plan_session, resident_bytes)
    from infer.runtime.loader import DEFAULT_CACHE_FRACTION

    planned = args.max_tokens if args.max_tokens > 0 else (context_length(args.model) or 4096)
    context = context_tokens(prompt + (args.prefill_response or ""), planned, args.system_prompt,
                             args.max_kv_size)
    extra = 0  # a draft model is held in memory beside the session
    if args.draft_model is not None:
        try:
            extra = resident_bytes(args.draft_model) + kv_bytes_per_token(args.draft_model) * context
        except (OSError, ValueError, TypeError) as e:
            raise ValueError(f"--draft-model {args.draft_model}: {first_line(e)}") from None

    def plan(budget):
        p, kw = plan_session(budget - extra, args.model, manifest, args.iod, dtype=args.dtype,
                             context=context, mtp_cache=mtp)
        return p, kw, p.cache_bytes

    if args.mem_budget not in (None, "auto"):
        budget = parse_size(args.mem_budget)
        p, kw, cache = plan(budget)
        return p, kw, cache, f"memory budget {format_size(budget)}, expert cache {format_size(cache)}"
    quarter = int(cached_expert_bytes(manifest, mtp) * DEFAULT_CACHE_FRACTION)
    default = f"expert cache {format_size(quarter)} (a quarter of the experts)"
    try:
        budget, why = auto_budget()
    except ValueError:
        if args.mem_budget == "auto":
            raise
        return None, {}, None, default  # nothing says what is available: the default as it is
    if group is not None:  # its ranks share this host's memory
        budget //= group.size()
    if args.mem_budget == "auto":
        try:
            p, kw, cache = plan(budget)
        except ValueError as e:
            raise ValueError(f"--mem-budget auto ({why}): {e}") from None
        return p, kw, cache, (f"memory budget {format_size(budget)} (auto: {why}), "
                              f"expert cache {format_size(cache)}")
    try:
        return _default_or_less(args, manifest, plan, budget, why, quarter, default, context, extra)
    except ValueError:  # a folder the planner cannot read: the load says what is wrong with it
        return None, {}, None, default


def _default_or_less(args, manifest, plan, budget, why, quarter, default, context, extra):
    """The default cache (a quarter of the experts) where auto's budget holds
    it; else auto's plan; else the smallest plan, which is what leaves the
    most memory to the machine."""
    from infer.runtime.budget import minimum_budget, shared_daemon_running

    try:
        p, kw, cache = plan(budget)
    except ValueError:
        p = None
    if p is not None and cache >= quarter:
        return None, {}, None, default
    if p is None:  # not even the smallest plan fits: take that one, and say so
        private = args.iod == "auto" and not shared_daemon_running()
        floor = minimum_budget(args.model, manifest, private, dtype=args.dtype, context=context) + extra
        p, kw, cache = plan(floor)
        return p, kw, cache, (f"memory budget {format_size(floor)}, the least this session takes "
                              f"(more than auto's {format_size(budget)}: {why}), "
                              f"expert cache {format_size(cache)}")
    return p, kw, cache, (f"memory budget {format_size(budget)} (auto: {why}; a quarter of the experts "
                          f"would not fit), expert cache {format_size(cache)}")


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
        adapter = check_mlx_lm_flags(args, manifest)
        if args.profile:
            check_profile_dir(args.profile)
        # as mlx_lm.generate: \n and \t typed in -p are a newline and a tab
        prompt = read_stdin_prompt() if args.prompt == "-" else \
            args.prompt.replace("\\n", "\n").replace("\\t", "\t")
        try:
            prompt.encode("utf-8")
        except UnicodeEncodeError:
            raise ValueError("the prompt is not UTF-8 text") from None
        if not prompt and args.ignore_chat_template:
            raise ValueError("the prompt is empty")
        group = distributed.group()  # a rank of mlx.launch: this rank's layers only
        if args.ranks > 1 or group is not None:
            if args.draft != "none" or args.profile or args.draft_model:
                raise ValueError("--ranks works without --draft, --draft-model and --profile")
            distributed.check_pipelined(args.model, args.ranks)
        if group is not None:
            manifest = distributed.rank_manifest(manifest, args.model, group)
            args.iod = args.iod.replace("{rank}", str(group.rank()))  # a daemon per rank
            distributed.quiet_unless_rank0()
        plan, client_kw, cache_bytes, args.memory_choice = plan_memory_choice(
            args, manifest, prompt, group, drafts_with_mtp(args.draft, args.model))
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
        stats, tokens, text = generate(args, source, manifest, prompt, cache_bytes, plan, adapter)
        if group is not None:
            stats = distributed.merge_stats(stats, manifest, group)
    except (PrepFolderError, UsageError) as e:  # both found before any text
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
            if d["kind"] == "model":
                print(f"Draft: {args.draft_model}, {d['from_draft']} of {d['tokens']} tokens "
                      f"drafted and accepted")
            else:
                print(f"Draft: {d['kind']}, {d['accept_len']:.2f} tokens per pass, "
                      f"acceptance {d['acceptance_rate']:.2f}")
    else:
        print()
    if args.profile:  # after the text and its figures, not inside them
        sys.stdout.flush()
        print(f"infer run: profile in {args.profile}", file=sys.stderr)
    return 0


def generate(args, source, manifest, prompt, cache_bytes, plan=None, adapter=None):
    """Load, then stream the text to stdout; (stats, token ids, text).
    ``plan``: the ``--mem-budget`` plan (``infer.runtime.budget.MemoryPlan``)
    or None; ``adapter``: the --adapter-path config (``read_adapter``)."""
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
    disk_start = daemon_bytes_read(source)
    # as mlx_lm.generate, before the model is built: its layers' initial
    # values draw from the random state (as many draws as mlx-lm's load),
    # and so do an adapter's and a draft model's
    if args.seed is not None:
        mx.random.seed(args.seed)
    # a memory plan hands the cache the per-layer capacities it counted (budget._fill)
    model, tokenizer, store = load_streaming(args.model, source, cache_bytes, dtype=dtype,
                                             group=group(), mtp_cache=drafts_with_mtp(args.draft, args.model),
                                             capacity=plan.capacity if plan is not None else None,
                                             device_wait=args.device_wait)
    at_load = dict(store.stats)  # the preload's
    if plan is not None:
        budget.release_page_cache(args.model)
    if adapter is not None:
        apply_adapter(model, args.adapter_path, adapter)
    for token in args.extra_eos_token or ():
        try:
            tokenizer.add_eos_token(token)
        except ValueError:
            raise UsageError(f"--extra-eos-token: {token!r} is not a token of this tokenizer") from None
    profiler = None
    if args.profile:
        from infer.tools.profile import attach

        profiler = attach(store, source)
    ids = encode_prompt(tokenizer, prompt, args.ignore_chat_template, args.system_prompt,
                        args.prefill_response, args.chat_template_config)
    draft_model = load_draft_model(args.draft_model, tokenizer, dtype) if args.draft_model else None
    sampler = make_sampler(args.temp, args.top_p, args.min_p, args.min_tokens_to_keep, top_k=args.top_k,
                           xtc_probability=args.xtc_probability, xtc_threshold=args.xtc_threshold,
                           xtc_special_tokens=tokenizer.encode("\n") + list(tokenizer.eos_token_ids))
    disk_before = daemon_bytes_read(source)
    # -1: until the eos token, or the model's context where the KV cache does not rotate
    limit = args.max_tokens
    if limit < 0 and args.max_kv_size is None and context_length(args.model):
        limit = max(1, context_length(args.model) - len(ids))
    tokens, text = [], ""
    response = None
    rest = ids  # the prompt tokens mlx-lm's generation prefills (layer-major: the last)
    if args.draft == "none":
        # within a budget, a prefill call's experts are bounded by its tokens
        step = plan.prefill_step if plan is not None else 2048
        if args.prefill_step_size is not None:
            step = min(step, args.prefill_step_size) if plan is not None else args.prefill_step_size
        kv = {"kv_bits": args.kv_bits, "kv_group_size": args.kv_group_size,
              "quantized_kv_start": args.quantized_kv_start} if args.kv_bits is not None else {}
        draft = {"draft_model": draft_model, "num_draft_tokens": args.num_draft} if draft_model else {}
        cache = None
        if args.prefill == "layer-major" and not kv and not draft and plan is None:
            # the prompt but its last token, as mlx-lm would (the same chunks); mlx-lm
            # goes on from the cache, its prompt rate then counts this part too. (Not
            # under a memory plan: a layer's experts kept for the chunks behind are
            # more than the plan's prefill step counts.)
            from mlx_lm.models.cache import make_prompt_cache

            from infer.runtime.prefill import prefill

            t0 = time.perf_counter()
            cache = make_prompt_cache(model, max_kv_size=args.max_kv_size)
            rest = prefill(model, store, ids, cache, step)
            prefill_s = time.perf_counter() - t0
        responses = stream_generate(model, tokenizer, rest, max_tokens=limit, sampler=sampler,
                                    max_kv_size=args.max_kv_size, prefill_step_size=step,
                                    prompt_cache=cache, **kv, **draft)
    else:
        responses = DraftedStream(model, tokenizer, ids, args.model, store, args.draft,
                                  args.num_draft, limit, manifest)
        mtp = responses.kwargs.get("mtp")
        if dtype is not None and mtp is not None:
            from infer.runtime.loader import cast_model

            cast_model(mtp.head, dtype)
    show = not args.json
    if show and args.verbose:
        print("==========", flush=True)
    from_draft = 0
    for response in responses:
        tokens.append(response.token)
        from_draft += bool(getattr(response, "from_draft", False))
        if profiler:
            profiler.token()
        text += response.text
        if show:
            print(response.text, end="", flush=True)
    if response is not None and response.finish_reason == "stop":
        tokens.pop()  # the eos token is not part of the text
    prompt_tps = response.prompt_tps if response else 0.0
    if response is not None and len(rest) < len(ids):
        prompt_tps = len(ids) / (prefill_s + len(rest) / response.prompt_tps)
    stats = session_stats(
        store,
        prompt_tps,
        response.generation_tps if response else 0.0,
        len(ids),
        len(tokens),
        at_load,
    )
    if args.draft != "none" and responses.stats is not None:
        stats["draft"] = responses.stats.summary()
    if draft_model is not None:
        stats["draft"] = {"kind": "model", "from_draft": from_draft, "tokens": len(tokens)}
    # read by the daemon while the model loaded (the preload's), then while
    # it generated; a shared daemon's other sessions count too
    stats["daemon_bytes_read_at_start"] = disk_before - disk_start
    stats["daemon_bytes_read"] = daemon_bytes_read(source) - disk_before
    stats["daemon_private"] = getattr(source, "_private", None) is not None
    stats["daemon_pid"] = source.daemon_pid
    stats["dtype"] = args.dtype or budget.folder_dtype(args.model)
    stats["dtype_choice"] = args.dtype_choice
    stats["memory_choice"] = args.memory_choice
    if profiler:
        profiler.write(args.profile, stats)
    return stats, tokens, text


def load_draft_model(path, tokenizer, dtype):
    """mlx_lm.generate's --draft-model: the folder loaded whole, its
    vocabulary the model's (UsageError otherwise), at the compute dtype
    (it only proposes tokens: greedy output is the model's either way)."""
    from mlx_lm import load as mlx_load

    from infer.runtime.loader import cast_model

    try:
        draft, draft_tokenizer = mlx_load(str(path))
    except Exception as e:  # mlx-lm's own errors are of many kinds: one line each
        raise UsageError(f"--draft-model {path}: does not load: {first_line(e)}") from None
    if draft_tokenizer.vocab_size != tokenizer.vocab_size:
        raise UsageError(f"--draft-model {path}: its tokenizer is not the model's "
                         f"({draft_tokenizer.vocab_size} tokens, the model's has {tokenizer.vocab_size})")
    if dtype is not None:
        cast_model(draft, dtype)
    return draft
