"""`python -m engine.cli …`: what torchrun and the deepspeed launcher start on every rank."""

import sys

from engine.cli.main import main

sys.exit(main())
