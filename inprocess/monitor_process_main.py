"""Entry point of the monitor process (kept apart so the package never imports it)."""

import logging
import os
import sys

from inprocess.monitor_process import main

if __name__ == "__main__":
    code = main()
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    # Not sys.exit: the fault watch's thread may be blocked in the store's
    # native client, which interpreter finalization must not tear down under it.
    os._exit(code)
