import sys

from dlfsd.main import main

sys.exit(main())
