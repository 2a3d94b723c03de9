import sys

from specroll.cli import main

sys.exit(main())
