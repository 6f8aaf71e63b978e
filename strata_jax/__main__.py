import sys

from strata_jax.cli import main

sys.exit(main())
