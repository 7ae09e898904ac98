"""``python -m dwise_predict.cli``: the console script without installing it."""

import sys

from dwise_predict.cli.app import main

sys.exit(main())
