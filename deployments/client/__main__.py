"""`python -m deployments.client`: see cli.py."""
import sys

from .cli import main

sys.exit(main())
