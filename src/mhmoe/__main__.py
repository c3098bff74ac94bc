"""`python -m mhmoe`: the same as the `mhmoe` command."""

from .cli import main

raise SystemExit(main())
