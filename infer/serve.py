"""`infer serve`: mlx-lm's OpenAI-compatible HTTP server on a prep folder.

The HTTP side (``/v1/chat/completions``, ``/v1/completions``, streaming or
not, ``/v1/models``, ``/health``) is mlx-lm's own server, unchanged; only its
model provider is replaced, so that the model is the prep folder's with
experts streamed through iod. The server process is one session of the
daemon: several servers and ``infer run`` processes share its reads.
"""

import argparse
import gc
import json
import logging
import signal
import sys
from pathlib import Path

import mlx.core as mx
from mlx_lm import server as mlx_server
from mlx_lm.models.cache import make_prompt_cache

from shared.units import parse_size

from .loader import PrepFolderError, check_prep_folder, load_streaming

# mlx-lm server options infer serve does not offer, at mlx-lm's defaults
_FIXED = dict(
    adapter_path=None, draft_model=None, num_draft_tokens=3, trust_remote_code=False,
    allowed_origins="*", prompt_cache_bytes=None, kv_bits=None, kv_group_size=64,
    quantized_kv_start=mlx_server.DEFAULT_QUANTIZED_KV_START, pipeline=False,
)


def build_parser():
    p = argparse.ArgumentParser(prog="infer serve", description=__doc__.splitlines()[0])
    p.add_argument("--model", required=True, help="prep folder (made by `infer prep`)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8080, help="0 picks a free port (printed)")
    p.add_argument("--iod", default="auto", help="'auto' or a daemon's socket file")
    p.add_argument("--mem-budget", default=None, help="bound on the session's memory, e.g. 4G")
    p.add_argument("--max-tokens", type=int, default=512, help="default per request")
    p.add_argument("--temp", type=float, default=0.0, help="default sampling temperature")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--min-p", type=float, default=0.0)
    p.add_argument("--chat-template", default="")
    p.add_argument("--use-default-chat-template", action="store_true")
    p.add_argument("--chat-template-args", type=json.loads, default="{}")
    p.add_argument("--decode-concurrency", type=int, default=32,
                   help="requests decoded together in one batch")
    p.add_argument("--prompt-concurrency", type=int, default=8)
    p.add_argument("--prefill-step-size", type=int, default=2048)
    p.add_argument("--prompt-cache-size", type=int, default=10)
    p.add_argument("--log-level", default="INFO",
                   choices=["DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL"])
    return p


class StreamingModelProvider(mlx_server.ModelProvider):
    """mlx-lm's model provider, loading the one prep folder through ``source``.

    ``source`` is an ``IodClient`` connected by the caller (so a refused
    connection is reported before the server starts); the model itself is
    built on mlx-lm's generation thread, the only thread that then uses it.
    """

    def __init__(self, cli_args, source, cache_bytes=None):
        super().__init__(cli_args)
        self.source = source
        self.cache_bytes = cache_bytes
        self.store = None
        folder = Path(cli_args.model)
        self._names = {"default_model", cli_args.model, str(folder.resolve()), folder.name}

    def load(self, model_path, adapter_path=None, draft_model_path=None):
        if model_path not in self._names:
            raise ValueError(f"this server serves only {self.cli_args.model} (asked for {model_path!r})")
        if adapter_path is not None:
            raise ValueError("infer serve does not support adapters")
        return super().load("default_model", None, "default_model")

    def _load(self, model_path, adapter_path=None, draft_model_path=None):
        if adapter_path is not None or draft_model_path is not None:
            raise ValueError("infer serve does not support adapters or draft models")
        self.reset()
        gc.collect()
        mx.clear_cache()
        model, tokenizer, store = load_streaming(
            model_path, self.source, self.cache_bytes, self._tokenizer_config)
        if self.cli_args.use_default_chat_template and tokenizer.chat_template is None:
            tokenizer.chat_template = tokenizer.default_chat_template
        self.model_key = (model_path, None, None)
        self.model, self.tokenizer, self.store = model, tokenizer, store
        self.processor = None
        self.draft_model = None
        self.is_batchable = all(hasattr(c, "merge") for c in make_prompt_cache(model))
        logging.info(f"infer serve: loaded {model_path} (daemon pid {self.source.daemon_pid}, "
                     f"session {self.source.session_id})")


def _server_class(host):
    class Server(mlx_server.ThreadingHTTPServer):
        def server_activate(self):
            super().server_activate()
            port = self.server_address[1]
            print(f"infer serve: listening on http://{host}:{port}", flush=True)

    return Server


def _stop(signum, frame):
    raise KeyboardInterrupt  # mlx-lm's server loop shuts down on it


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    from .budget import top_k
    from .client import IodClient, IodError
    from .run import cache_bytes_for

    logging.basicConfig(level=getattr(logging, args.log_level),
                        format="%(asctime)s - %(levelname)s - %(message)s")
    try:
        manifest = check_prep_folder(args.model)
        cache_bytes = None
        if args.mem_budget is not None:
            cache_bytes = cache_bytes_for(parse_size(args.mem_budget), args.model, manifest)
        source = IodClient(args.model, iod=args.iod, working_set=top_k(args.model))
    except (PrepFolderError, ValueError, IodError) as e:
        print(f"infer serve: {e}", file=sys.stderr)
        return 2

    cli_args = argparse.Namespace(**vars(args), **_FIXED)
    cli_args.model = str(Path(args.model).resolve())
    provider = StreamingModelProvider(cli_args, source, cache_bytes)
    signal.signal(signal.SIGTERM, _stop)
    generator = mlx_server.ResponseGenerator(
        provider, mlx_server.LRUPromptCache(args.prompt_cache_size))
    try:
        # mlx-lm's server loop; on SIGINT/SIGTERM it stops the generation thread
        mlx_server._run_http_server(args.host, args.port, generator,
                                    server_class=_server_class(args.host))
    except OSError as e:  # the address cannot be bound
        generator.stop_and_join()
        print(f"infer serve: {e}", file=sys.stderr)
        return 2
    finally:
        source.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
