"""Entry point of the monitor process (kept apart so the package never imports it)."""

import sys

from inprocess.monitor_process import main

if __name__ == "__main__":
    sys.exit(main())
