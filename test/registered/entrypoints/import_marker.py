"""A module whose import leaves a trace: it creates the file named by $SGLANG_TEST_IMPORT_MARKER.
A server that imports it on a request's word ran a stranger's code."""

import os

_path = os.environ.get("SGLANG_TEST_IMPORT_MARKER")
if _path:
    with open(_path, "w") as f:
        f.write("imported\n")


class Anything:
    pass
