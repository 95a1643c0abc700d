"""The one exception type for bad input to ``data_prep``; ``cli.main`` turns it into a message and exit code 2."""

from __future__ import annotations


class DataPrepError(Exception):
    """Input, settings or output that data prep refuses; the message names the file, line or task."""
