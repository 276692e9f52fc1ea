"""`python -m hebrus`: the same command line as `hebrus`, with its exit status."""
from hebrus.cli import console

raise SystemExit(console())
