"""``python -m pretrain.launch``: the command keeps its name; the code is in ``pretrain.runtime.launch``."""
import sys

from pretrain.runtime.launch import main

if __name__ == "__main__":
    sys.exit(main())
