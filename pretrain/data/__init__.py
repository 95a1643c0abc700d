"""The training stream over data_prep's shards: the global sample order (``stream``) and tar random access (``shard_reader``)."""
