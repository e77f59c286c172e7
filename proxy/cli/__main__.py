"""``python -m proxy.cli``: the ``enginemeter`` command."""

from proxy.cli import main

raise SystemExit(main())
