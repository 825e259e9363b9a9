"""``python -m expertcache``: the ``expertcache`` command (:func:`expertcache.cli.main.main`)."""

import sys

from .cli.main import main

sys.exit(main())
