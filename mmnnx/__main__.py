"""``python -m mmnnx``: the same as the ``mmnnx`` command."""

import sys

from mmnnx.cli import main

sys.exit(main())
