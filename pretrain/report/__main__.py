"""``python -m pretrain.report RUN_DIR``."""

import sys

from pretrain.report.page import main

sys.exit(main())
