"""`python -m hyparflow`: the same as the `hyparflow` command."""

import sys

from .cli import main

sys.exit(main())
