"""`python -m maxlm.tools.doctor`: see maxlm/tools/doctor/__init__.py."""

import sys

from maxlm.tools.doctor import main

sys.exit(main())
