import sys

from probe.cli import main

sys.exit(main())
