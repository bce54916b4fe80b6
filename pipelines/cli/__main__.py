"""`python -m pipelines.cli …` is the `drelay` command."""

import sys

from pipelines.cli.main import main

sys.exit(main())
