"""``python -m cluster`` is the ``pdcluster`` command."""

from cluster.cli import main

raise SystemExit(main())
