import sys

from exactspec.cli import main

sys.exit(main())
