import sys

from pdsweep.cli import main

sys.exit(main())
