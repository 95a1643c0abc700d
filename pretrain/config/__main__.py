"""``python -m pretrain.config get KEY CONFIG [dotted.key=value ...]``: one setting as a run would see
it (the YAML, its ``base:`` files, the overrides, the schema's default), without checking the rest.
For launch scripts that must act on a setting before any rank starts (launchers/slurm/pretrain.sbatch)."""

from __future__ import annotations

import sys

from pretrain.config.loader import ConfigError, setting
from pretrain.config.schema import Config


def main(argv: list[str]) -> int:
    if len(argv) < 3 or argv[0] != "get":
        print(__doc__.split(":", 1)[0].strip("`"), file=sys.stderr)
        return 2
    try:
        value = setting(Config, argv[2], argv[3:], argv[1])
    except ConfigError as exc:
        print(exc, file=sys.stderr)
        return 2
    print("" if value is None else value)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
