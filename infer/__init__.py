"""infer: MoE inference with experts streamed from SSD through iod."""


def load(model_dir, iod="auto", **kwargs):
    """Load a prep folder as ``(model, tokenizer)`` usable with mlx_lm.generate."""
    from infer.runtime.loader import load as _load

    return _load(model_dir, iod=iod, **kwargs)
