"""``python -m pretrain.data plan --config CONFIG [overrides]``: each source's sequences, share of the
steps and epochs at ``train.max_steps``."""

import sys

from pretrain.data.mixture_checks import main

sys.exit(main())
