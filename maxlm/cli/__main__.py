"""`python -m maxlm.cli ...` is the `maxlm` command."""

import sys

from maxlm.cli import main

sys.exit(main())
