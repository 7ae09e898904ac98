"""Run the CLI and SIGKILL it just before its N-th atomic rename (``os.replace``).

    python tests/kill_on_rename.py N COMMAND ARGS...

N = 0 kills nothing and prints, as its last stdout line, ``renames: K``: how many renames the
command made, i.e. the kill points to try. Every atomic write and directory swap of the package
goes through ``os.replace``, so these are exactly the moments where a crash can split old and new.
"""

import os
import signal
import sys


def main() -> int:
    kill_at = int(sys.argv[1])
    real_replace = os.replace
    count = 0

    def replace(src, dst, *args, **kwargs):
        nonlocal count
        count += 1
        if count == kill_at:
            os.kill(os.getpid(), signal.SIGKILL)
        return real_replace(src, dst, *args, **kwargs)

    os.replace = replace
    from dwise_predict.cli.app import main as cli

    code = cli(sys.argv[2:])
    print(f"renames: {count}")
    return code


if __name__ == "__main__":
    sys.exit(main())
