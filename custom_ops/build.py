"""`python -m custom_ops.build`: build (or find in the cache) and load the dspark CUDA kernels, print the path.

Only the command line lives here; building, caching and loading are `custom_ops._build` (why two modules: see its
docstring).
"""

import argparse
import sys

from custom_ops import _build


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m custom_ops.build", description=__doc__.splitlines()[0])
    parser.add_argument("--verbose", action="store_true", help="show the ninja / nvcc command lines")
    args = parser.parse_args(argv)
    try:
        path = _build.load(verbose=args.verbose, ahead_of_time=True)
    except _build.BuildError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
