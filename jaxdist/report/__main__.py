import sys

from jaxdist.report import main

sys.exit(main())
