"""``python -m pretrain.eval`` (also ``python -m pretrain.evaluate``)."""

import sys

from pretrain.eval.cli import main

sys.exit(main())
