"""One error hierarchy for topomesh.

User mistakes (bad files, impossible layouts, broken profiles) raise a subclass of
:class:`TopomeshError` with a full sentence naming the input, the place and the problem.
The CLI turns these into one line on stderr and exit code 2; anything else is a bug.
"""

from __future__ import annotations


class TopomeshError(Exception):
    """Base class for every error topomesh raises on purpose."""


class TopologyError(TopomeshError, ValueError):
    """A topology could not be discovered, read, built or queried.

    ``source`` names the file or node the problem came from, ``where`` the place inside
    it (a JSON path, an XML element, a line number), when known.
    """

    def __init__(self, message: str, *, source: str | None = None, where: str | None = None):
        self.source = source
        self.where = where
        parts = [p for p in (source, where) if p]
        prefix = ": ".join(parts)
        super().__init__(f"{prefix}: {message}" if prefix else message)
        self.reason = message


class LayoutError(TopomeshError, ValueError):
    """A parallel layout is invalid for the world, topology or model it is applied to."""


class LaunchError(TopomeshError, RuntimeError):
    """The launcher could not build or distribute the topology for a rendezvous round."""


class TraceError(TopomeshError, RuntimeError):
    """A model or parallelize function could not be traced."""


class CalibrationError(TopomeshError, RuntimeError):
    """A collective calibration or an op-profile database is unusable."""


class ModelConfigError(TopomeshError, ValueError):
    """A model configuration is inconsistent (e.g. heads do not divide hidden) or a preset
    is unknown."""


class ClusterError(TopomeshError, ValueError):
    """A cluster is unknown or cannot be built: a preset name, a --gpus count, a device,
    or a local cluster without the measurements it needs."""


class OutputError(TopomeshError, OSError):
    """An output file a user named cannot be written as asked: the path exists and is not a
    regular file (a device such as ``/dev/null``, a FIFO, a socket, a directory)."""
