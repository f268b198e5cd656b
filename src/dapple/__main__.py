"""``python -m dapple`` (also what torchrun launches)."""

import sys

from dapple.cli import main

if __name__ == "__main__":
    sys.exit(main())
