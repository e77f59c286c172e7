import sys

from proxy.embedded.cli import main

sys.exit(main())
