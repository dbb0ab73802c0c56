"""python -m observe RUN_DIR: the run's diagnosis, timeline and report (diagnose.py)."""
from observe.diagnose import main

main()
