"""What the package knows of itself: its version, and the folder that holds all its modules.

A leaf (no torch, nothing else of the package), so that any module, the native
build and the fix child included, reads these without importing the package.
"""

import os

__version__ = "0.1.0"

# The one answer to "is this frame ours?": every module of the package, in any of
# its folders, lies below it.
PACKAGE_DIR = os.path.dirname(os.path.abspath(__file__)) + os.sep
