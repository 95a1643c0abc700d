"""``python -m pretrain.export``: the command keeps its name; the code is in ``pretrain.checkpoint.export``."""
import sys

from pretrain.checkpoint.export import main

if __name__ == "__main__":
    sys.exit(main())
