"""What data prep and the trainer share, and nothing else of the project: storage (``storage/``: one
module per scheme, and ``atomic`` writes) and the data contract (``shards``: the tar shard format;
``manifest``: ``manifest.json``, the one file the trainer trusts). ``commands`` spells the commands
both sides print for a user to copy. ``tests/project/test_structure.py`` checks that nothing here imports the
rest of ``data_prep`` or ``pretrain``."""
