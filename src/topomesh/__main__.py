import sys

from topomesh.cli.main import main

sys.exit(main())
