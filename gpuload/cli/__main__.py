"""``python -m gpuload.cli``: the same as the ``gpuload`` command."""

import sys

from gpuload.cli.main import main

sys.exit(main())
