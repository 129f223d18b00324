"""`python -m engine.cli …`: what torchrun and the deepspeed launcher start on every rank."""

from engine.cli.main import entry

entry()
