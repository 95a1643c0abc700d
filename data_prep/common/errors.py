"""The data contract's error: a shard or a manifest that cannot be trusted. Its own module so that the
shard format (``shards.py``) and the manifest (``manifest.py``) both raise it without importing each
other."""

from __future__ import annotations


class ShardError(RuntimeError):
    """A shard or manifest that cannot be trusted; the message names the file."""
