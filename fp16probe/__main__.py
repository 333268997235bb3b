"""``python -m fp16probe``: the same command line as the ``fp16probe`` script."""

from fp16probe.cli import main

if __name__ == "__main__":
    main()
