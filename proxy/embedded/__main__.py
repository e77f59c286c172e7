import sys

from proxy.embedded.commands import main

sys.exit(main())
