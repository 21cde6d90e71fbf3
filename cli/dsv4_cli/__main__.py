"""`python -m dsv4_cli ...`: the `dsv4` command (what `dsv4 up` starts its processes with)."""

import sys

from dsv4_cli.main import main

sys.exit(main())
