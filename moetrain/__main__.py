"""`python -m moetrain` runs the command line."""

from moetrain.cli import main

raise SystemExit(main())
