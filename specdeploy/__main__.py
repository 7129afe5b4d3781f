"""`python -m specdeploy ...`: the `specdeploy` command where the package is not installed."""
import sys

from specdeploy.cli import main

sys.exit(main())
