"""`python -m nanovllm_models download [NAME] [--force]`: the same as `python -m nanovllm_ref download`."""
import sys

from nanovllm_models import download


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] != ["download"]:
        print("usage: python -m nanovllm_models download [NAME] [--force]", file=sys.stderr)
        return 2
    return download.main(argv[1:])


if __name__ == "__main__":
    sys.exit(main())
