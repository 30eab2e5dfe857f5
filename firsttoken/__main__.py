import sys

from firsttoken.cli import main

sys.exit(main())
