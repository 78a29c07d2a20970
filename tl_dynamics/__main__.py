import sys

from tl_dynamics.cli import main

sys.exit(main())
