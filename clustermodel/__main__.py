"""`python -m clustermodel [predict|ablation|scaling|plan|530b|validate] [key=value ...]`: the
performance model's command line (cli.py)."""
import sys

from clustermodel.cli import main

sys.exit(main(sys.argv[1:]))
