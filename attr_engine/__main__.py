"""``python -m attr_engine`` (and ``torchrun ... -m attr_engine``): the attr-engine command line."""

import sys

from attr_engine.cli import main

if __name__ == "__main__":
    sys.exit(main())
