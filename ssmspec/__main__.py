"""`python -m ssmspec` runs the `ssmspec` command."""

import sys

from ssmspec.cli import main

sys.exit(main())
