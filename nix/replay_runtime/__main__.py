"""`python3 -m nix.replay_runtime`, from the repository's root: the replay's command line (main.py)."""

import sys

from .main import main

sys.exit(main())
