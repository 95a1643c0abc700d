"""``python -m pretrain.study``."""

import sys

from pretrain.study.runner import main

sys.exit(main())
