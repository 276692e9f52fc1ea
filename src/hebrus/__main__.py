"""`python -m hebrus`: the same command line as `hebrus`."""
from hebrus.cli import console

console()
