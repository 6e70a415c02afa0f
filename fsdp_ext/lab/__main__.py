import sys

from fsdp_ext.lab.cli import main

sys.exit(main())
