"""infer: MoE inference with experts streamed from SSD through iod."""

import resource


def _fd_limit_within_hard():
    """mlx-lm sets the descriptor limit to (2048, 4096) when imported, which
    raises ValueError under a lower hard limit (1024 is common): a request
    for more than the hard limit gets the hard limit instead."""
    real = resource.setrlimit
    if getattr(real, "within_hard", False):
        return

    def setrlimit(which, limits):
        if which == resource.RLIMIT_NOFILE:
            hard = resource.getrlimit(which)[1]
            if hard != resource.RLIM_INFINITY:
                limits = tuple(hard if v == resource.RLIM_INFINITY or v > hard else v
                               for v in limits)
        return real(which, limits)

    setrlimit.within_hard = True
    resource.setrlimit = setrlimit


_fd_limit_within_hard()


def load(model_dir, iod="auto", **kwargs):
    """Load a prep folder as ``(model, tokenizer)`` usable with mlx_lm.generate."""
    from infer.runtime.loader import load as _load

    return _load(model_dir, iod=iod, **kwargs)
