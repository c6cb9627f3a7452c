"""Load a prep folder into mlx-lm's own model classes with streaming experts."""

import json
import os
from pathlib import Path

import mlx.core as mx
from mlx.utils import tree_map_with_path
from mlx_lm.tokenizer_utils import load as load_tokenizer
from mlx_lm.utils import _get_classes, load_model

from shared.blob import Manifest, ManifestError

from infer.runtime import coldstart
from infer.args import first_line
from infer.runtime.budget import cached_expert_bytes, cached_layers, model_config, top_k
from infer.runtime.device import DeviceWait
from infer.runtime.predict import CALIBRATION_NAME, Calibration, CalibrationError
from infer.runtime.streaming import ExpertStore, patch_model

DEFAULT_CACHE_FRACTION = 0.25


class PrepFolderError(ValueError):
    pass


def check_prep_folder(model_dir) -> Manifest:
    """The folder's manifest, or PrepFolderError saying what is wrong."""
    return read_prep_folder(model_dir)[0]


def read_prep_folder(model_dir):
    """(manifest, calibration or None, usage counts or None) of a prep
    folder, each checked against the others, or PrepFolderError."""
    model_dir = Path(model_dir)
    if not model_dir.is_dir():
        raise PrepFolderError(f"{model_dir} is not a folder")
    try:
        manifest = Manifest.load(model_dir)
    except ManifestError as e:
        raise PrepFolderError(str(e)) from None
    # mlx-lm and the tokenizer open what they find here: a FIFO or device
    # would block the load for good, so only regular files (and folders) pass
    import stat

    for entry in os.scandir(model_dir):
        try:
            mode = entry.stat().st_mode
        except OSError:
            continue  # a dangling link: whatever opens it fails at once
        if not (stat.S_ISREG(mode) or stat.S_ISDIR(mode)):
            raise PrepFolderError(f"{model_dir / entry.name} is not a regular file; a prep folder "
                                  f"holds the files infer prep wrote: infer verify {model_dir} checks it")
    if not (model_dir / "config.json").exists():
        raise PrepFolderError(f"{model_dir} has no config.json")
    try:  # read again by the loader and the budget: a broken one stops here
        config = json.loads((model_dir / "config.json").read_text())
    except (OSError, ValueError) as e:
        raise PrepFolderError(f"{model_dir / 'config.json'}: {first_line(e)}") from None
    if not isinstance(config, dict):
        raise PrepFolderError(f"{model_dir / 'config.json'} is not a JSON object")
    repair = (f"infer verify {model_dir} lists what is damaged; infer prep --model "
              f"{manifest.source_path()} --out {model_dir} --resume rewrites it")
    for layout in manifest.layers:
        path = model_dir / layout.file
        if not path.exists():
            raise PrepFolderError(f"missing blob {path}: {repair}")
        if path.stat().st_size < layout.stride * layout.num_experts:
            raise PrepFolderError(f"blob {path} is shorter than its manifest says (truncated): {repair}")
    for f in manifest.files or []:  # sizes only: the checksums are infer verify's
        path = model_dir / f["file"]
        size = path.stat().st_size if path.exists() else None
        if size != f["bytes"]:
            has = "is missing" if size is None else f"has {size} bytes, infer prep wrote {f['bytes']}"
            raise PrepFolderError(f"{model_dir}: the model does not load: {f['file']} {has}: {repair}")
    # the optional files of --calibrate
    hidden = model_config(model_dir).get("hidden_size")
    try:
        cal = Calibration.load(model_dir)
        if cal is not None:
            cal.check(manifest.layers, hidden if isinstance(hidden, int) else None,
                      model_dir / CALIBRATION_NAME)
        usage = coldstart.read_usage(model_dir)
        if usage is not None:
            coldstart.check_usage(usage, manifest.layers, model_dir / coldstart.USAGE_NAME)
    except (CalibrationError, coldstart.UsageError) as e:
        raise PrepFolderError(str(e)) from None
    return manifest, cal, usage


def cast_model(model, dtype):
    """Cast floating parameters to ``dtype`` as ``mlx_lm.convert --dtype``
    does (the model's ``cast_predicate`` keeps e.g. routing biases as they are)."""
    keep = getattr(model, "cast_predicate", lambda _: True)

    def cast(path, v):
        return v.astype(dtype) if keep(path) and mx.issubdtype(v.dtype, mx.floating) else v

    model.update(tree_map_with_path(cast, model.parameters()))


def load_streaming(model_dir, source, cache_bytes=None, tokenizer_config=None, dtype=None,
                   preload=True, group=None, mtp_cache=False, capacity=None, device_wait="auto"):
    """(model, tokenizer, store) for a prep folder, experts from ``source``.

    ``dtype`` (an ``mx.Dtype``, or None for the folder's own): the resident
    weights and every expert's floating tensors are cast to it. With
    ``preload`` and a ``usage.json`` in the folder (``infer.runtime.coldstart``),
    the cache starts filled with the experts a calibration text used most.
    ``group``: an ``mx.distributed`` group to pipeline over
    (infer.runtime.distributed): the model keeps this rank's layers only, and the
    store streams their experts only. ``mtp_cache``: an MTP head will draft,
    so its layers share the expert cache (else they get none of it).
    ``capacity``: {layer: experts its stack holds}, a memory plan's
    (``infer.runtime.budget.MemoryPlan.capacity``); without one,
    ``cache_bytes`` is split over the layers (``budget.split_cache``), where a
    ``usage.json`` says whole layers pay, with those. ``device_wait``: a
    decode call finds its experts on the GPU and waits there for its misses
    ("auto", "on" or "off": ``infer.runtime.device.wanted``)."""
    model_dir = Path(model_dir)
    manifest, calibration, usage = read_prep_folder(model_dir)
    if group is not None:
        from infer.runtime import distributed

        manifest = distributed.rank_manifest(manifest, model_dir, group)
    if cache_bytes is None:
        cache_bytes = int(cached_expert_bytes(manifest, mtp_cache) * DEFAULT_CACHE_FRACTION)
    store = ExpertStore(manifest, source, cache_bytes, calibration=calibration,
                        cached=[l.layer for l in cached_layers(manifest, mtp_cache)],
                        usage=usage, top_k=top_k(model_dir), capacity=capacity)
    store.dtype = dtype
    store.prefetcher.set_disk(model_dir)
    if group is None:
        store.device = DeviceWait.make(store, device_wait)
    if store.device is None and \
            any(store.capacity.get(l, 0) < store.layouts[l].num_experts for l in store.cached):
        # A streamed layer syncs at its router (no device wait). On an NVIDIA H200
        # (2026-12-02, 7a849c3) a sync cost ~0.5 ms with MLX CUDA's graphs and ~0.2 ms
        # without, and streaming at 25% ran 1.07x faster without them
        # (docs/benchmarks.md). MLX reads
        # this at its first CUDA evaluation, still to come here; Metal and
        # the CPU ignore it; a user's own setting wins.
        os.environ.setdefault("MLX_USE_CUDA_GRAPHS", "0")

    def get_classes(config):
        model_class, args_class = _get_classes(config)

        # Patch inside the constructor, before mlx-lm quantizes and loads:
        # its quantization predicate looks for `<path>.scales` among the
        # loaded weights, which the experts are not part of.
        class StreamingModel(model_class):
            def __init__(self, args):
                super().__init__(args)
                patch_model(self, manifest, store)

            def __call__(self, *args, **kwargs):
                # a decode call's misses may be copied in as late as here
                # (ExpertStore.settle): before the caller evaluates the output
                store.deferring = store.lockstep is None  # (a prefill's chunks take turns)
                try:
                    return super().__call__(*args, **kwargs)
                finally:
                    store.deferring = False
                    store.settle()

        StreamingModel.__name__ = model_class.__name__
        return StreamingModel, args_class

    # lazy, so a cast materializes each weight once, in its final dtype
    # a rank drops the other ranks' layers before anything is evaluated
    # (as mlx_lm.utils.sharded_load; their experts were never patched in)
    try:
        model, config = load_model(model_dir, lazy=True, strict=group is None,
                                   get_model_classes=get_classes)
    except (ValueError, RuntimeError, KeyError, OSError) as e:  # e.g. a hand-edited folder
        raise PrepFolderError(f"{model_dir}: the model does not load: {first_line(e)}") from None
    if group is not None:
        distributed.pipeline(model.model, group)
    if dtype is not None:
        cast_model(model, dtype)
    mx.eval(model.parameters())
    if group is not None:  # ranks load at their own pace: meet before the first transfer
        mx.eval(mx.distributed.all_sum(mx.array(1.0), group=group, stream=mx.cpu))
    try:
        tokenizer = load_tokenizer(
            model_dir, tokenizer_config or {}, eos_token_ids=config.get("eos_token_id")
        )
    except (ValueError, RuntimeError, KeyError, OSError) as e:
        raise PrepFolderError(f"{model_dir}: the tokenizer does not load: {first_line(e)}") from None
    if preload and source is not None:  # (infer bench sets its source later)
        coldstart.preload(store, model_dir)
    return model, tokenizer, store


def load(model_dir, iod="auto", cache_bytes=None, tokenizer_config=None, dtype=None,
         iod_timeout=10.0):
    """Load a prep folder as ``(model, tokenizer)``; experts stream through iod.

    The result works unchanged with ``mlx_lm.generate`` and
    ``mlx_lm.stream_generate``. ``dtype``: e.g. ``mx.float32`` to run a
    bfloat16 folder in float32 (much faster on CPUs without fast bfloat16).
    ``iod``: "auto" (the user's daemon, or a private one), a daemon's socket
    path, or "inproc" (the daemon's core in this process: no daemon at all).
    ``iod_timeout``: seconds the daemon may stand still before a call raises
    ``infer.runtime.client.DaemonDead`` (a slow disk is waited for).
    """
    from infer.runtime.source import INPROC, make_source

    check_prep_folder(model_dir)
    if isinstance(dtype, str):
        dtype = getattr(mx, dtype)
    daemon = {} if iod == INPROC else {"timeout": iod_timeout}  # (no daemon to declare dead)
    source = make_source(model_dir, iod, working_set=top_k(model_dir), **daemon)
    model, tokenizer, _ = load_streaming(model_dir, source, cache_bytes, tokenizer_config, dtype)
    return model, tokenizer
