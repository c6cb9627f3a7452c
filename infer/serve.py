"""`infer serve`: mlx-lm's OpenAI-compatible HTTP server on a prep folder.

The HTTP side (``/v1/chat/completions``, ``/v1/completions``, streaming or
not, ``/health``) is mlx-lm's own server; its model provider is replaced, so
that the model is the prep folder's with experts streamed through iod, and
``/v1/models`` lists that folder. The server process is one session of the
daemon: several servers and ``infer run`` processes share its reads.

What one client sends cannot harm another's requests: a bad parameter,
body, content part or prompt length is refused (4xx) before the request
joins the batch; a request that fails while generating fails alone; a client
that leaves stops its generation; ``--mem-budget`` holds across concurrent
requests (they wait for room); no web page may call the server unless
``--allow-origin`` names it.

With ``--ranks N`` (or under ``mlx.launch``) the model is pipelined over the
ranks as in ``infer run --ranks`` (infer.runtime.distributed); mlx-lm's server does
the rest: rank 0 serves HTTP and shares each request with the other ranks,
which generate in step with it.
"""

import argparse
import collections
import gc
import io
import json
import logging
import math
import os
import select
import signal
import socket
import sys
import time
import weakref
from pathlib import Path
from queue import Empty, Queue

import mlx.core as mx
from mlx_lm import server as mlx_server
from mlx_lm.models.cache import make_prompt_cache
from mlx_lm.sample_utils import greedy_sampler

from shared.units import format_size, parse_size

from infer.args import (Parser, add_device_wait, add_dtype, add_prefill, add_sampling, add_version, iod_target, json_object, mx_dtype,
                   port_int, positive_int)
from infer.runtime.budget import DEFAULT_CONTEXT, model_config
from infer.runtime.loader import PrepFolderError, check_prep_folder, load_streaming

MODELS = ("Model names: a request's \"model\" may be the folder's name (what /v1/models lists), "
          "the --model argument as given, its absolute path, or \"default_model\"; "
          "leaving it out means this model too.")

# mlx-lm server options infer serve does not offer, at mlx-lm's defaults
_FIXED = dict(
    adapter_path=None, draft_model=None, num_draft_tokens=3, trust_remote_code=False,
    prompt_cache_bytes=None, kv_bits=None, kv_group_size=64,
    quantized_kv_start=mlx_server.DEFAULT_QUANTIZED_KV_START, pipeline=False,
)
MAX_BODY = "4M"  # --max-body's default: ~1M tokens of text, far past most contexts
FALLBACK_CONTEXT = 32768  # a model whose config.json names no context
KV_STEP = 256  # mlx-lm grows a KV cache by this many tokens


def _size(text):
    try:
        return parse_size(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


_size.__name__ = "size"


def build_parser():
    p = Parser(prog="infer serve", description=__doc__.splitlines()[0].split(": ", 1)[1], epilog=MODELS)
    p.add_argument("--model", required=True, help="prep folder (made by `infer prep`)")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on")
    p.add_argument("--port", type=port_int, default=8080, help="port to listen on (0 picks a free one, printed)")
    p.add_argument("--iod", type=iod_target, default="auto",
                   help="'auto' (the shared daemon, else a private one) or a daemon's socket file")
    p.add_argument("--mem-budget", default=None,
                   help="bound on the memory of the server and its private daemon, e.g. 4G, held "
                        "across concurrent requests (a request waits until its KV cache fits)")
    add_dtype(p)
    add_device_wait(p)
    add_sampling(p, max_tokens=512, serve=True)
    p.add_argument("--max-context", type=positive_int, default=None, metavar="N",
                   help="tokens a request may use, prompt and max_tokens together (more: 400); "
                        "default: the model's context (max_position_embeddings, else "
                        f"{FALLBACK_CONTEXT}), with --mem-budget at most {DEFAULT_CONTEXT}")
    p.add_argument("--max-body", type=_size, default=MAX_BODY, metavar="SIZE",
                   help="largest request body (more: 413)")
    p.add_argument("--allow-origin", action="append", default=[], metavar="ORIGIN",
                   help="a web page origin allowed to call the server (CORS), e.g. "
                        "http://localhost:3000; repeat it or give a comma list; '*' allows any. "
                        "Default: none (a browser's cross-origin request is refused)")
    p.add_argument("--chat-template", default="", help="a chat template to use instead of the tokenizer's")
    p.add_argument("--use-default-chat-template", action="store_true",
                   help="use the tokenizer's default chat template")
    p.add_argument("--chat-template-args", type=json_object, default="{}",
                   help="JSON object of extra chat template arguments")
    p.add_argument("--decode-concurrency", type=positive_int, default=32,
                   help="requests decoded together in one batch")
    p.add_argument("--prompt-concurrency", type=positive_int, default=8,
                   help="prompts prefilled together (1 with --mem-budget)")
    p.add_argument("--prefill-step-size", type=positive_int, default=2048,
                   help="prompt tokens per prefill step (with --mem-budget at most the plan's)")
    add_prefill(p, default="chunked", more=". layer-major prefills one prompt at a time, each "
                "whole (mlx-lm takes a chunk a step, between the other requests' decode steps); "
                "not with --mem-budget or --ranks")
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


class ClientGone(BaseException):
    """The client closed its connection: its request ends, nothing is answered.
    Not an Exception, so that mlx-lm's handlers do not answer it."""


class Terminated(BaseException):
    """SIGTERM or SIGHUP: unwinds like Ctrl-C, so that the daemon session closes."""


class Limits:
    """What a request may ask of this server."""

    def __init__(self, context, max_body, origins, vocab):
        self.context = context  # tokens of prompt and max_tokens together
        self.max_body = max_body
        self.origins = origins
        self.vocab = vocab
        self.pool_tokens = None  # --mem-budget: KV tokens in flight at most (None: no bound)
        self.kv_token_bytes = 0

    def allows(self, origin):
        return "*" in self.origins or origin in self.origins


def model_context(model) -> int:
    """The context the model was made for (its config's), else FALLBACK_CONTEXT."""
    config = model_config(model)
    for key in ("max_position_embeddings", "max_sequence_length", "seq_length", "n_positions"):
        v = config.get(key)
        if isinstance(v, int) and not isinstance(v, bool) and v > 0:
            return v
    return FALLBACK_CONTEXT


def make_limits(args) -> Limits:
    """The request limits of these arguments; ValueError for a bad default."""
    vocab = model_config(args.model).get("vocab_size")
    vocab = vocab if isinstance(vocab, int) and vocab > 0 else None
    if vocab and args.top_k >= vocab:
        raise ValueError(f"--top-k must be below the vocabulary size ({vocab}); 0 is off")
    context = args.max_context or model_context(args.model)
    if args.mem_budget is not None and args.max_context is None:
        context = min(context, DEFAULT_CONTEXT)
    origins = tuple(o.strip() for given in args.allow_origin for o in given.split(",") if o.strip())
    return Limits(context, args.max_body, origins, vocab)


def _round_up(n, step):
    return -(-n // step) * step


class _Watch:
    """A request's link between its handler (the client) and the generation
    thread (its context): whichever comes second stops the generation."""

    def __init__(self):
        self.gone = False
        self.ctx = None

    def attach(self, ctx):
        self.ctx = ctx
        if self.gone:
            ctx.stop()

    def leave(self):
        self.gone = True
        if self.ctx is not None:
            self.ctx.stop()

    def stopped(self):
        return self.gone or (self.ctx is not None and self.ctx._should_stop)

    def __getstate__(self):  # shared with the other ranks: no context yet
        return {"gone": self.gone, "ctx": None}


class _Tracked:
    """A request's response queue as the generation thread sees it: it notes
    the request's context and its end (a reply's None or an error)."""

    def __init__(self, queue, watch, ended):
        self.queue, self.watch, self._ended = queue, watch, ended
        self.failed = False
        self.done = False

    def put(self, item):
        if self.failed:
            return  # its handler already has the error
        if isinstance(item, mlx_server.GenerationContext):
            self.watch.attach(item)
        elif item is None or isinstance(item, BaseException):
            self._end()
        self.queue.put(item)

    def fail(self, e):
        """This request alone failed while its batch goes on: the error for
        its handler, and the batch drops it at its next step."""
        if not self.failed:
            self.put(e)
            self.failed = True
            self.watch.leave()

    def _end(self):
        if not self.done:
            self.done = True
            self._ended(self)


class _Guarded:
    """A request's sampler or logits processor: one that raises fails its
    request alone (the batch computes the rest unchanged) instead of the
    batch, and MLX's random state is seeded again from the key it had (a
    compiled sampler that raised left it unusable for every later sampled
    request)."""

    def __init__(self, fn, args, fallback):
        self.fn, self.args, self.fallback = fn, args, fallback
        self.failed = False

    def __call__(self, *a):
        if not self.failed:
            key = mx.random.state[0]
            try:
                return self.fn(*a)
            except Exception as e:  # noqa: BLE001 - this request's failure only
                hi, lo = key.tolist()
                mx.random.seed((hi << 32) | lo)  # it cannot be set back, only seeded
                self.failed = True
                logging.error(f"infer serve: a request failed ({type(e).__name__}: {e})")
                tracked = getattr(self.args, "tracked", None)
                if tracked is not None:
                    tracked.fail(BadRequest(f"generation failed: {e}"))
        return self.fallback(*a)


def _guard_sampling():
    """mlx-lm makes each request's sampler and logits processors with these
    two functions of its module: wrap what they make (greedy sampling cannot
    fail, and batches share it as one call)."""
    make_sampler = mlx_server._make_sampler
    make_processors = mlx_server._make_logits_processors
    if getattr(make_sampler, "guarded", False):
        return

    def sampler(args, tokenizer):
        made = make_sampler(args, tokenizer)
        return made if made is greedy_sampler else _Guarded(made, args, greedy_sampler)

    def processors(args):
        return [_Guarded(p, args, lambda tokens, logits: logits) for p in make_processors(args)]

    sampler.guarded = True
    mlx_server._make_sampler, mlx_server._make_logits_processors = sampler, processors


def _pieces(text, size=1 << 16):
    """``text`` in pieces of about ``size`` characters, cut before a space where one is near."""
    i = 0
    while i < len(text):
        j = i + size
        if j < len(text):
            k = text.rfind(" ", i + size // 2, j)
            j = k if k > i else j
        yield text[i:j]
        i = j


def surely_longer(tokenizer, texts, limit) -> bool:
    """Whether ``texts`` are surely more than ``limit`` tokens, counted a piece
    at a time, stopping as soon as they are: a huge prompt is never tokenized
    whole (4 MB at once took 7 s and 700 MB here). A cut may add a token or two
    to the count: each piece is allowed 4."""
    if sum(len(t) for t in texts) <= limit:
        return False
    count = pieces = 0
    for text in texts:
        for piece in _pieces(text):
            count += len(tokenizer.encode(piece, add_special_tokens=False))
            pieces += 1
            if count - 4 * pieces > limit:
                return True
    return False


def _texts(request):
    """The prompt's text as the client gave it (a chat template adds to it)."""
    if request.request_type != "chat":
        return [request.prompt]
    out = []
    for m in request.messages:
        content = m.get("content")
        if isinstance(content, str):
            out.append(content)
        elif isinstance(content, list):
            out.extend(p["text"] for p in content)
    return out


class Generator(mlx_server.ResponseGenerator):
    """mlx-lm's response generator, whose errors fail their requests only.

    mlx-lm's generation thread ends at the first error a batch raises, and
    every later request is then a 503. A request's prompt is checked when
    tokenized (empty, or longer than the context: 400); a sampler or logits
    processor that raises fails its own request (``_Guarded``); any other
    error (a daemon that died, a record that failed its checksum) goes to the
    requests the thread held, and the thread starts again: the next request
    reattaches to the daemon. With --ranks the ranks fail together, as
    mlx-lm's do.

    With ``limits.pool_tokens`` (``--mem-budget``) a request is admitted only
    while the batch's KV cache (a row per request, each as long as the
    longest: requests x the longest prompt and max_tokens) fits the KV cache
    the plan counted; the prompt cache keeps what is left of it. The others
    wait, in order.
    """

    def __init__(self, provider, prompt_cache, limits):
        # the thread starts in super().__init__
        self._held = weakref.WeakSet()
        self._limits = limits
        self._waiting = collections.deque()  # requests not yet admitted, in order
        self._flight = {}  # tracked queue -> [tokens of KV at most, seen stopped]
        super().__init__(provider, prompt_cache)

    def _next_request(self, timeout=None):
        if self._limits.pool_tokens is None or self._is_distributed:
            request = super()._next_request(timeout)
            return None if request is None else self._track(request)
        self._settle()
        while True:
            while self._waiting and self._waiting[0][1].watch.gone:
                self._waiting.popleft()  # its client left while it waited
            if self._waiting:
                if self._fits(self._waiting[0][1]._need):
                    return self._track(self._waiting.popleft())
                if timeout is not None:
                    time.sleep(min(timeout, 0.02))  # the batch is empty: it is draining
                return None
            request = super()._next_request(timeout)
            if request is None:
                return None
            rqueue, req, args = request
            try:  # its length decides when it fits
                req._made = self._tokenize(self.model_provider.tokenizer, req, args)
            except Exception as e:  # noqa: BLE001 - answered like mlx-lm's own tokenizing errors
                rqueue.put(e)
                return None
            req._need = _round_up(len(req._made[0]) + args.max_tokens, KV_STEP)
            self._waiting.append(request)
            timeout = None

    def _track(self, request):
        rqueue, req, args = request
        watch = getattr(req, "watch", None) or _Watch()
        tracked = _Tracked(rqueue, watch, self._ended)
        args.tracked = tracked  # for its guarded sampler and processors
        self._held.add(tracked)
        if self._limits.pool_tokens is not None and not self._is_distributed:
            self._flight[tracked] = [req._need, False]
        return tracked, req, args

    def _ended(self, tracked):
        self._flight.pop(tracked, None)

    def _settle(self):
        """Release the requests whose client is done with them (the batch
        drops them at its next step: released the call after), and trim the
        prompt cache to what the requests in flight leave."""
        for tracked, entry in list(self._flight.items()):
            if tracked.watch.stopped():
                if entry[1]:
                    del self._flight[tracked]
                entry[1] = True
        free = self._limits.pool_tokens - self._in_flight()
        self.prompt_cache.trim_to(n_bytes=max(0, free) * self._limits.kv_token_bytes)

    def _in_flight(self, need=0):
        needs = [e[0] for e in self._flight.values()] + ([need] if need else [])
        return len(needs) * max(needs, default=0)

    def _fits(self, need):
        total = self._in_flight(need)
        # alone, a request fits: one request of the context is what the plan counted
        if self._flight and total > self._limits.pool_tokens:
            return False
        self.prompt_cache.trim_to(n_bytes=max(0, self._limits.pool_tokens - total)
                                  * self._limits.kv_token_bytes)
        return True

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
        made = request.__dict__.pop("_made", None)
        if made is not None:  # tokenized when it asked to be admitted
            return made
        context = self._limits.context
        if surely_longer(tokenizer, _texts(request), context):
            raise BadRequest(f"the prompt is more than {context} tokens, this server's context "
                             "(infer serve --max-context)")
        try:
            made = super()._tokenize(tokenizer, request, args)
        except Exception as e:  # noqa: BLE001 - a template or content error is the request's
            raise BadRequest(f"bad prompt: {e}") from e
        n = len(made[0])
        if not n:
            raise BadRequest("prompt is empty")
        if getattr(request, "max_tokens_given", True):
            if n + args.max_tokens > context:
                raise BadRequest(f"the prompt is {n} tokens and max_tokens {args.max_tokens}: more than "
                                 f"{context} tokens together, this server's context")
        elif n >= context:
            raise BadRequest(f"the prompt is {n} tokens, this server's context is {context}")
        else:  # the server's default, cut to what the context leaves
            args.max_tokens = min(args.max_tokens, context - n)
        return made

    def generate(self, request, generation_args, progress_callback=None, gone=None):
        """mlx-lm's, where ``gone()`` (the client closed its connection) is
        asked while waiting: the request stops, and ClientGone is raised."""
        response_queue = Queue()
        if not self.generation_available():
            raise RuntimeError("generation thread died")
        watch = request.watch = _Watch()
        self.requests.put((response_queue, request, generation_args))
        asked = [time.monotonic()]

        def wait():
            while True:
                try:
                    item = response_queue.get(timeout=0.25)
                except Empty:
                    if not self.generation_available():
                        raise RuntimeError("generation thread died") from None
                    item = Empty
                now = time.monotonic()
                if gone is not None and (item is Empty or now - asked[0] > 0.25):
                    asked[0] = now
                    if gone():
                        watch.leave()
                        raise ClientGone()
                if item is not Empty:
                    return item

        def inner():
            while True:
                response = wait()
                if response is None:
                    break
                if isinstance(response, Exception):
                    raise response
                if isinstance(response, tuple):
                    if progress_callback is not None:
                        progress_callback(*response)
                    continue
                yield response

        ctx = wait()
        if isinstance(ctx, Exception):
            raise ctx
        return ctx, inner()


class StreamingModelProvider(mlx_server.ModelProvider):
    """mlx-lm's model provider, loading the one prep folder through ``source``.

    ``source`` is an ``ExpertSource`` connected by the caller (so a refused
    connection is reported before the server starts); the model itself is
    built on mlx-lm's generation thread, the only thread that then uses it.
    """

    def __init__(self, cli_args, source, cache_bytes=None, given=None, capacity=None, layer_step=None):
        super().__init__(cli_args)
        self.layer_step = layer_step  # --prefill layer-major: the chunks' size (else None)
        self.source = source
        self.cache_bytes = cache_bytes
        self.capacity = capacity  # a --mem-budget plan's {layer: experts}
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

        # a --mem-budget plan hands the cache the per-layer capacities it counted
        model, tokenizer, store = load_streaming(
            model_path, self.source, self.cache_bytes, self._tokenizer_config,
            dtype=mx_dtype(self.cli_args.dtype), group=group(), capacity=self.capacity,
            device_wait=self.cli_args.device_wait)
        if self.cli_args.mem_budget is not None:
            from infer.runtime.budget import release_page_cache

            release_page_cache(model_path)  # the weights are in this process's memory now
        if self.cli_args.use_default_chat_template and tokenizer.chat_template is None:
            tokenizer.chat_template = tokenizer.default_chat_template
        if self.layer_step is not None:
            from infer.runtime.prefill import layer_major_calls

            layer_major_calls(model, store, self.layer_step)
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


class _Watched:
    """The response generator as one handler sees it: its requests stop when
    its client leaves."""

    def __init__(self, generator, gone):
        self._generator, self._gone = generator, gone

    def __getattr__(self, name):
        return getattr(self._generator, name)

    def generate(self, request, args, progress_callback=None):
        return self._generator.generate(request, args, progress_callback, gone=self._gone)


# the sampling fields a request gives as numbers: NaN and infinities pass
# mlx-lm's range checks, then fail (or poison) the batch
_FLOATS = ("temperature", "top_p", "min_p", "repetition_penalty", "presence_penalty",
           "frequency_penalty", "xtc_probability", "xtc_threshold")
_INTS = ("max_tokens", "top_k", "repetition_context_size", "presence_context_size",
         "frequency_context_size", "top_logprobs", "num_draft_tokens", "seed")
_CONTEXT_SIZES = ("repetition_context_size", "presence_context_size", "frequency_context_size")


def _handler_class(model, limits, given=None):
    """mlx-lm's request handler, with /v1/models listing the served folder
    (mlx-lm's lists the Hugging Face cache, and fails without one), and every
    request checked before it reaches the generation thread."""
    from urllib.parse import unquote

    listed = Path(model).resolve().name
    names = model_names(model, given)
    vocab, context = limits.vocab, limits.context

    class Handler(mlx_server.APIHandler):
        def do_POST(self):
            try:
                self._post()
            except (ClientGone, ConnectionError):
                self.close_connection = True  # nobody to answer

        def _post(self):
            # a page in a browser may not drive the server: its request
            # carries an Origin, which must be allowed
            origin = self.headers.get("Origin")
            if origin is not None and not limits.allows(origin):
                return self._refuse(403, f"origin {origin!r} is not allowed "
                                         "(infer serve --allow-origin)")
            # the body is read whole and parsed: bound it before reading it
            # (mlx-lm read any length, and a negative one until the end)
            length = self.headers.get("Content-Length")
            if length is None:
                return self._refuse(411, "Content-Length header is required")
            try:
                n = int(length)
                if n < 0:
                    raise ValueError
            except ValueError:
                return self._refuse(400, f"invalid Content-Length header: {length!r}")
            if n > limits.max_body:
                return self._refuse(413, f"request body of {n} bytes is over this server's limit of "
                                         f"{format_size(limits.max_body)} (infer serve --max-body)")
            body = self.rfile.read(n)
            # mlx-lm decodes the body outside its error handling: a body that
            # is not UTF-8 would drop the connection with no reply
            try:
                body.decode()
            except UnicodeDecodeError:
                return self._error(400, "request body is not UTF-8")
            rfile, self.rfile = self.rfile, io.BytesIO(body)
            try:
                super().do_POST()
            finally:
                self.rfile = rfile

        def _refuse(self, status, message):
            """Answer before reading the body, then read it away (for 5 s at
            most): closed with unread bytes, the connection would be reset,
            and a client that sends the whole body before reading would see
            the reset instead of the answer."""
            self.close_connection = True
            self._error(status, message)
            end = time.monotonic() + 5.0
            try:
                self.connection.shutdown(socket.SHUT_WR)
                self.connection.settimeout(1.0)
                while time.monotonic() < end and self.connection.recv(1 << 16):
                    pass
            except OSError:
                pass

        def validate_model_parameters(self):
            # mlx-lm checks these fields' types only (and lets bools pass as
            # ints, NaN as any number); a logit_bias id past the vocabulary
            # indexes the logits out of bounds (MLX does not check: the server
            # segfaults); a top_k of the vocabulary or more, a NaN min_p, an
            # xtc_threshold over 0.5 or a context size past 32 bits raise on
            # the generation thread, ending every request of the batch
            super().validate_model_parameters()
            for name in _INTS:
                if isinstance(getattr(self, name), bool):
                    raise ValueError(f"{name} must be an integer")
            for name in _FLOATS:
                v = getattr(self, name)
                if isinstance(v, bool) or not math.isfinite(v):
                    raise ValueError(f"{name} must be a finite number")
            if self.logit_bias:
                if vocab:
                    bad = [k for k in self.logit_bias if not 0 <= k < vocab]
                    if bad:
                        raise ValueError(f"logit_bias: token id {bad[0]} is outside the vocabulary [0, {vocab})")
                if not all(math.isfinite(v) for v in self.logit_bias.values()):
                    raise ValueError("logit_bias values must be finite numbers")
            if vocab and self.top_k >= vocab:
                raise ValueError(f"top_k must be below the vocabulary size ({vocab}); 0 is off")
            if self.xtc_threshold > 0.5:
                raise ValueError("xtc_threshold must be at most 0.5")
            for name in _CONTEXT_SIZES:
                if getattr(self, name) > context:
                    raise ValueError(f"{name} must be at most {context}, this server's context")
            # not given, the server's default is cut to what the prompt leaves
            self.max_tokens_given = any(self.body.get(k) is not None
                                        for k in ("max_completion_tokens", "max_tokens"))
            if self.max_tokens_given and self.max_tokens > context:
                raise ValueError(f"max_tokens must be at most {context}, this server's context "
                                 "(prompt and max_tokens together)")
            if self.seed is not None and not 0 <= self.seed < 2 ** 64:
                raise ValueError("seed must be between 0 and 2**64 - 1")
            stop = self.body.get("stop")
            if stop is not None and not (isinstance(stop, str) or (
                    isinstance(stop, list) and all(isinstance(w, str) for w in stop))):
                raise ValueError("stop must be a string or a list of strings")
            options = self.stream_options
            if options is not None:  # mlx-lm indexed it: {} cut the stream before [DONE]
                if not isinstance(options, dict):
                    raise ValueError("stream_options must be an object")
                usage = options.get("include_usage", False)
                if not isinstance(usage, bool):
                    raise ValueError("stream_options.include_usage must be a boolean")
                self.stream_options = {"include_usage": usage}
            if self.chat_template_kwargs is not None and not isinstance(self.chat_template_kwargs, dict):
                raise ValueError("chat_template_kwargs must be an object")

        def handle_chat_completions(self):
            messages = self.body.get("messages")
            if not isinstance(messages, list) or not messages:
                raise BadRequest("messages must be a non-empty list")
            for i, m in enumerate(messages):
                if not isinstance(m, dict) or not isinstance(m.get("role"), str):
                    raise BadRequest(f"messages[{i}] must be an object with a string role")
                content = m.get("content")
                if isinstance(content, list):
                    # mlx-lm fetches an image part's URL (any address, read
                    # whole) before refusing it: this model reads text only
                    for part in content:
                        kind = part.get("type") if isinstance(part, dict) else type(part).__name__
                        if kind != "text":
                            raise BadRequest(f"messages[{i}]: only text content parts are served "
                                             f"(this model reads text), not {kind!r}")
                        if not isinstance(part.get("text"), str):
                            raise BadRequest(f"messages[{i}]: a text part's text must be a string")
                elif content is not None and not isinstance(content, str):
                    raise BadRequest(f"messages[{i}].content must be a string or a list of text parts")
            request = super().handle_chat_completions()
            request.max_tokens_given = self.max_tokens_given
            return request

        def handle_text_completions(self):
            if not isinstance(self.body.get("prompt"), str):
                raise BadRequest("prompt must be a string")
            request = super().handle_text_completions()
            request.max_tokens_given = self.max_tokens_given
            return request

        def handle_completion(self, request, stop_words):
            generator = self.response_generator
            self.response_generator = _Watched(generator, self._client_gone)
            try:
                super().handle_completion(request, stop_words)
            except (ClientGone, ConnectionError):
                self.close_connection = True
            except Exception as e:  # noqa: BLE001 - this request failed after its headers
                self._failed_late(e)
            finally:
                self.response_generator = generator

        def log_message(self, format, *args):
            # one line a request, as --log-level says (mlx-lm's went to stderr)
            logging.info(f"{self.address_string()} {format % args}")

        def _client_gone(self):
            """Whether the client closed its end (a read would see its end of file)."""
            try:
                if not select.select([self.connection], [], [], 0)[0]:
                    return False
                return self.connection.recv(1, socket.MSG_PEEK) == b""
            except (OSError, ValueError):
                return True

        def _failed_late(self, e):
            """mlx-lm dropped the connection when a request failed after its
            headers: a stream gets an error event (and no [DONE]), a reply not
            yet sent its error status."""
            self.close_connection = True
            message = str(e) or type(e).__name__
            logging.error(f"infer serve: a request failed ({type(e).__name__}: {message})")
            try:
                if self.stream:
                    event = {"error": {"message": message, "type": "server_error"}}
                    self.wfile.write(f"data: {json.dumps(event)}\n\n".encode())
                    self.wfile.flush()
                else:
                    self._headers_buffer = []  # the 200 not sent
                    self._error(400 if isinstance(e, BadRequest) else 500, message)
            except OSError:
                pass

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

        def _set_cors_headers(self):
            # mlx-lm allowed any origin: any web page could drive the server
            origin = self.headers.get("Origin")
            if origin is None or not limits.allows(origin):
                return
            if "*" in limits.origins:
                self.send_header("Access-Control-Allow-Origin", "*")
            else:
                self.send_header("Access-Control-Allow-Origin", origin)  # one of the allowed
                self.send_header("Vary", "Origin")
            self.send_header("Access-Control-Allow-Methods", "GET, POST, OPTIONS")
            asked = " ".join(self.headers.get("Access-Control-Request-Headers", "").split())
            self.send_header("Access-Control-Allow-Headers", asked or "*")

        def do_OPTIONS(self):
            origin = self.headers.get("Origin")
            if origin is None or not limits.allows(origin):
                return self._error(403, "cross-origin requests are not allowed here "
                                        "(infer serve --allow-origin)")
            super().do_OPTIONS()

        def _error(self, status, message):
            body = json.dumps({"error": message}).encode()
            super()._set_completion_headers(status)
            self.send_header("Content-Length", str(len(body)))
            if self.close_connection:
                self.send_header("Connection", "close")
            self.end_headers()
            self.wfile.write(body)
            self.wfile.flush()

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
        limits = make_limits(args)
        if args.prefill == "layer-major" and (args.mem_budget is not None or args.ranks > 1):
            # (a layer's experts kept for the chunks behind are more than a memory
            # plan's prefill step counts; over ranks a prompt goes chunk by chunk)
            raise ValueError("--prefill layer-major works without --mem-budget and --ranks")
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
            httpd = bind(args.host, args.port, _handler_class(model, limits, args.model))
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
            cache_bytes, capacity, client_kw = None, None, {}
            if args.mem_budget is not None:
                from infer.runtime.budget import kv_bytes_per_token, limit_process, plan_session

                plan, client_kw = plan_session(parse_size(args.mem_budget), args.model, manifest, args.iod,
                                               dtype=args.dtype, context=limits.context)
                cache_bytes, capacity = plan.cache_bytes, plan.capacity
                # the plan counts one request's KV cache and one prefill step
                # of one prompt: the requests in flight share that KV cache
                limits.pool_tokens = _round_up(limits.context, KV_STEP)
                limits.kv_token_bytes = kv_bytes_per_token(args.model, args.dtype)
                args.prefill_step_size = min(args.prefill_step_size, plan.prefill_step)
                args.prompt_concurrency = 1
                limit_process(plan)
            source = make_source(args.model, args.iod, working_set=top_k(args.model), **client_kw)
        except (PrepFolderError, ValueError, IodError) as e:
            print(f"infer serve: {e}", file=sys.stderr)
            return 2
    except BaseException:
        if httpd is not None:
            httpd.server_close()
        raise

    cli_args = argparse.Namespace(**vars(args), **_FIXED)
    layer_step = None
    if args.prefill == "layer-major":
        # mlx-lm hands the model each prompt whole, one at a time; the model
        # cuts it in --prefill-step-size chunks, layer-major (StreamingModelProvider)
        layer_step = args.prefill_step_size
        cli_args.prefill_step_size = max(limits.context, args.prefill_step_size)
        cli_args.prompt_concurrency = 1
    cli_args.model = model
    cli_args.allowed_origins = list(limits.origins)
    cli_args.pipeline = g is not None  # mlx-lm's provider: a pipeline group, not tensor parallel
    provider = StreamingModelProvider(cli_args, source, cache_bytes, given=args.model, capacity=capacity,
                                      layer_step=layer_step)
    if g is not None:
        for s in (signal.SIGINT, signal.SIGTERM):
            signal.signal(s, _exit_rank(source))
    _guard_sampling()
    if g is not None and g.rank() != 0:
        # requests come from rank 0; a signal ends this rank
        Generator(provider, mlx_server.LRUPromptCache(args.prompt_cache_size), limits).join()
        return 1  # the generation thread ended on its own: it failed
    generator = None
    rc, why = 0, None
    try:
        generator = Generator(provider, mlx_server.LRUPromptCache(args.prompt_cache_size), limits)
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
