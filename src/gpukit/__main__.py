"""``python -m gpukit`` runs the command line, like the ``gpukit`` script."""

from gpukit.cli.__main__ import main

raise SystemExit(main())
