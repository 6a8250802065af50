"""The ``flyte_hvd`` logger: library output that users control the way the Python ecosystem
expects (``logging.getLogger("flyte_hvd").setLevel(logging.WARNING)`` silences it).

Until the program configures logging itself (any handler on the root logger), records of
INFO and above are written to the current ``sys.stderr`` as ``flyte-hvd: <message>``, as a
command-line tool would; once it does, they simply propagate to the program's handlers.
"""

from __future__ import annotations

import logging
import sys

LOGGER_NAME = "flyte_hvd"


class _DefaultStderrHandler(logging.StreamHandler):
    """Writes to ``sys.stderr`` as it is at each record (notebooks and tests replace it), and
    only while the root logger has no handler of its own."""

    def __init__(self) -> None:
        super().__init__()
        self.setFormatter(logging.Formatter("flyte-hvd: %(message)s"))

    @property  # type: ignore[override]
    def stream(self):
        return sys.stderr

    @stream.setter
    def stream(self, value) -> None:  # logging.StreamHandler.__init__ assigns one
        pass

    def emit(self, record: logging.LogRecord) -> None:
        if not logging.getLogger().handlers:
            super().emit(record)


def get_logger(name: str = LOGGER_NAME) -> logging.Logger:
    """The logger for a flyte_hvd module (pass its ``__name__``)."""
    return logging.getLogger(name)


_warned: set[str] = set()


def warn_once(logger: logging.Logger, key: str, message: str) -> None:
    """Log ``message`` at WARNING once per process and ``key`` (e.g. a Horovod argument that
    does nothing here: said once, not at every call)."""
    if key not in _warned:
        _warned.add(key)
        logger.warning(message)


def verbosity_level(verbose: int) -> int:
    """The level at which a launcher's own messages are logged: INFO when ``verbose >= 1``
    (shown by default), DEBUG when ``verbose`` is 0 (hidden unless asked for)."""
    return logging.INFO if verbose >= 1 else logging.DEBUG


_root = logging.getLogger(LOGGER_NAME)
if not any(isinstance(h, _DefaultStderrHandler) for h in _root.handlers):
    _root.addHandler(_DefaultStderrHandler())
    if _root.level == logging.NOTSET:
        _root.setLevel(logging.INFO)
