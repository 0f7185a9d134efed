import sys

from jaxdist.export import main

sys.exit(main())
