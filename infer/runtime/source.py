"""The one constructor of expert sources.

``make_source(model_dir, iod)`` returns an ``ExpertSource``
(``shared.source``): with ``iod="auto"`` the user's shared daemon (or a
private one it starts), with a socket path the daemon there, with
``"inproc"`` the daemon's core in this process (tools, tests, calibration).
"""

from shared.source import ExpertSource, SourceError  # noqa: F401  (the interface callers type against)

INPROC = "inproc"


def make_source(model_dir, iod="auto", **kw) -> ExpertSource:
    """A session on ``model_dir``'s experts.

    Keywords of both: ``working_set`` (records one layer call needs at
    least: the model's top-k), ``profile`` (keep per-record hop stamps),
    ``arena`` (bytes of a daemon this session starts: private or
    in-process), ``workers`` (its reader threads). A daemon's only:
    ``timeout`` / ``progress_timeout`` (seconds it may stand still /
    complete no read before it is declared dead). In-process only:
    ``read_rate`` (bytes/s cap on reads)."""
    if iod == INPROC:
        from iod.inproc import InprocSource

        return InprocSource(model_dir, **kw)
    from infer.runtime.client import IodClient

    return IodClient(model_dir, iod=iod, **kw)
