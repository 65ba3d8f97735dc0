import sys

from repgeom_eval.entrypoints.cli import main

sys.exit(main())
