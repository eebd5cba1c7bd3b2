"""`python -m gpt2serve ...`: the same as the `gpt2serve` command."""

from .cli import main

raise SystemExit(main())
