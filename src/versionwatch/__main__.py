"""``python -m versionwatch``: the same as the ``versionwatch`` command."""

import sys

from versionwatch._cli import main

if __name__ == "__main__":
    sys.exit(main())
