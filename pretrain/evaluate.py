"""``python -m pretrain.evaluate``: the command keeps its name; the code is in ``pretrain.eval.cli``."""

import sys

from pretrain.eval.cli import main

if __name__ == "__main__":
    sys.exit(main())
