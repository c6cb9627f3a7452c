"""`infer serve`: mlx-lm's OpenAI-compatible HTTP server on a prep folder.

The HTTP side (``/v1/chat/completions``, ``/v1/completions``, streaming or
not, ``/health``) is mlx-lm's own server, unchanged; its model provider is
replaced, so that the model is the prep folder's with experts streamed
through iod, and ``/v1/models`` lists that folder. The server process is one session of the
daemon: several servers and ``infer run`` processes share its reads.

With ``--ranks N`` (or under ``mlx.launch``) the model is pipelined over the
ranks as in ``infer run --ranks`` (infer.runtime.distributed); mlx-lm's server does
the rest: rank 0 serves HTTP and shares each request with the other ranks,
which generate in step with it.
"""

import argparse
import gc
import io
import json
import logging
import os
import signal
import socket
import sys
import weakref
from pathlib import Path

import mlx.core as mx
from mlx_lm import server as mlx_server
from mlx_lm.models.cache import make_prompt_cache

from shared.units import parse_size

from infer.args import (Parser, add_dtype, add_sampling, add_version, iod_target, json_object, mx_dtype,
                   port_int, positive_int)
from infer.runtime.budget import model_config
from infer.runtime.loader import PrepFolderError, check_prep_folder, load_streaming

MODELS = ("Model names: a request's \"model\" may be the folder's name (what /v1/models lists), "
          "the --model argument as given, its absolute path, or \"default_model\"; "
          "leaving it out means this model too.")

# mlx-lm server options infer serve does not offer, at mlx-lm's defaults
_FIXED = dict(
    adapter_path=None, draft_model=None, num_draft_tokens=3, trust_remote_code=False,
    allowed_origins="*", prompt_cache_bytes=None, kv_bits=None, kv_group_size=64,
    quantized_kv_start=mlx_server.DEFAULT_QUANTIZED_KV_START, pipeline=False,
)


def build_parser():
    p = Parser(prog="infer serve", description=__doc__.splitlines()[0].split(": ", 1)[1], epilog=MODELS)
    p.add_argument("--model", required=True, help="prep folder (made by `infer prep`)")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on")
    p.add_argument("--port", type=port_int, default=8080, help="port to listen on (0 picks a free one, printed)")
    p.add_argument("--iod", type=iod_target, default="auto",
                   help="'auto' (the shared daemon, else a private one) or a daemon's socket file")
    p.add_argument("--mem-budget", default=None, help="bound on the session's memory, e.g. 4G")
    add_dtype(p)
    add_sampling(p, max_tokens=512, serve=True)
    p.add_argument("--chat-template", default="", help="a chat template to use instead of the tokenizer's")
    p.add_argument("--use-default-chat-template", action="store_true",
                   help="use the tokenizer's default chat template")
    p.add_argument("--chat-template-args", type=json_object, default="{}",
                   help="JSON object of extra chat template arguments")
    p.add_argument("--decode-concurrency", type=positive_int, default=32,
                   help="requests decoded together in one batch")
    p.add_argument("--prompt-concurrency", type=positive_int, default=8,
                   help="prompts prefilled together")
    p.add_argument("--prefill-step-size", type=positive_int, default=2048,
                   help="prompt tokens per prefill step")
    p.add_argument("--prompt-cache-size", type=positive_int, default=10,
                   help="prompt caches kept for reuse")
    p.add_argument("--ranks", type=positive_int, default=1, metavar="N",
                   help="serve as N local ranks through mlx.launch (ring over loopback), the layers "
                        "split across them, each streaming its own layers' experts; over hosts: "
                        "mlx.launch --hostfile H -- infer serve ... ('{rank}' in --iod: the rank's number)")
    p.add_argument("--log-level", default="INFO",
                   choices=["DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL"], help="logging level")
    add_version(p)
    return p


class BadRequest(ValueError):
    """A request that cannot be served as asked: answered 400."""


class ModelNotServed(ValueError):
    """A request for another model: answered 404."""


class Terminated(BaseException):
    """SIGTERM or SIGHUP: unwinds like Ctrl-C, so that the daemon session closes."""


class Generator(mlx_server.ResponseGenerator):
    """mlx-lm's response generator, whose errors fail their requests only.

    mlx-lm's generation thread ends at the first error a batch raises, and
    every later request is then a 503. An empty prompt (which mlx-lm hands
    to the batch generator) is refused when made; any other error (a daemon
    that died, a record that failed its checksum) goes to the requests the
    thread held, and the thread starts again: the next request reattaches to
    the daemon. With --ranks the ranks fail together, as mlx-lm's do.
    """

    def __init__(self, *args, **kwargs):
        self._held = weakref.WeakSet()  # the thread starts in super().__init__
        super().__init__(*args, **kwargs)

    def _next_request(self, timeout=None):
        request = super()._next_request(timeout)
        if request is not None:
            self._held.add(request[0])  # its response queue
        return request

    def _run_generate(self):
        while True:
            try:
                self._generate()
                return
            except Exception as e:  # noqa: BLE001 - the requests under way get it
                served = len(self._held) > 0
                logging.error(f"infer serve: generation failed ({type(e).__name__}: {e})")
                for q in list(self._held):
                    q.put(e)
                self._held = weakref.WeakSet()
                # a failure with no request to blame (or across ranks) would
                # repeat: end as mlx-lm does
                if self._stop or self._is_distributed or not served:
                    self._generation_failed = True
                    return

    def _tokenize(self, tokenizer, request, args):
        try:
            made = super()._tokenize(tokenizer, request, args)
        except Exception as e:  # noqa: BLE001 - a template or content error is the request's
            raise BadRequest(f"bad prompt: {e}") from e
        if not made[0]:
            raise BadRequest("prompt is empty")
        return made


class StreamingModelProvider(mlx_server.ModelProvider):
    """mlx-lm's model provider, loading the one prep folder through ``source``.

    ``source`` is an ``ExpertSource`` connected by the caller (so a refused
    connection is reported before the server starts); the model itself is
    built on mlx-lm's generation thread, the only thread that then uses it.
    """

    def __init__(self, cli_args, source, cache_bytes=None, given=None):
        super().__init__(cli_args)
        self.source = source
        self.cache_bytes = cache_bytes
        self.store = None
        self._names = model_names(cli_args.model, given)

    def load(self, model_path, adapter_path=None, draft_model_path=None):
        if model_path not in self._names:
            raise ModelNotServed(f"this server serves only {self.cli_args.model} (asked for {model_path!r})")
        if adapter_path is not None:
            raise BadRequest("infer serve does not support adapters")
        return super().load("default_model", None, "default_model")

    def _load(self, model_path, adapter_path=None, draft_model_path=None):
        if adapter_path is not None or draft_model_path is not None:
            raise ValueError("infer serve does not support adapters or draft models")
        self.reset()
        gc.collect()
        mx.clear_cache()
        from infer.runtime.distributed import group

        # a --mem-budget plan counts an even split of the cache
        model, tokenizer, store = load_streaming(
            model_path, self.source, self.cache_bytes, self._tokenizer_config,
            dtype=mx_dtype(self.cli_args.dtype), group=group(),
            whole_layers=self.cli_args.mem_budget is None)
        if self.cli_args.use_default_chat_template and tokenizer.chat_template is None:
            tokenizer.chat_template = tokenizer.default_chat_template
        self.model_key = (model_path, None, None)
        self.model, self.tokenizer, self.store = model, tokenizer, store
        self.processor = None
        self.draft_model = None
        self.is_batchable = all(hasattr(c, "merge") for c in make_prompt_cache(model))
        logging.info(f"infer serve: loaded {model_path} (daemon pid {self.source.daemon_pid}, "
                     f"session {self.source.session_id})")


def model_names(model, given=None):
    """The names a request may give for the served folder (see MODELS)."""
    folder = Path(model)
    return {"default_model", model, given or model, str(folder.resolve()), folder.resolve().name}


def _handler_class(model, given=None):
    """mlx-lm's request handler, with /v1/models listing the served folder
    (mlx-lm's lists the Hugging Face cache, and fails without one)."""
    from urllib.parse import unquote

    listed = Path(model).resolve().name
    names = model_names(model, given)
    vocab = model_config(model).get("vocab_size")  # a checked prep folder's

    class Handler(mlx_server.APIHandler):
        def do_POST(self):
            # mlx-lm decodes the body outside its error handling: a body that
            # is not UTF-8 would drop the connection with no reply
            try:
                n = int(self.headers.get("Content-Length"))
            except (TypeError, ValueError):
                n = -1  # mlx-lm answers it
            if n < 0:
                return super().do_POST()
            body = self.rfile.read(n)
            try:
                body.decode()
            except UnicodeDecodeError:
                return self._error(400, "request body is not UTF-8")
            rfile, self.rfile = self.rfile, io.BytesIO(body)
            try:
                super().do_POST()
            finally:
                self.rfile = rfile

        def validate_model_parameters(self):
            # mlx-lm checks these fields' types only; a logit_bias id past the
            # vocabulary indexes the logits out of bounds (MLX does not check:
            # the server segfaults), a negative seed raises on the generation
            # thread after the headers, and a stop that is no string fails late
            super().validate_model_parameters()
            if self.logit_bias and vocab:
                bad = [k for k in self.logit_bias if not 0 <= k < vocab]
                if bad:
                    raise ValueError(f"logit_bias: token id {bad[0]} is outside the vocabulary [0, {vocab})")
            if self.seed is not None and not 0 <= self.seed < 2 ** 64:
                raise ValueError("seed must be between 0 and 2**64 - 1")
            stop = self.body.get("stop")
            if stop is not None and not (isinstance(stop, str) or (
                    isinstance(stop, list) and all(isinstance(w, str) for w in stop))):
                raise ValueError("stop must be a string or a list of strings")

        def handle_chat_completions(self):
            messages = self.body.get("messages")
            if not isinstance(messages, list) or not messages:
                raise BadRequest("messages must be a non-empty list")
            return super().handle_chat_completions()

        def _set_completion_headers(self, status_code=200):
            # mlx-lm answers 404 to any request that fails before its first
            # token (it is then handling the exception): tell them apart
            e = sys.exc_info()[1]
            if status_code == 404 and e is not None:
                if isinstance(e, BadRequest):
                    status_code = 400
                elif not isinstance(e, ModelNotServed):
                    status_code = 500 if self.response_generator.generation_available() else 503
            super()._set_completion_headers(status_code)

        def _error(self, status, message):
            body = json.dumps({"error": message}).encode()
            super()._set_completion_headers(status)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)
            self.wfile.flush()

        def log_message(self, format, *args):
            # one line a request, as --log-level says (mlx-lm's went to stderr)
            logging.info(f"{self.address_string()} {format % args}")

        def handle_models_request(self):
            card = {"id": listed, "object": "model", "created": self.created, "owned_by": "infer"}
            rest = unquote(self.path.split("?")[0][len("/v1/models"):]).strip("/")
            if not rest:
                status, body = 200, {"object": "list", "data": [card]}
            elif rest in names or "/" + rest in names:
                status, body = 200, card
            else:
                status, body = 404, {"error": {"message": f"model {rest!r} is not served here "
                                                          f"(this server serves {listed!r})",
                                               "type": "invalid_request_error", "code": "model_not_found"}}
            self._set_completion_headers(status)
            self.end_headers()
            self.wfile.write(json.dumps(body).encode())
            self.wfile.flush()

    return Handler


def bind(host, port, handler_class):
    """The HTTP server, bound and listening (as mlx-lm's ``_run_http_server``
    makes it); OSError when the address cannot be had."""
    infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    family, _, _, _, address = infos[0]

    class Server(mlx_server.ThreadingHTTPServer):
        address_family = family

    server = Server(address, None)
    server.RequestHandlerClass = lambda *a, **kw: handler_class(
        server.generator, *a, system_fingerprint=mlx_server.get_system_fingerprint(), **kw)
    return server


_WHY = {signal.SIGINT: "interrupted", signal.SIGTERM: "terminated", signal.SIGHUP: "hung up"}


def _terminate(signum, frame):
    raise Terminated(signum)


def _leave(rc):
    """Exit now, its status left for ``--ranks``'s launcher, without the
    interpreter's teardown: there MLX's stream threads sometimes abort the
    process ("terminate called without an active exception", about one
    SIGTERM in four here), and a rank's generation thread may be waiting in
    a collective on ranks already gone."""
    from infer.runtime.distributed import leave_status

    leave_status(rc)
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(rc)


def _exit_rank(source):
    """A rank's SIGINT/SIGTERM: leave at once (mlx-lm's orderly stop joins
    the generation thread, which could wait forever)."""

    def handler(signum, frame):
        try:
            source.close()
        except Exception:  # noqa: BLE001 - leaving anyway; the daemon reclaims a dead session
            pass
        _leave(0)

    return handler


def main(argv=None) -> int:
    from infer.runtime.distributed import leave_status

    try:
        rc = _main(argv)
    except KeyboardInterrupt:  # before the server ran: nothing of ours is left
        print("infer serve: interrupted", file=sys.stderr)
        rc = 130
    except Terminated as e:
        print(f"infer serve: {_WHY[e.args[0]]}", file=sys.stderr)
        rc = 128 + e.args[0]
    leave_status(rc)  # under --ranks: this rank's status, for the launcher
    return rc


def _main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    from infer.runtime import distributed
    from infer.runtime.budget import top_k
    from infer.runtime.client import IodError
    from infer.runtime.source import make_source

    logging.basicConfig(level=getattr(logging, args.log_level),
                        format="%(asctime)s - %(levelname)s - %(message)s")
    try:
        manifest = check_prep_folder(args.model)
        if args.ranks > 1 or distributed.launched():
            distributed.check_pipelined(args.model, args.ranks)
    except (PrepFolderError, ValueError) as e:
        print(f"infer serve: {e}", file=sys.stderr)
        return 2
    if args.ranks > 1 and not distributed.launched():
        return distributed.launch("serve", args.ranks, sys.argv[1:] if argv is None else list(argv))
    g = distributed.group()
    if g is None:
        for s in (signal.SIGTERM, signal.SIGHUP):
            signal.signal(s, _terminate)
    model = str(Path(args.model).resolve())
    httpd = None
    if g is None or g.rank() == 0:
        # the port first: a busy one is said before anything loads
        try:
            httpd = bind(args.host, args.port, _handler_class(model, args.model))
        except OSError as e:
            print(f"infer serve: cannot listen on {args.host}:{args.port}: {e.strerror or e}",
                  file=sys.stderr)
            if g is not None:  # the other ranks wait on this one: leave at once
                _leave(1)
            return 1
    try:
        try:
            if g is not None:
                manifest = distributed.rank_manifest(manifest, args.model, g)
                args.iod = args.iod.replace("{rank}", str(g.rank()))  # a daemon per rank
            cache_bytes, client_kw = None, {}
            if args.mem_budget is not None:
                from infer.runtime.budget import plan_session

                plan, client_kw = plan_session(parse_size(args.mem_budget), args.model, manifest, args.iod,
                                               dtype=args.dtype)
                cache_bytes = plan.cache_bytes
            source = make_source(args.model, args.iod, working_set=top_k(args.model), **client_kw)
        except (PrepFolderError, ValueError, IodError) as e:
            print(f"infer serve: {e}", file=sys.stderr)
            return 2
    except BaseException:
        if httpd is not None:
            httpd.server_close()
        raise

    cli_args = argparse.Namespace(**vars(args), **_FIXED)
    cli_args.model = model
    cli_args.pipeline = g is not None  # mlx-lm's provider: a pipeline group, not tensor parallel
    provider = StreamingModelProvider(cli_args, source, cache_bytes, given=args.model)
    if g is not None:
        for s in (signal.SIGINT, signal.SIGTERM):
            signal.signal(s, _exit_rank(source))
    if g is not None and g.rank() != 0:
        # requests come from rank 0; a signal ends this rank
        Generator(provider, mlx_server.LRUPromptCache(args.prompt_cache_size)).join()
        return 1  # the generation thread ended on its own: it failed
    generator = None
    rc, why = 0, None
    try:
        generator = Generator(provider, mlx_server.LRUPromptCache(args.prompt_cache_size))
        httpd.generator = generator
        print(f"infer serve: listening on http://{args.host}:{httpd.server_address[1]}", flush=True)
        httpd.serve_forever()
    except KeyboardInterrupt:
        rc, why = 130, "interrupted"
    except Terminated as e:
        rc, why = 128 + e.args[0], _WHY[e.args[0]]
    finally:
        for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
            signal.signal(s, signal.SIG_IGN)  # the cleanup is not cut short
        if httpd is not None:
            httpd.server_close()
        if generator is not None:
            if g is not None:
                source.close()
                _leave(rc)  # the generation thread may wait on the other ranks
            generator.stop_and_join()
        source.close()
    if why is not None:
        print(f"infer serve: {why}", file=sys.stderr)
    _leave(rc)  # everything is closed


if __name__ == "__main__":
    sys.exit(main())
