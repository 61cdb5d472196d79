"""`python -m proxy.devserver`: the same as `n-proxy-devserver`."""

from proxy.devserver.cli import main

raise SystemExit(main())
