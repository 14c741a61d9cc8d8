"""`python -m maxlm.doctor`: see maxlm/doctor/__init__.py."""

import sys

from maxlm.doctor import main

sys.exit(main())
