"""``python -m pretrain.export``: the command keeps its name; the code is in ``pretrain.checkpoint.hf_export``."""

import sys

from pretrain.checkpoint.hf_export import main

if __name__ == "__main__":
    sys.exit(main())
