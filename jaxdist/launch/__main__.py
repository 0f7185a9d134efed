"""``python -m jaxdist.launch --nproc N -- COMMAND ...`` (``launcher.py``)."""

import sys

from jaxdist.launch.launcher import main

sys.exit(main())
