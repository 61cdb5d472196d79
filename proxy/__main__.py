"""``python -m proxy`` runs the n-proxy command line."""

from proxy.cli import main

raise SystemExit(main())
