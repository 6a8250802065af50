"""``python -m flyte_hvd.launch -np 2 -- python train.py``: the ``flyte-hvd-run`` CLI."""

import sys

from flyte_hvd.launch.cli import main

sys.exit(main())
