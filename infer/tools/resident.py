"""mlx-lm's own model with every expert in memory, built from a prep folder:
the baseline streamed output is held to (`infer bench`, tests, scripts)."""

from pathlib import Path


def blob_tensors(model_dir, layers):
    """{module.projection.tensor: MLX array stacked over the experts} of
    manifest ``layers``, read from their blobs."""
    import mlx.core as mx
    import numpy as np

    from shared.blob import NUMPY_DTYPES

    from infer.runtime.streaming import _MX_DTYPES

    out = {}
    for lay in layers:
        raw = np.fromfile(Path(model_dir) / lay.file, dtype=np.uint8)
        raw = raw[: lay.num_experts * lay.stride].reshape(lay.num_experts, lay.stride)
        for s in lay.segments:
            a = np.ascontiguousarray(raw[:, s.offset : s.offset + s.nbytes])
            a = a.view(NUMPY_DTYPES[s.dtype]).reshape(lay.num_experts, *s.shape)
            arr = mx.array(a)
            if arr.dtype != _MX_DTYPES[s.dtype]:
                arr = arr.view(_MX_DTYPES[s.dtype])
            out[f"{lay.module}.{s.projection}.{s.tensor}"] = arr
        del raw
    return out


def load_resident(model_dir):
    """mlx-lm's own model with all experts in memory, from a prep folder."""
    from mlx_lm.tokenizer_utils import load as load_tokenizer
    from mlx_lm.utils import _get_classes, load_model

    from shared.blob import Manifest

    model_dir = Path(model_dir)
    manifest = Manifest.load(model_dir)

    def experts():
        # an MTP head's experts belong to the head (infer.tools.bench_draft)
        return blob_tensors(model_dir, [l for l in manifest.layers if not l.module.startswith("mtp.")])

    def get_classes(config):
        model_class, args_class = _get_classes(config)

        class Resident(model_class):
            def sanitize(self, weights):
                if hasattr(model_class, "sanitize"):
                    weights = super().sanitize(weights)
                weights.update(experts())
                return weights

        Resident.__name__ = model_class.__name__
        return Resident, args_class

    model, config = load_model(model_dir, get_model_classes=get_classes)
    tokenizer = load_tokenizer(model_dir, {}, eos_token_ids=config.get("eos_token_id"))
    return model, tokenizer
