"""`python -m cli …` is the `drelay` command."""

import sys

from cli.main import main

sys.exit(main())
