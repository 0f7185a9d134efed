"""``python -m jaxdist.train`` (``trainer.py``)."""

from jaxdist.cluster.shutdown import exit_now
from jaxdist.train.trainer import main

exit_now(main())
