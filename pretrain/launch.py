"""``python -m pretrain.launch``: the command keeps its name; the code is in ``pretrain.runtime.launcher``."""

import sys

from pretrain.runtime.launcher import main

if __name__ == "__main__":
    sys.exit(main())
