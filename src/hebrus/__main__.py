"""`python -m hebrus`: the same command line as `hebrus`, with its exit status."""
from hebrus.cli import console

if __name__ == "__main__":         # (not when a process `hebrus serve` spawns imports this module)
    raise SystemExit(console())
