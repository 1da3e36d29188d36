"""`python -m draftsman ...` is the `draftsman` command."""
import sys

from .cli import main

sys.exit(main())
