"""``python -m kiviq.gateway``: what ``kiviq serve`` runs."""

import sys

from kiviq.gateway.cli import main

sys.exit(main())
