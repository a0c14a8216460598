"""``python -m kiviq.worker``: what ``kiviq worker`` runs."""

import sys

from kiviq.worker.cli import main

sys.exit(main())
